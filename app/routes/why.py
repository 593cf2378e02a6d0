"""Why a head attends: POST /api/text/qk_attribution, the exact split of one attention score over the parts of the
residual stream on the query side × the key side (models/qk_attribution.py, docs/science.md "Query–key attribution").

One forward of the model with the request's interventions, under the runtime's model lock like any run; the split
itself is a few small matrix products.
"""
from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request, Response
from pydantic import Field, model_validator

from app.attention import check_request_limits, check_response_numbers
from app.interventions import engine_interventions
from app.admission import check_work_cost
from app.costs import forward_macs, model_shape
from app.deps import RuntimeDep, adapter_for
from app.errors import field_error
from app.context import RequestContext
from app.lifecycle import ParsedJsonRoute, check_cancelled
from app.lm_inputs import prompt_ids
from app.patch_sources import request_sources
from app.schemas import Interventions, NonNegInt, _Strict
from app.streams import respond
from models.adapters.base import RequestFieldError
from models.adapters.causal_lm import CausalLMAdapter
from models.head_ops import head_run
from models.qk_attribution import check_pre_norm, qk_attribution, refuse_residual_patches

router = APIRouter(prefix="/api/text", tags=["analysis"], route_class=ParsedJsonRoute)


class QKAttributionRequest(_Strict):
    """One score of one head, split over query-side × key-side parts of the residual stream (see /guide)."""

    model: str = "smollm2-135m"
    text: str | None = Field(None, min_length=1, description="the input; null when `ids` gives it")
    chat: bool = Field(False, description="the text as a user turn of the model's chat template (as the attention view)")
    layer: NonNegInt = Field(description="the layer of the head")
    head: NonNegInt = Field(description="the query head")
    query: NonNegInt = Field(description="the query position i")
    key: NonNegInt = Field(description="the key position j (≤ i: decoders are causal)")
    interventions: Interventions = Field(default_factory=list)
    ids: list[NonNegInt] | None = Field(None, description="the input as token ids instead of `text` (a continuation's "
                                        "prompt + generated ids, which text may not tokenize back to); null: `text`")
    expand: int = Field(3, ge=0, le=16, description="how many key-side head parts (largest |total| first) to split "
                        "by the source positions their head attended to from j")

    @model_validator(mode="after")
    def _an_input(self) -> "QKAttributionRequest":
        if self.text is None and self.ids is None:
            raise ValueError("text or ids: give the input as `text`, or as token `ids` instead")
        return self


def _prompt_ids(runtime, adapter: CausalLMAdapter, req: QKAttributionRequest):
    """The prompt's ids (1, T), as the attention view tokenizes it (with `chat`, the model's template), or `ids`."""
    if req.ids is not None:
        vocab = adapter.model.get_input_embeddings().num_embeddings
        limit = runtime.settings.analysis_max_tokens
        if not req.ids or len(req.ids) > limit or max(req.ids) >= vocab:
            raise field_error(("ids",), f"ids: 1 to {limit} token ids (analysis_max_tokens), each below the "
                              f"vocabulary's {vocab}")
        return torch.tensor([req.ids])
    if not req.chat:
        return prompt_ids(runtime, adapter, "text", req.text)
    try:
        ids = adapter.prompt_ids(req.text, chat=True)
    except ValueError as exc:  # no chat template
        raise field_error(("chat",), str(exc)) from None
    limit = runtime.settings.analysis_max_tokens
    if len(ids) > limit:
        raise field_error(("text",), f"text has {len(ids)} tokens; the limit is {limit} (analysis_max_tokens)")
    return torch.tensor([ids])


def _parts(layer: int, heads: int) -> int:
    """Parts on one side: the embedding, every earlier head and MLP, the bias and a perturbation."""
    return 1 + layer * (heads + 1) + 2


@router.post("/qk_attribution", responses={
    422: {"description": "a field is wrong: indices out of range, key after query, a post-norm model (`model`)"},
    503: {"description": "queue full"}})
def qk_attribution_route(req: QKAttributionRequest, request: Request, runtime: RuntimeDep) -> Response:
    """Why head `head` of layer `layer` attends from `query` to `key`: the score β·Ŝ_ij split exactly over
    (query part × key part), where the parts are the embedding, each earlier head through its slice of W_O, each
    earlier MLP and the biases, with every norm frozen at its actual scale. `matrix` sums to `score`, which equals
    β × the run's own `scores` at (i, j) (a window with include_scores). `expanded` splits the largest key-side head
    parts by the source positions that head attended to. Pre-norm decoders only; a post-norm model is a 422."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    try:
        check_pre_norm(adapter.model, adapter.layer_of)
    except RequestFieldError as exc:
        raise field_error((exc.field,), f"model {adapter.info.id}: {exc}") from None
    if not isinstance(adapter, CausalLMAdapter):
        raise field_error(("model",), f"model {adapter.info.id} is not a decoder language model: query–key "
                          "attribution is offered for pre-norm decoders (Llama, Qwen2, Gemma 2/3, GPT-2)")
    ids = _prompt_ids(runtime, adapter, req)
    n_tokens, info = ids.shape[1], adapter.info
    for name, value, size, what in (("layer", req.layer, info.layers, "layers"), ("head", req.head, info.heads, "heads"),
                                    ("query", req.query, n_tokens, "tokens"), ("key", req.key, n_tokens, "tokens")):
        if value >= size:
            raise field_error((name,), f"{name} {value} out of range: this model/input has {size} {what} (0..{size - 1})")
    if req.key > req.query:
        raise field_error(("key",), f"key {req.key} is after query {req.query}: a decoder's query sees only keys ≤ it")
    sources = request_sources(runtime, adapter, req.interventions)
    with head_run(sources):
        interventions = engine_interventions(req, adapter, n_tokens)
    try:
        refuse_residual_patches(interventions, req.layer, {req.query, req.key})
    except RequestFieldError as exc:
        raise field_error((exc.field,), str(exc)) from None
    parts = _parts(req.layer, info.heads)
    check_response_numbers(runtime.settings, parts * parts, {"layer": req.layer + 1},
                           "ask for an earlier layer")

    def work(ctx: RequestContext) -> dict[str, Any]:
        seconds = check_work_cost(adapter, runtime, forward_macs(model_shape(adapter), n_tokens, n_tokens,
                                                                          len(interventions)), 1, "text",
                                  "the attribution", ctx)
        with head_run(sources):
            check_cancelled(ctx)
            with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):
                try:
                    result = qk_attribution(adapter, ids, req.layer, req.head, req.query, req.key, interventions,
                                            req.expand)
                except RequestFieldError as exc:
                    raise field_error((exc.field,), f"model {info.id}: {exc}") from None
        tokens = [adapter.token_text(int(i)) for i in ids[0]]
        body = {"model": info.id, "tokens": tokens, "layer": req.layer, "head": req.head, "query": req.query,
                "key": req.key, **result.to_dict()}
        for entry in body["expanded"]:
            for source in entry["sources"]:
                source["token"] = tokens[source["position"]]
        return body

    return respond(request, work, "POST /api/text/qk_attribution")
