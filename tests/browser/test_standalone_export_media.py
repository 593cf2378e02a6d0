"""The image and speech pages' "Download standalone HTML" buttons (issue 31 §3; app/routes/export_media.py): the file
the button downloads opens from file:// with the network cut, draws the page's head (patch labels as tokens on the
image page, the decoder's tokens on the speech page) and moves to other heads and layers without a server."""
from __future__ import annotations

from tests.browser.conftest import SCREENSHOTS
from tests.browser.test_image_page import OVERLAY_HEATMAP, wait_idle
from tests.browser.test_standalone_export import HEATMAP, drag_beta, shown, wait_drawn


def open_offline(browser, path):
    """A new page with every request that is not file:, data: or blob: recorded and aborted, opened on `path`."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    asked: list[str] = []
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "blob:"))
             else (asked.append(r.request.url), r.abort()))
    pg.goto(path.as_uri())
    return context, pg, asked, errors


def download(page, tmp_path, name):
    with page.expect_download(timeout=120_000) as got:
        page.click("#export-html")
    path = tmp_path / name
    got.value.save_as(path)
    return got.value.suggested_filename, path


def test_image_pages_button_exports_the_patches_and_it_opens_offline(page, page_log, live_server, browser, tmp_path):
    page.goto(f"{live_server}/image")
    page.wait_for_selector(OVERLAY_HEATMAP, state="attached", timeout=120_000)
    wait_idle(page)
    name, path = download(page, tmp_path, "image.html")
    assert name.startswith("attnlab-dinov2-small-L") and name.endswith(".html")
    layer, head = name.removesuffix(".html").split("-L")[1].split("-H")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#export-panel").screenshot(path=str(SCREENSHOTS / "image-page-export-html-button.png"))
    # every layer of dinov2-small with scores (9.5 M numbers) is over max_response_numbers: the button's 413, then
    # the shown layer's heads (export-html.js)
    assert [e for e in page_log.errors if "413" not in e] == [] and page_log.external == []

    context, pg, asked, errors = open_offline(browser, path)
    try:
        wait_drawn(pg, layer=layer, head=head)  # it opens on the page's head
        assert pg.eval_on_selector(HEATMAP, "el => el.data[0].x.slice(0, 2)") == ["0:CLS", "1:p(0,0)"]  # index:label
        before = shown(pg)
        assert len(before) == 257 and len(before[0]) == 257  # dinov2-small at 224 px: CLS + 16×16 patches
        other = "1" if head == "0" else "0"
        pg.select_option("[data-role=head]", index=int(other))
        wait_drawn(pg, head=other)
        assert shown(pg) != before
        drag_beta(pg, 0.9)  # view-mode β from the saved scores
        pg.wait_for_function(f"Number(document.querySelector('{HEATMAP}').dataset.beta) > 5", timeout=20_000)
        pg.screenshot(path=str(SCREENSHOTS / "image-standalone-export.png"))
        assert asked == [] and errors == []
    finally:
        context.close()


def test_speech_pages_button_exports_the_decoder_map_and_it_opens_offline(page, page_log, live_server, browser, tmp_path):
    page.goto(f"{live_server}/audio?sample")
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)
    tokens = page.eval_on_selector("#decoder-map", "el => el.data[0].x")
    name, path = download(page, tmp_path, "speech.html")
    assert name == "attnlab-whisper-tiny-en-decoder-L3-H0.html"  # the page opens on layer 3, head 0
    page.locator("#decoder-map").locator("xpath=..").screenshot(path=str(SCREENSHOTS / "audio-page-export-html-button.png"))
    page_log.check()

    context, pg, asked, errors = open_offline(browser, path)
    try:
        wait_drawn(pg, layer="3", head="0")
        assert len(pg.eval_on_selector(HEATMAP, "el => el.data[0].x")) == len(tokens)  # the page's decoder tokens
        before = shown(pg)
        assert all(p == 0 for i, row in enumerate(before) for p in row[i + 1:])  # causal
        assert pg.locator("[data-role=layer] option").count() == 4  # whisper-tiny-en: every decoder layer and head
        pg.select_option("[data-role=layer]", "0")
        wait_drawn(pg, layer="0", head="0")
        assert shown(pg) != before
        drag_beta(pg, 0.1)  # flatter rows from Ŝ = ln P / β₀
        pg.wait_for_function(f"Number(document.querySelector('{HEATMAP}').dataset.beta) < 0.1", timeout=20_000)
        pg.screenshot(path=str(SCREENSHOTS / "audio-standalone-export.png"))
        assert asked == [] and errors == []
    finally:
        context.close()
