"""Circuits through attention: POST /api/text/circuit (a job) and POST /api/text/circuit/edge (docs/api.md "Circuits
through attention", docs/science.md). The work is app/pipeline/circuit.py's; the engine is models/circuits.py."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.attention import check_request_limits
from app.context import RequestContext
from app.deps import RuntimeDep
from app.lifecycle import ParsedJsonRoute
from app.pipeline.circuit import check_size, checked_pairs, circuit_model, run_circuit, run_edge
from app.schemas import CircuitEdgeRequest, CircuitRequest
from app.streams import respond, respond_steps

router = APIRouter(prefix="/api/text", tags=["analysis"], route_class=ParsedJsonRoute)


@router.post("/circuit", responses={
    200: {"description": "the circuit (JSON), or with Accept: text/event-stream progress events then the result",
          "content": {"text/event-stream": {}}},
    413: {"description": "the work would not finish within the time limit, or the response is too large"},
    422: {"description": "a field is wrong: a pair's token counts differ, an answer is not one token, an encoder "
                         "model, an unknown edge"},
    503: {"description": "queue full"}})
def circuit(req: CircuitRequest, request: Request, runtime: RuntimeDep) -> Response:
    """An edge graph of heads (their q, k and v inputs apart) and MLPs, scored over prompt pairs: `eap` (one clean
    forward and backward per pair), `eap_ig` (the gradient averaged over `ig_steps` inputs between corrupt and
    clean), or `exact` (each chosen edge patched alone). m = logit(answer) − logit(wrong) at the last position,
    mean over the pairs; a score estimates m(edge read from the corrupt run) − m(clean). The faithfulness curve keeps
    the top edges at each budget (pruned to paths input → logits) and reads every other edge from the corrupt run."""
    check_request_limits(runtime.settings, req)
    adapter = circuit_model(runtime, req.model)
    check_size(runtime, adapter, req)
    pairs = checked_pairs(runtime, adapter, req)

    def job(progress, ctx: RequestContext) -> dict:
        return run_circuit(runtime, adapter, req, pairs, progress, ctx)

    return respond_steps(request, job, "POST /api/text/circuit")


@router.post("/circuit/edge", responses={
    422: {"description": "a field is wrong: an unknown edge, a query outside the prompt, an encoder model"},
    503: {"description": "queue full"}})
def circuit_edge(req: CircuitEdgeRequest, request: Request, runtime: RuntimeDep) -> Response:
    """Why one edge matters on one pair: its exact score; for a `<q>`/`<k>` edge the receiving head's attention row
    at `query` with and without the edge and its query–key attribution at the key that moved most, the sender's
    part marked; for a `<v>` edge the head's output through the unembedding, top tokens with and without."""
    check_request_limits(runtime.settings, req)
    adapter = circuit_model(runtime, req.model)
    return respond(request, lambda ctx: run_edge(runtime, adapter, req, ctx), "POST /api/text/circuit/edge")
