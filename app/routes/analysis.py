"""Beyond attention weights: POST /api/text/patching, /api/text/lens and /api/text/faithfulness (docs/api.md,
docs/science.md "Beyond attention weights"). The patching scan's work is app/pipeline/patching.py's (a set of pairs:
app/pipeline/patching_set.py). The clean runs that patch_heads/patch_residual take as sources are kept
by app/patch_sources.py; the value-weighted maps of /api/text/attention are app/pipeline's (maps.py).

Scans go through the runtime's model lock like every run: a scan holds it one batch at a time, so other requests
interleave, and with `Accept: text/event-stream` it streams `{"progress", "total"}` events and then the result,
stopping at the next batch once the client has gone.
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response

from app.attention import check_request_limits
from app.interventions import engine_interventions
from app.errors import field_error
from app.admission import check_work_cost
from app.costs import forward_macs, model_shape
from app.patch_sources import request_sources
from app.pipeline.patching import patching_work
from app.pipeline.patching_set import patching_set_work
from app.streams import respond, respond_steps
from app.context import RequestContext
from app.lifecycle import ParsedJsonRoute, check_cancelled
from app.schemas import FaithfulnessRequest, LensRequest, PatchingRequest
from app.deps import RuntimeDep, adapter_for
from app.lm_inputs import language_model, one_token, prompt_ids
from models.adapters.causal_lm import CausalLMAdapter
from models.adapters.seq2seq import Seq2SeqAdapter
from models.faithfulness import faithfulness
from models.head_ops import head_run
from models.lens import logit_lens

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
    check_request_limits(runtime.settings, req)
    adapter = language_model(runtime, req.model)
    ids = prompt_ids(runtime, adapter, "text", req.text)
    sources = request_sources(runtime, adapter, req.interventions)
    with head_run(sources):
        interventions = engine_interventions(req, adapter, ids.shape[1])
    n_tokens = ids.shape[1]

    def work(ctx: RequestContext) -> dict:
        runs = 2 if req.compare and interventions else 1
        seconds = check_work_cost(adapter, runtime.settings, runs * forward_macs(
            model_shape(adapter), n_tokens, n_tokens, len(interventions)), runs, "text", "the lens", ctx)
        with head_run(sources):
            check_cancelled(ctx)
            with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):  # the estimate is checked at the first turn
                after = logit_lens(adapter, ids, interventions, req.top)
            before = None
            if req.compare:
                check_cancelled(ctx)
                with runtime.admitted(ctx=ctx):
                    before = logit_lens(adapter, ids, (), req.top) if interventions else after
        return {
            "model": adapter.info.id, "tokens": [adapter.token_text(int(i)) for i in ids[0]],
            "top": _lens_cells(adapter, after), "top_before": None if before is None else _lens_cells(adapter, before),
        }
    return respond(request, work, "POST /api/text/lens")


def _lens_cells(adapter: CausalLMAdapter, found) -> list:
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = adapter.token_text(token_id)
        return texts[token_id]
    return [[[{"token": text(i), "id": i, "prob": p} for i, p in zip(ids, probs)]
             for ids, probs in zip(layer_ids, layer_probs)]
            for layer_ids, layer_probs in zip(found.ids.tolist(), found.probs.tolist())]


# ---- POST /api/text/faithfulness ------------------------------------------------------------------------------------
@router.post("/faithfulness", responses={422: {"description": "a field is wrong"}, 503: {"description": "queue full"}})
def faithfulness_check(req: FaithfulnessRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Which attribution of a query row is faithful (see /guide#s12-5): keys ranked by raw attention (layer
    mean), value-weighted attention, rollout and gradient × attention; each method's top-k keys are masked in every
    layer, and the output change is reported per k: decoder LMs `kl` of the next-token distribution and `p_drop` of
    p(answer); encoders the change of their own output (`kl` for masked-LM/classes, 1 − cosine for embeddings)."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    if isinstance(adapter, Seq2SeqAdapter):
        raise field_error(("model",), "the faithfulness check is offered for encoders and decoder LMs")
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    encoded = adapter.encode(req.text)
    n_tokens = len(encoded.tokens)
    if n_tokens > runtime.settings.analysis_max_tokens:
        raise field_error(("text",), f"text has {n_tokens} tokens; the limit is {runtime.settings.analysis_max_tokens} "
                          "(analysis_max_tokens)")
    position = n_tokens - 1 if req.position is None else req.position
    if position >= n_tokens:
        raise field_error(("position",), f"position {position} is past the last token ({n_tokens - 1})")
    info = adapter.info
    if req.layer is not None and req.layer >= info.layers:
        raise field_error(("layer",), f"layer {req.layer} out of range: this model has {info.layers} layers")
    if req.head is not None and (req.layer is None or req.head >= info.heads):
        raise field_error(("head",), f"head {req.head}: give a layer too, and a head below {info.heads}")
    answer = None
    if req.answer is not None:
        if not isinstance(adapter, CausalLMAdapter):
            raise field_error(("answer",), "answer is for decoder language models")
        answer = one_token(adapter, "answer", req.answer)
    ks, methods = list(dict.fromkeys(req.k)), list(dict.fromkeys(req.methods))

    def work(ctx: RequestContext) -> dict:
        # a run to rank the keys (and a backward for grad × attention), then one masked run per method and k
        forwards = 3 + len(ks) * len(methods)
        seconds = check_work_cost(adapter, runtime.settings, forwards * forward_macs(
            model_shape(adapter), n_tokens, n_tokens), 1, "k", f"{forwards} forwards of the faithfulness check", ctx)
        check_cancelled(ctx)
        with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):
            result = faithfulness(adapter, encoded, position, ks, methods, answer, req.layer, req.head)
        return {"model": adapter.info.id, "tokens": encoded.tokens, "position": position, **result}
    return respond(request, work, "POST /api/text/faithfulness")
