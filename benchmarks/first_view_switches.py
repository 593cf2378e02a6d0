"""Where the app's fresh first view waits, against the floor's (issue 55 §3): one `python -m app.serve` and the floor
(benchmarks/raw_server.py), both on one torch thread with oneDNN's Linear layers (as `first_view.py --threads 1
--cpu-linear onednn`), fresh 128-token views posted to each in interleaved rounds; then, per server thread, its CPU
time and its voluntary and involuntary context switches a view (/proc/<pid>/task/<tid>/status). Voluntary switches on
the forward's thread are waits (the GIL, a lock, I/O); involuntary ones are the machine's load taking the core. The
wall time a view is the client's, medians. Prints only: paste what it finds into the results file that cites it.

    python -m benchmarks.first_view_switches [--model smollm2-135m|minilm] [--views 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx

from benchmarks.first_view import TreeServer
from benchmarks.run_all import LM, ROOT, RawLM, first_view_body, lm_first_view_body, text_of


def thread_switches(pid: int) -> dict[str, tuple[int, int, int]]:
    """(CPU clock ticks, voluntary switches, involuntary switches) of each thread of `pid` so far, by thread id."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[task] = (int(stat[11]) + int(stat[12]), int(status["voluntary_ctxt_switches"]),
                     int(status["nonvoluntary_ctxt_switches"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=LM, choices=[LM, "minilm"])
    parser.add_argument("--views", type=int, default=8)
    args = parser.parse_args()
    if args.model == LM:
        raw = RawLM()
        body_of = lambda v: lm_first_view_body(raw.text(128, v))  # noqa: E731
    else:
        body_of = lambda v: first_view_body(text_of(128, v))  # noqa: E731
    env = {"ATTNLAB_TORCH_THREADS": "1", "ATTNLAB_CPU_LINEAR": "onednn"}
    servers = {"app": TreeServer(ROOT, args.model, env), "floor": TreeServer(ROOT, args.model, env, floor=True)}
    walls: dict[str, list[float]] = {name: [] for name in servers}
    try:
        with httpx.Client(timeout=600) as client:
            for name, server in servers.items():  # warm each
                for k in range(2):
                    client.post(server.url + "/api/text/attention", json=body_of(900 + k)).raise_for_status()
            before = {name: thread_switches(s.proc.pid) for name, s in servers.items()}
            load = os.getloadavg()
            for i in range(args.views):
                for name, server in (list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]):
                    start = time.perf_counter()
                    client.post(server.url + "/api/text/attention",
                                json=body_of(2000 + 2 * i + (name == "app"))).raise_for_status()
                    walls[name].append((time.perf_counter() - start) * 1000)
            after = {name: thread_switches(s.proc.pid) for name, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    hz = os.sysconf("SC_CLK_TCK")
    print(f"{args.model}, 128 tokens, {args.views} views each, load {load[0]:.1f} → {os.getloadavg()[0]:.1f}")
    for name in servers:
        print(f"  {name}: wall {statistics.median(walls[name]):.1f} ms a view (median)")
        rows = []
        for task, (ticks, voluntary, involuntary) in after[name].items():
            was = before[name].get(task, (0, 0, 0))
            rows.append(((ticks - was[0]) * 1000 / hz / args.views, (voluntary - was[1]) / args.views,
                         (involuntary - was[2]) / args.views))
        for cpu, voluntary, involuntary in sorted(rows, reverse=True)[:5]:
            if cpu > 0 or voluntary > 5:
                print(f"    a thread: CPU {cpu:7.1f} ms, voluntary switches {voluntary:6.1f}, involuntary {involuntary:6.1f} a view")


if __name__ == "__main__":
    main()
