"""GET /metrics: this replica's state in Prometheus' text format (0.0.4), for scraping and autoscaling.

What a fleet scales on is the queue, not the CPU (on a GPU host the CPU says nothing): `attnlab_jobs_waiting`,
`attnlab_jobs_running`, `attnlab_queue_eta_seconds` (how long a job sent now by a new client would wait, by the job
board's one ETA: app/jobs.py JobBoard.eta_s, as /api/jobs and the streams say it) and the part of it more replicas
would take away: `attnlab_scalable_wait_seconds` and `attnlab_jobs_waiting_scalable` (accepted jobs waiting for the
model, not those that wait only for their own client's earlier job: one job per client runs at a time however many
replicas there are, so scaling on them over-scales). Also the bytes of kept runs (RAM, GPU, disk), readiness and the
drain, and every answered request by status (`attnlab_requests_total{status="404"}`), counted by `RequestCounter` as
the status is sent. deploy/k8s/keda.yaml scales on `sum(attnlab_scalable_wait_seconds)` (docs/deploy.md "Autoscaling").
"""
from __future__ import annotations

import threading
from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from app.allocator import process_warm_heap
from app.openmp_teams import TeamStats
from app.ids import replica_name

router = APIRouter(tags=["service"])

class StatusCounts:
    """Status code → responses answered with it since the app started (its app's: app/process.py)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self._lock = threading.Lock()

    def add(self, status: int) -> None:
        with self._lock:
            self._counts[status] += 1

    def items(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._counts.items())


class RequestCounter:
    """Counts each HTTP response by status as it starts (pure ASGI, outermost but one: static files too), into the
    app's `counts`."""

    def __init__(self, app, counts: StatusCounts):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts.add(int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


def _jobs(jobs) -> tuple[int, int]:
    """(running, waiting) from the job board `jobs`: one model forward runs at a time."""
    board = jobs.snapshot()
    running = sum(1 for job in board if job.get("state") == "running") if any("state" in j for j in board) \
        else min(1, len(board))
    return running, len(board) - running


def render(runtime, process) -> str:
    """The metrics of the app whose runtime and process state (app/process.py) these are."""
    running, waiting = _jobs(process.jobs)
    queue = process.jobs.queue()
    cache = runtime.cache
    kept = {"ram": cache.host_bytes, "device": getattr(cache, "device_bytes", 0) or 0,
            "disk": getattr(cache, "disk_bytes", 0) or 0}
    replica = replica_name()
    lines = [
        "# HELP attnlab_jobs_running Jobs (event-stream requests) running on this replica.",
        "# TYPE attnlab_jobs_running gauge",
        f"attnlab_jobs_running {running}",
        "# HELP attnlab_jobs_waiting Jobs accepted and waiting for the model on this replica.",
        "# TYPE attnlab_jobs_waiting gauge",
        f"attnlab_jobs_waiting {waiting}",
        "# HELP attnlab_queue_eta_seconds How long a job sent now by a new client would wait (the jobs' one ETA).",
        "# TYPE attnlab_queue_eta_seconds gauge",
        f"attnlab_queue_eta_seconds {queue['wait_s']:.3f}",
        "# HELP attnlab_scalable_wait_seconds What is left of the accepted jobs waiting for the model that more "
        "replicas would start at once (not those waiting only for their own client's earlier job): scale on this.",
        "# TYPE attnlab_scalable_wait_seconds gauge",
        f"attnlab_scalable_wait_seconds {queue['scalable_wait_s']:.3f}",
        "# HELP attnlab_jobs_waiting_scalable Accepted jobs waiting for the model that more replicas would start at once.",
        "# TYPE attnlab_jobs_waiting_scalable gauge",
        f"attnlab_jobs_waiting_scalable {int(queue['waiting_scalable'])}",
        "# HELP attnlab_kept_run_bytes Bytes of kept runs (their windows and rows), by where they are kept.",
        "# TYPE attnlab_kept_run_bytes gauge",
        *(f'attnlab_kept_run_bytes{{tier="{tier}"}} {int(n)}' for tier, n in kept.items()),
        "# HELP attnlab_ready 1 when the default models are loaded and the replica is not draining.",
        "# TYPE attnlab_ready gauge",
        f"attnlab_ready {int(bool(runtime.ready) and not process.fleet.draining)}",
        "# HELP attnlab_draining 1 from SIGTERM (drain_s > 0) until the process stops.",
        "# TYPE attnlab_draining gauge",
        f"attnlab_draining {int(process.fleet.draining)}",
        "# HELP attnlab_replica_info This replica's name (the prefix of its run ids).",
        "# TYPE attnlab_replica_info gauge",
        f'attnlab_replica_info{{replica="{replica}"}} 1',
        "# HELP attnlab_requests_total HTTP responses by status since the process started.",
        "# TYPE attnlab_requests_total counter",
    ]
    lines += [f'attnlab_requests_total{{status="{status}"}} {n}' for status, n in process.status.items()]
    warm = process_warm_heap()
    if warm is not None:
        lines += [
            "# HELP attnlab_warm_heap_top_ups_total Reservations the warm heap mapped (after plain responses; one at a time).",
            "# TYPE attnlab_warm_heap_top_ups_total counter",
            f"attnlab_warm_heap_top_ups_total {warm.top_ups}",
            "# HELP attnlab_warm_heap_mapped_pages_total Pages the top-ups mapped: first touches taken off requests.",
            "# TYPE attnlab_warm_heap_mapped_pages_total counter",
            f"attnlab_warm_heap_mapped_pages_total {warm.mapped_pages}",
        ]
    lines += [
        "# HELP attnlab_openmp_team_releases_total Threads that ended their OpenMP team (if they had one): plain "
        "requests finishing while another model request was handled, jobs handing the model over (app/openmp_teams.py).",
        "# TYPE attnlab_openmp_team_releases_total counter",
        f"attnlab_openmp_team_releases_total {TeamStats.released}",
    ]
    return "\n".join(lines) + "\n"


@router.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(render(request.app.state.runtime, request.app.state.process), media_type="text/plain; version=0.0.4; charset=utf-8")
