"""What value weighting costs where P is not kept whole (issue 22 §3, docs/science.md §12.4), on smollm2-135m, in one
process with the baselines interleaved (medians of the repeats):

- keeping the per-key norms n_j^h during a run (√(v G vᵀ) per layer): a short run (full maps) and a long first view
  (blockwise atlas), each with and without them;
- a value-weighted exact window (rows rebuilt over all keys, weighted, renormalised) against the plain window;
- a long run's value-weighted overview (P rebuilt block by block from q̂/k̂) against the long first view itself.

    python -m benchmarks.value_norms [--short 512] [--long 2048] [--repeats 3] [--device cpu|cuda] [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from benchmarks.analysis import ROOT, WEIGHTS, timed

SAMPLE = ROOT / "static" / "samples" / "long-sample.txt"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", type=int, default=512)
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from models.adapters.causal_lm import CausalLMAdapter
    from models.atlas import window
    from models.attribution import value_grams, value_weighted_overview, value_weighted_rows
    from models.head_ops import HeadRun, head_run

    device = torch.device(args.device)
    lm = CausalLMAdapter("smollm2-135m", str(WEIGHTS), device=args.device)
    lm.full_map_tokens = args.short  # inputs over it run blockwise
    block_rows = 1024 if device.type == "cuda" else 128
    lm.atlas_config = dataclasses.replace(lm.atlas_config, block_rows=block_rows, overview_blocks=128)
    ids = lm.prompt_ids(SAMPLE.read_text())
    grams = value_grams(lm)

    def encoded(n: int):
        from models.adapters.base import Encoded
        input_ids = torch.tensor([ids[:n]])  # (1, n): exactly n tokens of the long sample
        return Encoded(key=("bench", n), tokens=[lm.token_text(i) for i in ids[:n]],
                       inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                       extra={"position": n - 1})

    inputs = {n: encoded(n) for n in (args.short, args.long)}
    times: dict[str, list[float]] = {}
    kept = {}

    def run(n: int, norms: bool):
        context = head_run(HeadRun(value_grams=grams)) if norms else head_run(HeadRun())
        with context:
            kept[(n, norms)] = lm.run(inputs[n])

    for _ in range(args.repeats):
        for n in (args.short, args.long):
            for norms in (False, True):
                times.setdefault(f"run_{n}_{'norms' if norms else 'plain'}", []).append(timed(lambda: run(n, norms), device))
        long = kept[(args.long, True)]
        record = long.atlas.record(len(long.atlas.records) // 2)
        rows, cols = (args.long - args.window, args.long), (args.long - 2 * args.window, args.long - args.window)
        times.setdefault("window_plain", []).append(timed(lambda: window(record, 4, rows, cols), device))
        times.setdefault("window_value", []).append(timed(lambda: value_weighted_rows(record, [4], *rows)[0, :, cols[0]:cols[1]], device))
        times.setdefault("overview_value", []).append(timed(lambda: value_weighted_overview(long.atlas, block_rows), device))
    median = {k: statistics.median(v) for k, v in times.items()}
    s, l = args.short, args.long
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}" if device.type == "cpu"
        else torch.cuda.get_device_name(), "device": args.device, "repeats": args.repeats,
        "tokens": {"short": s, "long": l}, "seconds": median,
        "ratios": {
            f"short_{s}_norms_over_plain": median[f"run_{s}_norms"] / median[f"run_{s}_plain"],
            f"long_{l}_norms_over_plain": median[f"run_{l}_norms"] / median[f"run_{l}_plain"],
            "value_window_over_plain_window": median["window_value"] / median["window_plain"],
            f"value_overview_over_long_{l}_first_run": median["overview_value"] / median[f"run_{l}_plain"],
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
