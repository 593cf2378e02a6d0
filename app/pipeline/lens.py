"""The work of POST /api/text/lens (app/routes/analysis.py): the request checked (the settings' limits, a decoder
LM, the prompt, the interventions and their patch sources), then the work that runs the logit lens with the
interventions and, with `compare`, without them (models/lens.py), each run a turn of the model lock."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.admission import check_work_cost
from app.attention import check_request_limits
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.interventions import engine_interventions
from app.lifecycle import check_cancelled
from app.lm_inputs import language_model, prompt_ids
from app.patch_sources import request_sources
from app.runtime import Runtime
from app.schemas import LensRequest
from models.adapters.causal_lm import CausalLMAdapter
from models.head_ops import head_run
from models.lens import logit_lens


def lens_work(runtime: Runtime, req: LensRequest) -> Callable[[RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field); the result is the work app/streams.py
    respond runs with the request's context."""
    check_request_limits(runtime.settings, req)
    adapter = language_model(runtime, req.model)
    ids = prompt_ids(runtime, adapter, "text", req.text)
    sources = request_sources(runtime, adapter, req.interventions)
    with head_run(sources):
        interventions = engine_interventions(req, adapter, ids.shape[1])
    n_tokens = ids.shape[1]

    def work(ctx: RequestContext) -> dict[str, Any]:
        runs = 2 if req.compare and interventions else 1
        seconds = check_work_cost(adapter, runtime, runs * forward_macs(
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
            "top": lens_cells(adapter, after), "top_before": None if before is None else lens_cells(adapter, before),
        }
    return work


def lens_cells(adapter: CausalLMAdapter, found) -> list:
    """[L][T][k] of {"token", "id", "prob"} from the lens's top ids and probabilities (each token's text once)."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = adapter.token_text(token_id)
        return texts[token_id]
    return [[[{"token": text(i), "id": i, "prob": p} for i, p in zip(ids, probs)]
             for ids, probs in zip(layer_ids, layer_probs)]
            for layer_ids, layer_probs in zip(found.ids.tolist(), found.probs.tolist())]
