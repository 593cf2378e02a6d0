"""Jobs, fairness and the memory budget (docs/api.md "Jobs", docs/science.md §14), measured on the real server.

Three parts, each against a fresh `attnlab serve` on 127.0.0.1 (loopback only; every loop bounded in time; the
server is stopped at the end):

- `eta`: with `--busy N` busy processes beside the server (default 2: a loaded 2-core machine), long first views of
  the text page's sample at several lengths, a long compare and a continuation, each sent as a job: the accepted
  event's `eta_s` against the real time (the target: within 3× either way).
- `fairness`: 32-token first views (plain JSON, as the page's short views) sent while a 3,000-token job runs, and
  while 6 patching head scans from 6 clients run as jobs: their latencies (the target: within 5 s).
- `memory`: the server in a cgroup with a 4 GiB memory limit (cgroup v1 memory controller, written directly; needs
  root), under a mix of short requests plus 4 concurrent 4,000-token compares from 4 clients as jobs: peak RSS of the
  server and of the cgroup, OOM kills, and whether every compare finished with both runs answering windows (the
  target: nothing killed, peak within memory_budget_bytes + 0.5 GiB).

Writes benchmarks/results/jobs.md and the raw numbers as jobs.json beside it.

    .venv/bin/python -m benchmarks.jobs [--parts eta,fairness,memory] [--busy 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks import served

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = (ROOT / "static" / "samples" / "long-sample.txt").read_text().rstrip("\n")
STREAM = {"Accept": "text/event-stream"}
CGROUP = Path("/sys/fs/cgroup/memory/attnlab-bench")


def _busy(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


@contextlib.contextmanager
def busy_processes(n: int, seconds: float):
    """n processes spinning on a core each (the 'loaded machine'), stopped at the end or after `seconds`."""
    procs = [multiprocessing.Process(target=_busy, args=(time.time() + seconds,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()


@contextlib.contextmanager
def server(env: dict[str, str] | None = None, cgroup_bytes: int | None = None, ready_s: float = 600,
           tree: Path = ROOT):
    """A ready server (benchmarks/served.py), its log in results/jobs-server.log; in the 4 GiB cgroup with
    `cgroup_bytes`; with another `tree` (an older checkout, for a before/after) its app/ served by this venv."""
    with served.server(env, tree=tree, log=ROOT / "benchmarks" / "results" / "jobs-server.log", ready_s=ready_s,
                       cgroup=CGROUP if cgroup_bytes is not None else None, cgroup_bytes=cgroup_bytes) as running:
        yield running


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process."""
    values = {}
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(("VmRSS", "VmHWM")):
                values[line.split(":")[0]] = int(line.split()[1]) * 1024
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def server_pid(proc: subprocess.Popen) -> int:
    """The uvicorn process: `app.serve` re-executes itself (same pid), the cgroup wrapper execs it."""
    return proc.pid


def job(base: str, path: str, body: dict, client: str, timeout: float = 1200) -> dict:
    """Send one job; return its accepted event, the real time, how it ended and the final event."""
    started = time.time()
    out: dict = {"client": client, "status": None}
    for at, event in served.job_events(base, path, body, client, timeout, out):
        if event.get("accepted"):
            out["accepted"] = event
            out["accepted_after_s"] = round(at, 3)
        if "done" in event or "error" in event:
            out["end"] = "done" if "done" in event else event["error"]
            out["final"] = event
    out["real_s"] = time.time() - started
    return out


def text_of(tokens: int, tag: str) -> str:
    """About `tokens` smollm2 tokens of the sample (repeated when longer), behind a tag that makes it a fresh input."""
    words = SAMPLE.split(" ")
    text = " ".join(words * (tokens // 600 + 1))
    return f"[{tag}] " + text[: int(tokens * 4.4)]


# ---- parts ----------------------------------------------------------------------------------------------------------
def part_eta(busy: int) -> dict:
    rows = []
    with server() as (base, _proc), busy_processes(busy, 1800):
        time.sleep(3)  # the busy processes show in the load the server measures
        cases = [("first view, ~1,000 tokens", "/api/text/attention", {"text": text_of(1000, "e1")}),
                 ("first view, the sample (2,933 tokens)", "/api/text/attention", {"text": "Note. " + SAMPLE}),
                 ("first view, ~4,000 tokens", "/api/text/attention", {"text": text_of(4000, "e3")}),
                 ("compare with a mask, the sample", "/api/text/attention",
                  {"text": "Note 2. " + SAMPLE, "compare": True, "interventions": [{"op": "mask_keys", "tokens": [5]}]}),
                 ("continuation, 8 tokens after the sample", "/api/text/generate",
                  {"text": "Note 3. " + SAMPLE, "max_new_tokens": 8}),
                 ("first view, the sample again with a new tag", "/api/text/attention", {"text": "Note 4. " + SAMPLE})]
        for name, path, body in cases:
            body = {"model": "smollm2-135m", **body}
            if path.endswith("attention"):
                body.update(layers=[0], heads=[0])
            result = job(base, path, body, "eta-bench")
            eta = (result.get("accepted") or {}).get("eta_s")
            ratio = round(result["real_s"] / eta, 2) if eta else None
            rows.append({"case": name, "status": result["status"], "end": result.get("end"), "eta_s": eta,
                         "real_s": round(result["real_s"], 1), "real_over_eta": ratio, "load": os.getloadavg()[0]})
            print(rows[-1], flush=True)
    return {"busy_processes": busy, "rows": rows}


def traced_job(base: str, path: str, body: dict, client: str, timeout: float = 600) -> dict:
    """One job with every line's arrival: the accepted ETA, each progress event's eta_s against the time that was
    really left, the longest silence between lines, the real time."""
    started = time.time()
    out: dict = {"status": None, "etas": []}
    arrivals = [started]
    with httpx.stream("POST", f"{base}{path}", json=body, headers={**STREAM, "X-Attnlab-Client": client},
                      timeout=timeout) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            response.read()
            out["detail"] = response.text[:300]
            return out
        for line in response.iter_lines():
            if not line:
                continue
            arrivals.append(time.time())
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("accepted"):
                out["accepted"] = event
            elif "progress" in event and "eta_s" in event:
                out["etas"].append((time.time() - started, event["progress"], event["total"], event["eta_s"]))
            if "done" in event or "error" in event:
                out["end"] = "done" if "done" in event else event["error"]
                break
    out["real_s"] = round(time.time() - started, 2)
    out["longest_silence_s"] = round(max(b - a for a, b in zip(arrivals, arrivals[1:])), 2)
    return out


HEAD_SCAN = {"model": "smollm2-135m", "clean": "The capital city of France is the city of",
             "corrupt": "The capital city of Italy is the city of", "answer": " Paris", "wrong": " Rome",
             "scan": "heads", "method": "exact"}  # 9 tokens each


def part_headscan(busy: int, tree: Path = ROOT) -> dict:
    """Issue 36 §5 on a fresh server started beside `busy` busy processes (its start-up timing under that load):
    a 7-token plain first view and the 9-token exact head scan sent plain (answered, or 413 by the estimate?), then
    the scan streamed (another pair, so nothing is cached): its accepted ETA and each later eta_s against the time
    really left."""
    out: dict = {"busy_processes": busy, "tree": str(tree)}
    with busy_processes(busy, 1800):
        time.sleep(3)
        with server({"ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]'}, tree=tree) as (base, _proc):
            started = time.time()
            r = httpx.post(f"{base}/api/text/attention", timeout=120, json={
                "model": "smollm2-135m", "text": "the keeper lit the lamp", "layers": [0], "heads": [0]})
            out["short_view"] = {"status": r.status_code, "s": round(time.time() - started, 2),
                                 "detail": r.text[:200] if r.status_code != 200 else None}
            started = time.time()
            r = httpx.post(f"{base}/api/text/patching", json=HEAD_SCAN, timeout=300)
            out["plain_scan"] = {"status": r.status_code, "s": round(time.time() - started, 2),
                                 "detail": r.text[:300] if r.status_code != 200 else None}
            print(out, flush=True)
            streamed = traced_job(base, "/api/text/patching", {
                **HEAD_SCAN, "clean": "The capital city of Spain is the city of", "answer": " Madrid"}, "scan")
            real = streamed.get("real_s")
            accepted = (streamed.get("accepted") or {}).get("eta_s")
            out["streamed_scan"] = {k: v for k, v in streamed.items() if k != "etas"}
            out["streamed_scan"]["accepted_eta_over_real"] = round(accepted / real, 2) if accepted and real else None
            # each later ETA against the time that was really left then
            out["streamed_scan"]["later_eta_over_left"] = [
                (round(t, 1), f"{p}/{n}", round(eta / (real - t), 2) if real - t > 0.5 else None)
                for t, p, n, eta in streamed["etas"]][:: max(1, len(streamed["etas"]) // 8)]
            print(out, flush=True)
    return out


def _short_views(base: str, stop: threading.Event, out: list, every_s: float, tag: str) -> None:
    i = 0
    while not stop.is_set() and i < 200:
        body = {"model": "smollm2-135m", "layers": [0], "heads": [0],
                "text": f"{tag} {i}: the keeper wrote that the light was lit at dusk and the ship passed the rocks"}
        started = time.time()
        r = httpx.post(f"{base}/api/text/attention", json=body, headers={"X-Attnlab-Client": "short-views"},
                       timeout=120)
        out.append({"status": r.status_code, "latency_s": round(time.time() - started, 3)})
        i += 1
        stop.wait(every_s)


def part_fairness() -> dict:
    result = {}
    with server() as (base, _proc):
        # (a) one 3,000-token job
        latencies: list = []
        stop = threading.Event()
        long_job: dict = {}
        runner = threading.Thread(target=lambda: long_job.update(job(
            base, "/api/text/attention", {"model": "smollm2-135m", "text": "Fairness. " + SAMPLE, "layers": [0],
                                          "heads": [0]}, "long-job")))
        runner.start()
        time.sleep(2)
        viewer = threading.Thread(target=_short_views, args=(base, stop, latencies, 1.0, "during the long job"))
        viewer.start()
        runner.join(1200)
        stop.set()
        viewer.join(200)
        result["during_one_long_job"] = _latency_summary(latencies, long_job)
        print(result["during_one_long_job"], flush=True)
        # (b) six patching head scans from six clients
        latencies = []
        stop = threading.Event()
        scans: list[dict] = []
        prompts = [("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
                   ("When Anna and Peter went to the park, Peter gave a ball to", " Anna", " Peter")]

        def scan(k: int) -> None:
            clean, answer, wrong = prompts[k % 2]
            corrupt = clean.replace("When", "Then", 1)
            body = {"model": "smollm2-135m", "clean": f"{clean}", "corrupt": corrupt, "answer": answer,
                    "wrong": wrong, "scan": "heads"}
            scans.append(job(base, "/api/text/patching", body, f"scanner-{k}"))

        threads = [threading.Thread(target=scan, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        time.sleep(2)
        viewer = threading.Thread(target=_short_views, args=(base, stop, latencies, 1.0, "during six scans"))
        viewer.start()
        for t in threads:
            t.join(1800)
        stop.set()
        viewer.join(200)
        result["during_six_scans"] = _latency_summary(latencies, None)
        result["during_six_scans"]["scans"] = [{"status": s["status"], "end": s.get("end"),
                                                "eta_s": (s.get("accepted") or {}).get("eta_s"),
                                                "queue_position": (s.get("accepted") or {}).get("queue_position"),
                                                "real_s": round(s["real_s"], 1)} for s in scans]
        print(result["during_six_scans"], flush=True)
        result["jobs_endpoint"] = httpx.get(f"{base}/api/jobs", timeout=10).json()
    return result


def _latency_summary(latencies: list, long_job: dict | None) -> dict:
    ok = [x["latency_s"] for x in latencies if x["status"] == 200]
    summary = {"requests": len(latencies), "ok": len(ok), "statuses": sorted({x["status"] for x in latencies}),
               "p50_s": round(statistics.median(ok), 2) if ok else None, "max_s": max(ok) if ok else None,
               "load": os.getloadavg()[0]}
    if long_job:
        summary["long_job"] = {"eta_s": (long_job.get("accepted") or {}).get("eta_s"),
                               "real_s": round(long_job.get("real_s", 0), 1), "end": long_job.get("end")}
    return summary


def part_memory(pin_s: float, tokens: int) -> dict:
    limit = 4 * 2**30
    env = {"ATTNLAB_RESULT_PIN_S": str(pin_s)}
    samples: list[tuple[float, int, int]] = []
    with server(env, cgroup_bytes=limit) as (base, proc):
        pid = server_pid(proc)
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                rss, _ = rss_bytes(pid)
                usage = int((CGROUP / "memory.usage_in_bytes").read_text()) if CGROUP.exists() else 0
                samples.append((time.time(), rss, usage))
                stop.wait(0.2)

        threading.Thread(target=sampler, daemon=True).start()
        idle_rss = rss_bytes(pid)[0]
        latencies: list = []
        mixers = [threading.Thread(target=_short_views, args=(base, stop, latencies, 0.5, f"mix {k}")) for k in range(4)]
        for t in mixers:
            t.start()
        compares: list[dict] = []

        def compare(k: int) -> None:
            body = {"model": "smollm2-135m", "text": text_of(tokens, f"mem{k}-{random.random():.6f}"), "layers": [0],
                    "heads": [0], "compare": True, "interventions": [{"op": "mask_keys", "tokens": [5]}]}
            out = job(base, "/api/text/attention", body, f"memory-{k}", timeout=1800)
            final = out.get("final") or {}
            windows = []
            for run in ("run_id", "base_run_id"):
                if final.get(run):
                    w = httpx.post(f"{base}/api/runs/{final[run]}/window", timeout=120,
                                   json={"layer": 0, "head": 0, "rows": [0, 32], "cols": [0, 32]})
                    windows.append(w.status_code)
            out["windows"] = windows
            out["tokens"] = len(final.get("tokens") or [])
            compares.append(out)

        threads = [threading.Thread(target=compare, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3000)
        stop.set()
        for t in mixers:
            t.join(200)
        hwm = rss_bytes(pid)[1]
        cg_max = int((CGROUP / "memory.max_usage_in_bytes").read_text())
        failcnt = int((CGROUP / "memory.failcnt").read_text())
        oom = (CGROUP / "memory.oom_control").read_text()
        jobs_view = httpx.get(f"{base}/api/jobs", timeout=10).json()
        alive = proc.poll() is None
    budget = 3584 * 2**20
    return {"cgroup_limit_bytes": limit, "memory_budget_bytes": budget, "result_pin_s": pin_s, "tokens": tokens,
            "idle_rss_bytes": idle_rss, "peak_rss_bytes": max(s[1] for s in samples), "vmhwm_bytes": hwm,
            "cgroup_max_usage_bytes": cg_max, "cgroup_failcnt": failcnt, "oom_control": oom.strip().splitlines(),
            "server_alive": alive, "within_budget_plus_half_gib": max(s[1] for s in samples) <= budget + 2**29,
            "compares": [{"client": c["client"], "status": c["status"], "end": c.get("end"), "tokens": c.get("tokens"),
                          "eta_s": (c.get("accepted") or {}).get("eta_s"),
                          "queue_position": (c.get("accepted") or {}).get("queue_position"),
                          "real_s": round(c["real_s"], 1), "windows": c.get("windows")} for c in compares],
            "short_views": _latency_summary(latencies, None), "memory_waited": jobs_view["memory"]["waited"],
            "rss_timeline_mb": [(round(t - samples[0][0], 1), round(r / 2**20)) for t, r, _ in samples[::25]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="eta,fairness,memory", help="also: headscan (issue 36 §5)")
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--pin-s", type=float, default=30.0, help="result_pin_s of the memory part's server")
    ap.add_argument("--tokens", type=int, default=4000, help="tokens of each of the memory part's 4 compares")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "jobs.md")
    ap.add_argument("--tree", type=Path, default=ROOT, help="headscan: serve this checkout's app/ (a before/after)")
    args = ap.parse_args()
    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                 "python": sys.version.split()[0], "load_at_start": os.getloadavg()},
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    parts = args.parts.split(",")
    json_path = args.out.with_suffix(".json")
    runners = {"eta": lambda: part_eta(args.busy), "fairness": part_fairness,
               "memory": lambda: part_memory(args.pin_s, args.tokens),
               "headscan": lambda: part_headscan(args.busy, args.tree)}
    for part in parts:
        results[part] = runners[part]()
        old = json.loads(json_path.read_text()) if json_path.exists() else {}
        old.update(results)
        json_path.write_text(json.dumps(old, indent=1))
    print(json.dumps(results, indent=1)[:4000])


if __name__ == "__main__":
    main()
