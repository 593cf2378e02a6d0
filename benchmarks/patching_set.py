"""A head-patching scan over 10 prompt pairs on smollm2-135m (issue 30 item 3): the wall and CPU time of the set
(each pair's exact scan of 270 heads and its AtP/AtP* estimates) and how well each estimate ranks the heads against
the exact mean (Spearman ρ, top-10 overlap), with the load average beside the times.

    python -m benchmarks.patching_set [--pairs 10] [--threads N] [--device cpu|cuda] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights" / "smollm2-135m"
# (clean country, its capital): each corrupted with Italy / " Rome" — all 5 tokens with smollm2's tokenizer
CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("Russia", "Moscow"),
            ("Egypt", "Cairo"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
            ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Portugal", "Lisbon")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="patching_batch_tokens (the server's default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from models.adapters.causal_lm import CausalLMAdapter
    from models.patching import Pair, single_token
    from models.patching_set import ESTIMATES, agreement, mean_and_spread, set_scan

    lm = CausalLMAdapter("smollm2-135m", str(WEIGHTS), device=args.device)
    ids = lambda text: torch.tensor([lm.prompt_ids(text)])  # noqa: E731
    pairs, used = [], []
    for country, capital in CAPITALS:
        clean, corrupt = ids(f"The capital of {country} is"), ids("The capital of Italy is")
        answer, wrong = single_token(lm.tokenizer, f" {capital}"), single_token(lm.tokenizer, " Rome")
        if clean.shape != corrupt.shape or answer is None:
            continue
        pairs.append(Pair(clean, corrupt, answer, wrong))
        used.append(country)
        if len(pairs) == args.pairs:
            break
    set_scan(lm, pairs[:1], batch_tokens=args.batch_tokens)  # warm-up (first-call allocations)
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    scans = set_scan(lm, pairs, batch_tokens=args.batch_tokens)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    load_after = os.getloadavg()
    mean, spread = mean_and_spread([s.effect for s in scans if s.defined])
    result = {
        "model": "smollm2-135m", "device": args.device, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "pairs": len(pairs), "countries": used, "tokens": int(pairs[0].clean.shape[1]),
        "batch_tokens": args.batch_tokens, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "load_before": load_before, "load_after": load_after,
        "top_heads": [(int(i) // 9, int(i) % 9, round(float(mean.flatten()[i]), 3), round(float(spread.flatten()[i]), 3))
                      for i in mean.flatten().abs().topk(5).indices],
        "agreement": {name: agreement(mean, mean_and_spread([s.estimates[name] for s in scans if s.defined])[0], 10)
                      for name in ESTIMATES},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
