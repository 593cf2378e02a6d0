"""A text attention request, from its body to its answer (POST /api/text/attention and POST /api/text/export.html):
the settings' limits and the fields its model takes checked, the input encoded (kept in the runtime's cache), the job
built (app/pipeline/job.py), and the work that answers it (app/pipeline/views.py answer). Both routes call this;
neither calls the other."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.attention import check_request_limits
from app.context import RequestContext, current
from app.deps import adapter_for
from app.errors import field_error
from app.patch_sources import refuse_for_seq2seq
from app.pipeline.job import PageInput, build_job
from app.pipeline.views import answer, text_fields
from app.runtime import Runtime
from app.schemas import GenerateRequest, TextAttentionRequest
from models.adapters.base import AttentionAdapter, Encoded, RequestFieldError


def text_work(runtime: Runtime, req: TextAttentionRequest) -> Callable[[RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field); calling the result with the request's
    context (a plain request's, or its job's: app/streams.py respond) runs the work and gives the response dict."""
    check_request_limits(runtime.settings, req)  # the settings' limits, as on every route: before any model work
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    adapter = adapter_for(runtime, req.model, "text")
    ctx = current()  # the edge, after a first use's load gave its time back to the deadline (Runtime.adapter)
    refuse_fields(req, adapter.info.output)
    encoded = encode_text(runtime, adapter, req, ctx)
    # the request checked once, before any work, by the job its model's family names (app/pipeline/job.py): attention
    # per kind for an encoder–decoder; else with the patch_heads sources in reach and value norms kept by every run
    job = build_job(runtime, adapter, encoded, req, PageInput(fields=text_fields))
    return lambda work_ctx: with_input_tokens(answer(job, work_ctx), adapter, encoded, req)


def refuse_fields(req: TextAttentionRequest, output: str) -> None:
    """Fields that only some kinds of model take: 422 naming the field for the others."""
    allowed = {"text_pair": ("similarity", "mlm", "embedding"), "position": ("next_token",), "target": ("seq2seq",)}
    for name, outputs in allowed.items():
        if getattr(req, name) is not None and output not in outputs:
            raise field_error((name,), f"{name} is not used by a model whose output is {output!r}")
    if req.chat and output != "next_token":
        raise field_error(("chat",), f"chat is for decoder language models, not a model whose output is {output!r}")
    if output == "seq2seq":
        refuse_for_seq2seq(req)  # before encoding, which may generate the model's own target


def with_input_tokens(response: dict, adapter: AttentionAdapter, encoded, req: TextAttentionRequest) -> dict:
    """A truncated input says how many tokens it had (`input_tokens`), so the page can say how many were dropped."""
    if encoded.truncated:
        response["input_tokens"] = adapter.untruncated_tokens(req)
    return response


def encode_text(runtime: Runtime, adapter: AttentionAdapter, req: TextAttentionRequest | GenerateRequest,
                ctx: RequestContext | None = None) -> Encoded:
    """The request's input as its model encodes it (adapter.encode_request), kept in the runtime's cache of encoded
    inputs (the request `ctx`'s cache scope; None: the current context's); a field the model cannot take (a position
    past the input, chat without a template) is a 422 naming it."""
    try:
        return adapter.encode_request(req, lambda key, encode: runtime.encode(adapter, key, encode, ctx))
    except RequestFieldError as exc:
        raise field_error((exc.field,), str(exc)) from None
