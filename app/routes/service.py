"""Service endpoints: health, readiness and the model list."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.deps import RuntimeDep
from app.schemas import ModelsOut

router = APIRouter(prefix="/api", tags=["service"])


@router.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "default models still loading"}})
def ready(runtime: RuntimeDep):
    if not runtime.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    return {"status": "ready", "models": [a.info.id for a in runtime.loaded_adapters()]}


@router.get("/models", response_model=ModelsOut)
def list_models(runtime: RuntimeDep, kind: Literal["text", "image"] | None = None) -> dict:
    """Every model a request may name (of one `kind` if given). Models not loaded yet are loaded here (once)."""
    infos = []
    for model_id, spec in runtime.specs.items():
        if kind is not None and spec.kind != kind:
            continue
        try:
            infos.append(runtime.adapter(model_id).info.to_dict())
        except (ImportError, OSError, ValueError) as exc:  # weights not prepared on this machine
            runtime.unavailable[model_id] = str(exc)
    return {"models": infos}
