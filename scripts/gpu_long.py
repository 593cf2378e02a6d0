"""Long-context step of the GPU check (docs/science.md §10): smollm2-135m's first view at its whole context through the
API in this process, its peak device memory and window latency, and short first views as ratios to a raw forward on
the same device. Runs on a CPU too (with small --tokens) as a smoke test.

    python -m scripts.gpu_long [--long 8192] [--short 128 512] [--repeats 5] [--device auto] [--out FILE.json]

- long: POST /api/text/attention on --long tokens (one head's overview, f16, thumbnails), cache cleared before each
  repeat so the model runs; the peak device memory of that request (torch.cuda.max_memory_allocated, reset before);
  POST /api/runs/{id}/window of 512 × 512 and one row of every head (the retrieval view).
- short: the same first view at each --short length against a raw forward of the model loaded with sdpa
  (no attention weights) on the same device, interleaved; medians.
Targets (issue 20): long first view ≤ 1 s at 8,192 tokens; 512 tokens ≤ 1.5× raw; 128 tokens ≤ 1.3× raw.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights" / "smollm2-135m"
WORDS = ("the river ran past the old mill and the miller kept a record of every sack of grain that the farmers "
         "brought in autumn while the children counted boats on the water").split()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _text_of(tokenizer, n: int) -> str:
    """A text of about n tokens (Debian's GPL-3 text when present, else plain repeated words)."""
    source = Path("/usr/share/common-licenses/GPL-3")
    base = source.read_text() if source.is_file() else " ".join(WORDS)
    ids: list[int] = []
    while len(ids) < n + 8:
        ids += tokenizer(base)["input_ids"]
    return tokenizer.decode(ids[:n])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", "--tokens", dest="long", type=int, default=8192, help="tokens of the long input")
    parser.add_argument("--short", type=int, nargs="*", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine", action="store_true", help="the engine alone (no app, no fastapi): adapter runs")
    parser.add_argument("--weights", type=Path, default=WEIGHTS, help="the model folder (default: the prepared weights)")
    parser.add_argument("--block-rows", type=int, nargs="*", default=None,
                        help="engine mode: query rows per block to try on the long input (default: the engine's)")
    args = parser.parse_args()
    if args.engine:
        engine(args)
        return

    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.main import create_app
    from app.settings import Settings

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    settings = Settings(default_models=["smollm2-135m"], device=device.type, max_tokens=max(args.long, 512) + 64,
                        max_tokens_gpu=max(args.long, 512) + 64, max_run_bytes=64 << 30, result_cache_bytes=16 << 30,
                        request_timeout_s=3600, max_text_chars=10**7)
    tokenizer = AutoTokenizer.from_pretrained(WEIGHTS)
    raw = AutoModelForCausalLM.from_pretrained(WEIGHTS, attn_implementation="sdpa", dtype=torch.float32).eval().to(device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "long_tokens": args.long}
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.runtime
        runtime.warm_up()
        adapter = runtime.adapter("smollm2-135m")

        def first_view(text: str, long: bool) -> tuple[float, dict, int]:
            runtime.cache.clear()
            # one head's maps, as the page's first view asks (all 270 heads of P at 128 tokens are over max_response_numbers)
            body = {"model": "smollm2-135m", "text": text, "encoding": "f16", "thumbnail_size": 24, "layers": [0], "heads": [0]}
            _sync(device)
            start = time.perf_counter()
            response = client.post("/api/text/attention", json=body)
            _sync(device)
            elapsed = time.perf_counter() - start
            if response.status_code != 200:
                sys.exit(f"first view failed: {response.status_code} {response.text[:400]}")
            return elapsed, response.json(), len(response.content)

        def raw_forward(ids: torch.Tensor) -> float:
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                raw(input_ids=ids, logits_to_keep=1)
            _sync(device)
            return time.perf_counter() - start

        # short inputs: the first view as a ratio to a raw forward, interleaved
        report["short"] = []
        for n in args.short:
            text = _text_of(tokenizer, n)
            ids = torch.tensor([tokenizer(text)["input_ids"]], device=device)
            first_view(text, False), raw_forward(ids)  # warm-up, not timed
            views, raws = [], []
            for _ in range(args.repeats):
                views.append(first_view(text, False)[0])
                raws.append(raw_forward(ids))
            view, base = statistics.median(views), statistics.median(raws)
            report["short"].append({"tokens": ids.shape[1], "first_view_s": view, "raw_forward_s": base,
                                    "ratio": view / base})
            print(json.dumps(report["short"][-1]), flush=True)

        # the long input: first view, peak device memory, windows
        text = _text_of(tokenizer, args.long)
        ids = torch.tensor([tokenizer(text)["input_ids"]], device=device)
        raw_long = raw_forward(ids)
        times, body, size = [], None, 0
        for _ in range(max(1, min(args.repeats, 3))):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base_memory = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            elapsed, body, size = first_view(text, True)
            times.append(elapsed)
        peak = torch.cuda.max_memory_allocated() - base_memory if device.type == "cuda" else None
        run_id, n = body["run_id"], len(body["tokens"])
        side = min(512, n)
        windows, rows = [], []
        for i in range(5):
            r0 = (i * 997) % max(1, n - side + 1)
            _sync(device)
            start = time.perf_counter()
            window = client.post(f"/api/runs/{run_id}/window", json={
                "layer": i % adapter.info.layers, "head": i % adapter.info.heads, "rows": [r0, r0 + side],
                "cols": [max(0, r0 + side - side), r0 + side], "encoding": "f16"})
            windows.append(time.perf_counter() - start)
            if window.status_code != 200:
                sys.exit(f"window failed: {window.status_code} {window.text[:400]}")
            start = time.perf_counter()
            row = client.post(f"/api/runs/{run_id}/row", json={"row": n - 1, "span": [0, 64], "include_row": False})
            rows.append(time.perf_counter() - start)
            if row.status_code != 200:
                sys.exit(f"row failed: {row.status_code} {row.text[:400]}")
        report["long"] = {
            "tokens": n, "long_path": body["attention"] is None, "first_view_s": min(times), "first_view_all_s": times,
            "raw_forward_s": raw_long, "first_view_bytes": size,
            "peak_device_memory_bytes": peak, "window_512_ms": 1000 * statistics.median(windows),
            "row_span_mass_all_heads_ms": 1000 * statistics.median(rows),
            "all_of_p_bytes": adapter.info.layers * adapter.info.heads * n * n * 4,
        }
        print(json.dumps(report["long"]), flush=True)
    report["targets"] = {
        "long_first_view_le_1s": report["long"]["first_view_s"] <= 1.0,
        **{f"short_{r['tokens']}_ratio": r["ratio"] for r in report["short"]},
    }
    print(json.dumps(report["targets"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def engine(args) -> None:
    """The same measures on the engine alone: CausalLMAdapter.run (blockwise over full_map_tokens=512) against a raw
    sdpa forward, on --weights; for hosts without the app's dependencies."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.adapters.base import Encoded
    from models.adapters.causal_lm import CausalLMAdapter
    from models.atlas import window

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.weights)
    adapter = CausalLMAdapter("smollm2-135m", str(args.weights), max_tokens=args.long, device=device.type)
    # float32 like the served model (smollm2's config says bfloat16, which transformers would otherwise load)
    raw = AutoModelForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa", dtype=torch.float32).eval().to(device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "mode": "engine"}

    def encoded_of(n: int) -> Encoded:
        ids = torch.tensor([tokenizer(_text_of(tokenizer, n))["input_ids"][:n]])
        return Encoded(key=("gpu_long", n), tokens=["t"] * ids.shape[1],
                       inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, extra={"position": ids.shape[1] - 1})

    def timed(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    def raw_forward(ids):
        with torch.inference_mode():
            raw(input_ids=ids.to(device), logits_to_keep=1)

    report["short"] = []
    for n in args.short:
        enc = encoded_of(n)
        timed(lambda: adapter.run(enc)), timed(lambda: raw_forward(enc.inputs["input_ids"]))
        views = [timed(lambda: adapter.run(enc)) for _ in range(args.repeats)]
        raws = [timed(lambda: raw_forward(enc.inputs["input_ids"])) for _ in range(args.repeats)]
        report["short"].append({"tokens": n, "run_s": statistics.median(views), "raw_forward_s": statistics.median(raws),
                                "ratio": statistics.median(views) / statistics.median(raws)})
        print(json.dumps(report["short"][-1]), flush=True)
    enc = encoded_of(args.long)
    timed(lambda: raw_forward(enc.inputs["input_ids"]))  # warm-up at this length
    raw_s = statistics.median([timed(lambda: raw_forward(enc.inputs["input_ids"])) for _ in range(3)])
    report["long"] = []
    for block_rows in args.block_rows or [adapter.atlas_config.block_rows]:
        adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=block_rows)
        times, holder = [], {}
        for _ in range(max(1, min(args.repeats, 3))):
            holder.clear()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            times.append(timed(lambda: holder.update(r=adapter.run(enc))))
        result = holder["r"]
        peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
        n = len(enc.tokens)
        side = min(512, n)
        windows = [timed(lambda i=i: window(result.atlas.record(i % adapter.info.layers), i % adapter.info.heads,
                                            (n - side, n), (n - side, n)).cpu()) for i in range(5)]
        report["long"].append({"tokens": n, "block_rows": block_rows, "long_path": result.is_long, "run_s": min(times),
                               "all_s": times, "raw_forward_s": raw_s, "ratio": min(times) / raw_s,
                               "peak_device_memory_bytes": peak, "kept_bytes": result.atlas.nbytes,
                               "window_512_ms": 1000 * statistics.median(windows)})
        print(json.dumps(report["long"][-1]), flush=True)
        del result, holder
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    _ = dataclasses


if __name__ == "__main__":
    main()
