"""Text attention: POST /api/text/attention (encoders, decoder LMs, encoder–decoders) and POST /api/text/generate."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from app.pipeline.text import encode_text, text_work
from app.attention import check_request_limits
from app.interventions import engine_interventions
from app.errors import field_error
from app.admission import check_stream_cost
from app.costs import observe_run, observe_step
from app.deps import RuntimeDep, adapter_for
from app.lifecycle import ParsedJsonRoute, check_cancelled
from app.patch_sources import refuse_for_generate
from app.streams import JobStream, respond, run_job
from app.runtime import Runtime
from app.schemas import AttentionResponse, GenerateRequest, TextAttentionRequest
from models.adapters.causal_lm import CausalLMAdapter
from models.step_rows import RowRequest
from app.encoding import tensor_field

router = APIRouter(prefix="/api/text", tags=["text"], route_class=ParsedJsonRoute)
_WHAT = "POST /api/text/attention"


@router.post("/attention", responses={200: {"model": AttentionResponse}, 413: {"description": "response over the size cap"}, 503: {"description": "queue full"}})
def text_attention(req: TextAttentionRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Attention of every requested layer/head for a sentence (and optional second sentence).

    Interventions (see /guide#s2, /guide#s3, /guide#s4) are applied in order; with `compare` the same input is also run without
    them and `effect` holds the attention TV distance, hidden-state cosine per layer and the output change.
    Decoder LMs (output `next_token`, /guide#s9) also take `position` and `chat` and answer the next-token
    distribution; encoder–decoders (output `seq2seq`) take a `target` and answer attention per kind.
    With `Accept: text/event-stream` it streams `{"progress", "total", "run"}` after each attention layer, then
    `{"done": true, …this response…}`; closing the connection stops the work at the next layer.
    """
    # every check before any work (app/pipeline/text.py); with Accept: text/event-stream a job: accepted with its
    # ETA, layer progress, then this response (app/streams.py)
    return respond(request, text_work(runtime, req), _WHAT)


@router.post(
    "/generate",
    responses={200: {"content": {"text/event-stream": {}}, "description": "one event per new token, then a done event"},
               503: {"description": "queue full"}},
)
def generate(req: GenerateRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Greedy continuations of a decoder LM's prompt, with the interventions active at every step and without
    them, streamed as server-sent events (see /guide#s9): a job (docs/api.md "Jobs"), so first `{"accepted": true,
    "eta_s", "queue_position", "runs"}`, then `{"step", "token", "id", "prob", "ended", "base_token", "base_id",
    "base_prob", "base_ended"}` per new token, every key in every event (once a side has ended its `ended` is true and
    its other fields are null), then `{"done": true, "text", "base_text"}`. Streams run one at a time in the jobs'
    order: from its first step a stream keeps the model until it ends (interactive work still goes between its
    steps), and generate_timeout_s counts from that first step. Closing the connection stops the generation after the step in progress.
    """
    check_request_limits(runtime.settings, req)  # max_text_chars, max_new_tokens, max_interventions: as on every route
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    adapter = adapter_for(runtime, req.model, "text")
    if not isinstance(adapter, CausalLMAdapter):
        raise field_error(("model",), f"model {req.model} is not a decoder language model (output {adapter.info.output!r})")
    encoded = encode_text(runtime, adapter, req)
    interventions = engine_interventions(req, adapter, len(encoded.tokens))
    refuse_for_generate(req)  # mean ablation needs every position at once
    prompt = encoded.inputs["input_ids"][0].tolist()
    rows = _row_request(req, adapter)

    def work(stream: JobStream) -> dict:
        # 413 before the stream starts when its model time would exceed generate_timeout_s (app/costs.py); accepted
        check_stream_cost(adapter, runtime, len(prompt), req.max_new_tokens, len(interventions))
        # its steps one after another, no other job's turn between them (app/scheduler.py): streams run one at a
        # time, each as fast as its ETA assumed, instead of all at a fraction of it until generate_timeout_s
        with runtime.scheduler.keeping_turn():
            return _continue(runtime, adapter, prompt, interventions, req.max_new_tokens, stream, rows,
                             req.attention.encoding if req.attention is not None else "json")

    return run_job(request, work, "POST /api/text/generate", layer_progress=False)


def _row_request(req: GenerateRequest, adapter: CausalLMAdapter) -> RowRequest | None:
    """The request's `attention` checked against the model: 422 naming attention.layers, .heads or .top_k."""
    if req.attention is None:
        return None
    asked = req.attention
    rows = RowRequest(layers=None if asked.layers is None else tuple(asked.layers),
                      heads=None if asked.heads is None else tuple(asked.heads), top_k=asked.top_k)
    try:
        rows.check(adapter.info.layers, adapter.info.heads)
    except ValueError as exc:
        field = str(exc).split(":")[0].split(".")[-1]
        raise field_error(("attention", field), str(exc)) from None
    return rows


def _row_fields(attention: dict | None, encoding: str) -> object:
    """A step's rows as sent: (l, h, T_k) as JSON numbers or base64, or with top_k [l][h] {"indices", "values", "lse"}."""
    if attention is None:
        return None
    if "rows" in attention:
        return tensor_field(attention["rows"], encoding)
    indices, values, lse = (attention[k].cpu().numpy() for k in ("indices", "values", "lse"))
    return [[{"indices": indices[l, h], "values": values[l, h], "lse": float(lse[l, h])}
             for h in range(indices.shape[1])] for l in range(indices.shape[0])]


def _keep_runs(runtime: Runtime, adapter: CausalLMAdapter, prompt: list[int], ids: dict[str, list[int]],
               interventions) -> dict:
    """Each side's finished sequence (prompt + its continuation) named as a kept run, `run_id` with the interventions
    and `base_run_id` without (one run when there are none: the same sequence), without running it now: the decode
    has just done the model's work, and most continuations are never looked into. The run is made on first use of
    its id by one forward of the finished sequence through the runtime's own run path (Runtime.promise_run), so its
    windows are exactly those of an attention request on these ids."""
    names = {"run_id": runtime.promise_run(adapter, adapter.encode_ids(prompt + ids[""]), interventions)}
    names["base_run_id"] = (names["run_id"] if not interventions
                            else runtime.promise_run(adapter, adapter.encode_ids(prompt + ids["base_"]), ()))
    return names


def _side_fields(prefix: str, new, rows: RowRequest | None, encoding: str) -> dict:
    """One side's fields of a step event: once a side has ended, `ended` true and its other fields null."""
    ended = new is None
    fields = {f"{prefix}token": None if ended else new.token, f"{prefix}id": None if ended else new.id,
              f"{prefix}prob": None if ended else new.prob, f"{prefix}ended": ended}
    if rows is not None:
        fields[f"{prefix}attention"] = None if ended else _row_fields(new.attention, encoding)
    return fields


def _continue(runtime: Runtime, adapter: CausalLMAdapter, prompt: list[int], interventions, max_new_tokens: int,
              stream: JobStream, rows: RowRequest | None = None, encoding: str = "json") -> dict:
    """Both continuations step by step; each step takes the model lock on its own as a job's turn (the caller keeps
    the turn between them: app/scheduler.py keeping_turn), so interactive requests interleave. With `rows`, each step event carries the asked attention rows of both sides.
    Without interventions both sides are the same sequence: it is decoded once and sent as both."""
    sides = {"": adapter.continuation(prompt, interventions, max_new_tokens, rows=rows)}
    if interventions:
        sides["base_"] = adapter.continuation(prompt, (), max_new_tokens, rows=rows)
    ids: dict[str, list[int]] = {prefix: [] for prefix in sides}
    budget_s = runtime.settings.generate_timeout_s
    # the whole stream's budget, from its first turn: its wait behind the jobs ahead is theirs (job_timeout_s bounds
    # it, and the stream was accepted only if it fits there: app/jobs.py JobBoard.accept)
    deadline: float | None = None
    for step in range(max_new_tokens):
        event: dict = {"step": step}
        for prefix in ids:  # one shape every step: a side that has ended says so, its fields null
            new = None
            if prefix in sides:
                check_cancelled()  # before each side's forward: a client that left costs at most one more
                if deadline is not None and time.monotonic() > deadline:
                    return _over_budget(step, budget_s)
                # a job's turns (a started job's: before every waiting job; interactive work still goes first)
                with runtime.step(len(prompt) if step == 0 else 1, interactive=False):
                    deadline = deadline or time.monotonic() + budget_s
                    started = time.perf_counter()
                    new = next(sides[prefix], None)
                    if step == 0:  # the prompt's forward: its real speed feeds the cost estimate (app/costs.py);
                        # one-token steps are mostly per-call overhead and would skew a full forward's estimate
                        observe_run(runtime.measures, adapter, len(prompt), len(prompt), len(interventions) if prefix == "" else 0,
                                    time.perf_counter() - started)
                    else:  # a one-token step: its real seconds estimate the next streams' steps (app/costs.py)
                        observe_step(runtime.measures, adapter, time.perf_counter() - started)
                if new is None:
                    del sides[prefix]
                else:
                    ids[prefix].append(new.id)
            event.update(_side_fields(prefix, new, rows, encoding))
        if not interventions:  # the base side is the same sequence: the same fields (the rows encoded once)
            event.update({f"base_{name}": value for name, value in list(event.items()) if name != "step"})
        if not sides:
            break
        stream.emit(event)
    ids.setdefault("base_", ids[""])
    return {"text": adapter.decode(ids[""]), "base_text": adapter.decode(ids["base_"]), "prompt_tokens": len(prompt),
            "prompt_ids": prompt,
            **_keep_runs(runtime, adapter, prompt, ids, interventions)}


def _over_budget(step: int, budget_s: float) -> dict:
    return {"error": f"the stream ran past generate_timeout_s={budget_s:g} s after {step} steps and was ended; "
                     "ask for fewer tokens or interventions, or a shorter prompt", "setting": "generate_timeout_s"}


# ---- POST /api/text/tokenize --------------------------------------------------------------------------------------
# The analysis panels' answer boxes show which token an answer will be ("␣Paris · id 7042"): "Anna" and " Anna" are
# different tokens, and a prompt that ends without a space is followed by the spaced one.
from pydantic import BaseModel as _BaseModel, ConfigDict as _ConfigDict, Field as _Field  # noqa: E402


class TokenizeRequest(_BaseModel):
    model_config = _ConfigDict(extra="forbid", strict=True)
    model: str = "smollm2-135m"
    text: str = _Field(min_length=1, max_length=200, description="a short text, e.g. an answer token ' Paris'")


@router.post("/tokenize")
def tokenize(req: TokenizeRequest, runtime: RuntimeDep) -> dict:
    """The tokens and ids of a short text, without special tokens: `{"tokens", "ids"}`; a text that does not start
    with white space also names its variant with a leading space, `with_space: {"text", "tokens", "ids"}`."""
    adapter = adapter_for(runtime, req.model, "text")
    tokenizer = getattr(adapter, "tokenizer", None)
    if tokenizer is None:
        raise field_error(("model",), f"model {req.model} has no text tokenizer to ask")

    def pieces(text: str) -> dict:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        return {"text": text, "tokens": [tokenizer.decode([i]) for i in ids], "ids": ids}

    out = pieces(req.text)
    if not req.text[:1].isspace():
        out["with_space"] = pieces(" " + req.text)
    return out
