"""Costs known before the work starts: a request's model time (refused with 413 when it could not finish within
its time limit) and the memory budget's split into cache sizes. Pure arithmetic, no web imports but the 413.

**Model time.** One forward over T query tokens and T_k keys on a model with P parameters, L layers and H heads
of size d costs about

    P·T  +  2·L·H·T·T_k·d  +  4·n·L·H·T_k·(T + d)        multiply-adds

(every weight once per token; QKᵀ and PV per head; n interventions each touching every score and every key
vector once — a perturbation draws d noise values per key, at every decoding step too — counted four times:
elementwise work and random numbers are memory-bound). A long text first view with `weighting: "value_norm"` also
builds its value-weighted overview (models/attribution.value_weighted_overview): every score of every head rebuilt
from q̂/k̂ and passed through softmax, weighting, renormalising and pooling, counted as VALUE_OVERVIEW_WEIGHT·L·H·T·T_k·d
(`value_overview_macs`). A request runs `runs` such forwards (1, or 1 + samples with
`compare`: the base and every sample). Its seconds are that total over the model's throughput: measured from
the model's own runs (`THROUGHPUT`, runs of at least MIN_TIMED_S only: tiny runs are all overhead), else the
`compute_gmacs_per_s` setting. A request estimated over `request_timeout_s` would only be admitted to time
out after minutes of work (and gigabytes of recorded maps): it is answered 413 before it starts.

**Memory.** `cache_budgets(settings)` splits `memory_budget_bytes`: the models and torch
(`memory_reserved_bytes`), one run's recorded maps in flight (`max_run_bytes`: runs take turns),
`max_concurrent_decodes` decodes of `max_image_pixels` at DECODE_BYTES_PER_PIXEL each, and what is left to the
result cache (3/4) and the decoded-image cache (1/4).
"""
from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass

from fastapi import HTTPException

# The model seconds this request's cost check estimated (set by check_request_cost). The runtime compares it with the
# time left before the request's deadline when the request first gets the model: a request that waited in the queue
# so long that its work could no longer finish is refused then (503), rather than started and thrown away at the
# deadline.
request_model_seconds: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_model_seconds",
                                                                                    default=None)

# The passes over the model's layers this request's cost check counted: the model runs the result cache does not hold,
# and one more for a value-weighted overview (it goes layer by layer too). A progress stream (app/progress.py) shows
# one bar over all of them: passes × layers.
request_model_runs: contextvars.ContextVar[int | None] = contextvars.ContextVar("request_model_runs", default=None)

# Work a request does besides its forwards, not yet counted: (field, what, multiply-adds, passes over the layers it
# reports as progress), set by the route before the response is built (the value-weighted overview of a long first
# view). check_request_cost counts it with the runs; when every run is cached, check_extra_cost counts it alone just
# before the work.
request_extra_work: contextvars.ContextVar[tuple[str, str, float, int] | None] = contextvars.ContextVar(
    "request_extra_work", default=None)

# The value-weighted overview per score, in units of the head size d. Measured: at 2,048 tokens on smollm2-135m it
# took 0.83× the long first run itself (benchmarks/results/value_norms_cpu.json), 0.83·forward_macs / (L·H·T²·d) ≈ 4.8:
# the product q̂·k̂ once, then several float32 passes over every score that run far below the matmul rate.
VALUE_OVERVIEW_WEIGHT = 5.0
MIN_TIMED_S = 0.2  # runs shorter than this do not update a model's measured throughput
INTERVENTION_WEIGHT = 4  # elementwise work per score per intervention, in multiply-add equivalents
# A decode's peak: the decoded bitmap (≤ 4 B/px: RGBA, CMYK, 32-bit gray) + its RGB copy (3 B/px) + a stripe.
DECODE_BYTES_PER_PIXEL = 8
MIN_CACHE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    heads: int
    head_dim: int


def forward_macs(shape: ModelShape, queries: int, keys: int, interventions: int = 0) -> float:
    """Multiply-adds of one forward over `queries` new tokens attending to `keys` tokens (see the module doc)."""
    scores = shape.layers * shape.heads * queries * keys
    per_key = shape.layers * shape.heads * keys * (queries + shape.head_dim)  # scores + key vectors touched
    return shape.params * queries + 2 * scores * shape.head_dim + INTERVENTION_WEIGHT * interventions * per_key


def request_runs(samples: int, compare: bool) -> int:
    """Forwards of an attention request: the run, and with `compare` the base and each further sample."""
    return 1 + samples if compare else 1


def value_overview_macs(shape: ModelShape, queries: int, keys: int, layers: int | None = None) -> float:
    """The value-weighted overview of a long run over `layers` (default all of the shape's; see the module doc)."""
    layers = shape.layers if layers is None else layers
    return VALUE_OVERVIEW_WEIGHT * layers * shape.heads * queries * keys * shape.head_dim


def stream_macs(shape: ModelShape, prompt: int, new_tokens: int, interventions: int) -> float:
    """A generate stream: two sides (with and without the interventions), the prompt first, then one token a
    step attending to everything before it (the key/value cache keeps the rest)."""
    with_iv = forward_macs(shape, prompt, prompt, interventions)
    base = forward_macs(shape, prompt, prompt, 0)
    for step in range(1, new_tokens):
        keys = prompt + step
        with_iv += forward_macs(shape, 1, keys, interventions)
        base += forward_macs(shape, 1, keys, 0)
    return with_iv + base


class Throughput:
    """Measured multiply-adds per second of each model (an exponential average over its timed runs)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, model_id: str, macs: float, seconds: float) -> None:
        if seconds < MIN_TIMED_S or macs <= 0:
            return
        rate = macs / seconds
        with self._lock:
            old = self._rates.get(model_id)
            self._rates[model_id] = rate if old is None else 0.7 * old + 0.3 * rate

    def rate(self, model_id: str, default: float) -> float:
        with self._lock:
            return self._rates.get(model_id, default)

    def clear(self) -> None:
        with self._lock:
            self._rates.clear()


THROUGHPUT = Throughput()
_shapes: dict[int, ModelShape] = {}


def model_shape(adapter) -> ModelShape:
    """Parameters, layers, heads and head size of an adapter's model (parameters counted once per adapter)."""
    shape = _shapes.get(id(adapter))
    if shape is None:
        model = getattr(adapter, "model", None)
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        info = adapter.info
        layers = info.layers + (info.decoder_layers or 0)
        shape = _shapes[id(adapter)] = ModelShape(params, layers, info.heads, info.head_dim)
    return shape


def estimated_seconds(adapter, settings, macs: float) -> float:
    rate = THROUGHPUT.rate(adapter.info.id, settings.compute_gmacs_per_s * 1e9)
    return macs / rate


def check_request_cost(adapter, settings, tokens: int, runs: int, interventions: int, keys: int | None = None,
                       field: str = "samples") -> None:
    """413 before any work when `runs` forwards over `tokens` would not finish within request_timeout_s."""
    shape = model_shape(adapter)
    macs = runs * forward_macs(shape, tokens, keys or tokens, interventions)
    # work a family does besides its forwards, once per request (a long image's rollout: models/adapters/vit.py)
    macs += getattr(adapter, "summary_macs", lambda n: 0.0)(tokens)
    extra = request_extra_work.get()
    if extra is not None:  # counted here, with the runs, once
        macs += extra[2]
        request_extra_work.set(None)
    seconds = estimated_seconds(adapter, settings, macs)
    limit = settings.request_timeout_s
    request_model_seconds.set(seconds)
    request_model_runs.set(runs + (extra[3] if extra is not None else 0))
    if seconds > limit:
        raise HTTPException(413, detail=(
            f"{field}: this request needs {runs} model run{'s' if runs > 1 else ''} over {tokens:,} tokens"
            f"{f' with {interventions} interventions' if interventions else ''}"
            f"{f' and {extra[1]}' if extra is not None else ''}, about {seconds:,.0f} s of model "
            f"time on {adapter.info.id}, over request_timeout_s={limit:g} s; ask for fewer samples, a shorter input "
            f"or fewer interventions{f' (or {extra[0]} as before)' if extra is not None else ''}"))


def check_extra_cost(adapter, settings) -> None:
    """The request's extra work (request_extra_work) when check_request_cost did not count it (every run was in the
    result cache: a weighting switch after a long first view): 413 naming its field when it alone would not finish
    within request_timeout_s."""
    extra = request_extra_work.get()
    if extra is None:
        return
    request_extra_work.set(None)
    field, what, macs, passes = extra
    request_model_runs.set(max(1, passes))  # the request's passes over the layers: this work's only
    seconds = estimated_seconds(adapter, settings, macs)
    limit = settings.request_timeout_s
    if seconds > limit:
        raise HTTPException(413, detail=(
            f"{field}: {what} needs about {seconds:,.0f} s of model time on {adapter.info.id}, over "
            f"request_timeout_s={limit:g} s; use a shorter input"))


def check_stream_cost(adapter, settings, prompt: int, new_tokens: int, interventions: int) -> None:
    """413 before a generate stream that would not finish within generate_timeout_s."""
    seconds = estimated_seconds(adapter, settings, stream_macs(model_shape(adapter), prompt, new_tokens, interventions))
    limit = settings.generate_timeout_s
    if seconds > limit:
        raise HTTPException(413, detail=(
            f"max_new_tokens: {new_tokens} steps on a {prompt:,}-token prompt with {interventions} interventions "
            f"need about {seconds:,.0f} s of model time on {adapter.info.id}, over generate_timeout_s={limit:g} s; "
            "ask for fewer tokens, a shorter prompt or fewer interventions"))


def observe_run(adapter, tokens: int, keys: int, interventions: int, seconds: float) -> None:
    """Record a finished forward's time (runtime.run calls this)."""
    THROUGHPUT.observe(adapter.info.id, forward_macs(model_shape(adapter), tokens, keys, interventions), seconds)


def cache_budgets(settings) -> tuple[int, int]:
    """(result_cache_bytes, image_cache_bytes) from memory_budget_bytes (see the module doc)."""
    decodes = settings.max_concurrent_decodes * settings.max_image_pixels * DECODE_BYTES_PER_PIXEL
    free = settings.memory_budget_bytes - settings.memory_reserved_bytes - settings.max_run_bytes - decodes
    free = max(free, 2 * MIN_CACHE_BYTES)
    return int(free * 3 // 4), int(free // 4)
