"""Issue 36 §6: zooming a long map through nginx in Debian's Chromium. Three replicas, Redis and Debian's nginx from
deploy/nginx.conf (tests/ops/fleet.py). Before each zoom the browser gets another attnlab_client cookie, so its window
requests land on other replicas the way round robin spread them (issue 36: 2 of 6 windows drawn, the rest "404 …
evicted"); the replicas forward them to the run's owner and every zoom draws its exact window."""
from __future__ import annotations

from urllib.parse import quote

import pytest

from app.ids import run_owner
from tests.browser.conftest import screenshot
from tests.ops.fleet import Fleet, build_long_llama, long_text

pytestmark = pytest.mark.slow  # three replicas, redis-server and nginx behind the page

ZOOMS = [(0, 40), (100, 140), (200, 240), (300, 340), (420, 460), (520, 560)]  # (first, end) of rows and columns


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = build_long_llama(tmp_path_factory.mktemp("zoom-llama"))
    started = None
    try:
        started = Fleet(tmp_path_factory.mktemp("zoom-fleet"), {
            "default_models": ["lm"], "extra_models": {"lm": str(folder)}, "full_map_tokens": 64,
            "request_timeout_s": 600})
        yield started
    finally:
        if started is not None:
            started.close()


def test_zooming_a_long_map_through_nginx_draws_every_window(page, page_log, fleet):
    windows = []  # (status, the replica that forwarded it or None)
    page.on("response", lambda r: windows.append((r.status, r.headers.get("x-attnlab-forwarded-by")))
            if "/api/runs/" in r.url else None)
    page.goto(f"{fleet.nginx.base}/#m=lm&t={quote(long_text(600))}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    owner = run_owner(page.evaluate("() => document.getElementById('heatmap').dataset.runId || ''") or "") or None
    screenshot(page, "fleet-01-overview")
    for i, (first, end) in enumerate(ZOOMS):
        # another client key for this zoom: nginx's hash sends it to whichever replica that key maps to
        page.context.add_cookies([{"name": "attnlab_client", "value": f"zoom-client-{i:02d}", "url": fleet.nginx.base}])
        page.evaluate(f"""() => Plotly.relayout('heatmap', {{'xaxis.range[0]': {first}, 'xaxis.range[1]': {end},
                                                             'yaxis.range[0]': {end}, 'yaxis.range[1]': {first}}})""")
        page.wait_for_function(f"""() => {{ const el = document.getElementById('heatmap');
            return el.dataset.atlas === 'window-labels' && el.data[0].x[0] === {first}; }}""", timeout=120_000)
        drawn = page.eval_on_selector("#heatmap", "el => ({x: Array.from(el.data[0].x), z: el.data[0].z})")
        assert drawn["x"][-1] == end - 1 and len(drawn["z"]) == end - first
    screenshot(page, "fleet-02-last-window")
    statuses = [status for status, _ in windows]
    assert statuses and all(status == 200 for status in statuses), windows
    forwarded = {by for _, by in windows if by}
    assert forwarded, f"no window request landed on another replica than the run's owner ({owner}): {windows}"
    # no window failed (the page says a failed window under the map, e.g. "404 … press Run again")
    assert page.evaluate("() => { const box = document.getElementById('atlas-error'); "
                         "return box && !box.hidden ? box.textContent : ''; }") == ""
    page_log.check()
    print(f"\nzoom through nginx: {len(ZOOMS)} of {len(ZOOMS)} windows drawn, {statuses.count(200)} window requests "
          f"answered 200, forwarded by {sorted(forwarded)}")
