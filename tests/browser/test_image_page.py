"""The image page in Chromium: first view drawn, a patch click moves the query, the β slider redraws,
an upload replaces the photo, masks by click, the classifier's predictions, and hostile uploads
answered in the status line. Screenshots in artifacts/screenshots/."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from tests.browser.conftest import plot_data, screenshot

OVERLAY_HEATMAP = "#overlay g.hm image"


def wait_idle(pg, timeout_s=90):
    """Wait until the last request has been drawn (the status line leaves "running…"). Polled from
    Python: the page's CSP forbids the string evaluation wait_for_function would need."""
    for _ in range(int(timeout_s * 5)):
        if "running" not in (pg.text_content("#status") or ""):
            pg.wait_for_timeout(300)
            if "running" not in (pg.text_content("#status") or ""):
                return
        pg.wait_for_timeout(200)
    raise AssertionError(f"the page stayed busy: {pg.text_content('#status')!r}")


def overlay_z(pg):
    return np.array(plot_data(pg, "#overlay"), dtype=float)


def prefix_share(pg) -> float:
    """P[query, prefix tokens] as the overlay's title reports it."""
    return float(pg.text_content("#overlay-title").split(":")[-1])


def click_patch(pg, row: int, col: int):
    """Click the centre of patch (row, col) of the overlay figure."""
    rows, cols = pg.eval_on_selector("#overlay", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    box = pg.locator("#overlay .nsewdrag").first.bounding_box()
    x = box["x"] + (col + 0.5) / cols * box["width"]
    y = box["y"] + (row + 0.5) / rows * box["height"]
    pg.mouse.click(x, y)


def drag_patches(pg, start: tuple[int, int], end: tuple[int, int]):
    """Drag a box from just outside the centre of patch `start` to just past the centre of patch `end`
    (row, col): the page masks the patches whose centres lie inside the box."""
    rows, cols = pg.eval_on_selector("#overlay", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    box = pg.locator("#overlay .nsewdrag").first.bounding_box()
    to_xy = lambda rc: (box["x"] + (rc[1] + 0.5) / cols * box["width"], box["y"] + (rc[0] + 0.5) / rows * box["height"])
    pg.mouse.move(*to_xy((start[0] - 0.3, start[1] - 0.3)))
    pg.mouse.down()
    x1, y1 = to_xy((end[0] + 0.3, end[1] + 0.3))
    pg.mouse.move(x1, y1, steps=8)
    pg.mouse.up()


def png_upload(width=300, height=200, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    array = np.stack([xx * 255 // width, yy * 255 // height, rng.integers(0, 255, (height, width))], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(array.astype(np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_image_page_journey(live_server, page, page_log):
    pg = page
    pg.goto(f"{live_server}/image")
    # the first visit opens with an example photo already computed and drawn
    pg.wait_for_selector(OVERLAY_HEATMAP, state="attached", timeout=120_000)
    wait_idle(pg)
    assert "257 tokens" in pg.text_content("#status")  # dinov2-small at 224 px: CLS + 16×16
    assert pg.locator("#overlay .imagelayer image").count() == 1  # the photo under the map
    assert pg.locator("#model-grid g.hm image").count() == 1
    first = overlay_z(pg)
    assert first.shape == (16, 16) and np.isclose(first.sum(), 1 - prefix_share(pg), atol=2e-3)
    assert "query: CLS" in pg.text_content("#query-readout")
    screenshot(pg, "image-01-first-view")

    # a patch click makes that patch the query and changes the map
    click_patch(pg, 12, 7)
    pg.wait_for_selector("#query-readout:has-text('p(12,7)')", timeout=60_000)
    wait_idle(pg)
    after_click = overlay_z(pg)
    assert after_click.shape == (16, 16)
    assert np.abs(after_click - first).max() > 1e-3
    screenshot(pg, "image-02-patch-query")

    # the map mode (issue 22 §3): the value-weighted row ‖P·v W_O‖ of the same run redraws the overlay (it still sums
    # to 1 with its prefix share); back to P draws the map again
    plain = overlay_z(pg)
    pg.select_option("#weighting-select", "value_norm")
    pg.wait_for_selector("#overlay-title:has-text('value-weighted')", timeout=60_000)
    wait_idle(pg)
    weighted = overlay_z(pg)
    assert weighted.shape == plain.shape and np.abs(weighted - plain).max() > 1e-3
    assert np.isclose(weighted.sum(), 1 - prefix_share(pg), atol=2e-3)
    screenshot(pg, "image-02b-value-weighted")
    pg.select_option("#weighting-select", "attention")
    pg.wait_for_selector("#overlay-title:not(:has-text('value-weighted'))", timeout=60_000)
    wait_idle(pg)
    assert np.array_equal(overlay_z(pg), plain)  # the same run's P drawn again

    # the β slider re-runs the model and redraws: β = 10^1.5 β₀ sharpens the row
    prefix_share_before = prefix_share(pg)
    pg.eval_on_selector("#beta-slider", "el => { el.value = '1.5'; el.dispatchEvent(new Event('input', {bubbles: true})); }")
    pg.wait_for_selector("#beta-readout:has-text('β = 3.95')", timeout=60_000)
    for _ in range(200):
        sharp = overlay_z(pg)
        if np.abs(sharp - after_click).max() > 1e-4:
            break
        pg.wait_for_timeout(250)
    wait_idle(pg)
    sharp = overlay_z(pg)
    assert np.abs(sharp - after_click).max() > 1e-4
    # a hotter softmax concentrates the row on its best keys (a patch, or the CLS/prefix token)
    assert max(sharp.max(), prefix_share(pg)) > max(after_click.max(), prefix_share_before)
    screenshot(pg, "image-03-beta")

    # mask a patch as a key by clicking in mask mode
    pg.select_option("#click-mode", "mask")
    click_patch(pg, 3, 3)
    pg.wait_for_selector("#query-readout:has-text('masked keys: 1')", timeout=60_000)
    wait_idle(pg)
    assert overlay_z(pg)[3, 3] == 0  # column j of P is 0 for a masked key
    screenshot(pg, "image-04-mask")

    # the brush: a box drawn in mask mode masks every patch inside it (rows 0–1, columns 10–12)
    drag_patches(pg, (0, 10), (1, 12))
    pg.wait_for_selector("#query-readout:has-text('masked keys: 7')", timeout=60_000)
    wait_idle(pg)
    assert np.abs(overlay_z(pg)[0:2, 10:13]).max() == 0
    screenshot(pg, "image-04b-brush")

    # upload a new photo through the file picker: the photo and the map are replaced
    old_source = pg.get_attribute("#overlay .imagelayer image", "href")
    pg.set_input_files("#file-input", files=[{"name": "gradient.png", "mimeType": "image/png", "buffer": png_upload()}])
    pg.wait_for_selector("#status:has-text('gradient.png: 300×200')", timeout=120_000)
    new_source = pg.get_attribute("#overlay .imagelayer image", "href")
    assert new_source != old_source and "/api/images/" in new_source
    assert "query: CLS · masked keys: 0" in pg.text_content("#query-readout")
    screenshot(pg, "image-05-upload")

    page_log.check()


def test_classifier_predictions_before_after(live_server, page, page_log):
    pg = page
    pg.goto(f"{live_server}/image")
    pg.wait_for_selector(OVERLAY_HEATMAP, state="attached", timeout=120_000)
    wait_idle(pg)
    pg.click("#sample-buttons button[data-sample='fashion-sneaker.png']")
    pg.wait_for_selector("#status:has-text('vit-fashion')", timeout=120_000)
    wait_idle(pg)
    labels = pg.eval_on_selector("#predictions", "el => el.data[0].y")
    assert labels[0] == "Sneaker"  # the committed classifier recognises its own test image
    # masking patches of the garment moves the prediction: the effect shows KL > 0
    pg.select_option("#click-mode", "mask")
    for count, (row, col) in enumerate([(1, 1), (1, 2), (2, 1)], start=1):
        click_patch(pg, row, col)
        pg.wait_for_selector(f"#query-readout:has-text('masked keys: {count}')", timeout=60_000)
        pg.wait_for_timeout(400)  # a person's pace between clicks
    wait_idle(pg)
    text = pg.text_content("#output-effect")
    assert "KL(before ‖ after)" in text
    kl = float(text.split("KL(before ‖ after)")[1].split("top-1")[0])
    assert kl > 0
    assert len(pg.eval_on_selector("#predictions", "el => el.data")) == 2  # before and after bars
    screenshot(pg, "image-06-classifier")
    page_log.check()


def test_hostile_upload_is_reported(live_server, page, page_log):
    pg = page
    pg.goto(f"{live_server}/image")
    pg.wait_for_selector(OVERLAY_HEATMAP, state="attached", timeout=120_000)
    wait_idle(pg)
    pg.set_input_files("#file-input", files=[{"name": "notes.png", "mimeType": "image/png", "buffer": b"just text\n" * 50}])
    pg.wait_for_selector("#status.error:has-text('upload refused')", timeout=30_000)
    assert "PNG, JPEG or WebP" in pg.text_content("#status")
    screenshot(pg, "image-07-hostile-upload")
    # the only console error allowed is Chromium's own log line for the 415 response
    page_log.errors = [e for e in page_log.errors if "status of 415" not in e]
    page_log.check()
