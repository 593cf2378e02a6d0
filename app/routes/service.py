"""Service endpoints: health, readiness and the model list."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from app.lifecycle import ParsedJsonRoute
from app.model_sources import public_info
from app.deps import RuntimeDep
from app.context import current
from app.ids import is_valid_run_id
from app.streams import cancel_job, missing_job, reattach
from app.runtime import UnknownModel
from app.schemas import ModelsOut

router = APIRouter(prefix="/api", tags=["service"], route_class=ParsedJsonRoute)


# async: answered on the event loop. A plain `def` takes a worker thread, and under load every worker
# thread may be held by a request waiting for the model: health then waited behind them (p99 0.7 s).
@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/jobs")
async def jobs(request: Request, runtime: RuntimeDep) -> dict:
    """The jobs running and waiting (what, seconds left by their estimate, runs; no inputs) and the memory budget:
    bytes in flight, kept by the result cache, and the limit for both (docs/api.md "Jobs"). With
    result_cache_scope="client" a client sees its own jobs and counts only: no other client's work, no memory totals."""
    memory, board = runtime.memory, request.app.state.process.jobs
    if runtime.settings.result_cache_scope == "client":
        client = current().client
        # a request without its own scope (no X-Attnlab-Client header, no attnlab_client cookie yet) is known only by
        # its address, which clients behind one proxy share: it is shown no job of its own
        own = board.snapshot(client) if client and not client.startswith("a:") else []
        return {"jobs": own, "counts": {"jobs": len(board), "yours": len(own)}}
    return {"jobs": board.snapshot(),
            "memory": {"in_flight_bytes": memory.in_flight_bytes, "kept_bytes": runtime.cache.host_bytes,
                       "kept_disk_bytes": runtime.cache.disk_bytes, "limit_bytes": memory.limit,
                       "waited": memory.waited},
            "yields": runtime.yields}


JOB_404 = {404: {"description": "a job this server cannot answer: unknown (also another client's), expired, or "
                  "on a replica that is gone; the detail says which"}}


@router.get("/jobs/{job_id}/events", responses={
    200: {"content": {"text/event-stream": {}}, "description": "the job's events after the one named, then live"},
    **JOB_404, 422: {"description": "Last-Event-ID or `after` is not an event of this job"}})
async def job_events(job_id: str, request: Request, runtime: RuntimeDep,
                     after: Annotated[str | None, Query(description="the last event id received (`<job_id>:<n>` or "
                                                        "n), for clients that cannot set Last-Event-ID")] = None,
                     last_event_id: Annotated[str | None, Header()] = None):
    """Re-attach to a job (docs/api.md "Re-attaching to a job"): its kept events after `Last-Event-ID` (or `after`;
    neither: from its first), then the live ones until its done or error event. Leaving this stream does not cancel
    the job at once: with no stream listening it runs on for job_reattach_grace_s."""
    if not is_valid_run_id(job_id):
        raise HTTPException(404, detail=missing_job(job_id, "unknown", runtime.settings))
    field, value = ("after", after) if after is not None else ("Last-Event-ID", last_event_id)
    return reattach(request, job_id, _event_number(job_id, field, value))


@router.delete("/jobs/{job_id}", responses=JOB_404)
async def cancel(job_id: str, request: Request, runtime: RuntimeDep) -> dict:
    """Cancel a job (the page's Cancel): it stops at its next layer or step, whatever streams listen."""
    if not is_valid_run_id(job_id):
        raise HTTPException(404, detail=missing_job(job_id, "unknown", runtime.settings))
    return cancel_job(job_id, request.app.state.process.job_logs, runtime.settings)


def _event_number(job_id: str, field: str, value: str | None) -> int:
    """The number n of an event id `<job_id>:<n>` (or a bare n); 0 when none is given; 422 naming the field."""
    if value is None or not value.strip():
        return 0
    named, _, number = value.strip().rpartition(":")
    if (named and named != job_id) or not number.isdigit() or len(number) > 12:
        raise HTTPException(422, detail=[{"loc": ["header" if field == "Last-Event-ID" else "query", field],
                                          "msg": f"{value[:80]!r} is not an event id of job {job_id!r} "
                                                 f"(`{job_id}:<n>`, or n)", "type": "value_error"}])
    return int(number)


@router.get("/ready", responses={503: {"description": "default models still loading"}})
async def ready(runtime: RuntimeDep):
    if not runtime.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    adapters = runtime.loaded_adapters()
    # where the loaded models actually run ("cpu", "cuda"): what a deployment check reads
    return {"status": "ready", "models": [a.info.id for a in adapters],
            "device": ", ".join(sorted({a.device.type for a in adapters})),
            # what runs their Linear layers on the CPU (models/cpu_linear.py); null when none runs there
            "cpu_linear": ", ".join(sorted({a.cpu_linear for a in adapters if a.cpu_linear})) or None}


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
    # being prepared while the server serves (`make run`: app/preparation.py), or whose preparation failed
    return {"models": infos, "not_ready": runtime.not_ready(kind)}
