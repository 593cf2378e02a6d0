"""Why one circuit edge matters (docs/science.md "Circuits through attention"), on one prompt pair.

- every edge: its exact score, m(clean run with only this edge read from the corrupt run) − m(clean run);
- a `<q>` or `<k>` edge A→B: B's attention row at the query with and without the edge, the key whose weight moved
  most, and B's query–key attribution at (query, that key) on the clean run (models/qk_attribution.py), where A is one
  of the parts (`embed`, `L{l}.H{h}`, `L{l}.mlp`): its row total (as a query part) and column total (as a key part);
- a `<v>` edge: what B writes at the query with and without the edge, B's output through the model's unembedding
  with the final norm frozen at the clean run's scale there (a logit lens of the one head's part: nostalgebraist
  2020), top tokens by logit.
"""
from __future__ import annotations

from typing import Any

import torch

from models.adapters.base import RequestFieldError
from models.circuits import CHANNELS, Engine, Plan, metric
from models.patching import Pair
from models.qk_attribution import freeze_norm, qk_attribution

TOP_TOKENS = 10


def part_name(engine: Engine, sender: int) -> str:
    """A sender as the query–key attribution names its part: embed, L{l}.H{h}, L{l}.mlp."""
    if sender == 0:
        return "embed"
    layer, k = divmod(sender - 1, engine.graph.heads + 1)
    return f"L{layer}.mlp" if k == engine.graph.heads else f"L{layer}.H{k}"


def _receiver_head(engine: Engine, receiver: int) -> tuple[int, int, str] | None:
    """(layer, head, channel) of a head receiver; None for an MLP or the logits."""
    graph = engine.graph
    if receiver == graph.logits_row:
        return None
    layer, k = divmod(receiver, 3 * graph.heads + 1)
    if k == 3 * graph.heads:
        return None
    channel, head = divmod(k, graph.heads)
    return layer, head, CHANNELS[channel]


def _top_tokens(engine: Engine, vector: torch.Tensor, scale: torch.Tensor) -> list[dict[str, Any]]:
    logits = engine.head((vector.double() * scale).to(engine.dtype)[None])[0].float()  # (V,)
    top = torch.topk(logits, TOP_TOKENS)
    return [{"token": engine.adapter.token_text(int(i)), "id": int(i), "logit": float(v)}
            for v, i in zip(top.values, top.indices)]


@torch.inference_mode()
def edge_why(engine: Engine, pair: Pair, edge: str, query: int | None = None) -> dict[str, Any]:
    graph = engine.graph
    try:
        receiver, sender = graph.parse_edge(edge)
    except ValueError as exc:
        raise RequestFieldError("edge", str(exc)) from None
    n_tokens = pair.clean.shape[1]
    query = n_tokens - 1 if query is None else query
    if not 0 <= query < n_tokens:
        raise RequestFieldError("query", f"query {query} is outside the prompt's {n_tokens} tokens")
    clean, corrupt = engine.record(pair.clean), engine.record(pair.corrupt)
    head = _receiver_head(engine, receiver)
    plan = Plan(corrupt=corrupt, edits=[(1, receiver, sender)], watch=head[:2] if head else None)
    logits, _ = engine.forward(pair.clean.expand(2, -1), plan)  # item 0 clean, item 1 with the edge patched
    before, after = metric(logits, pair).tolist()
    out: dict[str, Any] = {
        "edge": edge, "sender": graph.sender_name(sender), "receiver": graph.receiver_name(receiver).split("<")[0],
        "channel": head[2] if head else None, "score": after - before,
        "metric": {"clean": before, "corrupt": float(metric(corrupt.logits[None], pair)[0]), "patched": after},
        "tokens": [engine.adapter.token_text(int(t)) for t in pair.clean[0]], "query": query,
        "row_before": None, "row_after": None, "key": None, "part": None, "qk": None, "part_share": None,
        "writes": None,
    }
    if head is None:
        return out
    layer, index, channel = head
    if channel in ("q", "k"):
        probs = plan.watched["probs"][:, query].float().cpu()  # (2, T)
        key = int((probs[1] - probs[0]).abs().argmax())
        found = qk_attribution(engine.adapter, pair.clean, layer, index, query, key, expand=0)
        part = part_name(engine, sender)
        totals = {"query": dict(zip(found.query_parts, found.matrix.sum(dim=1).tolist())),
                  "key": dict(zip(found.key_parts, found.matrix.sum(dim=0).tolist()))}
        out.update(row_before=probs[0].tolist(), row_after=probs[1].tolist(), key=key, part=part,
                   qk=found.to_dict(), part_share={side: totals[side].get(part) for side in ("query", "key")})
    else:
        scale = freeze_norm(engine.norm, clean.final[query].double().cpu()).scale.to(engine.device)  # (D,)
        written = plan.watched["out"][:, query]  # (2, D): B's part at the query, without and with the edge
        out["writes"] = {"before": _top_tokens(engine, written[0], scale), "after": _top_tokens(engine, written[1], scale)}
    return out
