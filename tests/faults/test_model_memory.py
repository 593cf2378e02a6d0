"""The memory budget with a model loaded on first use, under a real memory limit (issue 37 §2).

An outside probe ran the server with default settings in a 4 GiB cgroup (cgroup v1, as a Kubernetes pod would):
with gemma3-270m loaded on first use beside short views, peak RSS was 5.09 GB against memory_budget_bytes + 0.5 GiB
= 4.29 GB and the cgroup sat at its limit. Here the same: `attnlab serve` with default settings in a memory cgroup of
memory_budget_bytes + 0.5 GiB, four clients sending short views while gemma3-270m's first request loads it, then
views of both models; the server's peak RSS (VmHWM) must stay within memory_budget_bytes + 0.5 GiB, with no OOM kill.

The cgroup is made under /sys/fs/cgroup/memory (cgroup v1; writable as root). Where it is not writable the server
runs under RLIMIT_AS instead (prlimit's address-space limit: a loose stand-in, since torch and the mapped weights
reserve far more address space than they touch, so it is set to 4 × the limit) and the bound is checked on the
sampled RSS alone; the test says so in its output. Needs gemma3-270m prepared in weights/ (`make weights`)."""
from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from tests.faults.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ATTNLAB = Path(sys.executable).parent / "attnlab"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
MARGIN = 512 * 2**20  # the stated bound: memory_budget_bytes + 0.5 GiB
VIEW_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps"


def make_cgroup(limit: int) -> Path | None:
    """A fresh memory cgroup limited to `limit` bytes, or None where cgroups are not writable here."""
    path = CGROUP_ROOT / f"attnlab-test-{os.getpid()}-{free_port()}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no swap beyond it either
        return path
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None


def proc_status(pid: int) -> dict[str, int]:
    values = {}
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
                values[line.split(":")[0]] = int(line.split()[1]) * 1024
    return values


def cgroup_value(cgroup: Path | None, name: str) -> str:
    if cgroup is None:
        return ""
    with contextlib.suppress(OSError):
        return (cgroup / name).read_text()
    return ""


def start_server(cgroup: Path | None, limit: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}  # the default settings
    env["ATTNLAB_WEIGHTS_DIR"] = str(ROOT / "weights")
    cmd = [str(ATTNLAB), "serve", "--host", "127.0.0.1", "--port", str(port)]
    preexec = None
    if cgroup is not None:  # the shell joins the cgroup, then becomes the server (same pid)
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "attnlab-in-cgroup", *cmd]
    else:
        def preexec() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (4 * limit, 4 * limit))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=preexec)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, base: str, log: Path, limit_s: float = 900) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"the server exited during start-up:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/api/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"not ready after {limit_s} s:\n{log.read_text()[-3000:]}")


def view_clients(base: str, n: int, stop: threading.Event, models: list[str], answers: list) -> list[threading.Thread]:
    """n clients sending short views (a word changed each time: no cached answers), each of models[0] (the list
    can change while they run)."""
    def client(k: int) -> None:
        with httpx.Client(base_url=base, timeout=120, headers={"X-Attnlab-Client": f"view-client-{k:04d}"}) as c:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": models[0], "text": f"{VIEW_TEXT} {k} {i}", "layers": [0], "heads": [0]}
                try:
                    answers.append((models[0], c.post("/api/text/attention", json=body).status_code))
                except httpx.HTTPError as exc:
                    answers.append((models[0], type(exc).__name__))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.slow  # a server of its own and gemma3-270m's load: minutes on a loaded 2-core machine
@pytest.mark.skipif(not (ROOT / "weights" / "gemma3-270m" / "prepared.json").is_file(),
                    reason="gemma3-270m is not prepared in weights/ (make weights)")
def test_gemma3_first_use_beside_four_clients_stays_within_the_budget(tmp_path):
    budget = Settings().memory_budget_bytes
    limit = budget + MARGIN
    cgroup = make_cgroup(limit)
    if cgroup is None:
        print(f"cgroup v1 memory not writable here: RLIMIT_AS {4 * limit / 2**30:.1f} GiB stands in")
    log = tmp_path / "server.log"
    proc, base = start_server(cgroup, limit, log)
    stop, answers, peak = threading.Event(), [], {"rss": 0}
    try:
        wait_ready(proc, base, log)

        def sample() -> None:
            while not stop.is_set():
                peak["rss"] = max(peak["rss"], proc_status(proc.pid).get("VmRSS", 0))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        models = ["smollm2-135m"]
        clients = view_clients(base, 4, stop, models, answers)
        time.sleep(3)
        started = time.monotonic()
        with httpx.Client(base_url=base, timeout=900) as c:
            try:
                first = c.post("/api/text/attention", json={"model": "gemma3-270m", "text": VIEW_TEXT,
                                                            "layers": [0], "heads": [0]})
            except httpx.HTTPError as exc:  # still report what memory did
                first = httpx.Response(599, text=f"{type(exc).__name__}: {exc}")
        load_s = time.monotonic() - started
        models[0] = "gemma3-270m"  # then views of the loaded model too
        time.sleep(8)
        stop.set()
        for t in clients:
            t.join(150)
        sampler.join()
        status = proc_status(proc.pid)
        alive = proc.poll() is None
        jobs = httpx.get(base + "/api/jobs", timeout=10).json() if alive else {}
    finally:
        stop.set()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
        oom = cgroup_value(cgroup, "memory.oom_control")
        cgroup_peak = cgroup_value(cgroup, "memory.max_usage_in_bytes")
        failcnt = cgroup_value(cgroup, "memory.failcnt")
        if cgroup is not None:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
                    break
                time.sleep(0.1)
    hwm = status.get("VmHWM", 0)
    report = {"budget": budget, "limit": limit, "peak_rss_hwm": hwm, "peak_rss_sampled": peak["rss"],
              "rss_file_at_end": status.get("RssFile"), "rss_anon_at_end": status.get("RssAnon"),
              "cgroup_peak": cgroup_peak.strip(), "failcnt": failcnt.strip(), "oom_control": oom.replace("\n", " "),
              "gemma3_first_use": [first.status_code, round(load_s, 1)], "views": len(answers),
              "view_statuses": sorted({str(s) for _, s in answers}), "memory": jobs.get("memory")}
    print(json.dumps(report, indent=1))
    assert alive, f"the server died (OOM kill?): {report}\n{log.read_text()[-3000:]}"
    assert "oom_kill 0" in oom or cgroup is None, report
    # the model loads (200), or, while the short views keep the budget full, its load is refused at once with a 503
    # that names the memory budget and says to retry (the whole suite's run on two busy workers saw the 503); never an
    # OOM kill, never a load over the budget
    assert first.status_code == 200 or (first.status_code == 503 and "memory budget" in first.text
                                        and first.headers.get("retry-after")), (first.text[:500], report)
    assert all(s in (200, 503) for _, s in answers), report  # 503: busy, with Retry-After; never a dropped request
    assert max(hwm, peak["rss"]) <= budget + MARGIN, (
        f"peak RSS {max(hwm, peak['rss']) / 2**30:.2f} GiB over memory_budget_bytes + 0.5 GiB = "
        f"{(budget + MARGIN) / 2**30:.2f} GiB: {report}")
