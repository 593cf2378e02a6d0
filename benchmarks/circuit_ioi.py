"""IOI on a decoder LM, smollm2-135m by default (issue 51, docs/science.md "Circuits through attention"): the EAP circuit at 5 % of the edges
over seeded IOI pairs, its faithfulness curve, the heads it keeps, and for each of those heads what the lab measures
of it: its head-kind scores on the built-in probe (models/head_kinds.py: previous-token, duplicate-token, induction,
sink) and, on the IOI prompts themselves, where it attends from the last position (the indirect object IO, the
subject's first mention S1 or its second S2) and from S2 (to S1: duplicate-token behaviour). Those are the
signatures of Wang et al. 2022's roles: name movers attend end → IO, S-inhibition heads end → S2, duplicate-token
heads S2 → S1.

    python -m benchmarks.circuit_ioi [--model smollm2-135m|qwen2.5-0.5b|…] [--pairs 8] [--seed 0] [--method eap] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"  # one folder per prepared model (attnlab prepare)
BUDGETS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def attention_of(lm, ids: list[int]) -> torch.Tensor:
    from models.adapters.base import Encoded
    tensor = torch.tensor([ids])
    encoded = Encoded(key=("ioi", tuple(ids)), tokens=[lm.token_text(i) for i in ids],
                      inputs={"input_ids": tensor, "attention_mask": torch.ones_like(tensor)},
                      extra={"position": len(ids) - 1})
    return lm.run(encoded).attention.float()  # (L, H, T, T)


def ioi_positions(lm, task_pair) -> dict[str, int]:
    """Positions of IO, S1, S2 (the names' tokens) and the end, from the clean prompt's ids."""
    ids = task_pair.pair.clean[0].tolist()
    io, s = task_pair.pair.answer, task_pair.pair.wrong
    s_positions = [k for k, t in enumerate(ids) if t == s]
    return {"IO": ids.index(io), "S1": s_positions[0], "S2": s_positions[-1], "end": len(ids) - 1}


def head_signatures(lm, task_pairs, heads) -> dict:
    """Mean attention end → IO, end → S1, end → S2 and S2 → S1 over the clean prompts, per head."""
    totals = {h: torch.zeros(4) for h in heads}
    for tp in task_pairs:
        probs = attention_of(lm, tp.pair.clean[0].tolist())
        at = ioi_positions(lm, tp)
        for (l, h) in heads:
            p = probs[l, h]
            totals[(l, h)] += torch.tensor([p[at["end"], at["IO"]], p[at["end"], at["S1"]], p[at["end"], at["S2"]],
                                            p[at["S2"], at["S1"]]])
    return {f"L{l}.H{h}": dict(zip(("end_to_IO", "end_to_S1", "end_to_S2", "S2_to_S1"),
                                    (totals[(l, h)] / len(task_pairs)).tolist())) for (l, h) in heads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m", help="a prepared decoder LM under weights/")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="eap", choices=["eap", "eap_ig"])
    parser.add_argument("--top-heads", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from models import circuits as C
    from models.adapters.causal_lm import CausalLMAdapter
    from models.circuit_tasks import task_pairs
    from models.head_kinds import ProbeSettings, head_taxonomy, ordinary_token_ids

    started = time.perf_counter()
    lm = CausalLMAdapter(args.model, str(WEIGHTS / args.model), device="cpu")
    made = task_pairs(lm, "ioi", args.pairs, args.seed)
    pairs = [tp.pair for tp in made]
    engine = C.engine_for(lm)
    graph = engine.graph
    scores, cleans, corrupts = C.gradient_scores(engine, pairs, 5 if args.method == "eap_ig" else 1)
    m_clean = sum(float(C.metric(c.logits[None], p)[0]) for c, p in zip(cleans, pairs)) / len(pairs)
    m_corrupt = sum(float(C.metric(c.logits[None], p)[0]) for c, p in zip(corrupts, pairs)) / len(pairs)
    curve = C.faithfulness(engine, pairs, scores, BUDGETS, corrupts, m_clean, m_corrupt)
    keep = C.prune(graph, C.top_edges(graph, scores, round(0.05 * graph.n_edges)))
    weight = (scores.abs() * keep).float()  # (R, S) the kept edges' |score|
    per_node = torch.zeros(graph.n_senders + 1)
    per_node[: graph.n_senders] += weight.sum(0)  # as a sender
    owners = torch.tensor([graph.receiver_node(r) for r in range(graph.n_receivers)])
    per_node.index_add_(0, owners, weight.sum(1))  # as a receiver
    heads = []
    for node in per_node.argsort(descending=True).tolist():
        name = graph.sender_name(node) if node < graph.n_senders else "logits"
        if name.startswith("a"):
            layer, head = (int(x) for x in name[1:].split(".h"))
            heads.append((layer, head, float(per_node[node])))
        if len(heads) == args.top_heads:
            break
    kept_heads = {graph.receiver_node(r) for r in range(graph.n_receivers) if bool(keep[r].any())}
    vocab = lm.model.get_input_embeddings().num_embeddings
    candidates = ordinary_token_ids(vocab, lm.tokenizer.all_special_ids)
    kinds = head_taxonomy(lambda ids: attention_of(lm, ids), candidates, lm.tokenizer.bos_token_id, ProbeSettings())
    signatures = head_signatures(lm, made, [(l, h) for l, h, _ in heads])
    rows = []
    for l, h, total in heads:
        row = {"head": f"a{l}.h{h}", "kept_edge_weight": total, "label": kinds["labels"][l][h],
               **{kind: float(kinds["scores"][kind][l, h]) for kind in ("previous_token", "duplicate_token",
                                                                       "induction", "sink")
                  if kinds["scores"].get(kind) is not None},
               **signatures[f"L{l}.H{h}"]}
        rows.append(row)
    labelled = {f"a{l}.h{h}": kinds["labels"][l][h] for l in range(graph.layers) for h in range(graph.heads)
                if kinds["labels"][l][h]}
    result = {
        "model": args.model, "task": "ioi", "pairs": len(pairs), "seed": args.seed, "method": args.method,
        "prompts": [tp.clean for tp in made], "metric": {"clean": m_clean, "corrupt": m_corrupt},
        "n_edges": graph.n_edges, "faithfulness": curve, "cpr_cmd": C.areas(curve),
        "circuit_5pct": {"edges": int(keep.sum()),
                         "heads": sum(1 for n in kept_heads if n < graph.n_senders and graph.sender_name(n)[0] == "a"),
                         "mlps": sum(1 for n in kept_heads if n < graph.n_senders and graph.sender_name(n)[0] == "m")},
        "top_heads": rows, "labelled_heads_in_model": labelled,
        "seconds": time.perf_counter() - started, "loadavg": os.getloadavg(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
