"""A reload during a long compare keeps its interventions (issue 56 §2), in Chromium on the real server with the
12-layer random BERT: a key mask clicked on a long input's token strip sends a compare job that waits behind another
client's long job; the page is reloaded while it waits. After the reload the job is re-attached (not sent again),
the URL still holds the mask (`mk`), the lab lists it, and a second tab on the same URL asks for the same compare and
shows the same interventions and effects."""
from __future__ import annotations

import json
import threading
import time
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from tests.api.test_job_reattach import serve_big_bert
from tests.browser.conftest import screenshot
from tests.browser.test_job_reload_page import JOB_KEY, _blocker
from tests.faults.conftest import LONG_TEXT

OVERVIEW = "() => document.getElementById('heatmap').dataset.atlas === 'overview'"


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    yield from serve_big_bert(tmp_path_factory, "reload-ivs")


def _jobs_sent(pg) -> list[dict]:
    """The bodies of the attention jobs this page sends (a plain view is a plain POST, not counted)."""
    sent: list[dict] = []

    def on_request(request) -> None:
        if request.method == "POST" and request.url.endswith("/api/text/attention") and \
                "text/event-stream" in (request.headers.get("accept") or ""):
            sent.append(json.loads(request.post_data or "{}"))

    pg.on("request", on_request)
    return sent


def _hash(pg) -> dict:
    return parse_qs(urlparse(pg.url).fragment)


def test_a_reload_keeps_the_interventions_of_its_job_and_a_second_tab_shows_the_same(page, big_server):
    base = big_server.base
    sent = _jobs_sent(page)
    page.goto(f"{base}/#m=big")
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    page.fill("#text-input", LONG_TEXT)
    page.click("#run-button")
    page.wait_for_function(OVERVIEW, timeout=300_000)  # the long input's plain view, drawn
    page.wait_for_selector("#token-strip .tok[data-index='1']")
    assert "mk" not in _hash(page)
    blocked: dict = {}
    blocker = threading.Thread(target=_blocker, args=(base, blocked))
    blocker.start()
    try:
        for _ in range(200):  # the blocker has the model
            if httpx.get(base + "/api/jobs", timeout=10).json()["jobs"]:
                break
            time.sleep(0.05)
        page.click("#token-strip .tok[data-index='1']")  # mask key 1: a compare, queued behind the blocker
        page.wait_for_function(f"() => (sessionStorage.getItem('{JOB_KEY}') ?? '').includes('mask_keys')",
                               timeout=60_000)
        asked = [body for body in sent if body.get("interventions")]
        assert len(asked) == 1 and asked[0]["compare"], sent
        # the bar says what runs: a compare, not a "first view" (issue 56 §8)
        page.wait_for_function("() => /^compare/.test(document.getElementById('run-progress-text').textContent)")
        assert "events" not in blocked, "the blocking job ended before the reload: nothing was left to re-attach to"

        page.reload()
        page.wait_for_function(f"() => sessionStorage.getItem('{JOB_KEY}') === null", timeout=300_000)
        page.wait_for_function(OVERVIEW, timeout=300_000)
        page.wait_for_function("() => document.getElementById('interventions-list').textContent.trim() !== ''")
        assert [body for body in sent if body.get("interventions")] == asked  # re-attached, not sent again
        assert _hash(page).get("mk") == ["1"], page.url  # the mask is in the link
        listed = page.inner_text("#interventions-list")
        assert "mask" in listed.lower(), listed  # and in the lab's list, beside its effect
        assert page.get_attribute("#token-strip .tok[data-index='1']", "aria-pressed") == "true"
        effects = page.inner_text("#effect-summary")
        screenshot(page, "job-reload-interventions-01-reloaded")
    finally:
        blocker.join(timeout=300)

    # a second tab on the same link: the same compare asked, the same interventions listed, the same effects
    second = page.context.new_page()
    try:
        second_sent = _jobs_sent(second)
        second.goto(page.url)
        second.wait_for_function(OVERVIEW, timeout=300_000)
        second.wait_for_function("() => document.getElementById('interventions-list').textContent.trim() !== ''")
        asked_second = [body for body in second_sent if body.get("interventions")]
        assert asked_second and asked_second[-1]["interventions"] == asked[0]["interventions"], second_sent
        assert second.inner_text("#interventions-list") == listed
        second.wait_for_function("(text) => document.getElementById('effect-summary').innerText === text", arg=effects,
                                 timeout=60_000)
    finally:
        second.close()
