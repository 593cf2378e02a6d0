"""Service endpoints: health, readiness and the model list."""
from __future__ import annotations

import importlib.metadata
from functools import lru_cache
from pathlib import Path
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.lifecycle import ParsedJsonRoute
from app.deps import RuntimeDep
from app.context import current
from app.jobs import JOBS
from app.runtime import UnknownModel, Runtime
from app.schemas import ModelsOut

ROOT = Path(__file__).resolve().parents[2]

router = APIRouter(prefix="/api", tags=["service"], route_class=ParsedJsonRoute)


# async: answered on the event loop. A plain `def` takes a worker thread, and under load every worker
# thread may be held by a request waiting for the model: health then waited behind them (p99 0.7 s).
@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/jobs")
async def jobs(runtime: RuntimeDep) -> dict:
    """The jobs running and waiting (what, seconds left by their estimate, runs; no inputs) and the memory budget:
    bytes in flight, kept by the result cache, and the limit for both (docs/api.md "Jobs"). With
    result_cache_scope="client" a client sees its own jobs and counts only: no other client's work, no memory totals."""
    memory = runtime.memory
    if runtime.settings.result_cache_scope == "client":
        client = current().client
        # a request without its own scope (no X-Attnlab-Client header, no attnlab_client cookie yet) is known only by
        # its address, which clients behind one proxy share: it is shown no job of its own
        own = JOBS.snapshot(client) if client and not client.startswith("a:") else []
        return {"jobs": own, "counts": {"jobs": len(JOBS), "yours": len(own)}}
    return {"jobs": JOBS.snapshot(),
            "memory": {"in_flight_bytes": memory.in_flight_bytes, "kept_bytes": runtime.cache.host_bytes,
                       "kept_disk_bytes": runtime.cache.disk_bytes, "limit_bytes": memory.limit,
                       "waited": memory.waited},
            "yields": runtime.yields}


@router.get("/ready", responses={503: {"description": "default models still loading"}})
async def ready(runtime: RuntimeDep):
    if not runtime.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    adapters = runtime.loaded_adapters()
    # where the loaded models actually run ("cpu", "cuda"): what a deployment check reads
    return {"status": "ready", "models": [a.info.id for a in adapters],
            "device": ", ".join(sorted({a.device.type for a in adapters}))}


@router.get("/models", response_model=ModelsOut)
def list_models(runtime: RuntimeDep, kind: Literal["text", "image", "audio"] | None = None) -> dict:
    """Every model a request may name (of one `kind` if given). A model not loaded yet is described from its files
    (models/listing.py; no `parity` until its first use loads and probes it): listing loads none, except an operator's
    decoder LM named by a hub id, which has no local files to read."""
    infos = []
    for model_id, spec in runtime.specs.items():
        if kind is not None and spec.kind != kind:
            continue
        try:
            infos.append(public_info(runtime, runtime.describe(model_id)))
        except UnknownModel:  # weights not prepared here, or refused by the load-time probe: in runtime.unavailable
            continue
    return {"models": infos}


# ---- where a model comes from, without server paths ----------------------------------------------------
def public_info(runtime: Runtime, info: dict) -> dict:
    """A ModelInfo dict for clients: `source` names the package and version, the project's own folder,
    or the operator's model id, never an absolute path on the server."""
    return {**info, "source": public_source(runtime, info["id"], info.get("source", ""))}


def public_source(runtime: Runtime, model_id: str, source: str) -> str:
    settings = runtime.settings
    added = {**settings.extra_text_models, **settings.extra_image_models, **settings.extra_models}
    if model_id in added:
        configured = added[model_id]
        if "/" in configured and not configured.startswith(("/", ".", "~")) and configured.count("/") == 1 \
                and not Path(configured).exists():
            return f"hub:{configured}"  # a hub id (org/name) is public already
        return f"added by the operator as {model_id!r}"
    return _named_source(source)


@lru_cache(maxsize=64)
def _named_source(source: str) -> str:
    path = Path(source)
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            top = parts[parts.index(marker) + 1] if parts.index(marker) + 1 < len(parts) else ""
            for dist in importlib.metadata.packages_distributions().get(top, []):
                try:
                    return f"PyPI package {dist} {importlib.metadata.version(dist)}"
                except importlib.metadata.PackageNotFoundError:
                    continue
            return f"an installed package ({top})" if top else "an installed package"
    try:
        return f"attnlab: {path.resolve().relative_to(ROOT).as_posix()}"  # e.g. weights/dinov2-small
    except ValueError:
        pass
    if path.is_absolute() or source.startswith((".", "~")):
        return path.name or "a local folder"
    return source
