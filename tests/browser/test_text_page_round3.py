"""What the text page shows, third round (issue 28 items 1–3, 8, 9; issue 27's job ETA), in Debian's Chromium with
the real smollm2-135m: the token each answer box will be, the long sample's button, refusals beside the control that
was used with the old panels marked, the arrow keys only inside the map, and each job's time left."""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

from tests.browser.conftest import screenshot

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


def _ready(page, url, hash_=f"#m=smollm2-135m&t={quote(PROMPT)}"):
    page.goto(f"{url}/{hash_}")
    page.wait_for_function("() => document.getElementById('lm-output').dataset.top !== undefined", timeout=300_000)


def test_answer_boxes_show_the_token_and_offer_the_spaced_one(live_server, page, page_log):
    """"Anna" without its space is id 46484, not " Anna" (16435): the box says which token it is and offers the
    spaced one; the default " Paris" shows its space."""
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote('Peter gave the book to')}")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=300_000)
    page.wait_for_function("() => document.getElementById('patch-answer-token').dataset.id === '7042'", timeout=60_000)
    assert page.text_content("#patch-answer-token").startswith("␣Paris · id 7042")
    assert page.get_attribute("#patch-wrong-token", "data-id") is not None  # " Rome" is one token too
    assert "ends without a space" not in page.text_content("#patch-answer-token")

    page.fill("#patch-clean", "Anna gave the book to Peter, and Peter gave it back to")
    page.fill("#patch-answer", "Anna")
    page.wait_for_function("() => document.getElementById('patch-answer-token').dataset.id === '46484'", timeout=60_000)
    hint = page.text_content("#patch-answer-token")
    assert hint.startswith("Anna · id 46484") and "ends without a space" in hint and "id 16435" in hint
    assert page.get_attribute("#patch-answer-token", "data-suggest") == "16435"
    screenshot(page, "round3-answer-token")
    page.click("#patch-answer-token button")
    assert page.input_value("#patch-answer") == " Anna"
    page.wait_for_function("() => document.getElementById('patch-answer-token').dataset.id === '16435'", timeout=60_000)
    assert page.text_content("#patch-answer-token").startswith("␣Anna · id 16435")

    # several tokens: said under the box before the server refuses the scan
    page.fill("#patch-wrong", " Amsterdamsky")
    page.wait_for_function("() => /must be one token/.test(document.getElementById('patch-wrong-token').textContent)", timeout=60_000)

    # the faithfulness panel's answer box: empty = the top prediction; a typed one shows its token the same way
    assert "top prediction" in page.text_content("#faith-answer-token")
    page.fill("#faith-answer", "Anna")
    page.wait_for_function("() => document.getElementById('faith-answer-token').dataset.suggest === '16435'", timeout=60_000)
    page_log.check()


def test_tokenize_endpoint_refuses_an_unknown_model(live_server, page):
    r = page.request.post(f"{live_server}/api/text/tokenize", data=json.dumps({"model": "nope", "text": "Anna"}),
                          headers={"Content-Type": "application/json"})
    assert r.status == 422 and "model" in r.text()
    r = page.request.post(f"{live_server}/api/text/tokenize", data=json.dumps({"model": "smollm2-135m", "text": "Anna"}),
                          headers={"Content-Type": "application/json"})
    assert r.ok and r.json()["ids"] == [46484] and r.json()["with_space"]["ids"] == [16435]


def test_long_sample_button_opens_the_stripped_sample_streamed(live_server, page, page_log):
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    assert sample == sample.rstrip(), "the sample ends with white space: its last query row would be that"
    page.goto(f"{live_server}/#m=minilm&t=hello")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.scale", timeout=300_000)
    with page.expect_request(lambda r: r.url.endswith("/api/text/attention") and r.method == "POST") as req:
        page.click("#long-sample-button")
    body = json.loads(req.value.post_data)
    assert body["text"] == sample.rstrip() and body["model"] == "smollm2-135m"
    assert "text/event-stream" in req.value.headers.get("accept", "")  # mayBeLong: a job with progress and Cancel
    assert page.input_value("#model-select") == "smollm2-135m"
    page.wait_for_function("() => !document.getElementById('run-progress').hidden", timeout=60_000)
    page.click("#run-cancel")
    page.wait_for_function("() => document.getElementById('run-progress').hidden", timeout=60_000)
    page_log.check()


def test_refusal_beside_run_and_old_panels_marked(live_server, page, page_log):
    _ready(page, live_server)
    nav_height = page.eval_on_selector("header", "e => e.getBoundingClientRect().height")
    detail = ("the estimated model time of this request is 95 s, over request_timeout_s=60 s: ask for fewer tokens, "
              "layers or interventions, or raise the setting; setting request_timeout_s")
    page.route("**/api/text/attention", lambda route: route.fulfill(status=413, content_type="application/json",
                                                                   body=json.dumps({"detail": detail})))
    page.fill("#text-input", "The capital of Italy is")
    page.click("#run-button")
    page.wait_for_function("() => !document.getElementById('run-error').hidden", timeout=60_000)
    assert "request_timeout_s" in page.text_content("#run-error") and "previous run" in page.text_content("#run-error")
    # the header keeps one line: the message is under the Run button
    assert page.eval_on_selector("header", "e => e.getBoundingClientRect().height") <= nav_height + 1
    assert page.eval_on_selector("#heatmap", "e => e.classList.contains('stale')")
    assert page.eval_on_selector("#lm-panels", "e => e.classList.contains('stale')")
    screenshot(page, "round3-refusal")
    page.unroute("**/api/text/attention")
    page.click("#run-button")
    page.wait_for_function("() => document.getElementById('run-error').hidden && !document.querySelector('#heatmap.stale')",
                           timeout=300_000)
    # an edit away from the text the panels were run on marks them; back to it clears the mark
    page.fill("#text-input", "The capital of Spain is")
    assert page.eval_on_selector("#heatmap", "e => e.classList.contains('stale')")
    page.fill("#text-input", "The capital of Italy is")
    assert not page.eval_on_selector("#heatmap", "e => e.classList.contains('stale')")
    page_log.errors = [e for e in page_log.errors if "status of 413" not in e]  # the refusal this test sent
    page_log.check()


def test_arrow_keys_scroll_the_page_unless_the_map_has_the_focus(live_server, page, page_log):
    _ready(page, live_server)
    page.evaluate("() => document.activeElement?.blur()")
    assert page.input_value("#layer-select") == "0"
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    page.wait_for_timeout(500)
    assert page.input_value("#layer-select") == "0"  # no run started
    assert page.evaluate("() => window.scrollY") > 0  # the page scrolled
    page.click("#heatmap-title")  # inside the map's area
    page.keyboard.press("ArrowDown")
    page.wait_for_function("() => document.getElementById('layer-select').value === '1'", timeout=60_000)
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.getElementById('head-select').value === '1'", timeout=60_000)
    page_log.check()


def test_job_clock_counts_down_and_names_the_queue(live_server, page, page_log):
    """The count-down every progress display uses (static/js/views/jobs.js), fed the documented events: the accepted
    event's ETA and queue place, refined from the rate of progress; an older server's progress alone works too."""
    page.goto(f"{live_server}/guide")
    texts = page.evaluate("""async () => {
        const { jobClock } = await import('/static/js/views/jobs.js');
        const seen = [];
        const c = jobClock((t) => seen.push(t));
        c.event({accepted: true, eta_s: 12, queue_position: 2, runs: 1});
        const first = c.text();
        await new Promise((r) => setTimeout(r, 1100));
        const later = c.text();
        c.event({progress: 1, total: 30, run: 1, runs: 1});
        const running = c.text();
        await new Promise((r) => setTimeout(r, 200));
        c.event({progress: 3, total: 30, run: 1, runs: 1}); // 2 layers in 0.2 s: 27 more take about 2.7 s
        const refined = c.text();
        c.stop();
        const old = jobClock(() => {});
        old.event({progress: 1, total: 10});
        const oneEvent = old.text();
        await new Promise((r) => setTimeout(r, 100));
        old.event({progress: 2, total: 10});
        const twoEvents = old.text();
        old.stop();
        return {first, later, running, refined, oneEvent, twoEvents, seen};
    }""")
    assert texts["first"] == "waiting: 2 jobs ahead · about 12 s left"
    assert texts["later"] == "waiting: 2 jobs ahead · about 11 s left"
    assert "waiting" not in texts["running"]
    left = int(re.search(r"about (\d+) s left", texts["refined"]).group(1))
    # the measured rate (27 layers in about 2.7 s) pulls the estimate down from 11 s; the page smooths each step to
    # at most a halving (a count-down never jumps), so it lands between the measured and the earlier estimate
    assert 2 <= left < 11, texts["refined"]
    assert texts["oneEvent"] == "" and re.fullmatch(r"about \d+ s left", texts["twoEvents"])
    page_log.check()


def test_streamed_runs_show_their_time_left(live_server, page, page_log):
    """A real streamed run (the text page's first view of a long text, and a continuation) shows the job's time left
    while it runs, and the continuation still streams its tokens after the accepted event."""
    _ready(page, live_server)
    page.evaluate("""() => { window.__eta = []; for (const id of ['run-progress-eta', 'continuation-eta']) {
        const node = document.getElementById(id);
        new MutationObserver(() => window.__eta.push([id, node.textContent])).observe(node, {childList: true, characterData: true, subtree: true}); } }""")
    page.fill("#max-new-tokens", "12")
    page.click("#generate-button")
    page.wait_for_function("() => ['done', 'error'].includes(document.getElementById('continuation').dataset.state)", timeout=300_000)
    assert page.get_attribute("#continuation", "data-state") == "done", page.text_content("#continuation-status")
    assert page.text_content("#continuation-status").startswith("12 tokens")
    seen = page.evaluate("() => window.__eta")
    assert any(i == "continuation-eta" and re.search(r"about \d+ s left|finishing", t) for i, t in seen), seen
    page_log.check()


def test_empty_analysis_panels_are_collapsed_until_used(live_server, page, page_log):
    _ready(page, live_server)
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=60_000)
    heights = page.evaluate("""() => Object.fromEntries(['patching-panel', 'lens-panel', 'faith-panel']
        .map(id => [id, document.getElementById(id).getBoundingClientRect().height]))""")
    # before: 560 px of empty heatmap, 560 of lens and 320 of faithfulness plots, about 1,500 px in all
    assert sum(heights.values()) < 700, heights
    page.click("#faith-run")
    page.wait_for_function("() => document.getElementById('faith-panel').dataset.state === 'done'", timeout=300_000)
    assert page.eval_on_selector("#faith-plot", "e => e.getBoundingClientRect().height") > 300
    # the chart is of this prompt: an edit of the prompt dims it
    assert not page.eval_on_selector("#faith-plot", "e => e.classList.contains('stale')")
    page.fill("#text-input", "The capital of Spain is")
    assert page.eval_on_selector("#faith-plot", "e => e.classList.contains('stale')")
    page_log.check()


def test_guide_pages_link_only_to_pages_that_exist(live_server, page, page_log):
    page.goto(f"{live_server}/guide")
    pages = sorted({h.split("#")[0] for h in page.eval_on_selector_all(
        "a[href^='/guide']", "els => els.map(a => a.getAttribute('href'))")} | {"/guide"})
    broken = []
    for path in pages:
        page.goto(f"{live_server}{path}")
        hrefs = page.eval_on_selector_all("main a[href]", "els => els.map(a => a.href)")
        for href in sorted({h.split("#")[0] for h in hrefs if h.startswith(live_server)}):
            if page.request.get(href).status != 200:
                broken.append((path, href))
    assert not broken, broken  # /guide/configuration linked ../benchmarks/results/README.md: a 404
    page_log.check()
