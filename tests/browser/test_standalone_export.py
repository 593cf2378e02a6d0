"""The standalone HTML export (attnlab/export.py, issue 31): one file opened from file:// with every request that is
not file:, data: or blob: aborted. It renders the response's heatmap, and the view-mode controls work without a
server: a β drag re-normalises the saved scores, layer and head pick other maps, a key click masks it."""
from __future__ import annotations

import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from attnlab.export import standalone_html
from tests.browser.conftest import SCREENSHOTS, screenshot

TEXT = "the cat sat on the mat because it was tired"
HEATMAP = "[data-role=heatmap]"


@pytest.fixture(scope="module")
def exported(tiny_bert, tmp_path_factory):
    """A real run of the tiny BERT (every layer and head, with scores) exported to a file; its response too."""
    settings = Settings(default_models=["tiny"], extra_text_models={"tiny": str(tiny_bert)})
    body = {"model": "tiny", "text": TEXT, "include_scores": True, "encoding": "f32"}
    with TestClient(create_app(settings)) as client:
        response = client.post("/api/text/attention", json=body)
        assert response.status_code == 200, response.text
        answer = client.post("/api/text/attention", json={**body, "encoding": "json"}).json()  # the same numbers, as lists
        no_scores = client.post("/api/text/attention", json={**body, "include_scores": False}).json()
    folder = tmp_path_factory.mktemp("export")
    path = folder / "view.html"
    path.write_text(standalone_html(response.json(), request=body), encoding="utf-8")
    (folder / "no-scores.html").write_text(standalone_html(no_scores, request={**body, "include_scores": False}), encoding="utf-8")
    return path, answer


@pytest.fixture
def offline(page):
    """The page with the network cut: only file:, data: and blob: URLs load; anything else is recorded and aborted."""
    asked: list[str] = []

    def route(r):
        if r.request.url.startswith(("file:", "data:", "blob:")):
            r.continue_()
        else:
            asked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    return page, asked


def shown(pg):
    return pg.eval_on_selector(HEATMAP, "el => { const t = el.data[0]; return t.customdata || t.z; }")


def drag_beta(pg, to_fraction: float):
    box = pg.locator("[data-role=beta]").bounding_box()
    y = box["y"] + box["height"] / 2
    pg.mouse.move(box["x"] + box["width"] / 2, y)
    pg.mouse.down()
    pg.mouse.move(box["x"] + box["width"] * to_fraction, y, steps=10)
    pg.mouse.up()


def wait_drawn(pg, **data):
    """Until the heatmap's Plotly figure says it shows these data-* values (a drag's cells are painted first)."""
    checks = " && ".join(f"el.dataset.{k} === {str(v)!r}" for k, v in data.items()) or "true"
    pg.wait_for_function(f"(() => {{ const el = document.querySelector('{HEATMAP}'); return el?.data?.[0] && {checks}; }})()",
                         timeout=20_000)


def test_export_renders_offline_and_view_mode_beta_works(exported, offline, page_log):
    path, answer = exported
    pg, asked = offline
    pg.goto(path.as_uri())
    pg.wait_for_function(f"document.querySelector('{HEATMAP}')?.data?.[0]?.z?.length > 0", timeout=30_000)
    T = len(answer["tokens"])
    before = shown(pg)
    # the file's map is the server's P for layer 0, head 0 (float32 → JSON, to float32 precision)
    assert len(before) == T and all(len(row) == T for row in before)
    expected = answer["attention"][0][0]
    assert np.array_equal(np.array(before, dtype=np.float32), np.array(expected, dtype=np.float32))
    beta0 = answer["native_beta"]

    drag_beta(pg, 0.95)  # log10(β/β₀) from 0 towards +3: sharper rows
    pg.wait_for_function(f"Number(document.querySelector('{HEATMAP}').dataset.beta) > {beta0 * 10}", timeout=20_000)
    pg.wait_for_timeout(400)  # the drag's last Plotly redraw (150 ms after it rests)
    beta = float(pg.eval_on_selector(HEATMAP, "el => el.dataset.beta"))
    after = shown(pg)
    # softmax(β·Ŝ) of the saved scores, row by row, as the page computes it
    scores = answer["scores"][0][0]
    for row_p, row_s in zip(after, scores):
        top = max(beta * s for s in row_s)
        weights = [math.exp(beta * s - top) for s in row_s]
        total = sum(weights)
        assert max(abs(p - w / total) for p, w in zip(row_p, weights)) < 1e-5
    assert max(abs(a - b) for ra, rb in zip(after, before) for a, b in zip(ra, rb)) > 0.05  # the drag changed it
    screenshot(pg, "standalone-export-beta")
    assert asked == [], f"the export asked the network for {asked}"
    assert page_log.errors == [], page_log.errors  # (page_log.external counts the file: URL itself)


def test_export_layer_head_scale_and_mask_work_offline(exported, offline, page_log):
    path, answer = exported
    pg, asked = offline
    pg.goto(path.as_uri())
    wait_drawn(pg, layer="0", head="0")
    pg.select_option("[data-role=layer]", "1")
    pg.select_option("[data-role=head]", "2")
    wait_drawn(pg, layer="1", head="2")
    expected = answer["attention"][1][2]
    got = shown(pg)
    assert np.array_equal(np.array(got, dtype=np.float32), np.array(expected, dtype=np.float32))  # the server's P

    pg.select_option("[data-role=scale]", "log")
    wait_drawn(pg, scale="log")
    assert pg.eval_on_selector(HEATMAP, "el => el.data[0].colorbar.title.text") == "P (log)"

    # a key clicked in the head view is masked: its column is 0 and the rows re-normalise over the rest
    key = 3
    pg.click(f"[data-role=headview] text[data-side=k][data-index='{key}']")
    pg.wait_for_function(f"document.querySelector('{HEATMAP}').dataset.masked !== '0'", timeout=20_000)
    masked = shown(pg)
    assert all(row[key] == 0 for row in masked)
    assert all(abs(sum(row) - 1) < 1e-5 for row in masked)
    assert "masked keys: 3:sat" in pg.inner_text("[data-role=note]")
    screenshot(pg, "standalone-export-mask")
    assert asked == []
    assert page_log.errors == [], page_log.errors  # (page_log.external counts the file: URL itself)


def test_without_scores_beta_and_masks_are_off_and_say_why(exported, offline, page_log):
    path, answer = exported
    pg, asked = offline
    pg.goto((path.parent / "no-scores.html").as_uri())
    wait_drawn(pg, layer="0", head="0")
    before = shown(pg)
    assert pg.is_disabled("[data-role=beta]")
    assert "holds no scores" in pg.inner_text("[data-role=note]")
    pg.click("[data-role=headview] text[data-side=k][data-index='3']")  # nothing to re-normalise: no mask
    pg.wait_for_timeout(300)
    assert pg.eval_on_selector(HEATMAP, "el => el.dataset.masked") == "0" and shown(pg) == before
    assert asked == [] and page_log.errors == []


def test_the_text_pages_button_downloads_the_same_file_and_it_opens_offline(page, page_log, live_server, browser, tmp_path):
    """Export panel → "Download standalone HTML": the server's file for the page's input (every layer and head), which
    then opens from file:// with the network cut on the layer and head the page showed, and moves to others."""
    page.goto(f"{live_server}/#m=minilm&l=2&h=3")
    page.wait_for_function("() => document.querySelector('#heatmap.js-plotly-plot')?.data?.[0]?.z", timeout=60_000)  # (the page's CSP: a function, not a string)
    shown_on_page = page.eval_on_selector("#heatmap", "el => el.data[0].customdata || el.data[0].z")
    with page.expect_download(timeout=60_000) as download:
        page.click("#export-html")
    assert download.value.suggested_filename == "attnlab-minilm-L2-H3.html"
    path = tmp_path / "page-export.html"
    download.value.save_as(path)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#export-panel").screenshot(path=str(SCREENSHOTS / "text-page-export-html-button.png"))
    page_log.check()

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    offline_page = context.new_page()
    asked: list[str] = []
    errors: list[str] = []
    offline_page.on("pageerror", lambda e: errors.append(str(e)))
    offline_page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "blob:"))
                       else (asked.append(r.request.url), r.abort()))
    try:
        offline_page.goto(path.as_uri())
        wait_drawn(offline_page, layer="2", head="3")  # it opens on the page's head
        got = shown(offline_page)
        assert np.array_equal(np.array(got, dtype=np.float32), np.array(shown_on_page, dtype=np.float32))
        assert offline_page.locator("[data-role=layer] option").count() == 6  # minilm: every layer and head
        assert offline_page.locator("[data-role=head] option").count() == 12
        offline_page.select_option("[data-role=layer]", "0")
        wait_drawn(offline_page, layer="0", head="3")
        assert shown(offline_page) != got
        assert asked == [] and errors == []
    finally:
        context.close()
