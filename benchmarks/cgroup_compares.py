"""Long compares under a 4 GiB memory cgroup (issue 36 "Done means": every compare either finishes or is refused
within seconds, with no OOM kill).

`python -m app.serve` with the default settings (its default models, memory_budget_bytes, result_pin_s ...) in a
fresh cgroup v1 memory group limited to 4 GiB (as a Kubernetes pod's limit; needs root: /sys/fs/cgroup/memory is
written directly). Beside it, 4 client threads send short first views of smollm2-135m (each its own
X-Attnlab-Client), and 4 more clients each send one streamed compare of the page's long sample
(static/samples/long-sample.txt, lengthened to about `--tokens` tokens with its own words, behind a tag so nothing is
cached) with `compare` and `mask_keys` on a few early tokens. Per compare: accepted or refused (status, seconds after
sending, the reason), its ETA and queue place, time to done, and a few windows of both of its runs asked for right
after done and again `--later-s` seconds later. For the server: peak RSS (VmRSS sampled, VmHWM), the cgroup's
max_usage_in_bytes, failcnt and oom_kill count. Every wait is bounded (`--give-up-s` for the whole run).

    .venv/bin/python -m benchmarks.cgroup_compares [--tokens 4000] [--out benchmarks/results/cgroup_compares.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.served import job_events, server

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = (ROOT / "static" / "samples" / "long-sample.txt").read_text().rstrip("\n")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
LIMIT = 4 * 2**30
MODEL = "smollm2-135m"
WINDOW = {"layer": 0, "head": 0, "rows": [0, 32], "cols": [0, 32]}


def long_text(tokens: int, tag: str) -> str:
    """About `tokens` smollm2 tokens: the long sample (2,932 tokens), continued with its own words when longer."""
    words = SAMPLE.split(" ")
    text = SAMPLE if tokens <= 2932 else " ".join(words * (tokens // 2000 + 1))[: int(tokens * 4.4)]
    return f"[{tag}] {text}"


def cgroup_read(cgroup: Path, name: str) -> str:
    with contextlib.suppress(OSError):
        return (cgroup / name).read_text().strip()
    return ""


@contextlib.contextmanager
def server_in_cgroup(log: Path, ready_s: float):
    """The server with default settings in a fresh 4 GiB cgroup; yields (base url, process, cgroup path)."""
    cgroup = CGROUP_ROOT / f"attnlab-cgcompares-{os.getpid()}"
    log.write_text("")
    with server(log=log, ready_s=ready_s, cgroup=cgroup, cgroup_bytes=LIMIT) as (base, proc):
        yield base, proc, cgroup


def short_views(base: str, k: int, stop: threading.Event, out: list) -> None:
    """One client's short first views, one after another (a word changed each time: nothing cached)."""
    with httpx.Client(base_url=base, timeout=120, headers={"X-Attnlab-Client": f"views-{k}"}) as client:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": MODEL, "text": f"the keeper lit the lamp at the end of the pier {k} {i}",
                    "layers": [0], "heads": [0]}
            started = time.monotonic()
            try:
                status = client.post("/api/text/attention", json=body).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            out.append((status, time.monotonic() - started))
            stop.wait(0.3)


def windows(base: str, final: dict, client: str, each: int = 3) -> dict:
    """`each` windows of the compare's intervened run and of its base run: their statuses."""
    statuses: dict = {}
    for name in ("run_id", "base_run_id"):
        run = final.get(name)
        if not run:
            statuses[name] = "no id"
            continue
        statuses[name] = []
        for i in range(each):
            body = {**WINDOW, "rows": [32 * i, 32 * i + 32], "cols": [0, 32]}
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"{base}/api/runs/{run}/window", json=body, timeout=60,
                               headers={"X-Attnlab-Client": client})
                statuses[name].append(r.status_code)
    return statuses


def compare(base: str, k: int, tokens: int, timeout: float) -> dict:
    """One client's streamed compare of the long text with a few early keys masked."""
    client = f"compare-{k}"
    body = {"model": MODEL, "text": long_text(tokens, f"cg{k}-{time.time():.3f}"), "layers": [0], "heads": [0],
            "compare": True, "interventions": [{"op": "mask_keys", "tokens": [1, 2, 3]}]}
    out: dict = {"client": client, "status": None}
    sent = time.monotonic()
    try:
        for at, event in job_events(base, "/api/text/attention", body, client, timeout, out):
            if event.get("accepted"):
                out.update(accepted_after_s=round(at, 2), eta_s=event.get("eta_s"),
                           queue_position=event.get("queue_position"), total=event.get("total"))
            elif "progress" in event and "first_progress_s" not in out:
                out["first_progress_s"] = round(at, 2)
            if "done" in event or "error" in event:
                out["end"] = "done" if "done" in event else event.get("error")
                out["end_s"] = round(at, 2)
                if "error" in event:
                    out["detail"] = str(event)[:300]
                else:
                    out["tokens"] = len(event.get("tokens") or [])
                    out["windows_at_done"] = windows(base, event, client)
                    out["final"] = {n: event.get(n) for n in ("run_id", "base_run_id")}
    except httpx.HTTPError as exc:
        out.update(end=type(exc).__name__, end_s=round(time.monotonic() - sent, 2))
    return out


def sample_memory(pid: int, cgroup: Path, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        rss = 0
        with contextlib.suppress(OSError):
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS"):
                    rss = int(line.split()[1]) * 1024
        usage = cgroup_read(cgroup, "memory.usage_in_bytes")
        out.append((time.monotonic(), rss, int(usage or 0)))
        stop.wait(0.2)


def run(tokens: int, later_s: float, give_up_s: float, log: Path) -> dict:
    started = time.monotonic()
    with server_in_cgroup(log, ready_s=600) as (base, proc, cgroup):
        ready_s = round(time.monotonic() - started, 1)
        stop, views, memory = threading.Event(), [], []
        idle_rss = cgroup_read(cgroup, "memory.usage_in_bytes")
        helpers = [threading.Thread(target=sample_memory, args=(proc.pid, cgroup, stop, memory), daemon=True)]
        helpers += [threading.Thread(target=short_views, args=(base, k, stop, views), daemon=True) for k in range(4)]
        for t in helpers:
            t.start()
        time.sleep(2)
        results: list[dict] = []
        deadline = time.monotonic() + give_up_s
        workers = [threading.Thread(target=lambda k=k: results.append(compare(base, k, tokens, give_up_s)),
                                    daemon=True) for k in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(max(1.0, deadline - time.monotonic()))
        time.sleep(later_s)
        for r in results:  # the page's next steps a while later: both runs still answer?
            if r.get("final"):
                r["windows_later"] = windows(base, r["final"], r["client"])
        stop.set()
        for t in helpers:
            t.join(130)
        jobs_view = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            jobs_view = httpx.get(f"{base}/api/jobs", timeout=10).json().get("memory", {})
        oom = dict(line.split() for line in cgroup_read(cgroup, "memory.oom_control").splitlines())
        server = {"alive": proc.poll() is None, "ready_s": ready_s, "idle_cgroup_usage_bytes": int(idle_rss or 0),
                  "peak_rss_bytes": max((m[1] for m in memory), default=0),
                  "peak_cgroup_usage_sampled_bytes": max((m[2] for m in memory), default=0),
                  "cgroup_max_usage_bytes": int(cgroup_read(cgroup, "memory.max_usage_in_bytes") or 0),
                  "cgroup_failcnt": int(cgroup_read(cgroup, "memory.failcnt") or 0),
                  "oom_kill": int(oom.get("oom_kill", 0)), "memory_view": jobs_view}
    latencies = [s for status, s in views if status == 200]
    by_status: dict = {}
    for status, _ in views:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    return {"server": server, "compares": sorted(results, key=lambda r: r["client"]),
            "short_views": {"by_status": by_status, "p50_s": round(statistics.median(latencies), 3) if latencies else None,
                            "max_s": round(max(latencies), 3) if latencies else None},
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000, help="about this many tokens per compare (sample: 2,932)")
    ap.add_argument("--later-s", type=float, default=30.0, help="windows of every compare's runs again after this")
    ap.add_argument("--give-up-s", type=float, default=900.0, help="the compares' whole wall time at most")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cgroup_compares.json")
    args = ap.parse_args()
    if not os.access(CGROUP_ROOT, os.W_OK):
        sys.exit(f"{CGROUP_ROOT} is not writable here (cgroup v1 memory controller, as root)")
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_at_start": os.getloadavg(),
              "tokens": args.tokens, "cgroup_limit_bytes": LIMIT}
    result.update(run(args.tokens, args.later_s, args.give_up_s, args.out.with_suffix(".log")))
    result["load_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
