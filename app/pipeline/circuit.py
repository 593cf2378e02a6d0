"""The work of POST /api/text/circuit and /api/text/circuit/edge (models/circuits.py, docs/api.md "Circuits through
attention"): the pairs checked or generated, the cost estimated before any forward, the scores, the circuit at each
budget and its faithfulness, and the response with edges named only when it is built.

Every forward takes the runtime's model lock one step at a time (`guard`), so other requests interleave with a long
circuit job, and a cancelled job stops at its next step.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from app.admission import check_work_cost
from app.attention import check_response_numbers
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.deps import adapter_for
from app.errors import field_error
from app.runtime import Runtime
from app.schemas import CircuitEdgeRequest, CircuitRequest
from models.adapters.base import RequestFieldError
from models.adapters.causal_lm import CausalLMAdapter
from models import circuits as C
from models.circuit_edge import edge_why
from models.circuit_tasks import PairError, TaskPair, task_pairs, user_pairs

# forward-equivalents of each piece of the work, per pair (a backward counts as two forwards; an input per receiver
# and channel makes the gradient pass and a dense circuit run dearer than a plain forward: benchmarks/circuits.py)
GRADIENT_FORWARDS = 8
CIRCUIT_FORWARDS = 3
EXACT_BATCH = 16


def circuit_model(runtime: Runtime, model: str) -> CausalLMAdapter:
    """The adapter of a decoder LM the circuit engine runs; 422 on `model` naming the family otherwise."""
    adapter = adapter_for(runtime, model, "text")
    if not isinstance(adapter, CausalLMAdapter):
        info = adapter.info
        raise field_error(("model",), f"model {info.id} is a {info.architecture or info.output} "
                          f"({info.model_type or info.output}): circuits are offered for decoder language models "
                          "(Llama, SmolLM2, Qwen2, Mistral, Gemma 3)")
    return adapter


def engine(runtime: Runtime, adapter: CausalLMAdapter, guard) -> C.Engine:
    try:
        with guard():
            return C.engine_for(adapter)
    except RequestFieldError as exc:
        raise field_error((exc.field,), f"model {adapter.info.id}: {exc}") from None


def checked_pairs(runtime: Runtime, adapter: CausalLMAdapter, req: CircuitRequest) -> list[TaskPair]:
    if (req.pairs is None) == (req.task is None):
        raise field_error(("pairs",), "give either pairs or task (one of them)")
    if req.interventions:
        raise field_error(("interventions",), "circuits do not take interventions yet: leave the list empty")
    try:
        if req.task is not None:
            return task_pairs(adapter, req.task.name, req.task.n, req.task.seed)
        return user_pairs(adapter, [p.model_dump() for p in req.pairs], runtime.settings.analysis_max_tokens)
    except PairError as exc:
        raise field_error(exc.loc, str(exc)) from None


def _edges(graph: C.Graph, req: CircuitRequest) -> list[tuple[int, int]] | None:
    if req.edges is None:
        return None
    out = []
    for i, name in enumerate(req.edges):
        try:
            out.append(graph.parse_edge(name))
        except ValueError as exc:
            raise field_error(("edges", i), str(exc)) from None
    return out


def circuit_cost(adapter: CausalLMAdapter, req: CircuitRequest, pairs: list[TaskPair]) -> tuple[float, int]:
    """Multiply-adds of the whole request, and its forwards (for the message)."""
    steps = req.ig_steps if req.method == "eap_ig" else 1
    n_budgets = len(req.budgets) if req.budgets is not None else len(C.DEFAULT_BUDGETS)
    n_exact = (len(req.edges) if req.edges is not None else req.n_exact) if req.method == "exact" else 0
    forwards = 2 + GRADIENT_FORWARDS * steps + CIRCUIT_FORWARDS * n_budgets + n_exact
    shape = model_shape(adapter)
    macs = sum(forwards * forward_macs(shape, p.pair.clean.shape[1], p.pair.clean.shape[1]) for p in pairs)
    return macs, forwards * len(pairs)


def check_size(runtime: Runtime, adapter: CausalLMAdapter, req: CircuitRequest) -> None:
    info = adapter.info
    graph = C.Graph(info.layers, info.heads)
    listed = graph.n_edges if req.top is None else min(req.top, graph.n_edges)
    check_response_numbers(runtime.settings, 2 * listed, {"top": listed}, "ask for fewer edges with `top`")


def run_circuit(runtime: Runtime, adapter: CausalLMAdapter, req: CircuitRequest, pairs: list[TaskPair],
                progress: Callable[[int, int], None], ctx: RequestContext) -> dict[str, Any]:
    macs, forwards = circuit_cost(adapter, req, pairs)
    tokens = max(p.pair.clean.shape[1] for p in pairs)
    turn = ctx.turns(check_work_cost(adapter, runtime, macs, 1, "pairs" if req.pairs else "task",
                                     f"a circuit over {len(pairs)} pairs ({forwards:,} forward-equivalents)", ctx))
    guard = lambda: runtime.step(tokens, ctx=turn())  # noqa: E731
    started = time.perf_counter()
    eng = engine(runtime, adapter, guard)
    graph = eng.graph
    chosen = _edges(graph, req)
    plain = [p.pair for p in pairs]
    n_exact = (len(chosen) if chosen is not None else req.n_exact) if req.method == "exact" else 0
    total = 2 * len(plain) + len(plain) * n_exact
    done = [0]

    def step(count: int = 1) -> None:
        done[0] += count
        progress(min(done[0], total), total)

    steps = req.ig_steps if req.method == "eap_ig" else 1
    scores, cleans, corrupts = C.gradient_scores(eng, plain, steps, lambda k, n: step(), guard)
    m_clean = sum(float(C.metric(c.logits[None], p)[0]) for c, p in zip(cleans, plain)) / len(plain)
    m_corrupt = sum(float(C.metric(c.logits[None], p)[0]) for c, p in zip(corrupts, plain)) / len(plain)
    exact = None
    if req.method == "exact":
        if chosen is None:
            flat = graph.flat(scores)
            top = flat.abs().topk(min(req.n_exact, flat.numel())).indices
            chosen = [tuple(e) for e in graph.valid().nonzero()[top].tolist()]
        t0 = time.perf_counter()
        values = C.exact_scores(eng, plain, chosen, corrupts, EXACT_BATCH,
                                lambda k, n: progress(min(len(plain) + k, total), total), guard)
        done[0] = len(plain) + len(plain) * len(chosen)
        eap = torch.stack([scores[r, s] for r, s in chosen])
        exact = {"edges": chosen, "values": values, "eap": eap,
                 "spearman": C.spearman(eap, values),
                 "seconds_per_edge": (time.perf_counter() - t0) / max(1, len(chosen) * len(plain))}
    budgets = list(req.budgets) if req.budgets is not None else list(C.DEFAULT_BUDGETS)
    curve = C.faithfulness(eng, plain, scores, budgets, corrupts, m_clean, m_corrupt, lambda k, n: step(), guard)
    return circuit_response(eng, req, pairs, scores, curve, (m_clean, m_corrupt), exact,
                            time.perf_counter() - started)


def circuit_response(eng: C.Engine, req: CircuitRequest, pairs: list[TaskPair], scores: torch.Tensor,
                     curve: list[dict], metrics: tuple[float, float], exact: dict | None,
                     seconds: float) -> dict[str, Any]:
    graph = eng.graph
    in_graph = C.prune(graph, C.top_edges(graph, scores, round(req.budget * graph.n_edges)))
    if exact is not None:
        names = graph.edge_names(exact["edges"])
        edges = {name: {"score": float(v), "eap": float(e), "in_graph": bool(in_graph[r, s])}
                 for name, (r, s), v, e in zip(names, exact["edges"], exact["values"], exact["eap"])}
        exact_out = {"spearman": exact["spearman"], "seconds_per_edge": exact["seconds_per_edge"],
                     "n": len(names)}
    else:
        flat = graph.flat(scores)
        count = flat.numel() if req.top is None else min(req.top, flat.numel())
        order = flat.abs().topk(count).indices
        pairs_rs = graph.valid().nonzero()[order].tolist()
        values = flat[order].tolist()
        edges = {name: {"score": v, "in_graph": bool(in_graph[r, s])}
                 for name, (r, s), v in zip(graph.edge_names(pairs_rs), pairs_rs, values)}
        exact_out = None
    cpr, cmd = C.areas(curve)
    return {
        "model": eng.adapter.info.id, "method": req.method, "pairs": len(pairs),
        "ig_steps": req.ig_steps if req.method == "eap_ig" else None,
        "metric": {"clean": metrics[0], "corrupt": metrics[1]},
        "nodes": graph.node_names(), "layers": graph.layers, "heads": graph.heads,
        "n_edges": graph.n_edges, "edges": edges, "edges_returned": len(edges),
        "budget": req.budget, "in_graph": int(in_graph.sum()),
        "faithfulness": curve, "cpr": cpr, "cmd": cmd,
        "prompts": [p.describe() for p in pairs], "task": req.task.model_dump() if req.task else None,
        "exact": exact_out, "seconds": seconds,
    }


def run_edge(runtime: Runtime, adapter: CausalLMAdapter, req: CircuitEdgeRequest, ctx: RequestContext) -> dict:
    try:
        pair = user_pairs(adapter, [req.pair.model_dump()], runtime.settings.analysis_max_tokens)[0]
    except PairError as exc:
        raise field_error(("pair", *exc.loc[2:]), str(exc)) from None
    n_tokens = pair.pair.clean.shape[1]
    shape = model_shape(adapter)
    macs = 8 * forward_macs(shape, n_tokens, n_tokens)  # two records, the two-item patched run, the qk attribution
    turn = ctx.turns(check_work_cost(adapter, runtime, macs, 1, "pair", "one edge's why", ctx))
    eng = engine(runtime, adapter, lambda: runtime.step(n_tokens, ctx=turn()))
    try:
        with runtime.step(n_tokens, ctx=turn()):
            return {"model": adapter.info.id, **edge_why(eng, pair.pair, req.edge, req.query)}
    except RequestFieldError as exc:
        raise field_error((exc.field,), str(exc)) from None
