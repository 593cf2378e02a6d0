"""Gaussian attention heads (docs/science.md §7–8): trained runs, their centers over training, one head's pattern,
the attention-as-convolution theorem, and the page /gaussian.

Models are named by registry id (models/gaussian.py GAUSSIAN_REGISTRY), never by a path. The history
(centers and widths per epoch) is all the attention endpoints need: a Gaussian head's pattern depends
on its center and width only, so no weights are loaded to draw it. Routes are plain `def`: the
threadpool runs the numerical work.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from app.lifecycle import ParsedJsonRoute
from app.templating import templates
from models import conv_theorem
from models import gaussian as engine

router = APIRouter(tags=["gaussian"], route_class=ParsedJsonRoute)

ModelId = Annotated[str, Query(min_length=1, max_length=64, description="a registered Gaussian model id")]
MAX_DILATION = 8
MAX_CHANNELS = 16
NOT_FOUND = {404: {"description": "unknown Gaussian model id, or no trained run of it on this server"}}


class _StrictBody(BaseModel):
    # As the text routes (app/schemas.py _Strict): no coercion. `layer: false`, `head: true`, `alpha: "5"`,
    # `epoch: true`, `seed: false`, `kernel_size: true`, `image_size: 16.0` and `query: [0, false]` are 422s.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def _error(loc: tuple, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": message, "type": "value_error"}])


def _history(model_id: str) -> dict:
    if model_id not in engine.GAUSSIAN_REGISTRY:
        raise HTTPException(404, f"unknown Gaussian model {model_id!r}; known: {sorted(engine.GAUSSIAN_REGISTRY)}")
    try:
        return engine.load_history(model_id)
    except FileNotFoundError:
        raise HTTPException(404, f"Gaussian model {model_id!r} has no trained run on this server") from None


def _epoch_entry(history: dict, epoch: int | None, loc: tuple) -> dict:
    epochs = history["epochs"]
    if epoch is None:
        return epochs[-1]
    for entry in epochs:
        if entry["epoch"] == epoch:
            return entry
    saved = [e["epoch"] for e in epochs]
    raise _error(loc, f"epoch {epoch} is not saved for this model; saved epochs: {saved[0]}..{saved[-1]}")


def _centers_response(entry: dict) -> dict:
    return {"epoch": entry["epoch"], "accuracy": entry["accuracy"], "train_loss": entry.get("train_loss"),
            "layers": entry["layers"]}


def _model_info(model_id: str) -> dict:
    history = _history(model_id)
    cfg = engine.GaussianConfig.from_dict(history["config"])
    return {
        "id": model_id,
        "kind": "gaussian",
        "dataset": history["dataset"],
        "layers": cfg.n_layers,
        "heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden": cfg.hidden,
        "grid": list(cfg.grid),
        "epochs": [e["epoch"] for e in history["epochs"]],
        "accuracy": history["epochs"][-1]["accuracy"],
        "parameters": history.get("parameters"),
        "wall_time_s": history.get("wall_time_s"),
        "gelu": cfg.gelu,
        "position_embedding": cfg.position_embedding,
        "train_images": (history.get("training") or {}).get("train_subset") or None,
        # a run continued with --resume: from which epoch, on how many images, at which peak learning rate
        "continued": [{"from_epoch": c.get("from_epoch"), "train_images": c.get("train_subset") or None, "lr": c.get("lr")}
                      for c in history.get("continued", [])],
        "source": "trained by scripts/train_gaussian.py (committed under models/trained/)",
    }


@router.get("/api/gaussian/models")
def gaussian_models() -> dict:
    """The trained Gaussian-attention runs this server holds, the default first."""
    return {"models": [_model_info(m) for m in engine.available_models()]}


@router.get("/api/gaussian/centers", responses=NOT_FOUND)
def gaussian_centers(model: ModelId = engine.DEFAULT_GAUSSIAN_MODEL,
                     epoch: Annotated[int | None, Query(ge=0, le=100_000)] = None) -> dict:
    """Every head's center [dr, dc] (grid cells) and width alpha at one saved epoch (default: the last)."""
    return _centers_response(_epoch_entry(_history(model), epoch, ("query", "epoch")))


@router.get("/api/gaussian/history", responses=NOT_FOUND)
def gaussian_history(model: ModelId = engine.DEFAULT_GAUSSIAN_MODEL) -> dict:
    """The centers response of every saved epoch, oldest first (epoch 0 = the initialisation)."""
    return {"epochs": [_centers_response(e) for e in _history(model)["epochs"]]}


class GaussianAttentionRequest(_StrictBody):
    model: str = Field(engine.DEFAULT_GAUSSIAN_MODEL, min_length=1, max_length=64)
    epoch: int | None = Field(None, ge=0, le=100_000, description="saved epoch; null = the last")
    layer: int = Field(0, ge=0, le=1000)
    head: int = Field(0, ge=0, le=1000)
    query: Annotated[list[Annotated[StrictInt, Field(ge=0, le=1000)]], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [7, 7], description="query pixel [row, col] on the token grid")
    alpha: float | None = Field(None, gt=0, le=1e6, description="overrides the head's width")


@router.post("/api/gaussian/attention", responses=NOT_FOUND)
def gaussian_attention(req: GaussianAttentionRequest) -> dict:
    """P[q, k] of one head over the token grid for one query pixel (content-independent: no image needed)."""
    history = _history(req.model)
    cfg = engine.GaussianConfig.from_dict(history["config"])
    rows, cols = cfg.grid
    if req.layer >= cfg.n_layers:
        raise _error(("body", "layer"), f"layer {req.layer} out of range: the model has {cfg.n_layers} layers")
    if req.head >= cfg.n_heads:
        raise _error(("body", "head"), f"head {req.head} out of range: the model has {cfg.n_heads} heads")
    r, c = req.query
    if not (0 <= r < rows and 0 <= c < cols):
        raise _error(("body", "query"), f"query {[r, c]} is outside the {rows}x{cols} grid")
    entry = _epoch_entry(history, req.epoch, ("body", "epoch"))
    head = entry["layers"][req.layer]["heads"][req.head]
    alpha = req.alpha if req.alpha is not None else head["alpha"]
    probs = engine.attention_over_grid(head["center"], alpha, (rows, cols), (r, c))  # (rows, cols)
    target = [r + head["center"][0], c + head["center"][1]]
    nearest = [round(target[0]), round(target[1])]
    inside = 0 <= nearest[0] < rows and 0 <= nearest[1] < cols
    return {
        "grid": [rows, cols],
        "probs": probs.tolist(),
        "epoch": entry["epoch"],
        "center": head["center"],
        "alpha": alpha,
        "target": target,            # q + mu, in grid cells
        "nearest_pixel": nearest if inside else None,
        "prob_at_nearest": float(probs[nearest[0], nearest[1]]) if inside else None,
        "max_prob": float(probs.max()),
    }


class ConvEquivalenceRequest(_StrictBody):
    kernel_size: int = Field(3, ge=1, le=7, description="odd, 1-7", json_schema_extra={"enum": [1, 3, 5, 7]})
    dilation: int = Field(1, ge=1, le=MAX_DILATION)
    padding: Literal["zeros", "none"] = "zeros"
    alpha: float = Field(100.0, gt=0, le=1e6)
    image_size: int = Field(16, ge=1, le=64)
    channels_in: int = Field(3, ge=1, le=MAX_CHANNELS)
    channels_out: int = Field(4, ge=1, le=MAX_CHANNELS)
    seed: int = Field(0, ge=0, le=2**31 - 1)

    @field_validator("kernel_size")
    @classmethod
    def odd_kernel(cls, k: int) -> int:
        if k % 2 == 0:
            raise ValueError("kernel_size must be odd (1, 3, 5 or 7)")
        return k


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


@router.post("/api/gaussian/conv-equivalence")
def conv_equivalence(req: ConvEquivalenceRequest) -> dict:
    """Build the K^2-head attention layer from a seeded random K x K kernel (the theorem's construction)
    and compare it with the zero-padded convolution: errors at alpha and for a log-spaced alpha grid."""
    reach = req.dilation * (req.kernel_size // 2)
    if reach >= req.image_size:
        raise _error(("body", "dilation"), f"dilation*floor(K/2) = {reach} must be smaller than image_size {req.image_size}")
    result = conv_theorem.conv_equivalence(req.kernel_size, req.dilation, req.padding, req.alpha, req.image_size,
                                           req.channels_in, req.channels_out, req.seed)
    return {
        "max_abs_error": result.max_abs_error,
        "interior_max_abs_error": _finite_or_none(result.interior_max_abs_error),
        "conv": result.conv.tolist(),      # [C_out][n][n]
        "mhsa": result.mhsa.tolist(),      # [C_out][n][n]
        "error_by_alpha": [[a, e] for a, e in result.error_by_alpha],
        "heads": req.kernel_size ** 2,
        "centers": [[req.dilation * s for s in shift] for shift in conv_theorem.kernel_shifts(req.kernel_size)],
        "padding_width": reach if req.padding == "zeros" else 0,
        "stride_note": conv_theorem.STRIDE_NOTE,
    }


@router.get("/api/gaussian/blocks", responses=NOT_FOUND)
def gaussian_blocks(model: ModelId = engine.DEFAULT_GAUSSIAN_MODEL) -> dict:
    """GELU exact vs tanh, one layer's parameter count and cost (content vs Gaussian attention); see /guide#s8."""
    cfg = engine.GaussianConfig.from_dict(_history(model)["config"])
    return {
        "gelu": engine.gelu_curves(),
        "params": engine.layer_param_count(cfg),
        "cost": engine.layer_cost(cfg),
        "cordonnier_params": engine.layer_param_count(engine.GaussianConfig.cordonnier()),
        "cordonnier_cost": engine.layer_cost(engine.GaussianConfig.cordonnier()),
        "config": cfg.to_dict(),
    }


@router.get("/gaussian", response_class=HTMLResponse, include_in_schema=False)
def gaussian_page(request: Request):
    available = engine.available_models()
    config = {"model": available[0] if available else engine.DEFAULT_GAUSSIAN_MODEL, "models": available}
    return templates.TemplateResponse(request, "gaussian.html", {"config": config, "page": "gaussian"})
