"""The allocator bound, measured: `attnlab serve` with and without it under the same short mixed load.

For each configuration in turn (default: `bound`, then `unbound`): start `attnlab serve` on 127.0.0.1 and a free port
(the default models), wait for /api/ready, upload the street photo, then run benchmarks/load.py's mixed clients (text
attention, image uploads, views and attention, short generate streams) for `--duration` seconds, and record the
server's RSS before, its peak (VmHWM, the kernel's high-water mark), its RSS right after the clients leave and after
`--idle` seconds more; then stop it (SIGTERM by pid). The server's own environment (/proc/<pid>/environ) is recorded
too, so the table says what each one really ran with.

    .venv/bin/python -m benchmarks.allocator [--clients 8 --duration 120 --configs bound unbound]

Configurations: `bound` (the default: MALLOC_ARENA_MAX=2 set by attnlab serve, malloc_trim(0) every 10 s),
`arenas-only` (MALLOC_ARENA_MAX=2, no periodic trim), `unbound` (--no-allocator-bound: glibc's default, 8 arenas per
core, no trim), `jemalloc` (LD_PRELOAD of Debian's libjemalloc2, when installed).
Writes benchmarks/results/allocator-load.md (+ .json beside it; benchmarks/results/allocator.md sums up the runs).
Keep it short on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.load import free_port, machine, rss_mb, run_phase_sync, summary  # run as `python -m benchmarks.allocator`

ROOT = Path(__file__).resolve().parents[1]
ATTNLAB = Path(sys.executable).parent / "attnlab"
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def peak_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmHWM:")[1].split()[0]) / 1024


def long_client(base: str, until: float, seed: int, log: dict) -> None:
    """Long inputs back to back, as jobs (Accept: text/event-stream, job_timeout_s; a plain request is held to
    request_timeout_s, which a long input on a loaded 2-core machine does not fit): 500-650 words of text on
    smollm2-135m, over full_map_tokens: a blockwise run whose atlas the result cache keeps, its large temporaries
    freed after it. Each client is a client of its own (one running job per client)."""
    rng = random.Random(1000 + seed)
    words = "the a cat dog sat on mat river bank money bird flew over house red green small old book".split()
    headers = {"Accept": "text/event-stream", "X-Attnlab-Client": f"allocator-long-{seed}"}
    with httpx.Client(base_url=base, timeout=max(1.0, until - time.monotonic()) + 30, headers=headers) as client:
        while time.monotonic() < until:
            body = {"model": "smollm2-135m", "text": " ".join(rng.choice(words) for _ in range(rng.randint(500, 650))),
                    "layers": [rng.randrange(30)], "heads": [rng.randrange(9)]}
            try:
                r = client.post("/api/text/attention", json=body)
                key = str(r.status_code) + (" done" if '"done": true' in r.text or '"done":true' in r.text else "")
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            log[key] = log.get(key, 0) + 1
            if not key.endswith("done"):
                time.sleep(1.0)


def measure(config: str, clients: int, duration: float, idle: float, log_dir: Path, long_clients: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    args = [str(ATTNLAB), "serve", "--host", "127.0.0.1", "--no-access-log"]
    if config == "unbound":
        args.append("--no-allocator-bound")
    elif config == "arenas-only":
        env["ATTNLAB_MALLOC_TRIM_INTERVAL_S"] = "0"
    elif config == "jemalloc":
        if not JEMALLOC.is_file():
            return {"config": config, "skipped": f"{JEMALLOC} is not installed (apt-get install libjemalloc2)"}
        env["LD_PRELOAD"] = str(JEMALLOC)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_dir / f"allocator-{config}.server.log", "w") as log:
        server = subprocess.Popen([*args, "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"{config}: the server exited during start-up; see its log")
            try:
                if httpx.get(base + "/api/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{config}: not ready after 300 s")
            time.sleep(0.5)
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{server.pid}/environ").read_bytes().decode()
                       .split("\0") if "=" in item)
        with open(ROOT / "static" / "samples" / "street.jpg", "rb") as f:
            up = httpx.post(base + "/api/images", files={"file": ("street.jpg", f, "image/jpeg")}, timeout=60)
        image_id = up.json().get("image_id") if up.status_code == 200 else None
        load_before = os.getloadavg()
        rss_before = rss_mb(server.pid)
        print(f"{config}: ready, RSS {rss_before:.0f} MB; {clients} mixed clients × {duration:.0f} s", flush=True)
        long_log: dict[str, int] = {}
        longs = [threading.Thread(target=long_client, args=(base, time.monotonic() + duration, seed, long_log))
                 for seed in range(long_clients)]
        for t in longs:
            t.start()
        load = run_phase_sync(base, clients, duration, server.pid, sample_every=1.0, image_id=image_id, mixed=True)
        for t in longs:
            t.join()
        rss_after = rss_mb(server.pid)
        time.sleep(idle)
        trims = [line for line in (log_dir / f"allocator-{config}.server.log").read_text().splitlines()
                 if "malloc_trim:" in line]
        result = {
            "config": config,
            "allocator_env": {k: environ[k] for k in ("MALLOC_ARENA_MAX", "LD_PRELOAD") if k in environ},
            "rss_before_mb": round(rss_before, 1), "rss_peak_mb": round(peak_mb(server.pid), 1),
            "rss_after_load_mb": round(rss_after, 1), "rss_after_idle_mb": round(rss_mb(server.pid), 1),
            "idle_s": idle, "trims_logged": trims, "load_average_before": [round(x, 1) for x in load_before],
            "load_average_after": [round(x, 1) for x in os.getloadavg()],
            "requests": summary(load), "other_requests": load["mixed"], "long_requests": long_log,
        }
        print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "other_requests", "trims_logged")}),
              flush=True)
        return result
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _trimmed(lines: list[str]) -> str:
    sizes = [float(re.search(r"malloc_trim: ([\d,.]+) MB", line).group(1).replace(",", "")) for line in lines]
    return f"{len(sizes)}: {sum(sizes):,.0f} MB in all, the largest {max(sizes):,.0f} MB" if sizes else "none"


def _longs(log: dict | None) -> str:
    return f"; long: {', '.join(f'{n} × {k}' for k, n in sorted(log.items()))}" if log else ""


def report(results: list[dict], args, info: dict) -> str:
    lines = [
        "# The allocator bound: `attnlab serve` with and without MALLOC_ARENA_MAX=2",
        "",
        f"`python -m benchmarks.allocator --clients {args.clients} --duration {args.duration:g} --idle {args.idle:g} "
        f"--long-clients {args.long_clients}`: "
        "`attnlab serve` (default settings and models) on loopback, benchmarks/load.py's mixed clients (text "
        "attention, image uploads, views and dinov2-small attention, 4-token generate streams), one configuration "
        "after the other; `--long-clients` more clients post 500-650-word texts to smollm2-135m as jobs (long runs) "
        "back to back. Machine: " + f"{info['cpu_model']}, {info['cores']} cores (shared with other engineers' "
        f"tests: load averages below), torch {info['torch']}, Python {info['python']}.",
        "",
        "| configuration | server env | RSS before | peak RSS (VmHWM) | RSS after the load | after "
        f"{args.idle:g} s idle | trims logged (≥ 64 MB each) | requests (200 / 503) | load average before → after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        s = r["requests"]["statuses"]
        env = ", ".join(f"{k}={v}" for k, v in r["allocator_env"].items()) or "(none)"
        lines.append(
            f"| {r['config']} | {env} | {r['rss_before_mb']:,.0f} MB | {r['rss_peak_mb']:,.0f} MB | "
            f"{r['rss_after_load_mb']:,.0f} MB | {r['rss_after_idle_mb']:,.0f} MB | {_trimmed(r['trims_logged'])} | "
            f"{s.get('200', 0)} / {s.get('503', 0)}{_longs(r.get('long_requests'))} | "
            f"{r['load_average_before'][0]} → {r['load_average_after'][0]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--idle", type=float, default=10)
    ap.add_argument("--long-clients", type=int, default=0, help="clients posting 500-650-word texts (jobs) besides the mix")
    ap.add_argument("--configs", nargs="+", default=["bound", "arenas-only", "unbound"],
                    choices=["bound", "arenas-only", "unbound", "jemalloc"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "allocator-load.md")
    args = ap.parse_args()
    info = machine()
    logs = Path(tempfile.mkdtemp(prefix="attnlab-allocator-"))  # the servers' logs, outside the checkout
    print(f"server logs in {logs}", flush=True)
    results = [measure(c, args.clients, args.duration, args.idle, logs, args.long_clients) for c in args.configs]
    args.out.with_suffix(".json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    args.out.write_text(report(results, args, info))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
