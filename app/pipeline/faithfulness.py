"""The work of POST /api/text/faithfulness (app/routes/analysis.py): the request checked (the settings' limits, an
encoder or a decoder LM, the text's token count against analysis_max_tokens, position, layer, head, answer), then
the work that ranks the query row's keys by each method and masks each method's top-k keys (models/faithfulness.py),
one turn of the model lock."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.admission import check_work_cost
from app.attention import check_request_limits
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.deps import adapter_for
from app.errors import field_error
from app.lifecycle import check_cancelled
from app.lm_inputs import one_token
from app.runtime import Runtime
from app.schemas import FaithfulnessRequest
from models.adapters.causal_lm import CausalLMAdapter
from models.adapters.seq2seq import Seq2SeqAdapter
from models.faithfulness import faithfulness


def faithfulness_work(runtime: Runtime, req: FaithfulnessRequest) -> Callable[[RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field); the result is the work app/streams.py
    respond runs with the request's context."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    if isinstance(adapter, Seq2SeqAdapter):
        raise field_error(("model",), "the faithfulness check is offered for encoders and decoder LMs")
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    encoded = adapter.encode(req.text)
    n_tokens = len(encoded.tokens)
    position = _check_places(runtime, adapter, req, n_tokens)
    answer = None
    if req.answer is not None:
        if not isinstance(adapter, CausalLMAdapter):
            raise field_error(("answer",), "answer is for decoder language models")
        answer = one_token(adapter, "answer", req.answer)
    ks, methods = list(dict.fromkeys(req.k)), list(dict.fromkeys(req.methods))

    def work(ctx: RequestContext) -> dict[str, Any]:
        # a run to rank the keys (and a backward for grad × attention), then one masked run per method and k
        forwards = 3 + len(ks) * len(methods)
        seconds = check_work_cost(adapter, runtime, forwards * forward_macs(
            model_shape(adapter), n_tokens, n_tokens), 1, "k", f"{forwards} forwards of the faithfulness check", ctx)
        check_cancelled(ctx)
        with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):
            result = faithfulness(adapter, encoded, position, ks, methods, answer, req.layer, req.head)
        return {"model": adapter.info.id, "tokens": encoded.tokens, "position": position, **result}
    return work


def _check_places(runtime: Runtime, adapter, req: FaithfulnessRequest, n_tokens: int) -> int:
    """The text's token count, `position`, `layer` and `head` against the model (422 naming the field); returns the
    query row (the last token when `position` is not given)."""
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
    return position
