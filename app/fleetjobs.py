"""One running job per client across a fleet, kept in Redis (docs/deploy.md "Fleet", issue 36 §3).

On one process the job board (app/jobs.py) lets a client's job start only when its earlier jobs have ended, and caps
its queued jobs at `max_queued_jobs_per_client`. Replicas that share Redis (`redis_url`) keep the same two rules for
the whole fleet, whichever replica each job landed on:

- `attnlab:jobs:<client>` (a sorted set): the client's unfinished jobs by arrival (Redis's own clock, in µs), and
  `attnlab:jobs-alive:<client>` (a hash): each one's expiry and the seconds its replica says are left of it. A job is
  registered at its arrival (one over the cap: 429 + Retry-After), kept alive every third of `job_lease_ttl_s`, and
  removed at its end; one whose replica died drops out when its expiry passes. The same two keys for
  `s:<address>` (`attnlab:jobs:s:<address>`) count the jobs of one source address for max_queued_jobs_per_address.
- `attnlab:job-lease:<client>` (a string, `SET NX` with a TTL of `job_lease_ttl_s`): the job id of the client's one
  running job. A job takes it when no earlier job of its client is alive and nobody holds it; it is renewed with the
  job's other keys and deleted at the job's end. A dead replica's lease expires within `job_lease_ttl_s`.

Every change is one Lua script, so two replicas never both see the lease free. Redis unreachable: the job runs under
the one-process rules and a warning is logged (the fleet's rule is then not kept, its work is not lost).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from app.heartbeat import start_heartbeat

log = logging.getLogger("attnlab")

PREFIX = "attnlab:job"
POLL_S = 0.25  # a job waiting for its client's lease elsewhere asks Redis this often

_COMMON = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- drops the client's jobs whose replica stopped keeping them alive; returns the live ones in arrival order
local function live(now)
  local kept = {}
  for _, job in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local value = redis.call('HGET', KEYS[2], job)
    local expiry = value and tonumber(string.match(value, '^(%d+)')) or 0
    if expiry < now then
      redis.call('ZREM', KEYS[1], job)
      redis.call('HDEL', KEYS[2], job)
    else
      kept[#kept + 1] = {job, tonumber(string.match(value, ':(.*)$')) or 0}
    end
  end
  return kept
end
local function int(n)  -- tostring would write µs since 1970 as 1.7e+15
  return string.format('%.0f', n)
end
local function keep(ttl_ms)
  redis.call('PEXPIRE', KEYS[1], ttl_ms * 4)
  redis.call('PEXPIRE', KEYS[2], ttl_ms * 4)
end
"""
# KEYS: jobs (zset), alive (hash), lease; ARGV: job id, cap, ttl ms, seconds left → {1, ahead…} or {0, n live}
_REGISTER = _COMMON + """
local now = now_us()
local jobs = live(now)
if #jobs >= tonumber(ARGV[2]) then return {0, #jobs} end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], int(now + tonumber(ARGV[3]) * 1000) .. ':' .. ARGV[4])
keep(tonumber(ARGV[3]))
return {1, #jobs}
"""
# ARGV: job id, ttl ms → {1} the lease is this job's; {0, earlier live jobs (id, seconds left)…}; {-1} not registered
_ACQUIRE = _COMMON + """
local now = now_us()
local ahead = {}
for _, entry in ipairs(live(now)) do
  if entry[1] == ARGV[1] then
    local holder = redis.call('GET', KEYS[3])
    if #ahead == 0 and (not holder or holder == ARGV[1]) then
      redis.call('SET', KEYS[3], ARGV[1], 'PX', tonumber(ARGV[2]))
      return {1}
    end
    local flat = {0}
    for _, a in ipairs(ahead) do flat[#flat + 1] = a[1]; flat[#flat + 1] = tostring(a[2]) end
    return flat
  end
  ahead[#ahead + 1] = entry
end
return {-1}
"""
# ARGV: job id, ttl ms, seconds left → 1 kept alive, 0 no longer registered
_RENEW = _COMMON + """
local now = now_us()
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], int(now + tonumber(ARGV[2]) * 1000) .. ':' .. ARGV[3])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[2])) end
keep(tonumber(ARGV[2]))
return 1
"""
# ARGV: job id
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
return 1
"""


@dataclass
class Ahead:
    """A client's earlier job that is alive elsewhere in the fleet: its id and the seconds its replica says are left."""
    job_id: str
    left_s: float


class FleetJobTurns:
    """The fleet-wide job rules of a client (see the module doc) for the job board of this process (JobBoard.fleet).
    `left_of(job_id)` gives the seconds left of one of this process's jobs (its board's ends_in_s), for the others'
    ETAs; it is asked by the thread that keeps the jobs alive."""

    def __init__(self, settings: Any, client: Any = None, left_of: Any = None):
        import redis

        self.ttl_ms = max(1000, round(settings.job_lease_ttl_s * 1000))
        self.client = client or redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s,
                                                     socket_connect_timeout=settings.redis_timeout_s)
        self.errors = redis.exceptions.RedisError
        self._register = self.client.register_script(_REGISTER)
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self.left_of = left_of or (lambda _job_id: 0.0)
        self._held: dict[str, str] = {}  # job id → client: this process's registered jobs
        self._sources: dict[str, str] = {}  # job id → "s:<address>": the address lists they are on
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def keys(client: str) -> list[str]:
        return [f"{PREFIX}s:{client}", f"{PREFIX}s-alive:{client}", f"{PREFIX}-lease:{client}"]

    def register(self, job_id: str, client: str, cap: int, left_s: float) -> int | None:
        """Put the job on its client's fleet-wide list: the number of its client's jobs alive before it, or None
        when the client already has `cap` (the caller refuses the job). Redis unreachable: 0 (one-process rules)."""
        try:
            placed, count = self._register(keys=self.keys(client), args=[job_id, cap, self.ttl_ms, round(left_s, 1)])
        except self.errors as exc:
            log.warning("fleet jobs: Redis did not answer registering job %s (%s): one-process rules", job_id, exc)
            return 0
        if not placed:
            return None
        with self._lock:
            self._held[job_id] = client
        self._start()
        return int(count)

    def register_source(self, job_id: str, source: str, cap: int) -> bool:
        """Put the job on its source address's fleet-wide list too (`attnlab:jobs:s:<address>`, kept and released
        with the job; no lease: the address only counts): False when the address already has `cap` jobs alive (the
        caller refuses the job and releases it). Redis unreachable: True (one-process rules)."""
        owner = "s:" + source
        try:
            placed, _count = self._register(keys=self.keys(owner), args=[job_id, cap, self.ttl_ms, 0])
        except self.errors as exc:
            log.warning("fleet jobs: Redis did not answer registering job %s's address (%s): one-process rules",
                        job_id, exc)
            return True
        if placed:
            with self._lock:
                self._sources[job_id] = owner
        return bool(placed)

    def holds(self, job_id: str) -> bool:
        """Whether the job is on its client's fleet-wide list (registered, not released; False when Redis failed)."""
        with self._lock:
            return job_id in self._held

    def try_start(self, job_id: str) -> bool | list[Ahead]:
        """Take the client's lease: True when this job may run now; else the client's earlier jobs alive elsewhere
        (a list, empty when another job holds the lease). Not registered (it expired, or Redis failed): True."""
        with self._lock:
            client = self._held.get(job_id)
        if client is None:
            return True
        try:
            answer = self._acquire(keys=self.keys(client), args=[job_id, self.ttl_ms])
        except self.errors as exc:
            log.warning("fleet jobs: Redis did not answer for job %s's lease (%s): one-process rules", job_id, exc)
            return True
        if answer[0] != 0:
            return True
        flat = answer[1:]
        return [Ahead(flat[i].decode() if isinstance(flat[i], bytes) else flat[i], float(flat[i + 1]))
                for i in range(0, len(flat), 2)]

    def release(self, job_id: str) -> None:
        """The job ended: off its client's list, and its lease (when it held it) free for the next."""
        with self._lock:
            owners = [self._held.pop(job_id, None), self._sources.pop(job_id, None)]
        for owner in owners:
            if owner is None:
                continue
            try:
                self._release(keys=self.keys(owner), args=[job_id])
            except self.errors as exc:
                log.warning("fleet jobs: Redis did not answer releasing job %s (%s); it expires in %g s", job_id, exc,
                            self.ttl_ms / 1000)

    def renew_all(self) -> None:
        """Keep this process's jobs (and the lease one of them holds) alive for another job_lease_ttl_s."""
        with self._lock:
            held = list(self._held.items()) + list(self._sources.items())
        for job_id, client in held:
            try:
                self._renew(keys=self.keys(client), args=[job_id, self.ttl_ms, round(self.left_of(job_id), 1)])
            except self.errors as exc:
                log.warning("fleet jobs: Redis did not answer keeping job %s alive: %s", job_id, exc)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = start_heartbeat("attnlab-fleet-jobs", self.ttl_ms / 3000, self.renew_all, self._stop)

    def stop(self) -> None:
        """Stop keeping jobs alive and release those still held (a replica's plain stop)."""
        self._stop.set()
        with self._lock:
            held = set(self._held) | set(self._sources)
        for job_id in held:
            self.release(job_id)
