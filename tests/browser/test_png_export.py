"""PNG export of the figures that are not Plotly plots: the text page's model view (a grid of canvas
thumbnails) and head view (an SVG). Each PNG button must download a real picture of the figure."""
from __future__ import annotations

import shutil

import numpy as np
from PIL import Image

from tests.browser.conftest import SCREENSHOTS
from tests.browser.test_text_page import HEATMAP, wait_for_heatmap

MASKED_RED = (0xC0, 0x34, 0x2B)  # --bad, the head view's masked key label


def download_png(page, figure: str, tmp_path, name: str) -> np.ndarray:
    button = page.locator(f'[data-png-for="{figure}"] .export-png')
    assert button.count() == 1, f"no PNG button for #{figure}"
    with page.expect_download(timeout=30_000) as dl:
        button.click()
    download = dl.value
    assert download.suggested_filename.endswith(".png")
    path = tmp_path / f"{name}.png"
    download.save_as(path)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, SCREENSHOTS / f"{name}.png")  # kept with the screenshots, to look at
    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB")).astype(int)
    return pixels


def assert_picture(pixels: np.ndarray, min_w: int, min_h: int):
    h, w, _ = pixels.shape
    assert min_w <= w <= 10_000 and min_h <= h <= 10_000, (w, h)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) >= 20, f"only {len(colours)} colours: a flat or nearly empty image"
    assert pixels.std() > 10
    assert (pixels[0, 0] == 255).all(), "the background should be white"


def near(pixels: np.ndarray, rgb, tol=40) -> int:
    """How many pixels lie within `tol` (per channel) of the colour `rgb`."""
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tol).sum())


def blueish(pixels: np.ndarray) -> int:
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    return int(((b > r + 25) & (b > g + 15)).sum())


def test_model_view_and_head_view_download_as_png(page, page_log, live_server, tmp_path):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    page.wait_for_selector('[data-png-for="modelview"] .export-png', timeout=30_000)
    n_tokens = len(page.eval_on_selector(HEATMAP, "el => el.data[0].z"))

    n_layers, n_heads = page.eval_on_selector(
        "#modelview", "el => [el.querySelectorAll('canvas[data-head=\"0\"]').length, el.querySelectorAll('canvas[data-layer=\"0\"]').length]")
    assert (n_layers, n_heads) == (6, 12)  # minilm

    grid = download_png(page, "modelview", tmp_path, "text-export-modelview")
    h, w, _ = grid.shape
    assert_picture(grid, min_w=n_heads * 64, min_h=n_layers * 64)  # each thumbnail scaled up (≥ 64 px)
    assert 1.5 < w / h < 2.5  # 12 heads across, 6 layers down, like the page's grid
    assert near(grid, (68, 1, 84), tol=30) > 500  # viridis's dark end fills most of every thumbnail
    assert near(grid, (253, 231, 37), tol=40) > 50  # and its bright end marks each row's maximum
    # Unsmoothed upscaling: one token is a block of identical pixels, so rows repeat inside a cell.
    assert len(np.unique(grid.reshape(-1, 3), axis=0)) < 40 * 12 * 6 * n_tokens

    lines = download_png(page, "headview", tmp_path, "text-export-headview")
    assert_picture(lines, min_w=400, min_h=n_tokens * 18)
    assert blueish(lines) > 2000  # the attention lines (#3b5bdb at opacity ∝ P over white)
    assert near(lines, (0, 0, 0), tol=60) > 200  # the token labels (text, in black)
    assert near(lines, MASKED_RED) < 20  # nothing masked yet

    # A masked key is drawn red in the head view by the stylesheet: the export must carry that style.
    page.locator("#token-strip .tok").nth(3).click()
    page.wait_for_function("(sel) => document.querySelector(sel).data[0].z.every(row => row[3] === 0)", arg=HEATMAP,
                           timeout=30_000)
    page.wait_for_selector("#headview text.masked")
    masked = download_png(page, "headview", tmp_path, "text-export-headview-masked")
    assert_picture(masked, min_w=400, min_h=n_tokens * 18)
    assert near(masked, MASKED_RED) > 30
    page_log.check()


def test_png_button_of_a_head_view_with_nothing_drawn_reports_instead_of_throwing(page, page_log, live_server):
    from urllib.parse import quote

    text = " ".join(["the cat sat on a mat"] * 40)  # > 160 tokens: the head view shows a note, no SVG
    page.goto(f"{live_server}/#m=minilm&t={quote(text)}")
    page.wait_for_selector('[data-png-for="headview"] .export-png', timeout=60_000)
    page.wait_for_selector("#headview p.help")
    page.click('[data-png-for="headview"] .export-png')
    page.wait_for_function("() => document.querySelector('#status').textContent.includes('PNG export failed')",
                           timeout=10_000)
    page_log.check()
