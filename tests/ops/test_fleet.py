"""Issue 36 §2, §3, §6: three replicas, Debian's redis-server and Debian's nginx from deploy/nginx.conf (only addresses
substituted, tests/ops/fleet.py). A run id names its replica and any replica forwards a run's requests to the owner,
so every window of a long run and of both runs of a compare answers, whichever replica a request lands on (before:
round robin answered 6 of 20). One client's three jobs all end done, none silent for 30 s; a SIGKILL of the replica
running an attnlab.Lab call still returns the result, with working windows; a SIGTERM drains.

Each window below is sent as another client (its own X-Attnlab-Client), so nginx's hash spreads them over the three
replicas the way round robin did. Every loop is bounded; every process is stopped in the fixture's `finally`."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from app.ids import run_owner
from attnlab import Lab
from tests.ops.fleet import Fleet, build_long_llama, long_text, running_fleet

pytestmark = pytest.mark.slow  # three replicas, redis-server and nginx; replicas killed, drained and restarted

LONG_WORDS = 2400  # about the 2,395-token run
SETTINGS = {"default_models": ["lm"], "full_map_tokens": 64, "max_tokens": 4096, "max_text_chars": 40_000,
            "drain_s": 15.0, "shutdown_grace_s": 2.0}
MASK = [{"op": "mask_keys", "tokens": [1, 2, 3], "layers": [0, 1], "heads": [0, 1]}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = build_long_llama(tmp_path_factory.mktemp("long-llama"))
    with running_fleet(tmp_path_factory.mktemp("fleet"), SETTINGS, folder) as started:
        yield started


def client(n: int | str) -> dict:
    return {"X-Attnlab-Client": f"client-{n}"}


def attention(fleet: Fleet, who, text: str, **body) -> dict:
    """POST /api/text/attention through nginx as a job (a long input is refused plain over request_timeout_s)."""
    r = httpx.post(fleet.nginx.base + "/api/text/attention", headers={**client(who), "Accept": "text/event-stream"},
                   timeout=600, json={"model": "lm", "text": text, **body})
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert events and events[-1].get("done") is True, events[-1:]
    return events[-1]


def windows(fleet: Fleet, run_id: str, n_tokens: int, tag: str, count: int = 20, **extra) -> list[httpx.Response]:
    """`count` windows of `run_id`, each sent through nginx as another client, over the whole map."""
    answers = []
    for i in range(count):
        r0 = (i * 97) % max(1, n_tokens - 64)
        body = {"layer": i % 4, "head": i % 4, "rows": [r0, r0 + 64], "cols": [0, 64], **extra}
        answers.append(httpx.post(f"{fleet.nginx.base}/api/runs/{run_id}/window", headers=client(f"{tag}-{i}"),
                                  json=body, timeout=60))
    return answers


def test_windows_of_a_long_run_answer_whichever_replica_they_land_on(fleet):
    first = attention(fleet, "owner", long_text(LONG_WORDS), layers=[0], heads=[0])
    run_id, n = first["run_id"], len(first["tokens"])
    assert first["attention"] is None and n > 2000  # a long run: windows are its only maps
    owner = run_owner(run_id)
    assert owner in {r.name for r in fleet.replicas}
    answers = windows(fleet, run_id, n, "long")
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 20, [(a.status_code, a.text[:120]) for a in answers if a.status_code != 200]
    forwarded = {a.headers.get("x-attnlab-forwarded-by") for a in answers} - {None}
    assert forwarded and owner not in forwarded  # windows landed on the other replicas, which forwarded them

    # Control, the old behaviour: each replica answering only from its own memory (forwarding off by the header
    # a forwarded request carries) answers only the windows sent to the owner.
    direct = []
    for i in range(20):
        replica = fleet.replicas[i % 3]
        direct.append((replica.name, httpx.post(f"{replica.base}/api/runs/{run_id}/window", timeout=60,
                                                headers={"X-Attnlab-Forwarded": "test"},
                                                json={"layer": 0, "head": 0, "rows": [0, 8], "cols": [0, 8]})))
    answered = sum(r.status_code == 200 for _, r in direct)
    assert answered == sum(name == owner for name, _ in direct) < 20
    print(f"\nwindows of a {n}-token run through nginx: 20 of 20 (forwarded by {sorted(forwarded)}); "
          f"without forwarding, round robin over the replicas: {answered} of 20")


def test_both_runs_of_a_compare_answer_every_window(fleet):
    compare = attention(fleet, "comparer", long_text(LONG_WORDS, shift=3), layers=[0], heads=[0], compare=True,
                        interventions=MASK)
    run_id, base_id, n = compare["run_id"], compare["base_run_id"], len(compare["tokens"])
    assert base_id and base_id != run_id and run_owner(run_id) == run_owner(base_id)
    for which in (run_id, base_id):
        answers = windows(fleet, which, n, f"cmp-{which[-6:]}")
        assert [a.status_code for a in answers].count(200) == 20, [a.text[:160] for a in answers if a.status_code != 200]
    # P̂ − P through another replica: `minus` names the base, the path the intervened run; both live on the owner.
    minus = windows(fleet, run_id, n, "minus", count=5, minus=base_id)
    assert all(a.status_code == 200 for a in minus), [a.text[:160] for a in minus]


def test_a_run_of_a_replica_that_is_gone_says_so(fleet):
    gone = httpx.post(f"{fleet.nginx.base}/api/runs/zzzz9999.{'0' * 32}/window", headers=client("gone"), timeout=30,
                      json={"layer": 0, "head": 0, "rows": [0, 8], "cols": [0, 8]})
    assert gone.status_code == 404 and "its replica (zzzz9999) is gone" in gone.json()["detail"]


def stream_job(fleet: Fleet, who, text: str, out: dict) -> None:
    """POST a streamed job through nginx; out gets its events' kinds, the last event and the longest silence (s)."""
    silence, last, kinds = 0.0, None, []
    with httpx.stream("POST", fleet.nginx.base + "/api/text/attention", timeout=httpx.Timeout(120, connect=10),
                      headers={**client(who), "Accept": "text/event-stream"},
                      json={"model": "lm", "text": text, "layers": [0], "heads": [0], "compare": True,
                            "interventions": MASK}) as r:
        out["status"] = r.status_code
        before = time.monotonic()
        buffer = b""
        for chunk in r.iter_raw():
            now = time.monotonic()
            silence, before = max(silence, now - before), now
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = [line for line in event.split(b"\n") if line.startswith(b"data:")]  # after its `id:` line
                if data:
                    last = json.loads(data[0][5:])
                    kinds.append(next(iter(last)))
    out.update(silence=silence, last=last, kinds=kinds, ended=time.monotonic())


def test_three_jobs_of_one_client_all_end_done_none_silent(fleet):
    outs = [{} for _ in range(3)]
    threads = [threading.Thread(target=stream_job, args=(fleet, "jobs", long_text(LONG_WORDS, shift=10 + i), outs[i]))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for out in outs:
        assert out.get("status") == 200 and out["last"] and out["last"].get("done") is True, out
        assert out["silence"] < 30, out  # a waiting job's stream still sends something
    owners = {run_owner(out["last"]["run_id"]) for out in outs}
    assert len(owners) == 1  # one client's work lands together: its jobs queue one at a time on one replica
    print(f"\nthree jobs of one client: longest silence {max(o['silence'] for o in outs):.2f} s, owner {owners}")


def timed_job(base: str, who, text: str, out: dict, started: threading.Event | None = None) -> None:
    """POST a streamed compare to one replica directly (no nginx: its affinity cannot help); out gets its status,
    every event with the time it arrived, and the body of a refusal. `started` is set at its first progress event."""
    out["events"] = []
    with httpx.stream("POST", base + "/api/text/attention", timeout=httpx.Timeout(300, connect=10),
                      headers={**client(who), "Accept": "text/event-stream"},
                      json={"model": "lm", "text": text, "layers": [0], "heads": [0], "compare": True,
                            "interventions": MASK}) as r:
        out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
        if r.status_code != 200:
            out["body"] = r.read().decode()
            return
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                out["events"].append((time.monotonic(), event))
                if started is not None and "progress" in event:
                    started.set()


def _running_interval(out: dict) -> tuple[float, float]:
    """From a job's first progress event to its done event (the times they arrived)."""
    times = [t for t, event in out["events"] if "progress" in event or event.get("done")]
    return times[0], times[-1]


def test_one_client_runs_one_job_at_a_time_across_replicas_by_redis(fleet):
    """Two jobs of one client sent to two replicas directly: the second waits its turn on the fleet's lease in Redis
    (accepted with queue_position 1, heartbeats while it waits) and runs only after the first has ended; both end
    done. A fifth job of the client while four are alive on the fleet is refused at once (429 + Retry-After: a cap
    about the client, not the replica).
    Before (one job per client per process only), both ran at once and the fifth was accepted."""
    who = "one-at-a-time"
    first, second = {}, {}
    first_started = threading.Event()
    a = threading.Thread(target=timed_job, args=(fleet.replicas[0].base, who, long_text(LONG_WORDS, shift=80), first,
                                                 first_started))
    a.start()
    assert first_started.wait(120), first
    b = threading.Thread(target=timed_job, args=(fleet.replicas[1].base, who, long_text(LONG_WORDS, shift=81), second))
    b.start()
    # two short ones on the third replica fill the client's cap (max_queued_jobs_per_client=4) over the fleet
    shorts = [{} for _ in range(2)]
    waiting = [threading.Thread(target=timed_job, args=(fleet.replicas[2].base, who, long_text(40, shift=82 + i), out))
               for i, out in enumerate(shorts)]
    for t in waiting:
        t.start()
    end = time.monotonic() + 60
    while sum(bool(o.get("events")) for o in (second, *shorts)) < 3 and time.monotonic() < end:
        time.sleep(0.05)
    over = {}
    alive = [not any(e.get("done") or "error" in e for _, e in out.get("events", [])) for out in (first, second, *shorts)]
    assert all(alive), f"four jobs of the client must be alive when the fifth is sent: {alive}"
    timed_job(fleet.replicas[0].base, who, long_text(40, shift=90), over)
    for t in (a, b, *waiting):
        t.join(timeout=600)
    for out in (first, second, *shorts):
        assert out["status"] == 200 and out["events"][-1][1].get("done") is True, out["events"][-1:]
    assert second["events"][0][1]["queue_position"] >= 1  # told it waits for the client's job on another replica
    runs = sorted(_running_interval(out) for out in (first, second, *shorts))
    overlaps = [max(0.0, earlier[1] - later[0]) for earlier, later in zip(runs, runs[1:])]
    assert max(overlaps) < 0.1, runs  # each starts after the one before has ended (0.1 s: the wire's own delays)
    assert over["status"] == 429 and int(over["retry_after"]) >= 1, over
    assert "max_queued_jobs_per_client=4" in over["body"] and "replicas" in over["body"], over["body"]
    gaps = [later[0] - earlier[1] for earlier, later in zip(runs, runs[1:])]
    print(f"\none client's 4 jobs on 3 replicas: running intervals {[(round(s, 1), round(e, 1)) for s, e in runs]}, "
          f"gaps between them {[round(g, 2) for g in gaps]} s; a fifth refused 429 (Retry-After {over['retry_after']})")


class HeldJob(threading.Thread):
    """A streamed compare through nginx, read to its end in a thread (its stream stays open: a job whose streams all
    dropped is cancelled after job_reattach_grace_s): its job id, from its accepted event, and its last event."""

    def __init__(self, base: str, who, text: str):
        super().__init__(daemon=True)
        self.base, self.who, self.text = base, who, text
        self.accepted = threading.Event()
        self.job_id: str | None = None
        self.last: dict | None = None
        self.refusal: tuple | None = None  # (status, body) of an answer that is not a stream
        self.ended_at = float("inf")  # monotonic: when its done or error event arrived
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + "/api/text/attention", timeout=httpx.Timeout(300, connect=10),
                              headers={**client(self.who), "Accept": "text/event-stream"},
                              json={"model": "lm", "text": self.text, "layers": [0], "heads": [0], "compare": True,
                                    "interventions": MASK}) as r:
                if r.status_code != 200:
                    self.refusal = (r.status_code, r.read().decode()[:300])
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.last = json.loads(line[5:])
                        if "done" in self.last or "error" in self.last:
                            self.ended_at = time.monotonic()
                        if self.last.get("accepted"):
                            self.job_id = self.last["job_id"]
                            self.accepted.set()
        finally:
            self.accepted.set()


def test_over_cap_submits_leave_bystanders_served_and_cancels_working(fleet):
    """Issue 53 §3 through the shipped nginx.conf: a client over its fleet-wide job cap gets 429 + Retry-After (not
    503), nginx neither retries it nor takes a replica out, so bystanders get 0 × 502 and the client's cancels
    (DELETE) reach its jobs' replica. Before: `http_503` with `max_fails=1` marked every replica down: 24/30 bystanders and the
    cancels got 502, and the queued jobs ran on."""
    pace = 0.06  # under nginx's own per-address rate (20 r/s): a 429 below is the app's
    who = "over-cap"
    # the client's cap (4) filled: compares of ~4,000 tokens (under max_tokens), one running, three behind it; long
    # enough that the first is still running through the burst on a quiet machine (at ~2,400 tokens it ended first)
    held = []
    for i in range(4):
        held.append(HeldJob(fleet.nginx.base, who, long_text(4000, shift=120 + i)))
        assert held[-1].accepted.wait(120) and held[-1].job_id, (held[-1].refusal, held[-1].last)
    over = []
    for i in range(10):
        time.sleep(pace)
        sent = time.monotonic()
        with httpx.stream("POST", fleet.nginx.base + "/api/text/attention", timeout=60,
                          headers={**client(who), "Accept": "text/event-stream"},
                          json={"model": "lm", "text": long_text(40, shift=140 + i)}) as r:
            over.append((sent, r.status_code, r.headers.get("retry-after"), r.read().decode()[:300]))
    # the ones sent while the client's four jobs were all alive (1 s before the first one's end arrived, for the
    # wire's delays): on a loaded machine a held compare may end during the burst, and frees its place
    first_end = min(job.ended_at for job in held)
    capped = [(status, retry, body) for sent, status, retry, body in over if sent < first_end - 1.0]
    # the first submit follows the fourth acceptance at once: the cap is full then however fast the jobs run (a quiet
    # machine ends the first compare within the burst, so how many more fall in the window varies)
    first = over[0][1:]
    assert first[0] == 429 and int(first[1]) >= 1 and "max_queued_jobs_per_client=4" in first[2], first
    assert [status for status, _, _ in capped] == [429] * len(capped), capped
    assert all("max_queued_jobs_per_client=4" in body and int(retry) >= 1 for _, retry, body in capped)
    bystanders = []
    for i in range(30):
        time.sleep(pace)
        bystanders.append(httpx.post(fleet.nginx.base + "/api/text/tokenize", headers=client(f"bystander-{i}"),
                                     json={"model": "lm", "text": "the cat sat on the mat"}, timeout=60))
    statuses = [r.status_code for r in bystanders]
    assert statuses.count(502) == 0 and statuses == [200] * 30, statuses
    cancels = []
    for job in held:
        time.sleep(pace)
        cancels.append(httpx.delete(f"{fleet.nginx.base}/api/jobs/{job.job_id}", headers=client(who), timeout=30))
    assert [r.status_code for r in cancels] == [200] * 4, [r.text[:160] for r in cancels]
    # each answered by the job's replica (200 naming the job, not nginx's 502); the jobs end, cancelled or done
    # (here they are short: most have ended by now, and the answer says `"cancelled": false`)
    assert [r.json()["job_id"] for r in cancels] == [job.job_id for job in held]
    for job in held:
        job.join(120)
        assert not job.is_alive() and (job.last.get("cancelled") is True or job.last.get("done") is True), job.last
    print(f"\nover-cap submits while the cap was full: {len(capped)} × 429; bystanders: {statuses.count(200)}/30 × "
          f"200, 0 × 502; cancels: 4 × 200, {sum(r.json()['cancelled'] for r in cancels)} of them of a live job")


def test_a_job_re_attaches_through_another_replica(fleet):
    """A job id names its replica like a run id: its events asked of another replica are forwarded to the owner."""
    owner, other = fleet.replicas[0], fleet.replicas[1]
    headers = {**client("reattach"), "Accept": "text/event-stream"}
    sent = httpx.post(owner.base + "/api/text/attention", headers=headers, timeout=120,
                      json={"model": "lm", "text": long_text(200, shift=30), "layers": [0], "heads": [0]})
    assert sent.status_code == 200, sent.text
    ids = [line[3:].strip() for line in sent.text.splitlines() if line.startswith("id:")]
    job_id = ids[0].rpartition(":")[0]
    assert run_owner(job_id) == owner.name and len(ids) >= 3
    again = httpx.get(f"{other.base}/api/jobs/{job_id}/events", headers={**headers, "Last-Event-ID": ids[0]},
                      timeout=60)
    assert again.status_code == 200 and again.headers.get("x-attnlab-forwarded-by") == other.name, again.text
    assert [line[3:].strip() for line in again.text.splitlines() if line.startswith("id:")] == ids[1:]
    gone = httpx.get(f"{fleet.nginx.base}/api/jobs/zzzz9999.{'0' * 32}/events", headers=headers, timeout=30)
    assert gone.status_code == 404 and "its replica (zzzz9999) is gone" in gone.json()["detail"]


def _running_replica(fleet: Fleet, limit_s: float = 60):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        for replica in fleet.replicas:
            try:
                if replica.jobs():
                    return replica
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    raise AssertionError("no replica ever showed the job")


def test_sigkill_of_the_replica_running_a_lab_call_still_returns_the_result(fleet):
    lab = Lab(fleet.nginx.base, progress=False, timeout=120)
    answer: dict = {}

    def call() -> None:
        try:
            answer["result"] = lab.attention(long_text(LONG_WORDS, shift=20), "lm", layers=[0], heads=[0],
                                             compare=True, interventions=MASK)
        except Exception as exc:  # noqa: BLE001 - said below
            answer["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    victim = _running_replica(fleet)
    victim.kill()
    worker.join(timeout=300)
    assert "error" not in answer, answer.get("error")
    result = answer["result"]
    run_id = result.response["run_id"]
    assert run_owner(run_id) != victim.name  # run again on a replica that lives
    window = lab.window(run_id, 0, 0, (0, 32), (0, 32))
    assert window.response["attention"] is not None
    print(f"\nSIGKILL of {victim.name}: the Lab call returned a run of {run_owner(run_id)}; its window answers")

    # Its replacement gets no work while it loads: new work is a quick 503 (nginx then moves it on).
    fresh = fleet.restart(victim, wait=False)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            if httpx.get(fresh.base + "/api/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    loading = httpx.get(fresh.base + "/api/ready", timeout=5).status_code == 503
    started = time.monotonic()
    refused = httpx.post(fresh.base + "/api/text/attention", timeout=60, json={"model": "lm", "text": "the cat sat"})
    if loading and httpx.get(fresh.base + "/api/ready", timeout=5).status_code == 503:  # still loading throughout
        assert refused.status_code == 503 and "still loading" in refused.json()["detail"], refused.text
        print(f"a loading replica refused new work with 503 in {time.monotonic() - started:.1f} s")
    fresh.wait_ready()


def _followed(fleet: Fleet, who, last: dict) -> dict:
    """The job's last event, following a drain's handover: re-attached (through nginx) to the new job it names
    until an answer comes (a stream relayed by the draining replica ends when that replica exits)."""
    for _ in range(5):
        if "handed_over" not in last:
            return last
        new_id = last["handed_over"]["job_id"]
        again = httpx.get(f"{fleet.nginx.base}/api/jobs/{new_id}/events", timeout=600,
                          headers={**client(who), "Accept": "text/event-stream", "Last-Event-ID": f"{new_id}:0"})
        events = [json.loads(line[5:]) for line in again.text.splitlines() if line.startswith("data:")]
        last = events[-1] if events and ("done" in events[-1] or "error" in events[-1]) else last
    return last


def test_sigterm_drains(fleet):
    # A run owned by the replica about to drain, and a client whose work lands there.
    # A replica restarted by an earlier test may still be loading (its new work moves on with 503): clients are tried
    # until one lands on each replica, for up to 60 s.
    runs: dict = {}
    end, i = time.monotonic() + 60, 0
    while len(runs) < len(fleet.replicas) and time.monotonic() < end:
        made = attention(fleet, f"drain-{i}", long_text(200, shift=40 + i % 60), layers=[0], heads=[0])
        if run_owner(made["run_id"]) in runs:
            time.sleep(0.2)
        runs.setdefault(run_owner(made["run_id"]), (f"drain-{i}", made["run_id"], len(made["tokens"])))
        i += 1
    target = fleet.replicas[0]
    assert target.name in runs, f"no client's work reached {target.name} in 60 s: {sorted(runs)}"
    who, pinned_run, n = runs[target.name]
    job: dict = {}
    worker = threading.Thread(target=stream_job, args=(fleet, who, long_text(LONG_WORDS, shift=60), job))
    worker.start()
    end = time.monotonic() + 60
    while not target.jobs() and time.monotonic() < end:
        time.sleep(0.05)
    signalled = time.monotonic()
    target.proc.send_signal(15)  # SIGTERM

    # Readiness goes off at once; new work from the same client lands on another replica.
    ready = httpx.get(target.base + "/api/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    moved = attention(fleet, who, long_text(120, shift=70), layers=[0], heads=[0])
    assert run_owner(moved["run_id"]) != target.name
    # Its pinned run is still served, forwarded from the other replicas.
    answers = windows(fleet, pinned_run, n, "drain-win", count=10)
    assert all(a.status_code == 200 for a in answers), [a.text[:160] for a in answers]
    # The running job finishes: there, or on a peer it was handed to (app/handover.py) when its ETA was past the
    # drain's time left; its stream's last event then names the new job, which a re-attach follows to its end.
    worker.join(timeout=300)
    assert _followed(fleet, who, job.get("last") or {}).get("done") is True, job
    assert target.proc.wait(timeout=60) == 0
    stopped_after = time.monotonic() - signalled
    # Once it is gone, its runs say so: it drained (410).
    gone = windows(fleet, pinned_run, n, "after", count=1)[0]
    assert gone.status_code == 410 and "drained" in gone.json()["detail"], gone.text
    print(f"\nSIGTERM drain of {target.name}: job done, 10/10 windows during the drain, exited 0 after {stopped_after:.1f} s")
