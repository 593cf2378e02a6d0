"""Where a fresh first view's model time goes on a device (scripts/gpu_check.sh --profile runs this).

For minilm and smollm2-135m at 128 tokens: the median of a raw eager forward with attentions (the bench's
baseline; its maps stay on the device), of the same forward followed by copying every map to the CPU, and of
attnlab's engine run as the server calls it for a first view (scores recorded); then the split of one engine run
(forward, copies to the CPU), the first view's response pieces (thumbnails, output summary), and torch.profiler's
top operations by CPU time with the count of device → host synchronisations.

    python -m scripts.gpu_profile --device cuda [--out profile.md]    # from the checkout's root
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from app.attention import thumbnails
from models.registry import build_registry

WORDS = "the cat sat on a mat and the dog ran to the park while it was warm so we all went out for lunch".split()


def text_of(adapter, n_tokens: int) -> str:
    """Plain words giving at most n_tokens tokens on this adapter."""
    words = [WORDS[i % len(WORDS)] for i in range(n_tokens)]
    while len(adapter.encode(" ".join(words)).tokens) > n_tokens:
        words.pop()
    return " ".join(words)

MODELS = ("minilm", "smollm2-135m")


def median_ms(fn, device: str, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    registry = build_registry()
    lines = [f"### Where the model time goes ({args.device}, {args.tokens} tokens, median ms)", "",
             "| model | raw forward | raw + maps to CPU | engine run (scores) | engine run (no scores) | thumbnails 24 | "
             "output summary |", "|---|---|---|---|---|---|---|"]
    tables = []
    for model_id in MODELS:
        adapter = registry[model_id].load(args.device)
        encoded = adapter.encode(text_of(adapter, args.tokens))
        if adapter.info.output == "next_token":
            encoded = adapter.at_position(encoded, None)
        model, inputs = adapter.model, adapter.model_inputs(encoded.inputs)
        model.set_attn_implementation("eager")

        @torch.inference_mode()
        def raw(copy: bool = False):
            out = model(**inputs, output_attentions=True)
            if copy:
                torch.stack([a[0] for a in out.attentions]).cpu()

        raw_ms, raw_copy_ms = median_ms(raw, args.device), median_ms(lambda: raw(True), args.device)
        model.set_attn_implementation("attnlab")
        run_ms = median_ms(lambda: adapter.run(encoded, (), True), args.device)
        plain_ms = median_ms(lambda: adapter.run(encoded, (), False), args.device)
        result = adapter.run(encoded, (), True)
        thumbs_ms = median_ms(lambda: thumbnails(result.attention, 24), "cpu", 5)
        summary_ms = median_ms(lambda: adapter.output_summary(result, encoded), "cpu", 5)
        lines.append(f"| {model_id} | {raw_ms:.1f} | {raw_copy_ms:.1f} | {run_ms:.1f} | {plain_ms:.1f} | "
                     f"{thumbs_ms:.1f} | {summary_ms:.1f} |")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                adapter.run(encoded, (), True)
        events = prof.key_averages()
        syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                       "aten::_local_scalar_dense"))
        table = events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
        tables += [f"#### {model_id}: torch.profiler, 3 engine runs with scores ({syncs} synchronising calls)", "",
                   "```", table.strip(), "```", ""]
        del adapter, model, result
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = "\n".join(lines + [""] + tables)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
