"""The life of one HTTP request around the app: its body, its client, and the server's shutdown.

`RequestGuard` (pure ASGI, outside the admission gate) does, for every API POST:
- reads the whole body BEFORE the request is admitted (so a client that stalls mid-body holds a
  connection, not a slot of `queue_depth`), within `body_timeout_s` (`upload_timeout_s` for image
  uploads) → else 408; at most `max_json_bytes` (`max_upload_bytes` + multipart slack for uploads) → else
  413, from Content-Length before reading when the client declares it;
- refuses a JSON endpoint's body that is not `application/json` (415) and parses it itself, off the
  event loop when it is larger than a few KiB, with messages that say what is wrong (not UTF-8, nested
  too deeply, a number with too many digits, where the syntax breaks); the parsed value is handed to
  FastAPI by the API routers' route class (`ParsedJsonRoute`), so the body is parsed once;
- watches for the client leaving while the request runs: the request's cancel event (`check_cancelled`,
  called between samples and model runs) is then set, and its work stops at the next check.

With `result_cache_scope="client"` it also names the request's client for the result cache (`cache_scope`):
the `X-Attnlab-Client` header when a client sends one, else the `attnlab_client` cookie, which it sets (a
random id, HttpOnly) on the first response to a browser without one.

For every request (static files aside) it also answers **503 + Retry-After (JSON)** when the server shuts
down: at once for a request that arrives after shutdown began, and `shutdown_grace_s` after the SIGTERM
for one still running (its work is told to stop; the process does not wait for it). A server-sent-event
stream that has started (POST /api/text/generate) gets a last event instead, `{"error": …, "retry_after": 5}`,
and its body is ended cleanly (the final chunk), so the client sees why it stopped and when to retry.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread
from fastapi.routing import APIRoute
from starlette.requests import Request

from app.context import ContextField, RequestContext, current, enter, leave
from app.in_flight import MODEL_REQUESTS

log = logging.getLogger("attnlab")

JSON_IN_THREAD_BYTES = 16 * 1024  # larger bodies are parsed in a worker thread
MULTIPART_SLACK = 64 * 1024  # boundaries and part headers around an uploaded file
SHUTDOWN_RETRY_AFTER_S = 5
SCOPE_JSON_KEY = "attnlab.json"
SCOPE_BODY_KEY = "attnlab.body"  # an API POST's body as read here: a drain sends a job's request again (app/handover.py)


# ---- cancellation of a request's work ---------------------------------------------------------------
class RequestCancelled(Exception):
    """The request's client left, or the server is shutting down: its remaining work is skipped."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Set by RequestGuard for the request's task; the worker thread of a sync endpoint sees it too (anyio
# copies the context into the thread).
class CancelEvent(threading.Event):
    """Set when a request's work should stop; `reason` is "client" or "shutdown" (the first one set)."""

    reason = "cancelled"


# The request's cancel event (app/context.py RequestContext.cancel), read where no context is passed yet: the job
# board's wait for a client's earlier job (app/jobs.py)
request_cancel = ContextField("cancel")
SCOPE_COOKIE = "attnlab_client"
SCOPE_HEADER = "x-attnlab-client"
SCOPE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
SCOPE_COOKIE_MAX_AGE_S = 30 * 24 * 3600


def client_scope(headers: list[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """(the client's cache scope, whether it is new and must be set as a cookie)."""
    cookie_value = None
    for key, value in headers:
        if key == SCOPE_HEADER.encode():
            text = value.decode("latin-1").strip()
            if SCOPE_PATTERN.match(text):
                return "h:" + text, False
        elif key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                name, _, text = part.strip().partition("=")
                if name == SCOPE_COOKIE and SCOPE_PATTERN.match(text):
                    cookie_value = text
    if cookie_value is not None:
        return "c:" + cookie_value, False
    from app.ids import new_id

    return "c:" + new_id(), True


def after_layer(layer: int, n_layers: int, ctx: RequestContext | None = None) -> None:
    """The engine's per-layer listener during the request `ctx`'s model work (None: the current context): a client
    that left stops the forward at its next layer (not at the end of the forward), and a progress stream hears of
    each layer done."""
    ctx = ctx or current()
    check_cancelled(ctx)
    if ctx.progress is not None:
        ctx.progress(layer + 1, n_layers)


def check_cancelled(ctx: RequestContext | None = None) -> None:
    """Raise RequestCancelled when the request `ctx`'s client has gone or the server is shutting down (None: the
    current context's). Cheap (an Event lookup): call it between samples and between model runs."""
    event = (ctx or current()).cancel
    if event is not None and event.is_set():
        raise RequestCancelled(event.reason)


def _cancel(event: CancelEvent, reason: str) -> None:
    if not event.is_set():
        event.reason = reason
    event.set()


# ---- shutdown ---------------------------------------------------------------------------------------
class Lifecycle:
    """Shutdown state shared by the server process (app/serve.py calls `begin_shutdown` from its SIGTERM
    handling) and the requests' guards. One per app (app/process.py); serve.py's signal handling reaches the served
    app's."""

    def __init__(self) -> None:
        self.shutting_down = False
        self.cut_off = False
        self.shutdown_started: float | None = None
        self.grace_s = 5.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Future] = set()
        self._orphans: set[asyncio.Task] = set()  # requests answered 503 at shutdown whose work has not noticed yet

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def begin_shutdown(self, grace_s: float | None = None) -> None:
        """Called once when the process is told to stop (from the event loop's thread or any other)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.shutdown_started = time.monotonic()
        if grace_s is not None:
            self.grace_s = grace_s
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: self._loop.call_later(self.grace_s, self._cut))

    def _cut(self) -> None:
        self.cut_off = True
        for waiter in list(self._waiters):
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def cutoff_waiter(self) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        if self.cut_off:
            waiter.set_result(None)
        else:
            self._waiters.add(waiter)
        return waiter

    def forget(self, waiter: asyncio.Future) -> None:
        self._waiters.discard(waiter)
        if not waiter.done():
            waiter.cancel()

    def keep_orphan(self, task: asyncio.Task) -> None:
        """Hold a request's task answered 503 at shutdown until its work notices (the loop keeps only weak ones)."""
        self._orphans.add(task)
        task.add_done_callback(self._forget_orphan)

    def _forget_orphan(self, task: asyncio.Task) -> None:
        self._orphans.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" noise at exit

    def reset(self) -> None:  # tests
        self.__init__()


# ---- JSON ---------------------------------------------------------------------------------------------
class BodyError(Exception):
    def __init__(self, status: int, detail: Any):
        super().__init__(detail)
        self.status, self.detail = status, detail


def parse_json_body(body: bytes) -> Any:
    """json.loads with errors a client can act on (FastAPI's say only "There was an error parsing the body")."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the body is not valid UTF-8 (byte {exc.start} is 0x{body[exc.start]:02x}); send JSON in UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BodyError(422, [{"loc": ["body", exc.pos], "type": "json_invalid",
                               "msg": f"JSON decode error: {exc.msg} at line {exc.lineno}, column {exc.colno}"}]) from None
    except RecursionError:
        raise BodyError(400, "the JSON is nested too deeply (more than about 1,000 levels of arrays/objects)") from None
    except ValueError as exc:  # Python's int() limit: "Exceeds the limit (4300 digits) for integer string conversion"
        if "digits" in str(exc):
            raise BodyError(400, "the JSON holds a number with more than 4,300 digits") from None
        raise BodyError(400, "the JSON could not be parsed") from None


class ParsedJsonRequest(Request):
    """A request whose JSON body RequestGuard has already read and parsed: `body()` and `json()` answer those instead
    of reading and parsing again (FastAPI reads the body through them)."""

    def __init__(self, scope, receive, parsed: tuple[bytes, Any]):
        super().__init__(scope, receive)
        self._guard_body, self._guard_json = parsed

    async def body(self) -> bytes:
        return self._guard_body

    async def json(self) -> Any:
        return self._guard_json


class ParsedJsonRoute(APIRoute):
    """The API routers' route class (`APIRouter(route_class=ParsedJsonRoute)`, FastAPI's documented way to customise
    the request a route sees): a JSON POST takes the body RequestGuard parsed (off the event loop when it is large),
    as a ParsedJsonRequest, so the body is parsed once; other requests pass as they are."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Any]]:
        handler = super().get_route_handler()

        async def with_parsed_json(request: Request):
            parsed = request.scope.pop(SCOPE_JSON_KEY, None)
            if parsed is not None:
                request = ParsedJsonRequest(request.scope, request.receive, parsed)
            if request.method != "POST":
                return await handler(request)
            MODEL_REQUESTS.entered()  # while its handler works (app/openmp_teams.py)
            try:
                return await handler(request)
            finally:
                MODEL_REQUESTS.left()

        return with_parsed_json


# ---- the guard ----------------------------------------------------------------------------------------
def _json_response(status: int, detail: Any, headers: dict[str, str] | None = None) -> tuple[dict, dict]:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return ({"type": "http.response.start", "status": status, "headers": raw},
            {"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send, status: int, detail: Any, headers: dict[str, str] | None = None) -> None:
    start, body = _json_response(status, detail, headers)
    await send(start)
    await send(body)


def _is_json(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


class RequestGuard:
    """See the module docstring. `settings` needs max_json_bytes, max_upload_bytes, body_timeout_s,
    upload_timeout_s; `upload_paths` are the API POSTs whose body is a multipart upload, not JSON;
    `post_paths()` gives the paths that take a POST (read once, at the first request: the routes are all
    in place by then); a POST to any other path goes on untouched, to its 404/405."""

    def __init__(self, app, settings, upload_paths: tuple[str, ...] = ("/api/images",), lifecycle: Lifecycle | None = None,
                 post_paths: Callable[[], set[str]] | None = None):
        self.app, self.settings, self.upload_paths = app, settings, upload_paths
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()  # the app's (create_app passes it)
        self._post_paths_of, self._post_paths = post_paths, None

    def _takes_post(self, path: str) -> bool:
        if self._post_paths_of is None:
            return True
        if self._post_paths is None:
            self._post_paths = set(self._post_paths_of())
        return path in self._post_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/static/"):
            return await self.app(scope, receive, send)
        lifecycle = self.lifecycle
        lifecycle.attach(asyncio.get_running_loop())
        if lifecycle.shutting_down:
            return await _send_json(send, 503, "the server is shutting down; retry in a moment",
                                    {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S), "Connection": "close"})
        cancel = CancelEvent()
        disconnected = asyncio.Event()
        state = {"started": False, "complete": False, "cut": False, "sse": False}
        watcher: asyncio.Task | None = None
        app_receive = receive

        if scope["method"] == "POST" and scope["path"].startswith("/api/") and self._takes_post(scope["path"]):
            outcome = await self._read_body(scope, receive, send)
            if outcome is None:
                return  # answered (408/413/415/400/422) or the client left
            body, parsed = outcome
            scope[SCOPE_BODY_KEY] = body
            if parsed is not None:
                scope[SCOPE_JSON_KEY] = (body, parsed)
            replayed = False

            async def app_receive():  # the body once, then (like a server) wait for the client to leave
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await disconnected.wait()
                return {"type": "http.disconnect"}

            async def watch():
                message = await receive()  # returns when the client leaves (or the response is complete)
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    if not state["complete"]:
                        _cancel(cancel, "client")
                        log.info("client left during %s %s: its work stops at the next check", scope["method"], scope["path"])

            watcher = asyncio.ensure_future(watch())

        async def guarded_send(message):
            if state["cut"]:
                return  # already answered 503 by the shutdown cut-off
            if message["type"] == "http.response.start":
                state["started"] = True
                if state.get("set_cookie"):  # result_cache_scope="client": this browser's scope from now on
                    message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", state["set_cookie"])]}
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", []))
                # another replica's job relayed (app/fleet.py): it lives on there, so a cut is not its end
                state["relayed"] = any(k.lower() == b"x-attnlab-forwarded-by" for k, _ in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        scoped = None
        if getattr(self.settings, "result_cache_scope", "shared") == "client":
            scoped, new = client_scope(scope.get("headers", []))
            if new:
                state["set_cookie"] = (f"{SCOPE_COOKIE}={scoped[2:]}; Path=/; Max-Age={SCOPE_COOKIE_MAX_AGE_S}; "
                                       "HttpOnly; SameSite=Lax").encode()
        token = enter(current().with_(cancel=cancel, cache_scope=scoped))  # the app's task copies the context
        try:
            task = asyncio.ensure_future(self.app(scope, app_receive, guarded_send))
        finally:
            leave(token)
        cutoff = lifecycle.cutoff_waiter()
        try:
            await asyncio.wait({task, cutoff}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server's own graceful-shutdown timeout cancelled us
            await self._cut(task, cancel, state, send, scope)
            return
        finally:
            lifecycle.forget(cutoff)
            if watcher is not None and (task.done() or state["cut"]):
                watcher.cancel()
        if task.done():
            if watcher is not None:
                watcher.cancel()
            task.result()  # re-raise what the app raised
            return
        await self._cut(task, cancel, state, send, scope)

    async def _cut(self, task: asyncio.Task, cancel: CancelEvent, state: dict, send, scope) -> None:
        """Shutdown grace over: tell the work to stop, answer 503 if nothing was sent yet, don't wait."""
        _cancel(cancel, "shutdown")
        if not task.done():
            self.lifecycle.keep_orphan(task)
        if state["started"] and state["sse"] and not state["complete"] and state.get("relayed"):
            state["cut"] = True  # ended without an error event: the client re-attaches to the job on its owner
            log.info("shutdown: %s %s relayed stream ended after the %g s grace (its job lives on its owner)",
                     scope["method"], scope["path"], self.lifecycle.grace_s)
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001 — the client may be gone already
                pass
            return
        if state["started"] and state["sse"] and not state["complete"]:
            state["cut"] = True  # the stream's own later sends are dropped: this is its last event
            event = {"error": f"the server is shutting down (shutdown_grace_s={self.lifecycle.grace_s:g} s passed); "
                              "the stream ends here, retry in a moment", "retry_after": SHUTDOWN_RETRY_AFTER_S}
            log.info("shutdown: %s %s stream ended with an error event after the %g s grace", scope["method"],
                     scope["path"], self.lifecycle.grace_s)
            try:
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": False})
            except Exception:  # noqa: BLE001 — the client may be gone already
                pass
            return
        if state["started"]:
            return
        state["cut"] = True
        log.info("shutdown: %s %s cut off after the %g s grace (503)", scope["method"], scope["path"], self.lifecycle.grace_s)
        try:
            await _send_json(send, 503, f"the server is shutting down (shutdown_grace_s={self.lifecycle.grace_s:g} s "
                             "passed); retry in a moment", {"Retry-After": str(SHUTDOWN_RETRY_AFTER_S), "Connection": "close"})
        except Exception:  # noqa: BLE001 — the client may be gone already
            pass

    async def _read_body(self, scope, receive, send) -> tuple[bytes, Any] | None:
        s = self.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        upload = scope["path"] in self.upload_paths
        if upload:
            cap, timeout, cap_name, timeout_name = s.max_upload_bytes + MULTIPART_SLACK, s.upload_timeout_s, "max_upload_bytes", "upload_timeout_s"
        else:
            cap, timeout, cap_name, timeout_name = s.max_json_bytes, s.body_timeout_s, "max_json_bytes", "body_timeout_s"
            content_type = headers.get("content-type", "")
            if not _is_json(content_type):
                await _send_json(send, 415, f"send the request body as application/json (got {content_type or 'no content type'!r})")
                return None
        limit = s.max_upload_bytes if upload else cap
        too_large = (f"file: the upload is larger than the limit of {limit:,} bytes ({cap_name})" if upload
                     else f"the request body is larger than the limit of {limit:,} bytes ({cap_name})")
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_json(send, 400, "invalid Content-Length header", {"Connection": "close"})
                return None
            if int(declared) > cap:  # refused before a byte of the body is read
                await _send_json(send, 413, too_large, {"Connection": "close"})
                return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        log.info("client left while sending its body: %s %s after %d bytes", scope["method"], scope["path"], size)
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        await _send_json(send, 413, too_large, {"Connection": "close"})
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            log.info("body timeout: %s %s sent %d bytes in %g s", scope["method"], scope["path"], size, timeout)
            await _send_json(send, 408, f"the request body did not arrive within {timeout:g} s ({timeout_name}); "
                             f"{size:,} bytes came", {"Connection": "close"})
            return None
        body = b"".join(chunks)
        if upload or not body:
            return body, None
        try:
            if len(body) > JSON_IN_THREAD_BYTES:
                parsed = await anyio.to_thread.run_sync(parse_json_body, body)
            else:
                parsed = parse_json_body(body)
        except BodyError as exc:
            await _send_json(send, exc.status, exc.detail)
            return None
        return body, parsed
