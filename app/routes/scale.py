"""Positions and the scale, on the text page. POST /api/text/permutation_check: with positions off an encoder's maps
of a permuted input are the permuted maps (models/positions.py, docs/science.md "Positions off"). The scale's
statistics: POST /api/text/score_stats, the raw q·k of one head over its allowed pairs, the Gaussian
theory fitted with the head's own q and k, the rows' entropy at scale 1 and 1/√d, and the attention's parameter and
map counts (models/score_stats.py, docs/science.md "Why the scale is 1/√d"). The work: app/pipeline/scale.py.
"""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import Field

from app.deps import RuntimeDep
from app.lifecycle import ParsedJsonRoute
from app.pipeline.scale import permutation_check_work, score_stats_work
from app.schemas import NonNegInt, _Strict
from app.streams import respond
from models.score_stats import DEFAULT_BINS

router = APIRouter(prefix="/api/text", tags=["analysis"], route_class=ParsedJsonRoute)


class ScoreStatsRequest(_Strict):
    """One head's raw scores q·k and what the 1/√d scale does to them (see /guide)."""

    model: str = Field("minilm", max_length=200)
    text: str = Field(min_length=1)
    layer: NonNegInt = Field(description="the layer of the head")
    head: NonNegInt = Field(description="the query head")
    bins: int = Field(DEFAULT_BINS, ge=5, le=200, description="the histogram's bins")


@router.post("/score_stats", responses={
    422: {"description": "a field is wrong: layer or head out of range, too many tokens, a model without it"},
    503: {"description": "queue full"}})
def score_stats_route(req: ScoreStatsRequest, request: Request, runtime: RuntimeDep) -> Response:
    """The raw scores s_ij = q_i·k_j of head `head` at layer `layer` (before any scale, after RoPE) over every pair
    the model's mask allows: histogram, mean and variance; the theory for independent Gaussian entries fitted with
    the head's own q and k (`theory`, and `theory.pooled` for one μ, σ); the rows' softmax entropy in nats at scale
    1, 1/√d and the model's β₀; the attention's parameters by the textbook formula beside the real tensors
    (`counting`) and the N² attention weights of this input (`maps`). Encoders and decoder LMs."""
    return respond(request, score_stats_work(runtime, req), "POST /api/text/score_stats")


class PermutationCheckRequest(_Strict):
    """An encoder's maps of a permuted input against the permuted maps, with positions off and on (see /guide)."""

    model: str = Field("minilm", max_length=200)
    text: str = Field(min_length=1)
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the permutation of the tokens between [CLS] and [SEP]")


@router.post("/permutation_check", responses={
    422: {"description": "a field is wrong: not an encoder, too few or too many tokens"}, 503: {"description": "queue full"}})
def permutation_check_route(req: PermutationCheckRequest, request: Request, runtime: RuntimeDep) -> Response:
    """Permute the tokens of `text` (the first and last, [CLS] and [SEP], stay) and compare the maps of the permuted
    input with the permuted maps, max |P(πx) − Π P(x) Πᵀ| over every layer and head: with positions off (the
    `positions` intervention) they agree to float rounding, with positions on they do not. Encoders only (a
    decoder's causal mask is not permutation-symmetric); four runs of the model."""
    return respond(request, permutation_check_work(runtime, req), "POST /api/text/permutation_check")
