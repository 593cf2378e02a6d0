"""Cost of the analyses beside one forward, in one process and one run (issue 22 §7): a full head-patching scan,
attribution patching and the logit lens on smollm2-135m with a 12-token clean/corrupted pair, each as a ratio to
one forward of the corrupted prompt measured in the same run (the median of interleaved repeats).

    python -m benchmarks.analysis [--repeats 3] [--batch 64 270] [--random-weights] [--device cpu|cuda] [--out PATH]

--random-weights builds the smollm2-135m architecture from weights/smollm2-135m/config.json with random weights
(for machines the weights cannot reach; the cost does not depend on the values, the logit differences do).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights" / "smollm2-135m"
CLEAN = "The Eiffel Tower stands in France, in the city of"
CORRUPT = "The Colosseum stands in Italy, in the city of"
TARGETS = {"head_scan": 10.0, "attribution": 4.0, "lens": 1.5}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def load(random_weights: bool, device: str):
    from models.adapters.causal_lm import CausalLMAdapter

    if not random_weights:
        return CausalLMAdapter("smollm2-135m", str(WEIGHTS), device=device), "smollm2-135m (its weights)"
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="smollm2-random-"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(WEIGHTS))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (WEIGHTS / name).is_file():
            (folder / name).write_bytes((WEIGHTS / name).read_bytes())
    return CausalLMAdapter("smollm2-135m", str(folder), device=device), "smollm2-135m architecture, random weights"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 270])
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "analysis.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from models.lens import logit_lens
    from models.patching import Pair, attribution_patching, baseline, head_scan, last_logits, rank_correlation, single_token

    lm, label = load(args.random_weights, args.device)
    device = lm.device
    ids = lambda text: torch.tensor([lm.prompt_ids(text)])  # noqa: E731
    pair = Pair(ids(CLEAN), ids(CORRUPT), single_token(lm.tokenizer, " Paris"), single_token(lm.tokenizer, " Rome"))
    n_tokens = pair.clean.shape[1]

    def forward():
        last_logits(lm, pair.corrupt)

    def scan(batch: int):
        def run():
            base = baseline(lm, pair)
            run.effect = head_scan(lm, pair, base, batch=batch)
        return run

    def attribution():
        attribution.base, attribution.effect = attribution_patching(lm, pair)

    def lens():
        logit_lens(lm, pair.corrupt, top=5)

    jobs = {"forward": forward, "attribution": attribution, "lens": lens}
    jobs.update({f"head_scan_b{b}": scan(b) for b in args.batch})
    for fn in jobs.values():  # warm-up: first calls allocate and (on a GPU) load kernels
        fn()
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.repeats):  # interleaved, so load changes on a shared machine hit every measure alike
        for name, fn in jobs.items():
            times[name].append(timed(fn, device))
            if name != "forward":  # one forward beside each measure: the baseline follows the load
                times["forward"].append(timed(forward, device))
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = {name: median[name] / median["forward"] for name in median if name != "forward"}
    best_scan = min((name for name in ratios if name.startswith("head_scan")), key=ratios.get)
    exact = jobs[best_scan].effect
    result = {
        "model": label, "tokens": n_tokens, "clean": CLEAN, "corrupt": CORRUPT, "device": str(device),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                    "load_average": [round(x, 1) for x in os.getloadavg()]},
        "repeats": args.repeats, "median_s": median, "ratio_to_one_forward": ratios,
        "targets": {"head_scan": f"≤ {TARGETS['head_scan']}× ({best_scan})", "attribution": f"≤ {TARGETS['attribution']}×",
                    "lens": f"≤ {TARGETS['lens']}×"},
        "met": {"head_scan": ratios[best_scan] <= TARGETS["head_scan"],
                "attribution": ratios["attribution"] <= TARGETS["attribution"], "lens": ratios["lens"] <= TARGETS["lens"]},
        "ld_clean": attribution.base.ld_clean, "ld_corrupt": attribution.base.ld_corrupt,
        "max_head_effect": float(exact.max()), "spearman_exact_vs_attribution": rank_correlation(exact, attribution.effect),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
