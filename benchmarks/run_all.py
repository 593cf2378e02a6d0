"""attnlab speed, measured against baselines in the same run (`make bench`).

Writes benchmarks/results/README.md (tables + the machine), results.json and PNG plots.
Every figure is a ratio to a baseline measured in the same run, interleaved with it, because these
machines are shared and noisy. Sections:
  1. latency vs length: end-to-end API (fresh input, repeated input) ÷ a raw transformers forward
  2. first view: payload bytes and time to first figure vs bertviz's head_view
  3. β slider in Chromium: input → redraw, view mode and run mode
  4. images at 224 and 448 px
  5. throughput and p99 at 1, 4 and 16 concurrent clients
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
LENGTHS = [16, 32, 64, 128, 256, 512]
# Words that are single WordPiece tokens in MiniLM's vocabulary: a text of n-2 of them is n tokens.
WORDS = ("the cat sat on a mat and the dog ran to the park while it was warm so we all went out "
         "for lunch near old river bank").split()
FIRST_VIEW_REPEATS = 5
FRESH_WORDS = "red blue green black white brown pink gray gold silver orange purple".split()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def text_of(n_tokens: int, variant: int = 0) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(n_tokens - 2)]
    words[0] = FRESH_WORDS[variant % len(FRESH_WORDS)]
    if variant >= len(FRESH_WORDS):
        words[1] = FRESH_WORDS[(variant // len(FRESH_WORDS)) % len(FRESH_WORDS)]
    if variant >= len(FRESH_WORDS) ** 2:
        words[2] = FRESH_WORDS[(variant // len(FRESH_WORDS) ** 2) % len(FRESH_WORDS)]
    return " ".join(words)


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "device": "cuda: " + torch.cuda.get_device_name(0)
        if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_start": os.getloadavg(),
    }
    return info


class Server:
    """The real app under uvicorn, on loopback."""

    def __init__(self, port: int, env: dict[str, str] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        log = open(RESULTS / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"],
            cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/api/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become ready (see benchmarks/results/server.log)")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=20)


class RawForward:
    """The baseline: tokenizer + a plain transformers forward with attentions (eager), in this process."""

    def __init__(self):
        from transformers import AutoModel, AutoTokenizer

        from models.adapters.bert import minilm_source

        self.tokenizer = AutoTokenizer.from_pretrained(minilm_source())
        self.model = AutoModel.from_pretrained(minilm_source(), attn_implementation="eager").eval()

    @torch.inference_mode()
    def __call__(self, text: str):
        inputs = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=512)
        return self.model(**inputs, output_attentions=True)


def first_view_body(text: str, layer: int = 0, head: int = 0, thumbnails: bool = True) -> dict:
    """What the text page asks for on a first view (one head with its scores, thumbnails, f32 encoding)."""
    return {"model": "minilm", "text": text, "layers": [layer], "heads": [head], "include_scores": True,
            "thumbnail_size": 24 if thumbnails else None, "encoding": "f32"}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_latency(server: Server, raw: RawForward, repeats: int) -> list[dict]:
    rows = []
    client = httpx.Client(timeout=120)
    variant = 0
    for n in LENGTHS:
        raw(text_of(n, 999))  # warm
        client.post(server.url + "/api/text/attention", json=first_view_body(text_of(n, 998)))
        raws, fresh, repeated, plain = [], [], [], []
        same = text_of(n, 997)
        client.post(server.url + "/api/text/attention", json=first_view_body(same)).raise_for_status()
        for _ in range(repeats):  # interleaved so that load on the machine hits all three alike
            variant += 1
            raws.append(timed(lambda: raw(text_of(n, variant))))
            body = first_view_body(text_of(n, variant))
            fresh.append(timed(lambda: client.post(server.url + "/api/text/attention", json=body).raise_for_status()))
            repeated.append(timed(lambda: client.post(server.url + "/api/text/attention",
                                                      json=first_view_body(same)).raise_for_status()))
            variant += 1  # one head's P only (what an API client asking for a map pays), a fresh input too
            body = {"model": "minilm", "text": text_of(n, variant), "layers": [0], "heads": [0], "encoding": "f32"}
            plain.append(timed(lambda: client.post(server.url + "/api/text/attention", json=body).raise_for_status()))
        r, f, p, q = (statistics.median(x) * 1000 for x in (raws, fresh, repeated, plain))
        rows.append({"tokens": n, "raw_ms": r, "fresh_ms": f, "repeated_ms": p, "plain_ms": q,
                     "fresh_ratio": f / r, "repeated_ratio": p / r, "plain_ratio": q / r})
        print(f"  {n:4d} tokens: raw {r:7.1f} ms · fresh {f:7.1f} ms ({f / r:.2f}×) · repeated {p:6.1f} ms ({p / r:.2f}×)"
              f" · P only {q:6.1f} ms ({q / r:.2f}×)")
    return rows


def bench_payload(server: Server, raw: RawForward) -> list[dict]:
    from bertviz import head_view

    rows = []
    client = httpx.Client(timeout=300)
    for n in (128, 512):
        text = text_of(n, 500 + n)
        start = time.perf_counter()
        out = raw(text)
        tokens = raw.tokenizer.convert_ids_to_tokens(raw.tokenizer(text, truncation=True, max_length=512)["input_ids"])
        html = head_view(out.attentions, tokens, html_action="return")
        bertviz_s = time.perf_counter() - start
        bertviz_bytes = len(html.data.encode())
        start = time.perf_counter()
        response = client.post(server.url + "/api/text/attention", json=first_view_body(text))
        ours_s = time.perf_counter() - start
        rows.append({"tokens": n, "bertviz_bytes": bertviz_bytes, "bertviz_s": bertviz_s,
                     "ours_bytes": len(response.content), "ours_api_s": ours_s,
                     "payload_ratio": len(response.content) / bertviz_bytes})
        print(f"  {n} tokens: bertviz {bertviz_bytes / 1e6:.1f} MB in {bertviz_s:.2f} s · "
              f"attnlab first view {len(response.content) / 1e3:.0f} kB in {ours_s:.2f} s")
    return rows


def chromium():
    from playwright.sync_api import sync_playwright

    from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS

    p = sync_playwright().start()
    return p, p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


WAIT_HEATMAP = "() => { const el = document.querySelector('#heatmap'); return el && el.data && el.data[0] && el.data[0].z; }"


def bench_browser(server: Server, raw: RawForward, moves: int) -> dict:
    from urllib.parse import quote

    p, browser = chromium()
    result: dict = {}

    def fresh_page():
        # A new page per measurement: a goto that changes only the URL hash would not reload the page.
        return browser.new_page(viewport={"width": 1400, "height": 1000})

    # Time to first figure at 128 and 512 tokens, from navigation start (the page's performance marks):
    # the attention map's cells painted (before plotly.js is evaluated), then the full Plotly figure.
    marks = ("attnlab:first-heatmap", "attnlab:heatmap-figure")
    for n in (128, 512):
        firsts, figures = [], []
        for k in range(FIRST_VIEW_REPEATS):  # a fresh input and a new page each time; the median is reported
            page = fresh_page()
            page.goto(f"{server.url}/#m=minilm&t={quote(text_of(n, 700 + 10 * n + k))}")
            page.wait_for_function(f"() => performance.getEntriesByName('{marks[1]}').length > 0", timeout=120_000)
            page.wait_for_function(f"() => document.querySelector('#heatmap').data[0].z.length === {n}", timeout=120_000)
            first, figure = (page.evaluate(f"() => performance.getEntriesByName('{m}')[0].startTime") / 1000 for m in marks)
            firsts.append(first)
            figures.append(figure)
            page.close()
        result[f"first_figure_s_{n}"], result[f"plotly_figure_s_{n}"] = statistics.median(firsts), statistics.median(figures)
        result[f"first_figure_all_s_{n}"] = firsts
        print(f"  first figure at {n} tokens (median of {len(firsts)}): cells painted {statistics.median(firsts):.2f} s "
              f"(range {min(firsts):.2f}–{max(firsts):.2f}), Plotly figure {statistics.median(figures):.2f} s")

    # β slider → redraw. The page fires "attnlab:heatmap" on #heatmap after each repaint of the shown head
    # (its cells on a canvas while a slider moves, Plotly's full drawing once input settles).
    def slider_latencies(mode: str, n_tokens: int, count: int) -> list[float]:
        page = fresh_page()
        page.goto(f"{server.url}/#m=minilm&t={quote(text_of(n_tokens, 900 + n_tokens))}&bm={mode}")
        page.wait_for_function(WAIT_HEATMAP, timeout=120_000)
        page.wait_for_function(f"() => document.querySelector('#heatmap').data[0].z.length === {n_tokens}", timeout=120_000)
        if page.eval_on_selector("#mode-select", "el => el.value") != mode:
            page.select_option("#mode-select", mode)
            time.sleep(1.5)
        out = []
        for i in range(count):
            value = round(-1.5 + 3 * ((i * 7) % count) / count, 2)
            # Waits on the page's event (no polling: a spinning page would take CPU from the server).
            ms = page.evaluate(
                """(v) => new Promise((resolve) => {
                     const el = document.querySelector('#heatmap');
                     const timeout = setTimeout(() => resolve(-1), 20000);
                     let t0 = 0;
                     el.addEventListener('attnlab:heatmap', () => { clearTimeout(timeout); resolve(performance.now() - t0); }, {once: true});
                     const slider = document.querySelector('#beta-slider');
                     slider.value = v;
                     t0 = performance.now();
                     slider.dispatchEvent(new Event('input', {bubbles: true}));
                   })""", value)
            if ms >= 0:
                out.append(ms)
        page.close()
        return out

    view = slider_latencies("view", 128, moves)
    # The baseline right before and right after the moves. (Interleaving it with the moves would make the
    # two processes' OpenMP threads, still spinning after each forward, slow each other down on 2 cores.)
    raws32 = [timed(lambda: raw(text_of(32, k))) for k in range(15)]
    run = slider_latencies("run", 32, moves)
    raws32 += [timed(lambda: raw(text_of(32, k))) for k in range(15, 30)]
    raw32 = statistics.median(raws32) * 1000
    result.update({
        "view_p50_ms": percentile(view, 50), "view_p95_ms": percentile(view, 95),
        "run_p50_ms": percentile(run, 50), "run_p95_ms": percentile(run, 95), "raw32_ms": raw32,
        "run_p95_ratio": percentile(run, 95) / raw32,
    })
    print(f"  view-mode β redraw (128×128): p50 {result['view_p50_ms']:.1f} ms, p95 {result['view_p95_ms']:.1f} ms")
    print(f"  run-mode β (32 tokens): p50 {result['run_p50_ms']:.1f} ms, p95 {result['run_p95_ms']:.1f} ms "
          f"= {result['run_p95_ratio']:.2f}× raw forward ({raw32:.1f} ms)")
    browser.close()
    p.stop()
    return result


def bench_images(server: Server, repeats: int) -> list[dict]:
    """dinov2-small per image at 224 and 448 px: API (fresh image) vs a raw Dinov2Model forward."""
    from PIL import Image
    from transformers import Dinov2Model

    weights = ROOT / "weights" / "dinov2-small"
    if not weights.exists():
        print("  (skipped: weights/dinov2-small not prepared)")
        return []
    model = Dinov2Model.from_pretrained(weights, attn_implementation="eager").eval()
    client = httpx.Client(timeout=300)
    rows = []
    import io

    import numpy as np

    rng = np.random.default_rng(0)
    for size in (224, 448):
        raws, apis = [], []
        for i in range(repeats):
            pixels = torch.randn(1, 3, size, size)
            with torch.inference_mode():
                raws.append(timed(lambda: model(pixel_values=pixels, output_attentions=True)))
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
            image_id = client.post(server.url + "/api/images", files={"file": ("x.png", buf.getvalue(), "image/png")}).json()["image_id"]
            body = {"model": "dinov2-small", "image_id": image_id, "layers": [11], "heads": [0],
                    "image_size": size}
            response = None

            def call():
                nonlocal response
                response = client.post(server.url + "/api/image/attention", json=body)

            apis.append(timed(call))
            if response.status_code != 200:
                print(f"  image request failed: {response.status_code} {response.text[:200]}")
                return rows
        tokens = len(response.json()["tokens"])
        r, a = statistics.median(raws) * 1000, statistics.median(apis) * 1000
        rows.append({"image_px": size, "tokens": tokens, "raw_ms": r, "api_ms": a, "ratio": a / r})
        print(f"  {size} px ({tokens} tokens): raw {r:.0f} ms · API {a:.0f} ms ({a / r:.2f}×)")
    return rows


def bench_concurrency(server: Server, seconds: float) -> list[dict]:
    rows = []
    counter = iter(range(10**9))
    lock = threading.Lock()
    for clients in (1, 4, 16):
        latencies, statuses = [], []
        stop = time.time() + seconds

        def worker():
            with httpx.Client(timeout=120) as client:
                while time.time() < stop:
                    with lock:
                        variant = next(counter)
                    body = first_view_body(text_of(64, 2000 + variant), thumbnails=False)
                    start = time.perf_counter()
                    r = client.post(server.url + "/api/text/attention", json=body)
                    latencies.append(time.perf_counter() - start)
                    statuses.append(r.status_code)

        started = time.time()
        with ThreadPoolExecutor(clients) as pool:
            for _ in range(clients):
                pool.submit(worker)
        elapsed = time.time() - started
        ok = [lat for lat, s in zip(latencies, statuses) if s == 200]
        rows.append({"clients": clients, "requests": len(statuses), "ok": len(ok),
                     "throughput_rps": len(ok) / elapsed, "p50_ms": percentile(ok, 50) * 1000,
                     "p99_ms": percentile(ok, 99) * 1000, "statuses": sorted(set(statuses))})
        print(f"  {clients:2d} clients: {len(ok) / elapsed:.1f} req/s, p50 {rows[-1]['p50_ms']:.0f} ms, "
              f"p99 {rows[-1]['p99_ms']:.0f} ms, statuses {sorted(set(statuses))}")
    return rows


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["latency"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["tokens"] for r in rows]
    plain = all("plain_ratio" in r for r in rows)
    ax[0].plot(x, [r["raw_ms"] for r in rows], "o-", c="k", label="raw transformers forward (eager, attentions)")
    ax[0].plot(x, [r["fresh_ms"] for r in rows], "o-", c="C0", label="attnlab API, first view, fresh input")
    if plain:
        ax[0].plot(x, [r["plain_ms"] for r in rows], "o-", c="C2", label="attnlab API, one head's P, fresh input")
    ax[0].plot(x, [r["repeated_ms"] for r in rows], "o-", c="C1", label="attnlab API, first view, repeated input")
    ax[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms (median)", title="latency vs length")
    ax[1].plot(x, [r["fresh_ratio"] for r in rows], "o-", c="C0", label="first view, fresh ÷ raw")
    if plain:
        ax[1].plot(x, [r["plain_ratio"] for r in rows], "o-", c="C2", label="one head's P, fresh ÷ raw")
    ax[1].plot(x, [r["repeated_ratio"] for r in rows], "o-", c="C1", label="first view, repeated ÷ raw")
    ax[1].axhline(1.15, ls=":", c="C0", label="target fresh ≤ 1.15")
    ax[1].axhline(0.2, ls=":", c="C1", label="target repeated ≤ 0.2")
    ax[1].set(xscale="log", xlabel="tokens", ylabel="ratio", title="ratio to the raw forward")
    for a in ax:
        a.set_xticks(x, [str(n) for n in x])
        a.minorticks_off()
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "latency.png", dpi=110)
    if results.get("concurrency"):
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        c = results["concurrency"]
        ax.bar([str(r["clients"]) for r in c], [r["throughput_rps"] for r in c], color="C0")
        ax2 = ax.twinx()
        ax2.plot([str(r["clients"]) for r in c], [r["p99_ms"] for r in c], "o-", c="C3")
        ax.set(xlabel="concurrent clients", ylabel="requests/s (bars)", title="64-token fresh requests")
        ax2.set_ylabel("p99 ms (line)")
        fig.tight_layout()
        fig.savefig(RESULTS / "concurrency.png", dpi=110)


def fmt_range(values: list[float] | None) -> str:
    return f"{min(values):.2f}–{max(values):.2f} s" if values else "n/a"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def write_report(results: dict) -> None:
    m = results["machine"]
    lines = [
        "# attnlab benchmarks", "",
        f"Run `make bench` to reproduce. Machine: {m['cpu']}, {m['cores']} cores, {m['device']}, torch {m['torch']} "
        f"({m['torch_threads']} threads), Python {m['python']}, {m['date']}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_average_at_start'])}.",
        *([f"Sections run separately (`--only`): " + "; ".join(
            f"{name} on {info['date']} at load {info['load_average_at_start'][0]:.1f}"
            for name, info in sorted(results["machines"].items())) + "."] if results.get("machines") else []),
        "Every ratio divides by a baseline measured in the same run, interleaved with it.", "",
        "## 1. Latency vs length (text, all-MiniLM-L6-v2)", "",
        "Baseline: tokenizer + `AutoModel(attn_implementation=\"eager\")(…, output_attentions=True)` in-process. "
        "attnlab: HTTP POST of the text page's first-view request (one head with scores, 24×24 thumbnails of "
        "every head, entropy and mean distance of every head) to uvicorn on loopback, response fully read.", "",
        "The last two columns: a fresh request for one head's P alone (no scores, no thumbnails; the entropy and "
        "mean distance of every head still come with it).", "",
        "| tokens | raw forward ms | API fresh ms | fresh ÷ raw | API repeated ms | repeated ÷ raw | P only ms | P only ÷ raw |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["latency"]:
        lines.append(f"| {r['tokens']} | {r['raw_ms']:.1f} | {r['fresh_ms']:.1f} | {r['fresh_ratio']:.2f} | "
                     f"{r['repeated_ms']:.1f} | {r['repeated_ratio']:.3f} | {r.get('plain_ms', float('nan')):.1f} | "
                     f"{r.get('plain_ratio', float('nan')):.2f} |")
    lines += ["", "![latency](latency.png)", ""]
    targets = []
    r128 = next(r for r in results["latency"] if r["tokens"] == 128)
    targets.append(("fresh 128-token request ≤ 1.15 × raw forward", f"{r128['fresh_ratio']:.2f}×", r128["fresh_ratio"] <= 1.15))
    targets.append(("repeated view ≤ 0.2 × raw forward (128 tokens)", f"{r128['repeated_ratio']:.3f}×", r128["repeated_ratio"] <= 0.2))
    if results.get("payload"):
        lines += ["## 2. First view vs bertviz `head_view`", "",
                  "| tokens | bertviz bytes | bertviz generate s | attnlab first-view bytes | attnlab API s | bytes ratio |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in results["payload"]:
            lines.append(f"| {r['tokens']} | {r['bertviz_bytes']:,} | {r['bertviz_s']:.2f} | {r['ours_bytes']:,} | "
                         f"{r['ours_api_s']:.3f} | 1/{1 / r['payload_ratio']:.0f} |")
            targets.append((f"first-view payload ≤ 1/50 of bertviz ({r['tokens']} tokens)",
                            f"1/{1 / r['payload_ratio']:.0f}", r["payload_ratio"] <= 1 / 50))
        lines.append("")
    b = results.get("browser")
    if b:
        lines += ["## 3. In Chromium", "",
                  "| measure | p50 | p95 |", "|---|---:|---:|",
                  f"| view-mode β → redraw, 128×128 head | {b['view_p50_ms']:.1f} ms | {b['view_p95_ms']:.1f} ms |",
                  f"| run-mode β → redraw, 32 tokens (model re-run) | {b['run_p50_ms']:.1f} ms | {b['run_p95_ms']:.1f} ms |",
                  "", f"Raw forward at 32 tokens: {b['raw32_ms']:.1f} ms. First figure (navigation → the attention "
                  f"map's cells painted, before plotly.js is evaluated; median of {FIRST_VIEW_REPEATS} page loads): "
                  f"{b['first_figure_s_128']:.2f} s at 128 tokens, {b['first_figure_s_512']:.2f} s at 512 tokens "
                  f"(range {fmt_range(b.get('first_figure_all_s_512'))}); the full Plotly figure (axes, hover, colour bar) "
                  f"follows at {b.get('plotly_figure_s_128', float('nan')):.2f} s and {b.get('plotly_figure_s_512', float('nan')):.2f} s.",
                  "Slider redraws are timed from the input event to the page's `attnlab:heatmap` event: while the "
                  "slider moves, the heatmap's cells are repainted on a canvas over the Plotly figure; Plotly and the "
                  "other panels catch up 150 ms after the last move.", ""]
        targets.append(("view-mode β redraw p95 ≤ 33 ms (128×128)", f"{b['view_p95_ms']:.1f} ms", b["view_p95_ms"] <= 33))
        targets.append(("run-mode β p95 ≤ 1.3 × raw forward (32 tokens)", f"{b['run_p95_ratio']:.2f}×", b["run_p95_ratio"] <= 1.3))
        targets.append(("first figure at 512 tokens ≤ 1.5 s (median)", f"{b['first_figure_s_512']:.2f} s", b["first_figure_s_512"] <= 1.5))
    if results.get("images"):
        lines += ["## 4. Images (dinov2-small)", "", "| px | tokens | raw forward ms | API ms (fresh image) | ratio |",
                  "|---:|---:|---:|---:|---:|"]
        for r in results["images"]:
            lines.append(f"| {r['image_px']} | {r['tokens']} | {r['raw_ms']:.0f} | {r['api_ms']:.0f} | {r['ratio']:.2f} |")
        lines.append("")
    if results.get("concurrency"):
        lines += ["## 5. Concurrency (64-token fresh requests, no thumbnails)", "",
                  "| clients | requests | 200s | req/s | p50 ms | p99 ms | statuses |", "|---:|---:|---:|---:|---:|---:|---|"]
        for r in results["concurrency"]:
            lines.append(f"| {r['clients']} | {r['requests']} | {r['ok']} | {r['throughput_rps']:.1f} | {r['p50_ms']:.0f} | "
                         f"{r['p99_ms']:.0f} | {r['statuses']} |")
        lines += ["", "![concurrency](concurrency.png)", ""]
    lines += ["## Targets", "", "| target | measured | |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict(ok)} |" for name, value, ok in targets]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--moves", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--only", nargs="*", default=None, help="latency payload browser images concurrency")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sections = set(args.only or ["latency", "payload", "browser", "images", "concurrency"])
    results: dict = {"machine": machine()}
    server = Server(args.port)
    raw = RawForward()
    try:
        if "latency" in sections:
            print("latency vs length"); results["latency"] = bench_latency(server, raw, args.repeats)
        if "payload" in sections:
            print("first view vs bertviz"); results["payload"] = bench_payload(server, raw)
        if "browser" in sections:
            print("browser"); results["browser"] = bench_browser(server, raw, args.moves)
        if "images" in sections:
            print("images"); results["images"] = bench_images(server, max(3, args.repeats // 3))
        if "concurrency" in sections:
            print("concurrency"); results["concurrency"] = bench_concurrency(server, args.seconds)
    finally:
        server.stop()
    if args.only:  # a partial run updates its sections of the last full results and keeps the others
        previous_path = RESULTS / "results.json"
        previous = json.loads(previous_path.read_text()) if previous_path.exists() else {}
        sections_before = ("latency", "payload", "browser", "images", "concurrency")
        machines = previous.get("machines") or {name: previous["machine"] for name in sections_before if name in previous}
        machines.update({section: results["machine"] for section in sections})
        results = {**previous, **results, "machines": machines}
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2))
    if "latency" in results:
        plot(results)
        write_report(results)
    print(f"wrote {RESULTS / 'README.md'}")


if __name__ == "__main__":
    main()
