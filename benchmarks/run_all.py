"""attnlab speed, measured against baselines in the same run (`make bench`).

Writes benchmarks/results/README.md (tables + the machine), results.json and PNG plots.
Every figure is a ratio to a baseline measured in the same run, interleaved with it, because these
machines are shared and noisy. Sections:
  1. latency vs length: end-to-end API (fresh input, repeated input) ÷ a raw transformers forward
  2. first view: payload bytes and time to first figure vs bertviz's head_view
  3. β slider in Chromium: input → redraw, view mode and run mode
  4. images at 224 and 448 px
  5. throughput and p99 at 1, 4 and 16 concurrent clients
  6. lm: the decoder smollm2-135m (first view, run-mode β in Chromium, continuations, first figure, RSS
     under a 60-second mixed load)
  7. fixed: the fixed cost per request under `python -m app.serve` (fresh 128-token view, cache hit, run-mode
     β at 32 tokens, each ÷ a raw forward interleaved with it)
`--device cpu|cuda|auto` runs the server under test (ATTNLAB_DEVICE) and the in-process baselines there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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


def resolve_device(preference: str) -> str:
    if preference == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    return "cuda" if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()) else "cpu"


DEVICE = "cpu"  # set from --device in main(): the in-process baselines run here, the server under test too


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


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
        if DEVICE == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_start": os.getloadavg(),
    }
    return info


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 240) -> bool:
    """True once GET /api/ready answers 200; False after `seconds` or when the server process has exited."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/api/ready", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


class Server:
    """The real app under uvicorn, on loopback (benchmarks/serve_probe.py: uvicorn.run(app.main.app) plus a
    file with the result cache's size, refreshed every second). Server-Timing headers are on (queue, model,
    app ms), for the breakdowns."""

    def __init__(self, port: int, env: dict[str, str] | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.cache_file = RESULTS / "cache-size.json"
        self.cache_file.unlink(missing_ok=True)
        log = open(RESULTS / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "serve_probe.py"), str(port)],
            cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "ATTNLAB_DEVICE": DEVICE, "ATTNLAB_EXPOSE_TIMINGS": "1",
                           # a generate stream must end within request_timeout_s of its arrival (60 s by
                           # default), which a 32-token stream of two continuations can pass on a busy machine
                           "ATTNLAB_REQUEST_TIMEOUT_S": "300",
                           "ATTNLAB_BENCH_CACHE_FILE": str(self.cache_file), **(env or {})},
            stdout=log, stderr=subprocess.STDOUT,
        )
        if not wait_ready(self.url, self.proc):
            raise RuntimeError("server did not become ready (see benchmarks/results/server.log)")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.cache_file.unlink(missing_ok=True)

    def cache_size(self) -> dict | None:
        try:
            return json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return None


def same_gemm(model: torch.nn.Module, wanted: bool) -> torch.nn.Module:
    """`model` with its float32 Linear layers routed as the app routes them on this CPU (models/cpu_linear.py: oneDNN
    where it outruns MKL) when `wanted`: the baseline that isolates what the app adds beyond its forward's products.
    Without it the baseline is plain transformers, as a user would run it."""
    if wanted and DEVICE == "cpu":
        from models.cpu_linear import route_linear

        route_linear(model)
    return model


class RawForward:
    """The baseline: tokenizer + a plain transformers forward with attentions (eager), in this process.
    `same_gemm_as_app`: with the app's Linear routing (same_gemm())."""

    def __init__(self, same_gemm_as_app: bool = False):
        from transformers import AutoModel, AutoTokenizer

        from models.adapters.bert import minilm_source

        self.tokenizer = AutoTokenizer.from_pretrained(minilm_source())
        self.model = same_gemm(AutoModel.from_pretrained(minilm_source(), attn_implementation="eager").eval().to(DEVICE),
                               same_gemm_as_app)

    @torch.inference_mode()
    def __call__(self, text: str):
        inputs = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=512).to(DEVICE)
        out = self.model(**inputs, output_attentions=True)
        sync()
        return out


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


def new_page(browser):
    # A new page per measurement: a goto that changes only the URL hash would not reload the page.
    return browser.new_page(viewport={"width": 1400, "height": 1000})


# The page's performance marks, from navigation start: the attention map's cells painted (before plotly.js
# is evaluated), then the full Plotly figure.
FIGURE_MARKS = ("attnlab:first-heatmap", "attnlab:heatmap-figure")


def first_figures(browser, server: Server, model: str, texts: list[str], n_tokens: int, extra_wait: str | None = None):
    """Page loads, a new page and a fresh input each: ([cells painted s], [Plotly figure s], [extra s]).
    extra_wait: a JS condition whose time (performance.now() when seen, polled every 20 ms) is also returned."""
    from urllib.parse import quote

    firsts, figures, extras = [], [], []
    for text in texts:
        page = new_page(browser)
        page.goto(f"{server.url}/#m={model}&t={quote(text)}")
        page.wait_for_function(f"() => performance.getEntriesByName('{FIGURE_MARKS[1]}').length > 0", timeout=120_000)
        page.wait_for_function(f"() => document.querySelector('#heatmap').data[0].z.length === {n_tokens}", timeout=120_000)
        first, figure = (page.evaluate(f"() => performance.getEntriesByName('{m}')[0].startTime") / 1000 for m in FIGURE_MARKS)
        if extra_wait:
            extras.append(page.wait_for_function(f"() => ({extra_wait}) && performance.now()", polling=20,
                                                 timeout=120_000).json_value() / 1000)
        firsts.append(first)
        figures.append(figure)
        page.close()
    return firsts, figures, extras


def slider_latencies(browser, server: Server, mode: str, text: str, n_tokens: int, count: int,
                     model: str = "minilm") -> list[float]:
    """β slider → redraw, ms per move. The page fires "attnlab:heatmap" on #heatmap after each repaint of the
    shown head (its cells on a canvas while a slider moves, Plotly's full drawing once input settles)."""
    from urllib.parse import quote

    page = new_page(browser)
    page.goto(f"{server.url}/#m={model}&t={quote(text)}&bm={mode}")
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


def bench_browser(server: Server, raw: RawForward, moves: int) -> dict:
    p, browser = chromium()
    result: dict = {}

    # Time to first figure at 128 and 512 tokens, from navigation start (the page's performance marks).
    for n in (128, 512):
        texts = [text_of(n, 700 + 10 * n + k) for k in range(FIRST_VIEW_REPEATS)]
        firsts, figures, _ = first_figures(browser, server, "minilm", texts, n)
        result[f"first_figure_s_{n}"], result[f"plotly_figure_s_{n}"] = statistics.median(firsts), statistics.median(figures)
        result[f"first_figure_all_s_{n}"] = firsts
        print(f"  first figure at {n} tokens (median of {len(firsts)}): cells painted {statistics.median(firsts):.2f} s "
              f"(range {min(firsts):.2f}–{max(firsts):.2f}), Plotly figure {statistics.median(figures):.2f} s")

    view = slider_latencies(browser, server, "view", text_of(128, 1028), 128, moves)
    # The baseline right before and right after the moves. (Interleaving it with the moves would make the
    # two processes' OpenMP threads, still spinning after each forward, slow each other down on 2 cores.)
    raws32 = [timed(lambda: raw(text_of(32, k))) for k in range(15)]
    run = slider_latencies(browser, server, "run", text_of(32, 932), 32, moves)
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
    model = Dinov2Model.from_pretrained(weights, attn_implementation="eager").eval().to(DEVICE)
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
                raws.append(timed(lambda: (model(pixel_values=pixels.to(DEVICE), output_attentions=True), sync())))
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


# ---- 6. a decoder LM (issue 11 §6) ------------------------------------------------------------------------
LM = "smollm2-135m"
LM_WEIGHTS = ROOT / "weights" / LM
LM_BETA_LAYERS = [9, 10, 11]  # β on layers 10–12 (counted from 1), as in the headline
LM_NEW_TOKENS = 32
# Prompts for the continuations: open-ended, so that greedy decoding does not stop at an end of sequence.
LM_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The history of the printing press begins in the fifteenth century, when",
    "To make a good cup of tea, you first need to",
    "The most important thing I learned at university was that",
    "In the year 2050, cities will look very different because",
]


class RawLM:
    """The LM baseline, in this process: its tokenizer + AutoModelForCausalLM with eager attention.
    `same_gemm_as_app`: with the app's Linear routing (same_gemm())."""

    def __init__(self, same_gemm_as_app: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(LM_WEIGHTS)
        self.model = same_gemm(AutoModelForCausalLM.from_pretrained(
            LM_WEIGHTS, attn_implementation="eager", dtype=torch.float32).eval().to(DEVICE), same_gemm_as_app)

    def text(self, n_tokens: int, variant: int) -> str:
        # Every word of WORDS and FRESH_WORDS after a space is one token of this vocabulary, and no BOS is
        # added; at the start of the text some split ("pink" → "p", "ink"), hence the leading "The".
        text = "The " + text_of(n_tokens + 1, variant)
        count = len(self.tokenizer(text)["input_ids"])
        if count != n_tokens:
            raise RuntimeError(f"the {LM} text of {n_tokens} tokens has {count}")
        return text

    @torch.inference_mode()
    def __call__(self, text: str):
        inputs = self.tokenizer(text, return_tensors="pt").to(DEVICE)
        out = self.model(**inputs, output_attentions=True)
        sync()
        return out

    @torch.inference_mode()
    def generate(self, ids: list[int], n: int) -> list[int]:
        input_ids = torch.tensor([ids], device=DEVICE)
        out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                                  do_sample=False, use_cache=True, pad_token_id=self.tokenizer.eos_token_id)
        sync()
        return out[0, len(ids):].tolist()


def lm_first_view_body(text: str, thumbnails: bool = True) -> dict:
    """The text page's first request for an LM: one head with its scores, thumbnails, f32, next token at the end."""
    return {"model": LM, "text": text, "layers": [0], "heads": [0], "include_scores": True,
            "thumbnail_size": 24 if thumbnails else None, "encoding": "f32", "position": None, "chat": False}


def lm_interventions(native_beta: float) -> list[dict]:
    return [{"op": "temperature", "beta": native_beta * 0.5, "layers": LM_BETA_LAYERS}]


def server_timing(response: httpx.Response) -> dict[str, float]:
    """Server-Timing "queue;dur=0.1, model;dur=400.2, app;dur=412.0" → {"queue": 0.1, …} (ms)."""
    out = {}
    for part in response.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def bench_lm_first_view(server: Server, raw: RawLM, repeats: int) -> list[dict]:
    """Fresh first views (API) interleaved with raw eager forwards with attentions, at 32 and 128 tokens."""
    rows = []
    client = httpx.Client(timeout=300)
    variant = 5000
    for n in (128,):
        raw(raw.text(n, 4999))  # warm
        client.post(server.url + "/api/text/attention", json=lm_first_view_body(raw.text(n, 4998))).raise_for_status()
        raws, fresh, model_ms, app_ms = [], [], [], []
        for _ in range(repeats):
            variant += 1
            text = raw.text(n, variant)
            raws.append(timed(lambda: raw(text)))
            variant += 1
            body = lm_first_view_body(raw.text(n, variant))
            response = None

            def call():
                nonlocal response
                response = client.post(server.url + "/api/text/attention", json=body)
                response.raise_for_status()

            fresh.append(timed(call))
            timing = server_timing(response)
            model_ms.append(timing.get("model", float("nan")))
            app_ms.append(timing.get("app", float("nan")))
        r, f = statistics.median(raws) * 1000, statistics.median(fresh) * 1000
        row = {"tokens": n, "raw_ms": r, "fresh_ms": f, "fresh_ratio": f / r, "server_model_ms": statistics.median(model_ms),
               "server_app_ms": statistics.median(app_ms), "bytes": len(response.content),
               "top": response.json()["output"]["top"][0]["token"]}
        rows.append(row)
        print(f"  {n:4d} tokens: raw {r:7.1f} ms · fresh first view {f:7.1f} ms ({f / r:.2f}×) · server: model "
              f"{row['server_model_ms']:.1f} ms, whole request in the app {row['server_app_ms']:.1f} ms")
    return rows


def read_stream(client: httpx.Client, url: str, body: dict) -> dict:
    """POST /api/text/generate; the events' count, the time to the first event and to the done event."""
    start = time.perf_counter()
    first, steps, done = None, 0, None
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"generate stream: {event}")
            if first is None:
                first = time.perf_counter() - start
            if event.get("done"):
                done = event
                break
            steps += 1
    return {"s": time.perf_counter() - start, "first_s": first, "steps": steps, "done": done}


def bench_lm_continuation(server: Server, raw: RawLM, repeats: int) -> dict:
    """32 new tokens: the engine's continuation() with a temperature intervention (and with none), and the HTTP
    stream (which carries both continuations), interleaved with model.generate (greedy, with cache)."""
    from models.adapters.causal_lm import CausalLMAdapter
    from models.interventions import Intervention

    adapter = CausalLMAdapter(LM, str(LM_WEIGHTS), device=DEVICE)
    ivs_json = lm_interventions(adapter.info.native_beta)
    ivs = tuple(Intervention(op="temperature", beta=iv["beta"], layers=tuple(iv["layers"])) for iv in ivs_json)
    client = httpx.Client(timeout=300)
    url = server.url + "/api/text/generate"
    n = LM_NEW_TOKENS

    def engine(ids, interventions):
        return [step.id for step in adapter.continuation(ids, interventions, n)]

    prompts = [raw.tokenizer(p)["input_ids"] for p in LM_PROMPTS]
    raw.generate(prompts[0], 4), engine(prompts[0], ivs)[:1]  # warm
    read_stream(client, url, {"model": LM, "text": LM_PROMPTS[0], "max_new_tokens": 4, "interventions": ivs_json})
    gen, cont, cont0, stream, stream_first = [], [], [], [], []
    lengths = {"generate": [], "continuation": [], "continuation_none": [], "stream": []}
    same_as_generate = True
    for k in range(repeats):
        ids = prompts[k % len(prompts)]
        out = {}

        def run(name, fn):
            start = time.perf_counter()
            out[name] = fn()
            sync()
            return time.perf_counter() - start

        gen.append(run("g", lambda: raw.generate(ids, n)))
        cont.append(run("c", lambda: engine(ids, ivs)))
        cont0.append(run("c0", lambda: engine(ids, ())))
        s = read_stream(client, url, {"model": LM, "text": LM_PROMPTS[k % len(prompts)], "max_new_tokens": n,
                                      "interventions": ivs_json})
        stream.append(s["s"])
        stream_first.append(s["first_s"])
        lengths["generate"].append(len(out["g"]))
        lengths["continuation"].append(len(out["c"]))
        lengths["continuation_none"].append(len(out["c0"]))
        lengths["stream"].append(s["steps"])
        same_as_generate &= out["c0"] == out["g"][: len(out["c0"])]
    g, c, c0, st = (statistics.median(x) * 1000 for x in (gen, cont, cont0, stream))
    result = {
        "new_tokens": n, "generate_ms": g, "continuation_ms": c, "continuation_none_ms": c0, "stream_ms": st,
        "stream_first_event_ms": statistics.median(stream_first) * 1000,
        "continuation_ratio": c / g, "continuation_none_ratio": c0 / g, "stream_ratio": st / g,
        "stream_ratio_per_continuation": st / (2 * g), "lengths": lengths,
        "no_intervention_equals_generate": bool(same_as_generate), "repeats": repeats,
        "intervention": ivs_json,
    }
    print(f"  {n} new tokens: generate {g:.0f} ms · continuation with β {c:.0f} ms ({c / g:.2f}×) · without "
          f"{c0:.0f} ms ({c0 / g:.2f}×) · HTTP stream of both {st:.0f} ms ({st / g:.2f}× one generate, "
          f"{st / (2 * g):.2f}× two), first event {result['stream_first_event_ms']:.0f} ms")
    del adapter
    return result


def bench_lm_browser(server: Server, raw: RawLM, moves: int) -> dict:
    p, browser = chromium()
    result: dict = {}
    n = 128
    texts = [raw.text(n, 6000 + k) for k in range(FIRST_VIEW_REPEATS)]
    topk = "document.querySelector('#lm-output') && document.querySelector('#lm-output').dataset.top"
    firsts, figures, tops = first_figures(browser, server, LM, texts, n, extra_wait=topk)
    result.update({"first_figure_s_128": statistics.median(firsts), "plotly_figure_s_128": statistics.median(figures),
                   "next_token_panel_s_128": statistics.median(tops), "first_figure_all_s_128": firsts})
    print(f"  first LM figure at {n} tokens (median of {len(firsts)}): cells painted {statistics.median(firsts):.2f} s "
          f"(range {min(firsts):.2f}–{max(firsts):.2f}), Plotly figure {statistics.median(figures):.2f} s, "
          f"next-token panel ≈{statistics.median(tops):.2f} s")
    raws32 = [timed(lambda: raw(raw.text(32, 6100 + k))) for k in range(15)]
    run = slider_latencies(browser, server, "run", raw.text(32, 6200), 32, moves, model=LM)
    raws32 += [timed(lambda: raw(raw.text(32, 6100 + k))) for k in range(15, 30)]
    raw32 = statistics.median(raws32) * 1000
    result.update({"run_p50_ms": percentile(run, 50), "run_p95_ms": percentile(run, 95), "raw32_ms": raw32,
                   "run_p95_ratio": percentile(run, 95) / raw32, "moves": len(run)})
    print(f"  run-mode β (32 tokens): p50 {result['run_p50_ms']:.1f} ms, p95 {result['run_p95_ms']:.1f} ms "
          f"= {result['run_p95_ratio']:.2f}× raw forward ({raw32:.1f} ms)")
    browser.close()
    p.stop()
    return result


def bench_lm_memory(server: Server, raw: RawLM, seconds: float, clients: int = 3) -> dict:
    """RSS of the server process, sampled each second, under `seconds` of mixed LM requests from `clients`
    clients: first views at 32, 128 and 512 tokens, a compare at 128 tokens, a 16-token generate."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    native_beta = httpx.get(server.url + "/api/models?kind=text", timeout=60).json()
    native_beta = next(m["native_beta"] for m in native_beta["models"] if m["id"] == LM)
    ivs = lm_interventions(native_beta)
    texts = {n: [raw.text(n, 7000 + k) for k in range(400)] for n in (32, 128, 512)}
    kinds = ["attention_32", "attention_128", "attention_512", "compare_128", "generate_16"]
    counter = iter(range(10**9))
    lock = threading.Lock()
    done: list[tuple[str, int, float]] = []
    samples: list[dict] = []
    stop = time.time() + seconds

    def sample():
        cache = server.cache_size() or {}
        samples.append({"t": round(time.time() - started, 1), "rss_mb": proc.memory_info().rss / 2**20,
                        "cache_mb": (cache.get("bytes") or 0) / 2**20, "cache_items": cache.get("items")})

    def worker(w: int):
        with httpx.Client(timeout=300) as client:
            i = w
            while time.time() < stop:
                with lock:
                    v = next(counter)
                kind = kinds[i % len(kinds)]
                i += 1
                start = time.perf_counter()
                if kind == "generate_16":
                    s = read_stream(client, server.url + "/api/text/generate",
                                    {"model": LM, "text": texts[32][v % 400], "max_new_tokens": 16, "interventions": ivs})
                    status = 200 if s["done"] else 0
                else:
                    n = int(kind.split("_")[1])
                    body = lm_first_view_body(texts[n][v % 400])
                    if kind.startswith("compare"):
                        body.update(interventions=ivs, compare=True, include_base=True)
                    status = client.post(server.url + "/api/text/attention", json=body).status_code
                done.append((kind, status, time.perf_counter() - start))

    started = time.time()
    sample()
    rss_before = samples[0]["rss_mb"]
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        sample()
    time.sleep(1.5)  # the cache file is rewritten each second
    sample()
    by_kind = {}
    for kind in kinds:
        mine = [(s, lat) for k, s, lat in done if k == kind]
        ok = [lat for s, lat in mine if s == 200]
        by_kind[kind] = {"requests": len(mine), "ok": len(ok), "statuses": sorted({s for s, _ in mine}),
                         "p50_ms": percentile(ok, 50) * 1000 if ok else None}
    cache = server.cache_size() or {}
    result = {
        "seconds": seconds, "clients": clients, "rss_before_mb": rss_before,
        "rss_peak_mb": max(s["rss_mb"] for s in samples), "rss_final_mb": samples[-1]["rss_mb"],
        "cache_final_mb": (cache.get("bytes") or 0) / 2**20, "cache_peak_mb": max(s["cache_mb"] for s in samples),
        "cache_items": cache.get("items"), "cache_max_mb": (cache.get("max_bytes") or 0) / 2**20,
        "requests": by_kind, "samples": samples,
    }
    print(f"  {seconds:.0f} s of mixed LM requests from {clients} clients: RSS {rss_before:.0f} MB before, peak "
          f"{result['rss_peak_mb']:.0f} MB, final {result['rss_final_mb']:.0f} MB; result cache {result['cache_final_mb']:.0f} MB "
          f"in {result['cache_items']} results (peak {result['cache_peak_mb']:.0f} MB, bound {result['cache_max_mb']:.0f} MB)")
    for kind, row in by_kind.items():
        print(f"    {kind}: {row['ok']}/{row['requests']} ok, p50 {row['p50_ms'] or float('nan'):.0f} ms, statuses {row['statuses']}")
    return result


def bench_lm(server: Server, raw: RawLM, repeats: int, moves: int, seconds: float) -> dict:
    out = {"model": LM}
    print(" fresh first view vs a raw eager forward with attentions")
    out["first_view"] = bench_lm_first_view(server, raw, repeats)
    print(" continuations vs generate")
    out["continuation"] = bench_lm_continuation(server, raw, max(3, repeats // 3))
    print(" in Chromium")
    out["browser"] = bench_lm_browser(server, raw, moves)
    print(" memory under load")
    out["memory"] = bench_lm_memory(server, raw, seconds)
    return out


# ---- 7. fixed cost per request (issue 14 §3) --------------------------------------------------------------
FIXED_TOKENS = 128
RUN_MODE_TOKENS = 32


class ServeProcess:
    """The app as operators run it (`python -m app.serve`: uvicorn with attnlab's protocol, header timeout and
    middleware), minilm only, Server-Timing on. Its log goes to a temporary file (shown if it fails to start)."""

    def __init__(self, port: int, env: dict[str, str] | None = None, args: list[str] | None = None):
        import tempfile

        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="attnlab-fixed-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port), *(args or [])],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "ATTNLAB_DEVICE": DEVICE, "ATTNLAB_EXPOSE_TIMINGS": "1",
                 "ATTNLAB_DEFAULT_MODELS": '["minilm"]', **(env or {})},
        )
        if wait_ready(self.url, self.proc):
            return
        log = Path(self.log.name).read_text()[-2000:]  # before stop(), which deletes it
        self.stop()
        raise RuntimeError(f"app.serve did not become ready: {log}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        Path(self.log.name).unlink(missing_ok=True)


def run_mode_body(text: str, beta: float) -> dict:
    """What the text page sends while the β slider drags in run mode (text.js, a partial load)."""
    return {"model": "minilm", "text": text, "layers": [0], "heads": [0], "include_scores": True,
            "interventions": [{"op": "temperature", "beta": beta, "layers": None, "heads": None}],
            "compare": False, "include_base": False, "samples": 1, "thumbnail_size": None, "encoding": "f32",
            "text_pair": None}


def bench_fixed(raw: RawForward, rounds: int, port: int, serve_args: list[str] | None = None) -> dict:
    """Interleaved rounds, each: a raw forward at 128 tokens, a fresh 128-token first view, a cache hit (the
    same first view again), a raw forward at 32 tokens, a run-mode β move at 32 tokens (a new β: a model run),
    and GET /api/health. A short pause before each measure lets the other process's OpenMP threads stop
    spinning (on 2 cores they would otherwise slow whichever side comes next)."""
    server = ServeProcess(port, args=serve_args)
    url = server.url + "/api/text/attention"
    client = httpx.Client(timeout=120)
    out: dict = {k: [] for k in ("raw128", "fresh", "fresh_app", "fresh_model", "hit", "hit_app", "raw32", "run",
                                 "run_app", "run_model", "health")}
    try:
        same = first_view_body(text_of(FIXED_TOKENS, 3997))
        run_text = text_of(RUN_MODE_TOKENS, 3998)
        for k in range(3):  # warm both sides, and put `same` in the result cache
            raw(text_of(FIXED_TOKENS, 3900 + k))
            raw(text_of(RUN_MODE_TOKENS, 3900 + k))
            client.post(url, json=first_view_body(text_of(FIXED_TOKENS, 3950 + k))).raise_for_status()
            client.post(url, json=run_mode_body(run_text, 0.2 + k)).raise_for_status()
            client.post(url, json=same).raise_for_status()
            client.get(server.url + "/api/health").raise_for_status()

        def post(body: dict, total: str, parts: dict[str, str]) -> None:
            time.sleep(0.03)
            start = time.perf_counter()
            response = client.post(url, json=body)
            response.read()
            out[total].append((time.perf_counter() - start) * 1000)
            response.raise_for_status()
            timing = server_timing(response)
            for key, name in parts.items():
                out[key].append(timing.get(name, 0.0))

        def raw_at(n: int, variant: int, key: str) -> None:
            time.sleep(0.03)
            out[key].append(timed(lambda: raw(text_of(n, variant))) * 1000)

        for i in range(rounds):
            raw_at(FIXED_TOKENS, 4000 + i, "raw128")
            post(first_view_body(text_of(FIXED_TOKENS, 5000 + i)), "fresh", {"fresh_app": "app", "fresh_model": "model"})
            post(same, "hit", {"hit_app": "app"})
            raw_at(RUN_MODE_TOKENS, 6000 + i, "raw32")
            # a β that no earlier move used: every move is a model run, as when the slider drags
            post(run_mode_body(run_text, round(0.25 + 0.0371 * i, 4)), "run", {"run_app": "app", "run_model": "model"})
            time.sleep(0.03)
            out["health"].append(timed(lambda: client.get(server.url + "/api/health").raise_for_status()) * 1000)
    finally:
        client.close()
        server.stop()
    med = {k: statistics.median(v) for k, v in out.items()}
    result = {
        "rounds": rounds, "serve_args": serve_args or [], "load_average_after": os.getloadavg(), "samples_ms": out,
        "raw128_ms": med["raw128"], "fresh_ms": med["fresh"], "fresh_ratio": med["fresh"] / med["raw128"],
        "fresh_app_ms": med["fresh_app"], "fresh_model_ms": med["fresh_model"],
        "fresh_model_ratio": med["fresh_model"] / med["raw128"],
        "hit_ms": med["hit"], "hit_ratio": med["hit"] / med["raw128"], "hit_app_ms": med["hit_app"],
        "hit_app_p95_ms": percentile(out["hit_app"], 95),
        "raw32_ms": med["raw32"], "run_p50_ms": med["run"], "run_p95_ms": percentile(out["run"], 95),
        "run_p95_ratio": percentile(out["run"], 95) / med["raw32"], "run_p50_ratio": med["run"] / med["raw32"],
        "run_app_ms": med["run_app"], "run_model_ms": med["run_model"], "health_ms": med["health"],
    }
    print(f"  fresh {FIXED_TOKENS} tokens: {result['fresh_ms']:.1f} ms = {result['fresh_ratio']:.2f}× raw "
          f"({result['raw128_ms']:.1f} ms); in the server: model {result['fresh_model_ms']:.1f} ms "
          f"({result['fresh_model_ratio']:.2f}× raw), app {result['fresh_app_ms']:.1f} ms")
    print(f"  cache hit: {result['hit_ms']:.1f} ms end to end ({result['hit_ratio']:.3f}× raw), "
          f"{result['hit_app_ms']:.2f} ms in the server (p95 {result['hit_app_p95_ms']:.2f})")
    print(f"  run-mode β {RUN_MODE_TOKENS} tokens: p50 {result['run_p50_ms']:.1f} ms, p95 {result['run_p95_ms']:.1f} ms "
          f"= {result['run_p95_ratio']:.2f}× raw ({result['raw32_ms']:.1f} ms); in the server: model "
          f"{result['run_model_ms']:.1f} ms, app {result['run_app_ms']:.1f} ms · GET /api/health {result['health_ms']:.2f} ms")
    return result


def fixed_report(f: dict, when: dict | None, targets: list) -> list[str]:
    load = ", ".join(f"{x:.1f}" for x in (when or {}).get("load_average_at_start", ())) or "?"
    lines = [
        "## 7. Fixed cost per request (issue 14 §3)", "",
        f"`python -m app.serve` (uvicorn as operators run it: attnlab's protocol with the header timeout, every "
        f"middleware; minilm only, Server-Timing on) on loopback, {f['rounds']} interleaved rounds of: a raw eager "
        f"forward at {FIXED_TOKENS} tokens in this process; a fresh {FIXED_TOKENS}-token first view (the text page's "
        f"request); the same first view again (a result-cache hit); a raw forward at {RUN_MODE_TOKENS} tokens; a "
        f"run-mode β move at {RUN_MODE_TOKENS} tokens (the page's partial request with a new β: a model run); "
        f"GET /api/health. Load average at start {load}, after {', '.join(f'{x:.1f}' for x in f['load_average_after'])}. "
        + (f"More app.serve options: `{' '.join(f['serve_args'])}`. " if f.get("serve_args") else "") +
        "Server-side ms are the Server-Timing `app` (the whole request inside the app, from the outermost middleware "
        "on) and `model` (the model run).", "",
        "| measure | median ms | ratio to raw | in the server |", "|---|---:|---:|---|",
        f"| raw forward, {FIXED_TOKENS} tokens | {f['raw128_ms']:.1f} | 1 | |",
        f"| fresh {FIXED_TOKENS}-token first view, end to end | {f['fresh_ms']:.1f} | {f['fresh_ratio']:.2f} | "
        f"app {f['fresh_app_ms']:.1f} ms, of which model {f['fresh_model_ms']:.1f} ms ({f['fresh_model_ratio']:.2f}× raw) |",
        f"| cache hit (same first view), end to end | {f['hit_ms']:.1f} | {f['hit_ratio']:.3f} | app {f['hit_app_ms']:.2f} ms "
        f"(p95 {f['hit_app_p95_ms']:.2f}) |",
        f"| raw forward, {RUN_MODE_TOKENS} tokens | {f['raw32_ms']:.1f} | 1 | |",
        f"| run-mode β move, {RUN_MODE_TOKENS} tokens: p50 / p95 | {f['run_p50_ms']:.1f} / {f['run_p95_ms']:.1f} | "
        f"{f['run_p50_ratio']:.2f} / {f['run_p95_ratio']:.2f} | app {f['run_app_ms']:.1f} ms, of which model "
        f"{f['run_model_ms']:.1f} ms |",
        f"| GET /api/health, end to end | {f['health_ms']:.2f} | | |", "",
    ]
    targets.append((f"fixed: fresh {FIXED_TOKENS}-token request ≤ 1.15 × raw forward", f"{f['fresh_ratio']:.2f}×",
                    f["fresh_ratio"] <= 1.15))
    targets.append(("fixed: cache hit ≤ 3 ms in the server (median)", f"{f['hit_app_ms']:.2f} ms", f["hit_app_ms"] <= 3))
    targets.append((f"fixed: run-mode β p95 ≤ 1.3 × raw forward ({RUN_MODE_TOKENS} tokens)", f"{f['run_p95_ratio']:.2f}×",
                    f["run_p95_ratio"] <= 1.3))
    return lines


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
    memory = (results.get("lm") or {}).get("memory")
    if memory:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        t = [s["t"] for s in memory["samples"]]
        ax.plot(t, [s["rss_mb"] for s in memory["samples"]], "-", c="C0", label="server RSS")
        ax.plot(t, [s["cache_mb"] for s in memory["samples"]], "-", c="C1", label="result cache (bytes held)")
        ax.axvline(memory["seconds"], ls=":", c="k", label="load ends")
        ax.set(xlabel="s", ylabel="MB", title=f"{LM}: mixed LM requests from {memory['clients']} clients")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "lm_memory.png", dpi=110)


def fmt_range(values: list[float] | None) -> str:
    return f"{min(values):.2f}–{max(values):.2f} s" if values else "n/a"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def lm_report(lm: dict, targets: list) -> list[str]:
    lines = [f"## 6. Language model ({lm['model']}: 30 layers × 9 query heads, 3 K/V heads)", ""]
    fv = lm.get("first_view")
    if fv:
        lines += ["Baseline: its tokenizer + `AutoModelForCausalLM(attn_implementation=\"eager\")(…, output_attentions=True)` "
                  "in-process. attnlab: the text page's first request for an LM (one head with scores, 24×24 thumbnails, "
                  "next-token top-10), a fresh text each time, interleaved with the baseline. Server-Timing: `model` is "
                  "the model run inside the server, `app` the whole request inside the app.", "",
                  "| tokens | raw forward ms | API fresh ms | fresh ÷ raw | server model ms | server app ms | bytes |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in fv:
            lines.append(f"| {r['tokens']} | {r['raw_ms']:.1f} | {r['fresh_ms']:.1f} | {r['fresh_ratio']:.2f} | "
                         f"{r['server_model_ms']:.1f} | {r['server_app_ms']:.1f} | {r['bytes']:,} |")
        lines.append("")
        r128 = next(r for r in fv if r["tokens"] == 128)
        targets.append(("LM fresh first view ≤ 1.2 × raw forward (128 tokens)", f"{r128['fresh_ratio']:.2f}×", r128["fresh_ratio"] <= 1.2))
    c = lm.get("continuation")
    if c:
        iv = c["intervention"][0]
        lines += [f"{c['new_tokens']} new tokens, greedy; median of {c['repeats']} prompts, each run interleaved. Baseline: "
                  f"`model.generate(max_new_tokens={c['new_tokens']}, do_sample=False)` with its KV cache. The intervention: "
                  f"β = {iv['beta']:.4g} (half the native β) on layers {iv['layers']}. The HTTP stream carries both "
                  "continuations (with and without the interventions), step by step.", "",
                  "| | ms | ÷ generate |", "|---|---:|---:|",
                  f"| `model.generate` | {c['generate_ms']:.0f} | 1 |",
                  f"| `CausalLMAdapter.continuation`, with β | {c['continuation_ms']:.0f} | {c['continuation_ratio']:.2f} |",
                  f"| `CausalLMAdapter.continuation`, no intervention | {c['continuation_none_ms']:.0f} | {c['continuation_none_ratio']:.2f} |",
                  f"| `POST /api/text/generate`, both continuations, to the done event | {c['stream_ms']:.0f} | "
                  f"{c['stream_ratio']:.2f} ({c['stream_ratio_per_continuation']:.2f} per continuation) |",
                  f"| the stream's first event | {c['stream_first_event_ms']:.0f} | |",
                  "", f"Without interventions the continuation equals `generate`'s tokens: {c['no_intervention_equals_generate']}.", ""]
        targets.append(("LM 32-token continuation with β ≤ 1.5 × generate", f"{c['continuation_ratio']:.2f}×", c["continuation_ratio"] <= 1.5))
        targets.append(("LM HTTP stream ≤ 1.5 × generate per continuation", f"{c['stream_ratio_per_continuation']:.2f}×",
                        c["stream_ratio_per_continuation"] <= 1.5))
    b = lm.get("browser")
    if b:
        lines += [f"In Chromium. First LM figure (navigation → the attention map's cells painted; median of {FIRST_VIEW_REPEATS} "
                  f"page loads, 128 tokens, fresh text): {b['first_figure_s_128']:.2f} s (range {fmt_range(b['first_figure_all_s_128'])}); "
                  f"the Plotly figure follows at {b['plotly_figure_s_128']:.2f} s and the next-token panel at "
                  f"≈{b['next_token_panel_s_128']:.2f} s (polled every 20 ms).",
                  f"Run-mode β at 32 tokens ({b['moves']} moves): p50 {b['run_p50_ms']:.1f} ms, p95 {b['run_p95_ms']:.1f} ms; "
                  f"raw forward at 32 tokens {b['raw32_ms']:.1f} ms (15 before the moves, 15 after).", ""]
        targets.append(("LM run-mode β p95 ≤ 1.5 × raw forward (32 tokens)", f"{b['run_p95_ratio']:.2f}×", b["run_p95_ratio"] <= 1.5))
        targets.append(("first LM figure on page load ≤ 2 s (median)", f"{b['first_figure_s_128']:.2f} s", b["first_figure_s_128"] <= 2))
    m = lm.get("memory")
    if m:
        lines += [f"Memory: {m['seconds']:.0f} s of mixed LM requests from {m['clients']} clients (first views at 32, 128 and "
                  "512 tokens, a compare with β at 128 tokens, a 16-token generate; fresh texts), the server's RSS sampled "
                  "each second.", "",
                  "| RSS before | RSS peak | RSS final | result cache final | cache peak | cache bound | results cached |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {m['rss_before_mb']:.0f} MB | {m['rss_peak_mb']:.0f} MB | {m['rss_final_mb']:.0f} MB | "
                  f"{m['cache_final_mb']:.0f} MB | {m['cache_peak_mb']:.0f} MB | {m['cache_max_mb']:.0f} MB | {m['cache_items']} |",
                  "", "| request | done | 200 | p50 ms | statuses |", "|---|---:|---:|---:|---|"]
        for kind, r in m["requests"].items():
            p50 = f"{r['p50_ms']:.0f}" if r["p50_ms"] is not None else "–"
            lines.append(f"| {kind} | {r['requests']} | {r['ok']} | {p50} | {r['statuses']} |")
        lines += ["", "![LM memory](lm_memory.png)", ""]
    return lines


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
    lm = results.get("lm")
    if lm:
        lines += lm_report(lm, targets)
    if results.get("fixed"):
        lines += fixed_report(results["fixed"], (results.get("machines") or {}).get("fixed") or results["machine"], targets)
    lines += ["## Targets", "", "| target | measured | |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict(ok)} |" for name, value, ok in targets]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")


SECTIONS = ("latency", "payload", "browser", "images", "concurrency", "lm", "fixed")


def main() -> None:
    global RESULTS, DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--moves", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--lm-seconds", type=float, default=60, help="length of the LM memory load")
    parser.add_argument("--fixed-rounds", type=int, default=60, help="interleaved rounds of the fixed-cost section")
    parser.add_argument("--serve-args", default="", help="fixed section: more `python -m app.serve` options, e.g. "
                        "'--http h11 --loop asyncio' to compare with the defaults")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where the server under test (ATTNLAB_DEVICE) and the baselines run")
    parser.add_argument("--only", nargs="*", default=None, help=" ".join(SECTIONS))
    parser.add_argument("--report-only", action="store_true", help="rewrite README.md and the plots from results.json")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of README.md, results.json and the plots "
                        "(default benchmarks/results; a partial run merges into the results.json there)")
    args = parser.parse_args()
    RESULTS = args.results
    if args.report_only:
        results = json.loads((RESULTS / "results.json").read_text())
        plot(results)
        write_report(results)
        return
    DEVICE = resolve_device(args.device)
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sections = set(args.only or SECTIONS)
    results: dict = {"machine": machine()}
    # `timeout` or Ctrl-C: stop the server under test too (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server(args.port) if sections - {"fixed"} else None  # the fixed section starts its own
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
        if "lm" in sections:  # last: its memory load fills the result cache
            print(f"language model ({LM})"); results["lm"] = bench_lm(server, RawLM(), args.repeats, args.moves, args.lm_seconds)
    finally:
        if server is not None:
            server.stop()
    if "fixed" in sections:  # after the other server has stopped: one server on the machine at a time
        print("fixed cost per request"); results["fixed"] = bench_fixed(raw, args.fixed_rounds, args.port + 1,
                                                                          args.serve_args.split())
    if args.only:  # a partial run updates its sections of the last full results and keeps the others
        previous_path = RESULTS / "results.json"
        previous = json.loads(previous_path.read_text()) if previous_path.exists() else {}
        machines = previous.get("machines") or {name: previous["machine"] for name in SECTIONS if name in previous}
        machines.update({section: results["machine"] for section in sections})
        results = {**previous, **results, "machines": machines}
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2))
    if "latency" in results:
        plot(results)
        write_report(results)
    print(f"wrote {RESULTS / 'README.md'}")


if __name__ == "__main__":
    main()
