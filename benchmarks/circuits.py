"""The cost of circuits on smollm2-135m (issue 51 §8): EAP over every edge (123,211) against a plain forward and
backward of the same pairs, as a ratio (target ≤ 3), and the seconds per exact edge, per faithfulness budget and for
EAP-IG, on seeded IOI pairs. Wall and CPU time side by side, with the load average (the machine is shared).

The plain forward+backward is the model's own forward (the lab's attention function, no circuit hooks) on the clean
prompt with its input embeddings requiring a gradient, and one backward of m = logit(answer) − logit(wrong).
EAP is models/circuits.gradient_scores: the clean and corrupt records (two forwards without gradients), one forward
with an input per receiver and channel and its backward, and the (receiver × sender) products.

    python -m benchmarks.circuits [--pairs 4] [--threads N] [--device cpu|cuda] [--out PATH]
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


def timed(work, repeat: int = 1) -> dict:
    """The best of `repeat` runs: wall and process CPU seconds."""
    best = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        got = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        best = got if best is None or got["wall_s"] < best["wall_s"] else best
    return best


def plain_forward_backward(lm, pairs) -> None:
    for pair in pairs:
        with torch.inference_mode(False), torch.enable_grad():
            embeds = lm.model.get_input_embeddings()(pair.clean.to(lm.device)).detach().requires_grad_(True)
            logits = lm.model(inputs_embeds=embeds, logits_to_keep=1).logits[0, -1]
            (logits[pair.answer] - logits[pair.wrong]).backward()


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "loadavg_before": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from models import circuits as C
    from models.adapters.causal_lm import CausalLMAdapter
    from models.circuit_tasks import task_pairs

    lm = CausalLMAdapter("smollm2-135m", str(WEIGHTS), device=args.device)
    found = machine()
    pairs = [p.pair for p in task_pairs(lm, "ioi", args.pairs, 0)]
    engine = C.engine_for(lm)
    plain_forward_backward(lm, pairs[:1])  # warm-up of both paths
    C.gradient_scores(engine, pairs[:1], 1)
    plain = timed(lambda: plain_forward_backward(lm, pairs), args.repeat)
    eap = timed(lambda: C.gradient_scores(engine, pairs, 1), args.repeat)
    ig = timed(lambda: C.gradient_scores(engine, pairs, 5))
    scores, _, corrupts = C.gradient_scores(engine, pairs, 1)
    flat = engine.graph.flat(scores)
    top = [tuple(e) for e in engine.graph.valid().nonzero()[flat.abs().topk(32).indices].tolist()]
    exact = timed(lambda: C.exact_scores(engine, pairs[:1], top, corrupts[:1], batch=16))
    budgets = list(C.DEFAULT_BUDGETS)
    faith = timed(lambda: C.faithfulness(engine, pairs[:1], scores, budgets, corrupts[:1], 1.0, 0.0))
    result = {
        "model": "smollm2-135m", "device": args.device, "task": "ioi", "pairs": len(pairs),
        "tokens": int(pairs[0].clean.shape[1]), "edges": engine.graph.n_edges, **found,
        "plain_forward_backward": plain, "eap": eap,
        "ratio_wall": eap["wall_s"] / plain["wall_s"], "ratio_cpu": eap["cpu_s"] / plain["cpu_s"],
        "eap_ig_5_steps": ig, "exact_seconds_per_edge_wall": exact["wall_s"] / len(top),
        "exact_seconds_per_edge_cpu": exact["cpu_s"] / len(top),
        "faithfulness_seconds_per_budget_wall": faith["wall_s"] / len(budgets),
        "faithfulness_seconds_per_budget_cpu": faith["cpu_s"] / len(budgets),
        "loadavg_after": os.getloadavg(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
