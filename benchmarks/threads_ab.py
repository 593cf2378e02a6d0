"""The A/B of `single_thread_max_tokens` (issue 55 §4) with a browser beside it: one `python -m app.serve` per value
(ATTNLAB_SINGLE_THREAD_MAX_TOKENS), each serving minilm, and fresh first views of several lengths posted to each in
interleaved rounds (the servers' order turned every round), while Debian's Chromium keeps the text page of one more
server busy on the same machine (a new text every view: its request, its drawing), as a user's browser is beside a
local lab. The value decides which inputs run on one torch thread; longer ones get as many as the cores other
processes leave free at the run's start (app/costs.py CpuShare), so the A/B measures that count against one thread
when something else, here the browser, wants the cores too.

Records per value and length the median wall time of a view (client side), the server's `model` part (Server-Timing),
the load average before and after, and the browser's views done meanwhile. Writes benchmarks/results/threads_ab_<label>.json.

    python -m benchmarks.threads_ab --label load11 [--values 0 48 512] [--tokens 32 96 192 384] [--rounds 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

from benchmarks.first_view import TreeServer
from benchmarks.run_all import RESULTS, ROOT, first_view_body, machine, server_timing, text_of

CHROMIUM = "/usr/bin/chromium"


class BrowserBeside(threading.Thread):
    """Chromium on the text page of `url`, drawing a fresh first view of another text again and again until stopped
    (its own thread: Playwright's sync API stays on the thread that started it)."""

    def __init__(self, url: str, tokens: int = 128):
        super().__init__(daemon=True, name="browser-beside")
        self.url, self.tokens = url, tokens
        self.views, self.failed = 0, None
        self.going = threading.Event()
        self.ready = threading.Event()
        self.going.set()

    def run(self) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{self.url}/#m=minilm&t={quote(text_of(self.tokens, 70_000))}")
                page.wait_for_function("() => { const el = document.querySelector('#heatmap.js-plotly-plot'); "
                                       "return el && el.data && el.data.length; }", timeout=300_000)
                self.ready.set()
                variant = 70_001
                while self.going.is_set():
                    page.fill("#text-input", text_of(self.tokens, variant))
                    page.click("#run-button")
                    # drawn: the status line names the new view's time once its heatmap is up
                    page.wait_for_function("() => / ms$/.test(document.getElementById('status').textContent)",
                                           timeout=300_000)
                    page.evaluate("() => { document.getElementById('status').textContent = ''; }")
                    self.views += 1
                    variant += 1
                browser.close()
        except Exception as exc:  # noqa: BLE001  reported with the results, the A/B goes on without it
            self.failed = repr(exc)
            self.ready.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--values", nargs="*", type=int, default=[0, 48, 512],
                        help="single_thread_max_tokens of each server")
    parser.add_argument("--tokens", nargs="*", type=int, default=[32, 96, 192, 384])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    servers = {v: TreeServer(ROOT, "minilm", {"ATTNLAB_SINGLE_THREAD_MAX_TOKENS": str(v)}) for v in args.values}
    beside = None if args.no_browser else TreeServer(ROOT, "minilm")
    browser = None
    samples: dict[str, dict[str, list[float]]] = {f"{v}/{n}": {"ms": [], "model": []}
                                                  for v in args.values for n in args.tokens}
    client = httpx.Client(timeout=600)
    try:
        if beside is not None:
            browser = BrowserBeside(beside.url)
            browser.start()
            browser.ready.wait(600)
        for v, server in servers.items():  # warm every server at every length
            for n in args.tokens:
                client.post(server.url + "/api/text/attention", json=first_view_body(text_of(n, 100 + n))).raise_for_status()
        load = os.getloadavg()
        variant, order = 5000, list(servers.items())
        for r in range(args.rounds):
            for n in args.tokens:
                for v, server in (order if r % 2 == 0 else order[::-1]):
                    variant += 1
                    start = time.perf_counter()
                    response = client.post(server.url + "/api/text/attention", json=first_view_body(text_of(n, variant)))
                    response.read()
                    elapsed = (time.perf_counter() - start) * 1000
                    response.raise_for_status()
                    samples[f"{v}/{n}"]["ms"].append(elapsed)
                    samples[f"{v}/{n}"]["model"].append(server_timing(response).get("model", float("nan")))
        load_after = os.getloadavg()
    finally:
        if browser is not None:
            browser.going.clear()
            browser.join(timeout=120)
        client.close()
        for server in [*servers.values(), *([beside] if beside else [])]:
            server.stop()
    base = 48 if 48 in args.values else args.values[0]  # the default this A/B questions
    out = {"machine": machine(), "rounds": args.rounds, "values": args.values, "tokens": args.tokens,
           "load_average_before": load, "load_average_after": load_after,
           "browser_views": None if browser is None else browser.views,
           "browser_failed": None if browser is None else browser.failed, "medians": {}, "samples": samples}
    for n in args.tokens:
        for v in args.values:
            own, ref = samples[f"{v}/{n}"], samples[f"{base}/{n}"]
            med, ref_med = statistics.median(own["ms"]), statistics.median(ref["ms"])
            out["medians"][f"{v}/{n}"] = {"ms": med, "model_ms": statistics.median(own["model"]),
                                          "ratio_to_default": med / ref_med}
            print(f"  {n:4d} tokens, single_thread_max_tokens={v:4d}: view {med:7.1f} ms "
                  f"(model {statistics.median(own['model']):7.1f} ms), {med / ref_med:.3f}× the {base} server's",
                  flush=True)
    print(f"  load {load[0]:.1f} → {load_after[0]:.1f}; browser views beside: "
          f"{out['browser_views']}{' (failed: ' + out['browser_failed'] + ')' if out['browser_failed'] else ''}")
    path = RESULTS / f"threads_ab_{args.label}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
