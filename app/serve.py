"""`python -m app.serve [APP] [uvicorn options]`: uvicorn's command line, with attnlab's process lifecycle.

- **SIGTERM during start-up** (importing torch, loading the app: before uvicorn installs its own
  handlers) exits at once, status 0: `docker stop` of a starting container never waits for its kill.
- **Graceful SIGTERM**: uvicorn stops accepting connections and lets in-flight requests finish; at
  `shutdown_grace_s` (setting, 5 s) after the signal, app/lifecycle.py answers every request still
  running **503 + Retry-After (JSON)** and tells its work to stop; uvicorn's own
  `--timeout-graceful-shutdown` (grace + 2 s) is only a safety net. Then the lifespan shutdown runs and
  the process exits 0 without waiting for worker threads still inside a forward (they hold nothing that
  needs flushing): the whole shutdown stays well inside `docker stop`'s 10 s. (Plain uvicorn re-raises
  the SIGTERM after its graceful shutdown and dies of it, status 143.)
- **Slow or idle connections**: a connection must deliver its request line and headers within
  `header_timeout_s` (10 s) of opening or of its previous response, else it is closed (uvicorn's
  keep-alive timeout, 5 s, closes idle ones; it cannot see a client trickling a header byte at a time);
  at most `max_connections` connections + requests at once (uvicorn's `--limit-concurrency`). Both of
  uvicorn's HTTP protocols get the header timeout: httptools (the default when installed, as it is from
  requirements.txt) and h11 (`--http h11`). The event loop is asyncio's unless `--loop` says otherwise: uvloop
  measured 1-2 ms slower per API request here (sync endpoints hop to worker threads and back), see
  benchmarks/results section 7.
  Bodies are timed by the app (`body_timeout_s`, app/lifecycle.py).
- **Header sizes**: both protocols count a request's head (request line + header lines) as its bytes arrive,
  before the parser buffers them, and answer **431** (JSON naming the setting, then close) past
  `max_header_bytes` (64 KiB in all) or `max_header_line_bytes` (8 KiB for one line), as nginx's
  `large_client_header_buffers 8 8k` would: a 64 MB header flood costs the server 64 KiB, not gigabytes.

APP defaults to app.main:app. Explicit uvicorn options win over these defaults.

`--model SOURCE` (repeatable) adds an operator's checkpoint, a hub id in the local cache or a folder, of any
family (e.g. `--model gpt2 --model ./my-vit`); its id is the last path part, or give one: `--model id=SOURCE`.
It is the command-line form of the `extra_models` setting (ATTNLAB_EXTRA_MODELS); a request never adds one.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # one of uvicorn's [standard] extras (requirements.txt): a C HTTP parser
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: the h11 protocol below serves alone
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from app.allocator import allocator_report, bound_allocator, start_malloc_trim, start_warm_heap
from app.preparation import stop_all
from app.settings import get_settings

if TYPE_CHECKING:  # imported with the app itself, not before torch's settings are made here
    from app.process import ProcessState

# The module (the package's `uvicorn.main` attribute is the click command of the same name).
uvicorn_main = importlib.import_module("uvicorn.main")
DEFAULT_APP = "app.main:app"
SAFETY_NET_S = 2.0  # uvicorn's --timeout-graceful-shutdown = shutdown_grace_s + this


log = logging.getLogger("attnlab")


class HeaderBudget:
    """Counts the bytes of one request head (request line + header lines) before the parser sees them, and
    refuses the request with 431 past `max_header_bytes` in all or `max_header_line_bytes` on one line.

    While a head is being read, data is fed to the parser one line at a time, each line checked first, so
    neither parser ever holds more than the limits (httptools keeps a header value it has not finished in
    memory, however long; h11 would answer 400, not 431). Once the head is complete, the rest (the body,
    timed and capped by the app) goes to the parser at once. A normal head arrives whole in one read and is
    fed whole after one scan."""

    max_header_bytes = 64 * 1024
    max_header_line_bytes = 8 * 1024
    LINGER_S = 5.0  # after a 431, what the client still sends is read and dropped for at most this long
    LINGER_IDLE_S = 0.5  # … or until it has been quiet this long
    _head_bytes = 0
    _line_bytes = 0
    _head_refused = False
    _linger_end = 0.0
    _linger_timer = None

    def _head_reset(self) -> None:
        self._head_bytes = self._line_bytes = 0

    def _feed_counted(self, data: bytes, in_head: Callable[[], bool], feed: Callable[[bytes], None]) -> None:
        if self._head_refused:
            self._linger()  # answered 431: drop what still comes, close once the client is quiet
            return
        if not in_head():
            feed(data)
            return
        if self._head_bytes == 0 and self._whole_head_fits(data):
            feed(data)  # the usual case: a whole head within the limits in this read
            return
        pos, size = 0, len(data)
        while pos < size:
            if not in_head():
                feed(data[pos:])  # the head is complete: the body (or a pipelined request) goes on at once
                return
            newline = data.find(b"\n", pos)
            end = size if newline < 0 else newline + 1
            line_bytes = self._line_bytes + end - pos
            head_bytes = self._head_bytes + end - pos
            if line_bytes > self.max_header_line_bytes:
                self._refuse_head(f"a request header line is longer than {self.max_header_line_bytes:,} bytes "
                                  f"(max_header_line_bytes)")
                return
            if head_bytes > self.max_header_bytes:
                self._refuse_head(f"the request's headers are larger than {self.max_header_bytes:,} bytes in all "
                                  f"(max_header_bytes)")
                return
            self._line_bytes = 0 if newline >= 0 else line_bytes
            self._head_bytes = head_bytes
            feed(data[pos:end])
            if self._head_refused:
                return
            pos = end

    def _whole_head_fits(self, data: bytes) -> bool:
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > self.max_header_bytes:
            return False
        limit = self.max_header_line_bytes
        return all(len(line) + 1 <= limit for line in data[:end + 2].split(b"\n"))

    def _refuse_head(self, reason: str) -> None:
        self._head_refused = True
        transport = self.transport  # type: ignore[attr-defined]
        client = getattr(self, "client", None)
        log.info("431 for %s: %s", f"{client[0]}:{client[1]}" if client else "a client", reason)
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:  # a response is being sent: no room for a 431
            transport.close()
            return
        body = json.dumps({"detail": reason + "; send fewer or smaller headers"}).encode()
        transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        # A lingering close, as nginx does: closing with unread bytes in the socket makes the kernel send a
        # reset, which can destroy the 431 before the client reads it. So: end our side (FIN after the answer),
        # drop what the client still sends, and close once it is quiet (or after LINGER_S).
        try:
            transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            transport.close()
            return
        self._linger_end = self.loop.time() + self.LINGER_S  # type: ignore[attr-defined]
        self._linger()

    def _linger(self) -> None:
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing():
            return
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        loop = self.loop  # type: ignore[attr-defined]
        delay = min(self.LINGER_IDLE_S, max(0.0, self._linger_end - loop.time()))
        self._linger_timer = loop.call_later(delay, transport.close)


def _remove_run_directories() -> None:
    """The run store's disk-tier directories of this process, removed before os._exit (which runs no finalizers).
    Not imported here when the app never was: then there are none (and torch need not load to exit)."""
    runstore = sys.modules.get("app.runstore")
    if runstore is not None:
        runstore.remove_directories()


def _exit_now(signum=None, frame=None) -> None:
    """SIGTERM before uvicorn serves (or re-raised by uvicorn after its graceful shutdown): exit 0 now,
    without waiting for worker threads (a forward in progress, the model warm-up)."""
    try:
        _remove_run_directories()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


class HeaderTimeoutH11Protocol(HeaderBudget, H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not delivered a request's headers within
    `header_timeout_s` of opening (or of its previous response). A request that is running is never timed
    here (its body is timed by the app). Heads are counted by HeaderBudget (431 past the limits)."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        # h11 is reading a head while the client's side is IDLE (after a request, SEND_BODY then DONE).
        self._feed_counted(data, lambda: self.conn.their_state is h11.IDLE, super().data_received)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete and self._header_timer is not None:
            self._header_timer.cancel()  # a request's headers arrived
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_reset()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def connection_lost(self, exc) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


if HttpToolsProtocol is not None:
    class HeaderTimeoutHttpToolsProtocol(HeaderBudget, HttpToolsProtocol):
        """uvicorn's httptools protocol with the same header timeout as HeaderTimeoutH11Protocol (httptools
        parses in C: about 0.3-0.5 ms less per request than h11 here, benchmarks/results section 7), and the
        same head limits (HeaderBudget)."""

        header_timeout_s = 10.0
        _header_timer = None
        _in_head = True  # between a message's end (or the connection's start) and the next head's end

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            self._feed_counted(data, lambda: self._in_head, super().data_received)

        def on_message_complete(self) -> None:
            self._in_head = True  # what follows is the next (pipelined) request's head
            self._head_reset()
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()
            if self._header_timer is not None:  # a request's headers arrived
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # (a pipelined request already parsed is running: no timer)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()
else:
    HeaderTimeoutHttpToolsProtocol = None  # type: ignore[assignment,misc]


def header_timeout_protocol(http: object) -> object:
    """The protocol class for uvicorn's `--http` choice, with the header timeout: "auto" is httptools when it
    is installed (uvicorn's own rule), else h11. A class given by the caller is kept as it is."""
    if http == "httptools" or (http == "auto" and HeaderTimeoutHttpToolsProtocol is not None):
        if HeaderTimeoutHttpToolsProtocol is None:
            raise SystemExit("--http httptools: the httptools package is not installed (see requirements.txt)")
        return HeaderTimeoutHttpToolsProtocol
    if http in ("auto", "h11"):
        return HeaderTimeoutH11Protocol
    return http


class AttnlabServer(uvicorn.Server):
    """uvicorn's Server: tells the app's lifecycle when shutdown begins, and uses the header timeout."""

    def __init__(self, config: uvicorn.Config) -> None:
        config.http = header_timeout_protocol(config.http)
        super().__init__(config)

    def handle_exit(self, sig, frame) -> None:
        settings = get_settings()
        process = served_process(self.config.loaded_app if self.config.loaded else None)
        if process is not None and sig == signal.SIGTERM and settings.drain_s > 0 and not process.fleet.draining:
            # A drain first (app/fleet.py): not ready, new work 503, jobs and pinned runs served; then the plain stop.
            process.fleet.drain_then(lambda: self._stop(sig, frame, process), settings.drain_s,
                                     tick=_handover_tick(settings, process))
            return
        self._stop(sig, frame, process)

    def _stop(self, sig, frame, process: ProcessState | None) -> None:
        if process is not None:
            process.lifecycle.begin_shutdown(get_settings().shutdown_grace_s)
        super().handle_exit(sig, frame)


def served_process(app: Any) -> ProcessState | None:
    """The process state (app/process.py) of the app uvicorn serves: uvicorn's own middleware wrap the loaded app, each
    keeping the next as `.app`. None before the app is loaded or for an app without one."""
    for _ in range(16):
        if app is None:
            return None
        state = getattr(getattr(app, "state", None), "process", None)
        if state is not None:
            return state
        app = getattr(app, "app", None)
    return None


def _handover_tick(settings, process: ProcessState) -> Callable[[float], None] | None:
    """The drain's handover of `process`'s jobs to peers (app/handover.py), in a fleet with a registry; None outside
    one. Made at the first tick, in the drain's thread: nothing is imported or built in the signal handler."""
    registry = process.fleet.registry
    if registry is None:
        return None
    made: list = []

    def tick(drain_left_s: float) -> None:
        if not made:
            from app.handover import Handover

            made.append(Handover(registry, process.jobs, settings))
        made[0].tick(drain_left_s)

    return tick


def build_args(argv: list[str]) -> list[str]:
    settings = get_settings()
    args = list(argv)
    if not args or args[0].startswith("-"):
        args.insert(0, DEFAULT_APP)
    if not any(a.startswith("--timeout-graceful-shutdown") for a in args):
        args += ["--timeout-graceful-shutdown", f"{settings.shutdown_grace_s + SAFETY_NET_S:g}"]
    if not any(a.startswith("--limit-concurrency") for a in args):
        args += ["--limit-concurrency", str(settings.max_connections)]
    if not any(a.startswith("--loop") for a in args):
        args += ["--loop", "asyncio"]  # not uvloop, even when installed: slower here (see the module docstring)
    if not any(a.startswith("--timeout-keep-alive") for a in args):
        args += ["--timeout-keep-alive", "5"]
    if not any(a.startswith("--h11-max-incomplete-event-size") for a in args):
        # h11's own buffer limit (16 KiB) would answer 400 before max_header_bytes' 431; HeaderBudget counts first
        args += ["--h11-max-incomplete-event-size", str(settings.max_header_bytes + 1024)]
    if "--server-header" not in args and "--no-server-header" not in args:
        args.append("--no-server-header")  # no `server: uvicorn`: nothing to fingerprint
    return args


def _log_to_stderr() -> None:
    """The app's logger ("attnlab": cancelled requests, aborted uploads, errors) beside uvicorn's, at INFO."""
    logger = logging.getLogger("attnlab")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s attnlab: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def take_models(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split `--model [ID=]SOURCE` options off the command line: (the rest, {id: source})."""
    rest, models = [], {}
    args = iter(argv)
    for arg in args:
        if arg == "--model" or arg.startswith("--model="):
            value = arg.split("=", 1)[1] if arg.startswith("--model=") else next(args, None)
            if not value:
                raise SystemExit("--model needs a value: a hub id, a folder, or ID=SOURCE")
            model_id, _, source = value.rpartition("=") if "=" in value else ("", "", value)
            models[model_id or source.rstrip("/").rsplit("/", 1)[-1]] = source
        else:
            rest.append(arg)
    return rest, models


def add_models(models: dict[str, str]) -> None:
    """Merge command-line models into ATTNLAB_EXTRA_MODELS, read when the app builds its settings."""
    if not models:
        return
    configured = json.loads(os.environ.get("ATTNLAB_EXTRA_MODELS") or "{}")
    os.environ["ATTNLAB_EXTRA_MODELS"] = json.dumps({**configured, **models})
    get_settings.cache_clear()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" not in argv:
        # MALLOC_ARENA_MAX=2 unless set or turned off (app/cli.py): re-executes this module with it, same pid
        argv = bound_allocator("app.serve", argv)
    signal.signal(signal.SIGTERM, _exit_now)  # until uvicorn installs its own (and again when it restores this)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked across the re-execution (app/cli.py)
    argv, models = take_models(argv)
    add_models(models)
    _log_to_stderr()
    log.info("allocator: %s", allocator_report(os.environ))
    settings = get_settings()
    for protocol in (HeaderTimeoutH11Protocol, HeaderTimeoutHttpToolsProtocol):
        if protocol is not None:
            protocol.header_timeout_s = settings.header_timeout_s
            protocol.max_header_bytes = settings.max_header_bytes
            protocol.max_header_line_bytes = settings.max_header_line_bytes
    uvicorn_main.Server = AttnlabServer  # uvicorn.main.run builds its Server from this module global
    warm = start_warm_heap(settings.warm_heap_bytes)
    log.info("allocator: warm heap %s", f"{settings.warm_heap_bytes / 2**20:g} MiB" if warm else "off")
    trimmer = start_malloc_trim(settings.malloc_trim_interval_s, 2 * warm.nbytes if warm else 0)
    log.info("allocator: malloc_trim(0) %s", f"every {settings.malloc_trim_interval_s:g} s" if trimmer else "off")
    try:
        uvicorn_main.main.main(args=build_args(argv), prog_name="uvicorn")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = 0
    try:
        stop_all()  # background preparations (app/preparation.py): the lifespan's close stopped them when it ran
        _remove_run_directories()  # the lifespan's close did it when the lifespan ran to its end
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)  # don't wait for worker threads still inside a forward


if __name__ == "__main__":
    main()
