"""The work of POST /api/text/head_scores (app/routes/heads.py; docs/api.md "Head kinds", docs/science.md "Head
kinds"): the request checked, then a job whose every score is taken from the lab's own runs (runtime.run: the fair
model lock, the result cache, the same P the page shows) on the seeded built-in probes of models/head_kinds.py, or on
the user's text. Answers are kept per (client scope, model, text) in a small bounded cache, one per app."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field

from app.attention import check_request_limits
from app.errors import field_error
from app.admission import check_work_cost
from app.costs import forward_macs, model_shape
from app.context import RequestContext, current
from app.lifecycle import check_cancelled
from app.lm_inputs import language_model
from app.runtime import PerRuntime, Runtime
from app.schemas import _Strict
from models.adapters.base import Encoded
from models.adapters.causal_lm import CausalLMAdapter
from models.head_kinds import ProbeSettings, head_taxonomy, locality, ordinary_token_ids
from models.lru import BoundedLRU
from models.step_rows import RowRequest

_ANSWERS_KEPT = 16  # answers are a few hundred numbers each: a count bound is enough


class HeadScoresRequest(_Strict):
    """Each head's kind scores (previous-token, induction, duplicate-token, sink, retrieval, mean distance) and label."""

    model: str = "smollm2-135m"
    text: str | None = Field(None, description="null: the seeded built-in probes; a text: every score on that input")


_answers = PerRuntime(lambda _runtime: BoundedLRU(_ANSWERS_KEPT))  # per app, like the result cache


def head_scores_work(runtime: Runtime, req: HeadScoresRequest) -> Callable[[Callable, RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field); the result is the job app/streams.py
    respond_steps runs with its progress callback and context, one progress step per probe."""
    check_request_limits(runtime.settings, req)  # max_text_chars on `text`, before any model work
    if req.text is not None and not req.text.strip():
        raise field_error(("text",), "text is empty or only white space (send null for the built-in probes)")
    adapter = language_model(runtime, req.model)
    info = adapter.info
    limit = min(adapter.full_map_tokens, adapter.max_tokens)  # scores need every P, kept whole only up to here
    text_ids = None
    if req.text is not None:
        text_ids = adapter.prompt_ids(req.text)
        if len(text_ids) > limit:
            raise field_error(("text",), f"text has {len(text_ids):,} tokens; head scores take at most {limit:,} "
                              "(full_map_tokens or the model's max_tokens)")
        if len(text_ids) < 2:
            raise field_error(("text",), "text must have at least 2 tokens")
    vocab = adapter.model.get_input_embeddings().num_embeddings
    candidates = ordinary_token_ids(vocab, adapter.tokenizer.all_special_ids)
    settings = ProbeSettings().fitted(len(candidates), limit)
    # the forwards made: the text, or the repeated tokens and each fact's prompt (about filler + 32 tokens), and their
    # few one-token generation steps over a KV cache, all of them counted as one more prompt's worth
    lengths = ([len(text_ids)] if text_ids is not None else
               [1 + 2 * settings.period] + [32 + settings.filler] * (settings.needles + 1))
    first_id = _first_token(adapter)
    key = (current().cache_scope, info.id, req.text)

    def job(progress, ctx: RequestContext) -> dict[str, Any]:
        cached = _answers(runtime).get(key)
        if cached is not None:
            return cached
        shape = model_shape(adapter)
        turn = ctx.turns(check_work_cost(adapter, runtime, sum(forward_macs(shape, n, n) for n in lengths),
                                         len(lengths), "text" if text_ids is not None else "model",
                                         "the head taxonomy", ctx))

        def run(ids: list[int]) -> torch.Tensor:
            check_cancelled(ctx)
            return runtime.run(adapter, _encoded(adapter, ids), (), False, turn()).kept_attention  # (L, H, T, T)

        def generate(ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
            """The plain greedy continuation and each step's top-attended key of every head: (S, L, H)."""
            check_cancelled(ctx)
            generated, top_keys = [], []
            with runtime.admitted(ctx=turn()):
                for new in adapter.continuation(ids, (), steps, rows=RowRequest(top_k=1)):
                    generated.append(new.id)
                    top_keys.append(new.attention["indices"][..., 0].cpu())  # (L, H)
            return generated, torch.stack(top_keys)

        def encode(text: str) -> list[int]:
            return adapter.tokenizer(text, add_special_tokens=False)["input_ids"]

        found = head_taxonomy(run, candidates, first_id, settings, text_ids, progress, generate, encode)
        answer = {
            "model": info.id, "layers": info.layers, "heads": info.heads,
            "scores": {name: None if value is None else _rounded(value) for name, value in found["scores"].items()},
            "labels": found["labels"], "locality": locality(info.layer_types, info.heads),
            "sliding_window": info.sliding_window, "probe": found["probe"],
            **({"retrieval_heads": found["retrieval_heads"]} if "retrieval_heads" in found else {}),
        }
        return _answers(runtime).put(key, answer)

    return job


def _first_token(adapter: CausalLMAdapter) -> int:
    """The probe's first token: the tokenizer's BOS, else the first id it puts before any text, else its EOS."""
    tokenizer = adapter.tokenizer
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    leading = adapter.prompt_ids("")
    return int(leading[0]) if leading else int(tokenizer.eos_token_id)


def _encoded(adapter: CausalLMAdapter, ids: list[int]) -> Encoded:
    """Token ids as the adapter's own input (the same run a prompt of those tokens gets), cached by its ids."""
    input_ids = torch.tensor([ids])  # (1, T)
    return Encoded(key=("head_probe", tuple(ids)), tokens=[adapter.token_text(i) for i in ids],
                   inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                   extra={"position": len(ids) - 1})


def _rounded(values: torch.Tensor) -> list[list[float]]:
    return [[round(float(v), 6) for v in row] for row in values.cpu()]
