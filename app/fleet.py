"""Replicas of one fleet: who owns a run, where its owner is, and the drain at SIGTERM (docs/deploy.md "Fleet").

A run lives in the memory of the process that computed it, and its id names that process: `<replica>.<hex>`
(app/ids.py). With `redis_url` and `replica_url` set, each replica registers the URL the others reach it at under
`attnlab:replica:<name>` with a TTL of `replica_ttl_s`, refreshed every third of it by a thread.

`FleetRouter` (pure ASGI, inside RequestGuard: the body is read and limited once, there) does, per request:
- a run's request (POST /api/runs/<id>/…, or any JSON body naming a run id of another replica: `minus`, a patch
  `source`) goes to the run's owner when that is another replica: forwarded with httpx, streamed back as it comes
  (a job's server-sent events too); a forwarded request carries `X-Attnlab-Forwarded` and is never forwarded again;
- an owner that is not registered (its process ended: its TTL ran out, or it deregistered) or cannot be reached is
  a 404 that says so: "its replica is gone", not "unknown";
- in a fleet, new work sent to a replica that is loading its models or draining is answered 503 at once (nginx's
  `proxy_next_upstream http_503` moves it to the next replica), as is GET /api/ready while draining;
- a drain hands jobs to peers (app/handover.py): a re-attach whose Last-Event-ID names another job goes to that
  job, one to a handed job whose replica has gone follows `attnlab:job-moved:<id>`, and a drained replica's runs
  (`attnlab:drained:<name>`, written as it stops) answer 410 saying so, not 404.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from typing import Any, NamedTuple

import anyio.to_thread

from app.heartbeat import start_heartbeat
from app.ids import replica_name, run_owner, set_replica_name
from app.lifecycle import SCOPE_JSON_KEY

log = logging.getLogger("attnlab")

KEY_PREFIX = "attnlab:replica:"
FORWARDED_HEADER = b"x-attnlab-forwarded"
RUN_PATH = re.compile(r"^/api/runs/([^/]+)/")
# a job's re-attach and cancel (GET /api/jobs/<id>/events, DELETE /api/jobs/<id>): a job id names its replica as a
# run id does (app/streams.py), and goes to its owner the same way
JOB_PATH = re.compile(r"^/api/jobs/([^/]+)(?:/events)?$")
BODY_RUN_ID = re.compile(rb'"([a-z0-9]{4,16})\.[0-9a-f]{32}"')
HOP_BY_HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length",
              b"proxy-connection", b"trailer"}
FLEET_BODY_KEY = "attnlab.fleet_body"
URL_CACHE_S = 2.0  # an owner's URL is asked of Redis at most this often per owner
DRAINED_PREFIX = "attnlab:drained:"  # a replica that ended a drain: its runs answer 410, not 404 (Registry.stop)
DRAINED_KEEP_S = 24 * 3600
MOVED_PREFIX = "attnlab:job-moved:"  # a job a drain handed over → its new id (app/handover.py writes it)


class Registry:
    """This replica's entry in Redis (`attnlab:replica:<name>` → its URL, with a TTL) and the look-up of others'."""

    def __init__(self, settings, url: str, client: Any = None):
        import redis

        self.name, self.url, self.ttl_s = replica_name(), url, settings.replica_ttl_s
        self.client = client or redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s,
                                                     socket_connect_timeout=settings.redis_timeout_s)
        self._errors = redis.exceptions.RedisError
        self._known: dict[str, tuple[float, str | None]] = {}  # name → (when asked, URL or None)
        # name → the last URL Redis gave for it (asked, or read with the whole registry at each heartbeat): asked
        # before answering "gone" when Redis fails or no longer has the entry (an outage; a Redis restarted empty
        # before the owner's next heartbeat). An owner that really went refuses the connection, or says it is not
        # that replica (FleetRouter), and the answer is "gone" as before.
        self._last_good: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self) -> bool:
        try:
            self.client.set(KEY_PREFIX + self.name, self.url, ex=max(1, round(self.ttl_s)))
            return True
        except self._errors as exc:
            log.warning("fleet: registering replica %s in Redis failed: %s", self.name, exc)
            return False

    def start(self) -> None:
        """Register now and keep the entry alive every third of its TTL, until stop(); each beat also reads the whole
        registry (the last known owners, for an outage)."""
        self.beat()
        log.info("fleet: replica %s registered at %s (TTL %g s)", self.name, self.url, self.ttl_s)
        self._thread = start_heartbeat("attnlab-fleet-heartbeat", self.ttl_s / 3, self.beat, self._stop)

    def beat(self) -> None:
        if self.register():
            self._last_good.update(self.replicas())

    def stop(self, drained: bool = False) -> None:
        """Stop the heartbeat and remove the entry: this replica's runs answer 'its replica is gone' at once; after
        a drain, `attnlab:drained:<name>` (DRAINED_KEEP_S) makes that a 410 saying it drained (`drained_at`)."""
        self._stop.set()
        try:
            if drained:
                self.client.set(DRAINED_PREFIX + self.name, str(round(time.time())), ex=DRAINED_KEEP_S)
            self.client.delete(KEY_PREFIX + self.name)
        except self._errors as exc:
            log.warning("fleet: deregistering replica %s failed: %s", self.name, exc)

    def _get(self, key: str) -> str | None:
        try:
            raw = self.client.get(key)
        except self._errors:
            return None
        return raw.decode() if isinstance(raw, bytes) else raw

    def drained_at(self, name: str) -> str | None:
        """When replica `name` ended a drain (Unix seconds, as text), or None (it was not drained, or long ago)."""
        return self._get(DRAINED_PREFIX + name)

    def moved_to(self, job_id: str) -> str | None:
        """The id a drain handed job `job_id` over as (app/handover.py), or None."""
        return self._get(MOVED_PREFIX + job_id)

    def url_of(self, name: str) -> str | None:
        """The registered URL of replica `name`, or None when it is not registered (or Redis cannot say)."""
        now = time.monotonic()
        known = self._known.get(name)
        if known is not None and now - known[0] < URL_CACHE_S:
            return known[1]
        try:
            raw = self.client.get(KEY_PREFIX + name)
        except self._errors as exc:
            log.warning("fleet: asking Redis for replica %s failed (%s): %s", name, exc,
                        "its last known URL is asked" if name in self._last_good else "not known here")
            raw = None
        url = raw.decode() if isinstance(raw, bytes) else raw
        if url is not None:
            self._last_good[name] = url
        else:  # Redis down, or restarted empty: the owner's last known URL (it may be alive: asked, not presumed)
            url = self._last_good.get(name)
        self._known[name] = (now, url)
        return url

    def replicas(self) -> dict[str, str]:
        """Every registered replica: {name: URL} (for /metrics and the tests)."""
        try:
            keys = list(self.client.scan_iter(KEY_PREFIX + "*", count=100))
            values = self.client.mget(keys) if keys else []
        except self._errors:
            return {}
        return {k.decode()[len(KEY_PREFIX):]: v.decode() for k, v in zip(keys, values) if v is not None}


def expand_url(url: str) -> str:
    """replica_url with `{ip}` replaced by this host's address (compose and Kubernetes give each container its own:
    `http://{ip}:8000` is one setting for every replica) and `{hostname}` by its name."""
    if "{ip}" in url or "{hostname}" in url:
        import socket

        host = socket.gethostname()
        url = url.replace("{hostname}", host)
        if "{ip}" in url:
            url = url.replace("{ip}", socket.gethostbyname(host))
    return url


class Fleet:
    """The fleet state of an app (app/process.py): its registry (None outside a fleet) and the drain, over the app's
    job board `jobs` (the drain waits for it to empty; in a fleet sharing Redis its client rules span the replicas)."""

    def __init__(self, jobs: Any) -> None:
        self.jobs = jobs
        self.registry: Registry | None = None
        self.runtime: Any = None  # the app's Runtime (its kept runs' pins: how long the drain serves them)
        self.draining = False
        self.drain_started: float | None = None

    def start(self, settings, runtime: Any = None) -> None:
        self.runtime = runtime
        if settings.replica_name:
            set_replica_name(settings.replica_name)
        if settings.redis_url and settings.replica_url:
            self.registry = Registry(settings, url=expand_url(settings.replica_url))
            self.registry.start()
        if settings.redis_url:  # replicas sharing Redis: one running job per client over all of them
            from app.fleetjobs import FleetJobTurns

            self.jobs.fleet = FleetJobTurns(settings, left_of=self.jobs.left_s)

    def stop(self) -> None:
        if self.registry is not None:
            self.registry.stop(drained=self.draining)
            self.registry = None
        if self.jobs.fleet is not None:
            self.jobs.fleet.stop()
            self.jobs.fleet = None

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining, self.drain_started = True, time.monotonic()
            log.info("fleet: draining replica %s: not ready, new work refused (503), runs still served",
                     replica_name())

    def drained(self) -> str | None:
        """Why the drain may end now ("jobs done, no run pinned"), or None while a job runs or waits or a run is pinned."""
        if len(self.jobs):
            return None
        cache = getattr(self.runtime, "cache", None)
        pins = getattr(cache, "_pins", {}) or {}
        now = time.monotonic()
        if any(until > now for until, *_ in list(pins.values())):
            return None
        return "no job running or waiting, no run pinned"

    def drain_then(self, stop, drain_s: float, tick=None) -> None:
        """SIGTERM with drain_s > 0: drain (not ready, new work 503, jobs and pinned runs served) until drained() or
        drain_s, then call stop() (the plain shutdown: shutdown_grace_s, then exit). `tick(seconds left)` is called
        every 0.2 s meanwhile (app/handover.py: jobs handed to peers)."""
        self.begin_drain()

        def wait() -> None:
            end = time.monotonic() + drain_s
            why = None
            while time.monotonic() < end and (why := self.drained()) is None:
                if tick is not None:
                    try:
                        tick(end - time.monotonic())
                    except Exception:  # noqa: BLE001 - a failed handover leaves its job to the plain drain
                        log.exception("fleet: drain tick failed")
                time.sleep(0.2)
            log.info("fleet: drain of replica %s over after %.1f s: %s", replica_name(),
                     time.monotonic() - (self.drain_started or 0), why or f"drain_s={drain_s:g} s passed")
            stop()

        threading.Thread(target=wait, name="attnlab-drain", daemon=True).start()

    def reset(self) -> None:  # tests
        self.stop()
        self.__init__(self.jobs)


def _body_of(scope) -> bytes | None:
    """The request's body when RequestGuard (parsed JSON) or FleetRouter (a run route's) read it whole, else None."""
    parsed = scope.get(SCOPE_JSON_KEY)
    return parsed[0] if parsed is not None else scope.get(FLEET_BODY_KEY)


class Owned(NamedTuple):
    """What a request names that lives on one replica: a run (its windows, rows; a body's `minus`) or a job (its
    events, its cancel), by its id, and the replica that owns it."""
    kind: str  # "run" | "job"
    id: str
    owner: str


def _gone(owned: Owned, why: str, drained_at: str | None = None) -> tuple[int, bytes]:
    if drained_at is not None:  # it stopped on purpose (a scale-down): 410, and what to do
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(drained_at))) if drained_at.isdigit() else "?"
        detail = (f"{owned.kind} {owned.id!r}: its replica ({owned.owner}) drained and stopped at {when} (a "
                  f"scale-down); its {owned.kind}s went with it: " + (
                      "send the job again" if owned.kind == "job" else "run the input again for a new run_id"))
        return 410, json.dumps({"detail": detail}).encode()
    if owned.kind == "job":  # a job's events: the client sends the job again
        detail = (f"job {owned.id!r}: its replica ({owned.owner}) is gone ({why}); the job went with it: send the job "
                  "again")
        return 404, json.dumps({"detail": detail}).encode()
    detail = (f"run {owned.id!r}: its replica ({owned.owner}) is gone ({why}); the run went with it: run the input "
              "again for a new run_id")
    return 404, json.dumps({"detail": detail}).encode()


def _job_scope(scope, job_id: str, last_event_id: bytes | None) -> dict:
    """The scope of a re-attach asked of job `job_id` instead, with `last_event_id` (None: from its first event)."""
    path = f"/api/jobs/{job_id}/events"
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"last-event-id"]
    if last_event_id is not None:
        headers.append((b"last-event-id", last_event_id))
    return {**scope, "path": path, "raw_path": path.encode(), "headers": headers}


def _follow_last_event_id(scope) -> dict:
    """A re-attach whose Last-Event-ID names another job (`<new id>:<n>`: the job was handed over by a drain,
    app/handover.py, and a plain SSE client keeps its first URL) is a re-attach to that job."""
    if scope["method"] != "GET" or not scope["path"].endswith("/events"):
        return scope
    match = JOB_PATH.match(scope["path"])
    last = next((v for k, v in scope.get("headers", []) if k.lower() == b"last-event-id"), None)
    if match is None or last is None:
        return scope
    named = last.decode("latin-1").strip().rpartition(":")[0]
    if not named or named == match.group(1) or run_owner(named) is None:
        return scope
    return _job_scope(scope, named, last)


def _forwarded_for(scope) -> bytes:
    """X-Forwarded-For as a proxy passes it on: what it came with, then the peer this replica was reached from (the
    owner reads the source address from it when this replica is one of its trusted_proxies)."""
    came = b", ".join(v for k, v in scope.get("headers", []) if k.lower() == b"x-forwarded-for")
    peer = (scope.get("client") or ("?", 0))[0].encode()
    return came + b", " + peer if came else peer


async def _send_plain(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class FleetRouter:
    """See the module docstring. Added inside RequestGuard and outside the admission gate: forwarding takes no slot."""

    def __init__(self, app, settings, fleet: Fleet):
        self.app, self.settings, self.fleet = app, settings, fleet
        self._client = None

    def _http(self):
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.settings.forward_timeout_s, connect=3.0))
        return self._client

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            return await self.app(scope, receive, send)
        if self.fleet.registry is not None:
            scope = _follow_last_event_id(scope)
        forwarded = any(k == FORWARDED_HEADER for k, _ in scope.get("headers", []))
        if scope["method"] == "POST" and RUN_PATH.match(scope["path"]) and SCOPE_JSON_KEY not in scope:
            receive = await self._buffer_body(scope, receive)  # a run route's body: read here, replayed below
        owned = self._owner_of(scope)
        owner = owned.owner if owned is not None else None
        if owned is not None and owner != replica_name() and not forwarded:
            return await self._forward(owned, scope, receive, send)
        if forwarded and owner is not None and owner != replica_name() and self._named_by_path(scope):
            # sent to the owner's last known URL, which another process serves now (a restart on the same address)
            return await _send_plain(send, *_gone(owned, f"its address now serves replica {replica_name()}"))
        other = self._body_owner(scope) if owned is not None else None
        if other is not None and not forwarded and await self._url(other.owner) is None:
            # this replica's run with another's (`minus`): both live in one process only; a gone one says so
            return await _send_plain(send, *_gone(other, "not registered: its process ended"))
        if self.fleet.draining and scope["path"] == "/api/ready":
            return await _send_plain(send, 503, b'{"status": "draining"}', [(b"retry-after", b"5")])
        if not forwarded and owner is None and self._refuses_work(scope):
            why = "draining (shutting down)" if self.fleet.draining else "still loading its models"
            body = json.dumps({"detail": f"this replica is {why}: retry, another replica will answer"}).encode()
            return await _send_plain(send, 503, body, [(b"retry-after", b"1")])
        return await self.app(scope, receive, send)

    async def _buffer_body(self, scope, receive):
        """Read a run route's JSON body (RequestGuard reads only fixed paths' bodies), at most max_json_bytes: kept in
        the scope as (bytes, None) for the owner look-up and the forward; the app gets it again from the returned
        receive."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.settings.max_json_bytes:
                break
        body, replayed = b"".join(chunks), False
        if not more:
            scope[FLEET_BODY_KEY] = body

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        return replay

    def _owner_of(self, scope) -> Owned | None:
        """The run or job named by the path (None: one whose id names no replica), else by the JSON body (the first
        run of another replica's)."""
        for kind, path in (("run", RUN_PATH), ("job", JOB_PATH)):
            match = path.match(scope["path"])
            if match:
                owner = run_owner(match.group(1))
                return Owned(kind, match.group(1), owner) if owner is not None else None
        return self._body_owner(scope)

    @staticmethod
    def _named_by_path(scope) -> bool:
        return RUN_PATH.match(scope["path"]) is not None or JOB_PATH.match(scope["path"]) is not None

    def _body_owner(self, scope) -> Owned | None:
        """The first run of another replica named in the JSON body, or None."""
        body = _body_of(scope)
        if body is None:
            return None
        here = replica_name().encode()
        for found in BODY_RUN_ID.finditer(body):
            if found.group(1) != here:
                return Owned("run", found.group(0)[1:-1].decode(), found.group(1).decode())
        return None

    def _refuses_work(self, scope) -> bool:
        """New work (an API POST) on a replica of a fleet that is draining or not ready yet."""
        if self.fleet.registry is None or scope["method"] != "POST":
            return False
        if self.fleet.draining:
            return True
        runtime = getattr(scope["app"].state, "runtime", None)
        return runtime is not None and not runtime.ready

    async def _url(self, owner: str) -> str | None:
        registry = self.fleet.registry
        return await anyio.to_thread.run_sync(registry.url_of, owner) if registry is not None else None

    async def _forward(self, owned: Owned, scope, receive, send) -> None:
        owner = owned.owner
        url = await self._url(owner)
        if url is None:
            return await self._answer_gone(owned, "not registered: its process ended", scope, receive, send)
        import httpx

        body = _body_of(scope)
        if body is None and scope["method"] == "POST":
            body = b"".join([(await receive()).get("body", b"")])
        body = body or b""
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in HOP_BY_HOP | {b"x-forwarded-for"}]
        headers.append((FORWARDED_HEADER, replica_name().encode()))
        headers.append((b"x-forwarded-for", _forwarded_for(scope)))  # the source address (app/sources.py)
        target = url.rstrip("/") + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        client = self._http()
        try:
            answer = await client.send(client.build_request(scope["method"], target, headers=headers, content=body),
                                       stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            log.info("fleet: replica %s at %s unreachable for %s: %s", owner, url, scope["path"], exc)
            return await self._answer_gone(owned, "unreachable", scope, receive, send)
        await self._relay(answer, receive, send)

    async def _answer_gone(self, owned: Owned, why: str, scope, receive, send) -> None:
        """The owner is gone: a job a drain handed over is followed to its new id (app/handover.py); a drained
        owner's run or job is a 410 saying so; else the 404 "gone"."""
        registry = self.fleet.registry
        if registry is None:
            return await _send_plain(send, *_gone(owned, why))
        if owned.kind == "job" and scope["method"] == "GET":
            moved = await anyio.to_thread.run_sync(registry.moved_to, owned.id)
            if moved is not None and moved != owned.id:  # its events from the new job's start
                return await self(_job_scope(scope, moved, last_event_id=None), receive, send)
        drained = await anyio.to_thread.run_sync(registry.drained_at, owned.owner)
        return await _send_plain(send, *_gone(owned, why, drained))

    async def _relay(self, answer, receive, send) -> None:
        """The owner's answer as it comes (a job's events one by one); a client that leaves closes the upstream."""
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            await answer.aclose()

        watcher = asyncio.ensure_future(watch())
        try:
            headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in HOP_BY_HOP - {b"content-length"}]
            headers.append((b"x-attnlab-forwarded-by", replica_name().encode()))  # which replica passed it on
            await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
            try:
                async for chunk in answer.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as exc:  # noqa: BLE001 - the owner died mid-answer or the client left: end the body
                log.info("fleet: forwarded answer cut: %s", exc)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await answer.aclose()
