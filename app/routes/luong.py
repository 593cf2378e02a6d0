"""Luong attention beside a tiny Transformer (docs/science.md "Luong attention and a Transformer's cross-attention"):
the trained models, one input's alignment under the lab's interventions, and the page /luong.

The models are trained at setup into weights/luong/ (`attnlab prepare`, models/luong.py); the work is
models/luong_lab.py's. Routes are plain `def`: the threadpool runs the numerical work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Request
from fastapi.responses import HTMLResponse

from app.deps import SettingsDep
from app.errors import field_error
from app.lifecycle import ParsedJsonRoute
from app.schemas import LuongAttentionRequest
from app.settings import Settings
from app.templating import templates
from models import luong, luong_lab

router = APIRouter(tags=["luong"], route_class=ParsedJsonRoute)
EXAMPLES = {"masked_year": {
    "summary": "the dot score's model on a date with its year masked: alignment, output before/after, the Transformer's "
               "cross-attention",
    "value": {"score": "dot", "text": "the 3rd of March 2021", "beta": 1.0, "mask": [17, 18, 19, 20], "perturb": None}}}
NOT_READY = {503: {"description": "the Luong models are not trained on this server yet (`attnlab prepare --model luong`)"}}


def _folder(settings: Settings) -> Path:
    folder = Path(settings.weights_dir) / luong.FOLDER
    if not luong.prepared(folder):
        raise HTTPException(503, "the Luong models are not trained on this server yet: run `attnlab prepare --model "
                                 "luong` (about a minute on two cores)", headers={"Retry-After": "60"})
    return folder


@router.get("/api/luong/models", responses=NOT_READY)
def luong_models(settings: SettingsDep) -> dict:
    """The four Luong models and the Transformer, with their held-out exact match and the training's seconds."""
    return luong_lab.models_view(_folder(settings))


@router.post("/api/luong/attention", responses=NOT_READY)
def luong_attention(req: Annotated[LuongAttentionRequest, Body(openapi_examples=EXAMPLES)], settings: SettingsDep) -> dict:
    """The alignment [steps][source], context vectors and greedy output of the chosen score's model, with β, source
    masks and noise on the source states and their effect; the Transformer's cross-attention for the same input."""
    perturb = None if req.perturb is None else luong_lab.Perturbation(
        req.perturb.sigma, req.perturb.seed, None if req.perturb.positions is None else tuple(req.perturb.positions))
    ivs = luong_lab.Interventions(req.beta, tuple(req.mask), perturb)
    try:
        return luong_lab.attention_view(_folder(settings), req.score, req.text, ivs)
    except luong_lab.LuongInputError as exc:
        raise field_error((exc.field,), str(exc)) from None


@router.get("/luong", response_class=HTMLResponse, include_in_schema=False)
def luong_page(request: Request):
    config = {"examples": list(luong.EXAMPLES), "scores": list(luong.SCORES), "max_chars": luong.MAX_SOURCE}
    return templates.TemplateResponse(request, "luong.html", {"config": config, "page": "luong"})
