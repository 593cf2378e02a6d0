"""Text attention: POST /api/text/attention."""
from __future__ import annotations

from fastapi import APIRouter, Response

from app.attention import build_attention_response, fast_json, field_error
from app.deps import RuntimeDep
from app.runtime import UnknownModel
from app.schemas import AttentionResponse, TextAttentionRequest
from models.adapters.base import AttentionResult
from models.summaries import mean_token_distance

router = APIRouter(prefix="/api/text", tags=["text"])


@router.post("/attention", responses={200: {"model": AttentionResponse}, 413: {"description": "response over the size cap"}, 503: {"description": "queue full"}})
def text_attention(req: TextAttentionRequest, runtime: RuntimeDep) -> Response:
    """Attention of every requested layer/head for a sentence (and optional second sentence).

    Interventions (see /guide#s2, /guide#s3, /guide#s4) are applied in order; with `compare` the same input is also run without
    them and `effect` holds the attention TV distance, hidden-state cosine per layer and the output change.
    """
    limit = runtime.settings.max_text_chars
    if len(req.text) > limit:
        raise field_error(("text",), f"text has {len(req.text):,} characters; the limit is {limit:,} (max_text_chars)")
    if req.text_pair is not None and len(req.text_pair) > limit:
        raise field_error(("text_pair",), f"text_pair has {len(req.text_pair):,} characters; the limit is {limit:,}")
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    try:
        adapter = runtime.adapter(req.model, kind="text")
    except UnknownModel as exc:
        raise field_error(("model",), str(exc.args[0])) from None
    encoded = runtime.encode(
        adapter, ("text", req.text, req.text_pair), lambda: adapter.encode(req.text, req.text_pair)
    )
    return fast_json(build_attention_response(runtime, adapter, encoded, req, text_fields))


def text_fields(result: AttentionResult) -> dict:
    """Text-only summaries: mean attention distance in tokens for every head (docs/science.md §6)."""
    return {"mean_distance": result.summary("mean_distance", lambda: mean_token_distance(result.attention).tolist())}
