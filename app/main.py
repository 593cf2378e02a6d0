"""The ASGI app: assembles settings, the runtime, routers, pages and error handling."""
from __future__ import annotations

import importlib.util
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio.to_thread
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from app.routes import pages, service, text
from app.routes import images
from app.routes import gaussian
from app.routes import luong
from app.routes import analysis
from app.routes import audio
from app.routes import runs
from app.routes import why
from app.routes import scale
from app.routes import heads
from app.routes import circuit as circuit_routes
from app.routes import export as export_routes
from app.routes import export_media
from app import metrics
from app.fleet import FleetRouter
from app.preparation import start_background
from app.process import ProcessState
from app.lifecycle import RequestCancelled, RequestGuard
from app.in_flight import API_POSTS
from app.metrics import RequestCounter
from app.openapi_404 import add_not_found
from app.openmp_teams import TeamStats
from app.context import current, enter, leave
from app.jobs import client_of
from app.memory import RequestMemory
from app.runtime import Overloaded, Runtime
from app.settings import Settings, get_settings
from app.templating import templates
from attnlab.vendor import plotly_bundle
from models.adapters.base import cuda_absence, describe_device, pick_device
from models import cpu_linear

log = logging.getLogger("attnlab")
ROOT = Path(__file__).resolve().parent.parent

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
        "script-src 'self'; connect-src 'self'; object-src 'none'; frame-ancestors 'none'"
    ),
}


def swagger_ui_dist() -> str:
    """The Swagger UI 5 files shipped in the swagger-ui-py package (found without importing it)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or spec.origin is None:
        raise RuntimeError("package swagger-ui-py is not installed (see requirements.txt)")
    return str(Path(spec.origin).parent / "static")


class SecurityHeaders:
    """Pure ASGI middleware adding SECURITY_HEADERS to every HTTP response that lacks them. (Starlette's
    BaseHTTPMiddleware re-streams each body through a task group: several ms per request here.)"""

    RAW = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in SECURITY_HEADERS.items()]

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = [_relative_location(name, value) for name, value in message.get("headers", [])]
                present = {name.lower() for name, _ in headers}
                extra = [(name, value) for name, value in self.RAW if name not in present]
                message = {**message, "headers": [*headers, *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _relative_location(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    """A redirect to this same server as a path only: Starlette builds absolute ones from the request's Host
    header (`/static` → `http://<Host>/static/`), which let any client choose where a redirect points."""
    if name.lower() == b"location" and b"://" in value:
        path = value.split(b"://", 1)[1].partition(b"/")
        return name, path[1] + path[2] or b"/"
    return name, value


class ServerTiming:
    """Pure ASGI middleware: a Server-Timing header on API responses (shown by browsers' dev tools and
    readable from the Resource Timing API): time waiting for the model, running it, and in the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            return await self.app(scope, receive, send)
        timings: dict[str, float] = {}
        token = enter(current().with_(timings=timings))  # outermost: the request's context starts here
        started = time.perf_counter()

        async def send_with_timing(message):
            if message["type"] == "http.response.start":
                parts = [f"{name};dur={seconds * 1000:.1f}" for name, seconds in timings.items()]
                parts.append(f"app;dur={(time.perf_counter() - started) * 1000:.1f}")
                message = {**message, "headers": [*message.get("headers", []), (b"server-timing", ", ".join(parts).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_timing)
        finally:
            leave(token)


class RequestDeadline:
    """Pure ASGI middleware: each HTTP request gets a deadline `seconds` from its arrival.

    The runtime reads it (a context variable, so it reaches the worker thread of a sync endpoint) and
    answers 503 + Retry-After when the request's waits for the model add up past it.
    """

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the request's context, made once (app/context.py): its deadline, who sent it (jobs queue per client; a
        # client may evict its own kept runs) and what it holds of the memory budget (app/memory.py: reserved before
        # its runs, released here when its response has been sent), beside the cancel event and cache scope that
        # RequestGuard set; the cost check's values start empty (a value left in the context this request was started
        # from, a test calling check_request_cost directly, was read as this request's estimate)
        client = client_of(scope.get("headers", []), scope.get("client"))
        memory = RequestMemory(client=client)
        token = enter(current().with_(deadline=time.monotonic() + self.seconds, client=client, memory=memory,
                                      estimate_s=None))
        try:
            await self.app(scope, receive, send)
        finally:
            leave(token)
            if memory.budget is not None:
                memory.budget.release(memory)


class AdmissionGate:
    """Pure ASGI middleware: at most `limit` API POSTs (the requests that may run a model) in flight. Those it lets in
    are also counted process-wide until their response has been sent (app/in_flight.py API_POSTS: the run store's
    writer waits for none).

    One more is answered 503 + Retry-After on the event loop, before it takes a worker thread, so a
    refusal stays fast however many requests are queued (the runtime's own check, `queue_depth` waiting
    for the model, still applies behind it).
    """

    def __init__(self, app, limit: int):
        self.app, self.limit, self.in_flight = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/api/"):
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            busy = JSONResponse(
                {"detail": f"server busy: {self.in_flight} requests in flight (queue_depth)"},
                status_code=503, headers={"Retry-After": "1"},
            )
            return await busy(scope, receive, send)
        self.in_flight += 1  # one event loop: no lock needed
        API_POSTS.entered()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            API_POSTS.left()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="attnlab",
        description="Attention maps, interventions (β, masks, perturbations) and their effects for Transformers.",
        version="0.1.0",
        lifespan=_lifespan(settings),
        docs_url=None,  # FastAPI's /docs loads Swagger UI from a CDN: served from swagger-ui-py below
        redoc_url=None,
    )
    app.state.process = ProcessState()  # the app's job board, logs, lifecycle, fleet state, counts (app/process.py)
    _add_middleware(app, settings, app.state.process)
    _add_error_handlers(app)
    _add_routes(app)
    # JSON bodies take the value RequestGuard parsed (off the loop): the routers' route class, app/lifecycle.ParsedJsonRoute
    app.openapi = lambda: _openapi_with_guard_responses(app)
    return app


def _lifespan(settings: Settings):
    """The app's start and stop: the runtime, the device said once, the default models loaded in the background."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime = Runtime(settings, app.state.process.measures)  # the app's measures of its models' speed
        app.state.runtime = runtime
        TeamStats.enabled = settings.openmp_one_team  # process-wide, as OpenMP's teams are (app/openmp_teams.py)
        # Where the models will run, said once; ATTNLAB_DEVICE=cuda with no visible GPU stops the start here
        # (DeviceUnavailable: uvicorn exits with status 3) instead of a server that never turns ready.
        device = pick_device(settings.device)
        if device.type == "cpu" and settings.device == "auto" and torch.version.cuda is not None:
            log.warning("device: no GPU visible, falling back to the CPU: %s (ATTNLAB_DEVICE=auto)", cuda_absence())
        else:
            log.info("device: %s (ATTNLAB_DEVICE=%s)", describe_device(device), settings.device)
        if device.type == "cpu":
            log.info("cpu linear layers: %s", cpu_linear.describe())
        # Load the default models in the background: /api/health answers at once, /api/ready turns 200 when
        # warm. Then run the text page's example once, so its first view is already cached.
        def warm() -> None:
            runtime.warm_up()
            try:
                pages.warm_example(runtime)
            except Exception:  # a warm-up is an optimisation: never let it take the server down
                log.exception("warming the text page's example failed")

        # `make run`: the default models not loaded at start are prepared meanwhile (app/preparation.py)
        background = start_background(settings.weights_dir, settings.default_models) \
            if settings.prepare_in_background else None
        threading.Thread(target=warm, name="warm-up", daemon=True).start()
        # Sync endpoints run in anyio's worker threads (40 by default): enough for every admitted request.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, settings.queue_depth + 8)
        fleet = app.state.process.fleet
        fleet.start(settings, runtime)  # a fleet's replica registers its URL in Redis (app/fleet.py)
        try:
            yield
        finally:
            fleet.stop()
            if background is not None:
                background.stop()
            runtime.cache.close()  # the disk tier's directory goes with the server (serve.py exits with os._exit)

    return lifespan


def _add_middleware(app: FastAPI, settings: Settings, process: ProcessState) -> None:
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"])
    if settings.trusted_hosts != ["*"]:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts)

    # Outermost last. A request reaches the admission gate only once RequestGuard has its whole body.
    app.add_middleware(RequestDeadline, seconds=settings.request_timeout_s)
    # queue_depth waiting + the one running + a few cache hits / uploads that never wait for the model.
    app.add_middleware(AdmissionGate, limit=settings.queue_depth + 4)
    # Runs of other replicas are forwarded to their owner (app/fleet.py): after the body is read, before admission.
    app.add_middleware(FleetRouter, settings=settings, fleet=process.fleet)
    app.add_middleware(RequestGuard, settings=settings, upload_paths=("/api/images", "/api/audio"),
                       lifecycle=process.lifecycle, post_paths=lambda: {
        path for path, operations in app.openapi().get("paths", {}).items() if "post" in operations})

    app.add_middleware(SecurityHeaders)
    app.add_middleware(RequestCounter, counts=process.status)  # /metrics: responses by status, as sent (app/metrics.py)
    if settings.expose_timings:  # off by default: the model time says whether someone sent this input before
        app.add_middleware(ServerTiming)  # outermost: `app` is the whole request, body and JSON parsing included


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        # FastAPI's default echoes the input, which may be NaN/Infinity and then fails to serialise (a 500).
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded):
        # 503: the replica is busy or not ready; 429 (ClientLimit): a cap about the client, the same on every replica
        return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(RequestCancelled)
    async def cancelled(request: Request, exc: RequestCancelled):  # the client left or the server stops
        log.info("%s %s stopped: %s", request.method, request.url.path,
                 "client left" if exc.reason == "client" else "server shutting down")
        return JSONResponse({"detail": "the server is shutting down; retry in a moment" if exc.reason == "shutdown"
                             else "request cancelled: the client left"}, status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect):  # one line, not a traceback per abort
        log.info("client left during %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "client disconnected"}, status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug: log it, never leak a trace
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal error (logged on the server)"}, status_code=500)


def _add_routes(app: FastAPI) -> None:
    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(plotly_bundle(), media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    @app.get("/docs", include_in_schema=False)
    def api_docs(request: Request):
        """Swagger UI 5 for /openapi.json, from the swagger-ui-py package (no CDN, works offline; its
        start-up script is a file, so the page keeps the strict script-src 'self' policy)."""
        return templates.TemplateResponse(request, "api_docs.html", {"page": "api"})

    app.mount("/static/vendor/swagger-ui", StaticFiles(directory=swagger_ui_dist()), name="swagger-ui")
    app.mount("/static", StaticFiles(directory=ROOT / "static"), name="static")
    app.include_router(service.router)
    app.include_router(metrics.router)  # GET /metrics (Prometheus text)
    app.include_router(text.router)
    app.include_router(pages.router)
    app.include_router(images.router)
    app.include_router(gaussian.router)
    app.include_router(luong.router)  # /api/luong/*, /luong (models/luong.py)
    app.include_router(analysis.router)
    app.include_router(audio.router)
    app.include_router(runs.router)
    app.include_router(why.router)
    app.include_router(scale.router)  # POST /api/text/score_stats
    app.include_router(heads.router)
    app.include_router(circuit_routes.router)  # POST /api/text/circuit, /api/text/circuit/edge
    app.include_router(export_routes.router)  # POST /api/text/export.html (attnlab/export.py)
    app.include_router(export_media.router)  # POST /api/image/export.html, /api/audio/export.html


def api_routes(routes) -> list[APIRoute]:
    """Every APIRoute, also inside included routers (FastAPI ≥ 0.16x keeps those as their own router objects): a
    test checks that each JSON POST is a ParsedJsonRoute (app/lifecycle.py)."""
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif getattr(route, "original_router", None) is not None:
            found += api_routes(route.original_router.routes)
    return found


# What RequestGuard, the admission gate and the runtime may answer besides each route's own responses.
GUARD_RESPONSES = {
    "400": "malformed body: not UTF-8, nested too deeply, a number with too many digits, bad Content-Length",
    "408": "the body did not arrive within body_timeout_s (upload_timeout_s for uploads)",
    "413": "the body is over max_json_bytes (max_upload_bytes for uploads), or the work/response is over a cap",
    "415": "the body is not application/json (multipart/form-data for uploads)",
    "429": "a cap about the client: its jobs (max_queued_jobs_per_client) or its address's (max_queued_jobs_per_address)"
           " queued or running; see Retry-After",
    "503": "server busy (queue_depth, max_queued_jobs, request_timeout_s) or shutting down; see Retry-After",
}


def _openapi_with_guard_responses(app: FastAPI) -> dict:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _add_request_examples(app, schema)
    for operations in schema.get("paths", {}).values():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            codes = ["503"] if method != "post" else list(GUARD_RESPONSES)
            for code in codes:
                responses.setdefault(code, {"description": GUARD_RESPONSES[code]})
    add_not_found(schema)  # an id it names that is not held here: 404 (app/openapi_404.py)
    app.openapi_schema = schema
    return schema


def _add_request_examples(app: FastAPI, schema: dict) -> None:
    """Explicit request examples (app/schemas.py request_examples) naming this server's models, so that
    Swagger's "Try it out" sends a body the server accepts."""
    runtime = getattr(app.state, "runtime", None)
    if runtime is None:  # no lifespan (the schema asked for outside a server): no model to name
        return
    from models.images import image_id_for

    from app.schemas import request_examples

    families: dict[str, str] = {}
    for model_id, spec in runtime.specs.items():
        families.setdefault(spec.family, model_id)
    samples: dict[str, str] = {}
    for sample in images.SAMPLES:  # the page's example photos keep content-hash ids, the same on every replica
        path = images.SAMPLES_DIR / sample["file"]
        if sample["model"] in runtime.specs and sample["model"] not in samples and path.is_file():
            samples[sample["model"]] = image_id_for(path.read_bytes())
    from app.pipeline.audio import SAMPLE_ID, sample_path  # the bundled speech clip has a fixed id, where setup made it

    clip = SAMPLE_ID if sample_path(runtime).is_file() else None
    for path, named in request_examples(families, samples, clip).items():
        body = schema.get("paths", {}).get(path, {}).get("post", {}).get("requestBody", {})
        media = body.get("content", {}).get("application/json")
        if media is not None and named:
            media["examples"] = named


app = create_app()
