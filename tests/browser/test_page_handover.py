"""Issue 53 §1 in Debian's Chromium: the page follows a drain's hand-over. Three replicas, Redis and Debian's nginx
from deploy/nginx.conf (tests/ops/fleet.py). The text page, through nginx, runs a patching scan of every head (one
patched copy per forward: a long job with a step per head); the replica running it gets a SIGTERM and drains for
less than the scan's ETA, so it hands the job to a peer (app/handover.py), where it runs again from its start. The
page says so ("moved to another replica (repN), restarting", static/js/views/jobs.js jobClock), its progress goes
back and climbs again, and it ends with the scan drawn (the panel `done`, the heatmap of every layer and head),
having sent the job's POST once: the page re-attached to the new job (postJob), it did not send the job again.
Every wait is on a DOM state, a job on a replica's board or a process's exit, with limits for a loaded machine."""
from __future__ import annotations

import time
from urllib.parse import quote

import httpx
import pytest

from tests.browser.conftest import screenshot
from tests.ops.fleet import Fleet, long_text, running_fleet

LAYERS, HEADS = 8, 8
PROMPT_WORDS = 700
# drain_s under MARGIN_S (app/handover.py): a running job with any time left moves at the drain's first tick;
# patching_batch_tokens = the prompt's tokens: one copy a forward, a progress step per head (a job of seconds a step)
SETTINGS = {"default_models": ["lm"], "analysis_max_tokens": 2048, "patching_batch_tokens": PROMPT_WORDS,
            "max_tokens": 4096, "max_text_chars": 40_000, "drain_s": 3.0, "shutdown_grace_s": 2.0,
            "job_reattach_grace_s": 120.0, "request_timeout_s": 600}
CLIENT = "handpage-client-0001"


def build_deep_llama(folder):
    """A random Llama of LAYERS layers × HEADS heads (hidden 64) on the tiny tokenizer: a head scan is LAYERS × HEADS
    forwards, each a fraction of a second over PROMPT_WORDS tokens on 2 cores."""
    import torch
    import transformers as tf

    from tests.tiny_models import CLS, PAD, SEP, save_tokenizer

    vocab = save_tokenizer(folder)
    config = tf.LlamaConfig(vocab_size=vocab, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                            initializer_range=0.3, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = build_deep_llama(tmp_path_factory.mktemp("deep-llama"))
    with running_fleet(tmp_path_factory.mktemp("handover-fleet"), SETTINGS, folder) as started:
        yield started


# What the panel showed, in order: its progress values and its status line's texts (the count-down beside the bar)
WATCH = """() => {
  window.seen = { progress: [], eta: [] };
  const panel = document.getElementById('patching-panel'), eta = document.getElementById('patch-eta');
  new MutationObserver(() => window.seen.progress.push(Number(panel.dataset.progress || 0)))
    .observe(panel, { attributes: true, attributeFilter: ['data-progress'] });
  new MutationObserver(() => { const text = eta.textContent; if (text && text !== window.seen.eta.at(-1)) window.seen.eta.push(text); })
    .observe(eta, { childList: true, characterData: true, subtree: true });
}"""


def _running_on(fleet: Fleet):
    """The replica whose board has the scan running, or None."""
    for replica in fleet.replicas:
        try:
            if any(job["state"] == "running" for job in replica.jobs()):
                return replica
        except (httpx.TransportError, ValueError):
            continue
    return None


def _wait_for(what: str, check, limit_s: float = 300):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not seen in {limit_s:g} s")


@pytest.mark.slow  # three replicas, redis-server and nginx behind the page; one replica drained
def test_the_page_follows_a_drains_handover_without_sending_the_job_again(page, page_log, fleet):
    posts = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" and r.url.endswith("/api/text/patching")
            else None)
    page.context.add_cookies([{"name": "attnlab_client", "value": CLIENT, "url": fleet.nginx.base}])
    page.goto(f"{fleet.nginx.base}/#m=lm&t={quote('the cat sat on the mat')}")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=300_000)
    clean = long_text(PROMPT_WORDS - 1, shift=5) + " the"
    page.fill("#patch-clean", clean)
    page.fill("#patch-corrupt", long_text(PROMPT_WORDS - 1, shift=5) + " a")  # one token apart, the same count
    page.fill("#patch-answer", "cat")
    page.fill("#patch-wrong", "dog")
    page.select_option("#patch-scan", "heads")
    page.evaluate(WATCH)
    page.click("#patch-run")

    # the scan runs (its first heads patched) on the replica nginx put this client on: that one is drained
    page.wait_for_function("() => Number(document.getElementById('patching-panel').dataset.progress || 0) >= 2",
                           timeout=600_000)
    target = _wait_for("the scan running on a replica's board", lambda: _running_on(fleet), limit_s=120)
    before = int(page.eval_on_selector("#patching-panel", "e => e.dataset.progress"))
    assert before < LAYERS * HEADS, "the scan ended before the drain: make it longer"
    target.proc.send_signal(15)  # SIGTERM: the drain
    signalled = time.monotonic()

    # the page says the job moved, names the peer, and its progress starts again there
    page.wait_for_function("() => window.seen.eta.some((t) => t.includes('moved to another replica'))",
                           timeout=300_000)
    moved_after = time.monotonic() - signalled
    screenshot(page, "handover-01-moved")
    moved = next(t for t in page.evaluate("() => window.seen.eta") if "moved to another replica" in t)
    peer = moved.split("(", 1)[1].split(")", 1)[0]
    assert peer != target.name and peer in {r.name for r in fleet.replicas}, moved
    assert page.eval_on_selector("#patching-panel", "e => e.dataset.state") == "running"
    page.wait_for_function("() => document.getElementById('patching-panel').dataset.state === 'done'",
                           timeout=900_000)
    done_after = time.monotonic() - signalled
    assert target.proc.wait(timeout=120) == 0
    assert f"handed over to replica {peer}" in target.log_path.read_text()  # the drained replica's own account
    screenshot(page, "handover-02-done")

    seen = page.evaluate("() => window.seen")
    progress = seen["progress"]
    restart = next((i for i in range(1, len(progress)) if progress[i] < progress[i - 1]), None)
    assert restart is not None and progress[restart] < before, progress  # the bar went back: the peer's run
    assert progress[-1] == LAYERS * HEADS and progress[restart:] == sorted(progress[restart:]), progress
    assert any(t.startswith(f"restarted on another replica ({peer})") for t in seen["eta"]), seen["eta"]
    # the result drawn: every layer × head of the scan, from the peer's run
    z = page.eval_on_selector("#patch-heatmap", "el => el.data && el.data[0].z")
    assert len(z) == LAYERS and all(len(row) == HEADS for row in z), z
    status = page.text_content("#patch-status")
    assert "best head" in status, status
    assert page.is_hidden("#patch-error")
    # the job's POST went out once: the page re-attached to the moved job, it did not send it again
    assert len(posts) == 1, posts
    page_log.check()
    print(f"\nSIGTERM of {target.name} at head {before} of {LAYERS * HEADS}: the page showed {moved!r}, its progress "
          f"went back to {progress[restart]} and ended at {progress[-1]}; shown {moved_after:.1f} s after the SIGTERM, "
          f"drawn after {done_after:.1f} s; POSTs of the scan: {len(posts)}")


def test_the_count_down_says_a_handover_then_the_restart(page, page_log, live_server):
    """jobClock replayed on its own clock: a job's count-down, its handover (the text names the peer and the restart),
    the new job's accepted event (its own ETA and total), then its progress from the start ("restarted on …")."""
    page.goto(f"{live_server}/guide")
    shown = page.evaluate("""async () => {
      const { jobClock } = await import('/static/js/views/jobs.js');
      let t = 0;
      const clock = jobClock(() => {}, { now: () => t });
      const texts = [];
      const feed = (ms, event) => { t = ms; clock.event(event); texts.push(clock.text()); };
      feed(0, { accepted: true, eta_s: 60, queue_position: 0, total: 64 });
      feed(1000, { progress: 1, total: 64 });
      feed(2000, { progress: 2, total: 64 });
      feed(2500, { handed_over: { from: 'rep0', to: 'rep2', job_id: 'j2', why: 'drain' } });
      feed(3000, { accepted: true, eta_s: 90, queue_position: 0, total: 64 });
      feed(4000, { progress: 1, total: 64 });
      feed(5000, { progress: 2, total: 64 });
      clock.stop();
      return { texts, total: clock.total({ progress: 2, total: 7 }) };
    }""")
    texts = shown["texts"]
    assert not any("replica" in text for text in texts[:3]), texts
    assert texts[3] == "moved to another replica (rep2), restarting", texts  # no count-down of the old job
    assert texts[4] == "moved to another replica (rep2), restarting · about 90 s left", texts  # the new job's ETA
    assert all(text.startswith("restarted on another replica (rep2) · about ") for text in texts[5:]), texts
    assert shown["total"] == 64
    page_log.check()
