"""Long inputs on smollm2-135m, or another prepared decoder LM (--model gemma3-270m) (docs/science.md §10): the first
view of a long input through the API against the model's own forwards on the same tokens, with the server's peak RSS
growth, the first view's bytes, and the latency of a 512 × 512 window and of one full row. One fresh process per
length (ru_maxrss is a process's lifetime peak).

    python -m benchmarks.long_inputs [--tokens 128 512 2048 4096] [--repeats 1] [--short-repeats 5] [--out FILE.json]
    python -m benchmarks.long_inputs --model gemma3-270m --tokens 4096 --out benchmarks/results/long_inputs_gemma3.json

Baselines, same tokens, same process, interleaved with the first view:
- sdpa: the model loaded with attn_implementation="sdpa", one forward (no attention weights), logits of one position;
- eager: attn_implementation="eager" with output_attentions=True (all of P), where it fits (≤ --eager-max tokens).
The first view is POST /api/text/attention (layers [0], heads [0], f16, thumbnails 24) on a fresh runtime, so the
model runs; over full_map_tokens the run is blockwise and keeps q̂/k̂ and summaries (no P).
Short rows (≤ full_map_tokens: all of P kept where the run ran) repeat the first view and the sdpa forward
--short-repeats times, interleaved, and add medians, what the kept run holds, and what keeping q̂/k̂ instead of P
would cost (their bytes; rebuilding every map from them: scripts/gpu_long.rebuild_cost).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
TEXT_SOURCES = [Path("/usr/share/common-licenses/GPL-3"), ROOT / "static" / "samples" / "long-sample.txt"]


def _text() -> str:
    for path in TEXT_SOURCES:
        if path.is_file():
            return path.read_text() * 4
    raise SystemExit("no long text found")


def one_length(tokens: int, repeats: int, eager_max: int, short_repeats: int = 5, model: str = MODEL) -> dict:
    """Everything for one length, in this (fresh) process; `model` a prepared decoder LM in weights/."""
    import statistics

    import torch
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.main import create_app
    from app.settings import Settings

    weights = ROOT / "weights" / model
    tokenizer = AutoTokenizer.from_pretrained(weights)
    ids = tokenizer(_text())["input_ids"][:tokens]
    text = tokenizer.decode(ids)
    # the baselines' own copies of the model live in this process: the memory accountant's RSS watch would count
    # them as the server's and wait for room forever (gemma3-270m: 2.2 GB of baselines), so it is off here
    settings = Settings(default_models=[model], max_tokens=tokens + 64, max_run_bytes=8 << 30,
                        request_timeout_s=3600, result_cache_bytes=8 << 30, max_text_chars=10**6,
                        memory_budget_bytes=16 << 30, memory_watch_rss=False)
    # float32 like the server (the checkpoint's config says bfloat16, which transformers would otherwise load)
    sdpa = AutoModelForCausalLM.from_pretrained(weights, attn_implementation="sdpa", dtype=torch.float32).eval()
    eager = (AutoModelForCausalLM.from_pretrained(weights, attn_implementation="eager", dtype=torch.float32).eval()
             if tokens <= eager_max else None)
    out: dict = {"tokens": tokens, "model": model}
    with TestClient(create_app(settings)) as client:
        client.app.state.runtime.warm_up()
        runtime = client.app.state.runtime
        adapter = runtime.adapter(model)
        n_real = len(adapter.encode(text).tokens)
        input_ids = torch.tensor([tokenizer(text)["input_ids"][:n_real]])
        out["tokens"] = n_real
        short = n_real <= adapter.full_map_tokens
        if short:  # a short first view is quick: more interleaved repeats, medians
            repeats = max(repeats, short_repeats)
        times: dict[str, list[float]] = {"sdpa": [], "eager": [], "first_view": []}
        with torch.inference_mode():  # first calls pay one-time set-up: not timed
            for baseline in (sdpa, eager):
                if baseline is not None:
                    baseline(input_ids=input_ids[:, :16], logits_to_keep=1, output_attentions=baseline is eager)
        for repeat in range(repeats):
            # the first view first: ru_maxrss is the process's lifetime peak, and the eager baseline holds all of P
            runtime.cache.clear()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            start = time.perf_counter()
            response = client.post("/api/text/attention", json={
                "model": model, "text": text, "layers": [0], "heads": [0], "encoding": "f16",
                "thumbnail_size": 24})
            times["first_view"].append(time.perf_counter() - start)
            assert response.status_code == 200, response.text[:500]
            body = response.json()  # the last repeat's run stays in the cache for the windows below
            if repeat == 0:
                out["peak_rss_growth_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
                # the process's peak: both models' weights (attnlab's and the sdpa baseline's) plus the first view
                out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                out["first_view_bytes"] = len(response.content)
                out["long"] = body["attention"] is None
            with torch.inference_mode():
                start = time.perf_counter()
                sdpa(input_ids=input_ids, logits_to_keep=1)
                times["sdpa"].append(time.perf_counter() - start)
                if eager is not None:
                    start = time.perf_counter()
                    eager(input_ids=input_ids, logits_to_keep=1, output_attentions=True)
                    times["eager"].append(time.perf_counter() - start)
        run_id = body["run_id"]
        n = n_real
        side = min(512, n)
        window_times, row_times, all_heads_times = [], [], []
        for i in range(5):
            r0 = (i * 997) % max(1, n - side + 1)
            start = time.perf_counter()
            window = client.post(f"/api/runs/{run_id}/window", json={
                "layer": i % adapter.info.layers, "head": i % adapter.info.heads, "rows": [r0, r0 + side],
                "cols": [0, side], "encoding": "f16"})
            window_times.append(time.perf_counter() - start)
            assert window.status_code == 200, window.text[:300]
            start = time.perf_counter()
            row = client.post(f"/api/runs/{run_id}/row", json={"row": n - 1, "layers": [i], "heads": [0],
                                                               "encoding": "f16"})
            row_times.append(time.perf_counter() - start)
            assert row.status_code == 200, row.text[:300]
            start = time.perf_counter()
            client.post(f"/api/runs/{run_id}/row", json={"row": n - 1, "span": [0, min(64, n)], "include_row": False})
            all_heads_times.append(time.perf_counter() - start)
        if short:
            from scripts.gpu_long import rebuild_cost

            kept = runtime.get_run(run_id)
            out.update({"kept_host_bytes": kept.nbytes - kept.device_nbytes, "kept_device_bytes": kept.device_nbytes,
                        **rebuild_cost(kept, torch.device("cpu")),
                        "first_view_median_s": statistics.median(times["first_view"]),
                        "sdpa_median_s": statistics.median(times["sdpa"]), "repeats": repeats})
            out["first_view_over_sdpa_median"] = out["first_view_median_s"] / out["sdpa_median_s"]
    out.update({
        "sdpa_s": min(times["sdpa"]), "eager_attentions_s": min(times["eager"]) if times["eager"] else None,
        "first_view_s": min(times["first_view"]),
        "window_512_ms": 1000 * sorted(window_times)[len(window_times) // 2],
        "row_one_head_ms": 1000 * sorted(row_times)[len(row_times) // 2],
        "row_span_mass_all_heads_ms": 1000 * sorted(all_heads_times)[len(all_heads_times) // 2],
        "all_of_p_bytes": adapter.info.layers * adapter.info.heads * n * n * 4,
        "full_map_tokens": settings.full_map_tokens, "block_rows": adapter.atlas_config.block_rows,
    })
    out["first_view_over_sdpa"] = out["first_view_s"] / out["sdpa_s"]
    if out["eager_attentions_s"]:
        out["first_view_over_eager"] = out["first_view_s"] / out["eager_attentions_s"]
    out["rss_growth_over_all_of_p"] = out["peak_rss_growth_bytes"] / out["all_of_p_bytes"]
    return out


def machine() -> dict:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").is_file() else None
    import os

    import torch
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "load_average": load, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--short-repeats", type=int, default=5, help="repeats for lengths ≤ full_map_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eager-max", type=int, default=2048, help="longest input for the eager baseline (all of P)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default=MODEL, help="a prepared decoder LM in weights/ (e.g. gemma3-270m)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child process: one length
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_length(args.one, args.repeats, args.eager_max, args.short_repeats, args.model)))
        return
    rows = []
    for tokens in args.tokens:
        child = subprocess.run([sys.executable, "-m", "benchmarks.long_inputs", "--one", str(tokens), "--repeats",
                                str(args.repeats), "--eager-max", str(args.eager_max), "--short-repeats",
                                str(args.short_repeats), "--model", args.model], cwd=ROOT,
                               capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(child.stderr[-3000:])
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    report = {"machine": machine(), "results": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
