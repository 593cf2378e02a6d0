"""The image page as a laboratory (issue 5), in Debian's Chromium: perturb patches and see the effect,
export, reload the link and get the same view; a link whose image the server dropped asks for the file
again. No console errors, nothing fetched from outside the server."""
from __future__ import annotations

import json
from pathlib import Path

from tests.browser.conftest import ROOT, plot_data, screenshot

OVERLAY = "#overlay.js-plotly-plot"


def wait_idle(page, timeout=90_000):
    """The status line shows the token count once a load has finished."""
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=timeout)


def set_number(page, selector, value):
    page.fill(selector, str(value))
    page.dispatch_event(selector, "change")


def controls(page) -> dict:
    return page.evaluate("""() => ({
        model: document.getElementById('model-select').value,
        layer: document.getElementById('layer-select').value,
        head: document.getElementById('head-select').value,
        beta: document.getElementById('beta-slider').value,
        masks: document.getElementById('mask-list').textContent,
        chosen: document.getElementById('perturb-chosen').textContent,
        sigma: document.getElementById('perturb-sigma').value,
        samples: document.getElementById('perturb-samples').value,
        perturbOn: document.getElementById('perturb-apply').textContent,
        list: document.getElementById('interventions-list').textContent,
        query: document.getElementById('query-readout').textContent,
    })""")


def click_patch(page, row, col):
    page.evaluate("([r, c]) => document.getElementById('overlay').emit('plotly_click', {points: [{x: c, y: r}]})", [row, col])


def test_image_perturb_export_and_reload(page, page_log, live_server, tmp_path):
    page.goto(live_server + "/image")
    page.wait_for_selector(OVERLAY, timeout=90_000)
    wait_idle(page)
    assert "no interventions" in page.inner_text("#effect-summary")
    overlay_before = plot_data(page, OVERLAY)

    # Mask one patch as a key (the page's own click mode, shared with the lab's mask panel).
    page.select_option("#click-mode", "mask")
    click_patch(page, 2, 3)
    page.wait_for_function("() => /p\\(2,3\\)/.test(document.getElementById('mask-list').textContent)", timeout=90_000)
    wait_idle(page)
    assert plot_data(page, OVERLAY) != overlay_before

    # Arrow keys move between heads and layers.
    page.focus("#overlay")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    page.wait_for_function("() => document.getElementById('head-select').value === '1' && document.getElementById('layer-select').value === '1'")
    wait_idle(page)

    # Choose two patches and perturb them as keys at the shown head, two samples.
    page.select_option("#click-mode", "perturb")
    click_patch(page, 7, 5)
    click_patch(page, 7, 6)
    assert "p(7,5)" in page.inner_text("#perturb-chosen") and "p(7,6)" in page.inner_text("#perturb-chosen")
    rings = page.evaluate("() => document.getElementById('overlay').data.find(t => t.name === 'perturbed patches')")
    assert sorted(zip(rings["y"], rings["x"])) == [(7, 5), (7, 6)]
    set_number(page, "#perturb-sigma", 20)
    set_number(page, "#perturb-samples", 2)
    summary_before = page.inner_text("#effect-summary")
    page.click("#perturb-apply")
    page.wait_for_function("() => /n = 2 samples/.test(document.getElementById('effect-summary').textContent)", timeout=90_000)
    wait_idle(page)
    summary_after = page.inner_text("#effect-summary")
    assert summary_after != summary_before and "±" in summary_after
    page.wait_for_function("() => Number(document.getElementById('diff-map').dataset.maxAbs) > 0", timeout=60_000)
    assert "pk=" in page.url and "mk=" in page.url and "pn=2" in page.url
    screenshot(page, "image-lab-perturbed")

    # Export: the response as JSON, the overlay as PNG.
    with page.expect_download(timeout=30_000) as dl:
        page.click("#export-json")
    path = tmp_path / "image.json"
    dl.value.save_as(path)
    exported = json.loads(path.read_text())
    assert [iv["op"] for iv in exported["request"]["interventions"]] == ["mask_keys", "perturb_keys"]
    assert exported["response"]["effect"]["samples"] == 2 and exported["response"]["grid"]
    with page.expect_download(timeout=30_000) as dl:
        page.click("#export-png")
    png = tmp_path / "overlay.png"
    dl.value.save_as(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Reload the link: the same controls and the same attention over the photo.
    shown = controls(page)
    overlay = plot_data(page, OVERLAY)
    page.reload()
    page.wait_for_selector(OVERLAY, timeout=90_000)
    page.wait_for_function("() => /n = 2 samples/.test(document.getElementById('effect-summary').textContent)", timeout=90_000)
    wait_idle(page)
    assert controls(page) == shown
    assert plot_data(page, OVERLAY) == overlay
    screenshot(page, "image-lab-restored")
    page_log.check()


def test_link_to_an_evicted_image_asks_for_the_file_again(page, page_log, live_server):
    page.goto(live_server + "/image#m=dinov2-small&img=0123456789abcdef0123456789abcdef&l=3&h=2&q=0&b=0&bs=head")
    page.wait_for_selector("#reupload:not([hidden])", timeout=90_000)
    assert page.locator("#status.error").count() == 1
    page.set_input_files("#reupload-input", str(Path(ROOT) / "static" / "samples" / "street.jpg"))
    wait_idle(page)
    page.wait_for_selector("#reupload", state="hidden")
    assert page.input_value("#layer-select") == "3" and page.input_value("#head-select") == "2"
    assert "img=0123456789abcdef" not in page.url
    screenshot(page, "image-lab-reuploaded")
    # The 404s (the API's answer and the photo behind the overlay) are the point of this test.
    page_log.errors = [e for e in page_log.errors if "404" not in e]
    page_log.check()
