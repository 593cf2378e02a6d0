"""Beyond attention weights: POST /api/text/patching, /api/text/lens and /api/text/faithfulness (docs/api.md,
docs/science.md "Beyond attention weights"): thin routes over their work in app/pipeline/ (the patching scan:
patching.py, a set of pairs: patching_set.py; the lens: lens.py; the faithfulness check: faithfulness.py). The clean
runs that patch_heads/patch_residual take as sources are kept by app/patch_sources.py; the value-weighted maps of
/api/text/attention are app/pipeline's (maps.py).

Scans go through the runtime's model lock like every run: a scan holds it one batch at a time, so other requests
interleave, and with `Accept: text/event-stream` it streams `{"progress", "total"}` events and then the result,
stopping at the next batch once the client has gone.
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response

from app.deps import RuntimeDep
from app.lifecycle import ParsedJsonRoute
from app.pipeline.faithfulness import faithfulness_work
from app.pipeline.lens import lens_work
from app.pipeline.patching import patching_work
from app.pipeline.patching_set import patching_set_work
from app.schemas import FaithfulnessRequest, LensRequest, PatchingRequest
from app.streams import respond, respond_steps

router = APIRouter(prefix="/api/text", tags=["analysis"], route_class=ParsedJsonRoute)
log = logging.getLogger("attnlab")


# ---- POST /api/text/patching --------------------------------------------------------------------------------------
@router.post("/patching", responses={
    200: {"description": "the scan (JSON), or with Accept: text/event-stream progress events then the result",
          "content": {"text/event-stream": {}}},
    422: {"description": "a field is wrong: answer/wrong not one token, prompts of different token counts, …"},
    503: {"description": "queue full"}})
def patching(req: PatchingRequest, request: Request, runtime: RuntimeDep) -> Response:
    """Patching between a clean and a corrupted prompt (see /guide#s12-1): LD = logit(answer) − logit(wrong) at
    the last position; each cell's effect is (LD_patched − LD_corrupt) / (LD_clean − LD_corrupt).

    `scan` "heads": every head's output (before W_O, all positions) from the clean run, as [L][H]; "residual":
    the output of each layer at each position, as [L][T]. `method` "attribution": the gradient estimate (heads
    only; 2 forwards and 1 backward). An exact head scan also returns `attribution` and `rank_correlation`.
    `clean_run_id` names the clean run's head outputs, kept for `{"op": "patch_heads", "source": clean_run_id}`.
    """
    if req.pairs is not None or req.template is not None:  # a set of pairs: app/pipeline/patching_set.py
        return respond_steps(request, patching_set_work(runtime, req), "POST /api/text/patching (set)")
    return respond_steps(request, patching_work(runtime, req), "POST /api/text/patching")


# ---- POST /api/text/lens ------------------------------------------------------------------------------------------
@router.post("/lens", responses={422: {"description": "a field is wrong"}, 503: {"description": "queue full"}})
def lens(req: LensRequest, runtime: RuntimeDep, request: Request) -> Response:
    """The logit lens (see /guide#s12-3): row l is the residual stream after layer l through the final norm and the
    unembedding, `top` [L][T][k] of {"token", "id", "prob"}; the last row is the model's own next-token
    distribution. With interventions and `compare`, `top_before` is the lens without them."""
    return respond(request, lens_work(runtime, req), "POST /api/text/lens")


# ---- POST /api/text/faithfulness ------------------------------------------------------------------------------------
@router.post("/faithfulness", responses={422: {"description": "a field is wrong"}, 503: {"description": "queue full"}})
def faithfulness_check(req: FaithfulnessRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Which attribution of a query row is faithful (see /guide#s12-5): keys ranked by raw attention (layer
    mean), value-weighted attention, rollout and gradient × attention; each method's top-k keys are masked in every
    layer, and the output change is reported per k: decoder LMs `kl` of the next-token distribution and `p_drop` of
    p(answer); encoders the change of their own output (`kl` for masked-LM/classes, 1 − cosine for embeddings)."""
    return respond(request, faithfulness_work(runtime, req), "POST /api/text/faithfulness")
