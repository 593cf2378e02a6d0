"""The fixed cost of a fresh short view (issue 41 §1) over HTTP, as the bench's `fixed` and LM sections measure it:
interleaved rounds of a raw eager forward with attentions in this process (tokenizer included) and a fresh 128-token
first view (the text page's request: one head with scores, 24 × 24 thumbnails of every head, f32) posted to
`python -m app.serve` on loopback, the response fully read; the median of each and their ratio. Two raw forwards in
every round: plain transformers (`raw`, the ratio's baseline: what a user runs without the app) and the same with
the app's Linear routing (`raw_same_gemm`, models/cpu_linear.py: oneDNN where it outruns MKL), against which the
ratio is what the app adds beyond its forward's products.

With `--trees A B`, one server per checkout (each run from its folder, on its own code), their fresh views interleaved
with the same raw forwards in every round (in alternating order), so a before/after comparison shares the machine's
load. minilm, then smollm2-135m, each against servers that serve that model alone. Records each server's CPU time a
view per thread (the second: torch's other thread, see cpu_by_thread). Writes
benchmarks/results/first_view_<label>.json with the machine and the load average before and after each part.

With `--floor`, one more server in the same rounds: benchmarks/raw_server.py, the raw forward behind the same uvicorn,
answering the same request with a body of the same kind and size and doing nothing else. It is the floor of any view
served over HTTP on this machine; what a tree takes over it (`over_floor_ms`) is the app's own work, a figure that
holds whatever the gap, while the raw forward in this process slows after longer idle times (--gap-s).

`--threads N` runs every side on N torch threads (this process's raw forwards, the floor, the app: its runs then take
at most N) and `--cpu-linear` fixes the Linear routing for all of them: on a loaded machine a side's own start-up
timing of oneDNN against MKL, or its choice of threads, would otherwise differ from the other's and swamp what the app
adds (a two-thread forward beside busy processes took 5-25× a one-thread one).

    python -m benchmarks.first_view --label after [--rounds 30] [--only minilm lm] [--trees /tmp/before .] [--floor]
        [--threads 1] [--cpu-linear onednn]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.run_all import (
    LM, RESULTS, ROOT, RawForward, RawLM, first_view_body, lm_first_view_body, machine, server_timing, text_of,
    wait_ready,
)
from models.cpu_linear import set_cpu_linear

TOKENS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TreeServer:
    """`python -m app.serve` run from the checkout `tree` on its own code, serving `model` alone, Server-Timing on.
    `floor=True`: instead, benchmarks/raw_server.py from this checkout, labelled "floor" (same uvicorn, the raw
    forward, a body of the same kind and size)."""

    def __init__(self, tree: Path, model: str, extra_env: dict[str, str] | None = None, floor: bool = False):
        self.tree, port = (Path("floor") if floor else tree), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="attnlab-first-view-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "ATTNLAB_DEVICE": "cpu",
               "ATTNLAB_EXPOSE_TIMINGS": "1", "ATTNLAB_DEFAULT_MODELS": json.dumps([model]),
               "ATTNLAB_REQUEST_TIMEOUT_S": "300", "ATTNLAB_FLOOR_MODEL": model, **(extra_env or {})}
        command = (["uvicorn", "benchmarks.raw_server:app", "--http", "httptools", "--log-level", "warning"] if floor
                   else ["app.serve"])
        if floor:  # the allocator bound app.serve starts with (app/allocator.py); not its warm heap
            env.setdefault("MALLOC_ARENA_MAX", "2")
        self.proc = subprocess.Popen([sys.executable, "-m", *command, "--host", "127.0.0.1", "--port", str(port)],
                                     cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_ready(self.url, self.proc, seconds=600):
            log = Path(self.log.name).read_text()[-2000:]
            self.stop()
            raise RuntimeError(f"app.serve in {tree} did not become ready: {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        Path(self.log.name).unlink(missing_ok=True)


def thread_cpu_ticks(pid: int) -> dict[str, int]:
    """CPU clock ticks (user + system) of each thread of process `pid` so far, by thread id."""
    ticks = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks[task] = int(fields[11]) + int(fields[12])
    return ticks


def minor_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far: a fresh view's kept run (P, q̂/k̂, hidden states: ~8.5 MB at 128
    tokens of minilm) is new memory while the result cache grows, first touched in the forward. On a fresh VM a
    first touch of guest memory cost 8-12 µs a page against ~1.3 µs once the host backs it (first_view.md)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def cpu_by_thread(before: dict[str, int], after: dict[str, int], views: int) -> list[float]:
    """The server's CPU ms a view per thread between two thread_cpu_ticks, largest first. The second is mostly torch's
    other OpenMP thread: its share of forwards run on two threads (the run's decision, app/costs.py) and of the
    response's tensor work, which runs at the process's default thread count, spin-waits included."""
    hz = os.sysconf("SC_CLK_TCK")
    spent = [(after[t] - before.get(t, 0)) * 1000 / hz / views for t in after]
    return sorted((round(ms, 1) for ms in spent if ms > 0), reverse=True)


def compare(model: str, trees: list[Path], rounds: int, server_env: dict[str, str] | None = None,
            floor: bool = False, gap_s: float = 0.03) -> dict:
    """Interleaved rounds: a raw forward, then each tree's fresh first view (and the floor's); medians, ratios,
    Server-Timing (the floor has none)."""
    # two baselines: plain transformers (`raw`, the ratio's denominator) and the same model with the app's Linear
    # routing (`raw_same_gemm`), each its own copy of the weights
    if model == LM:
        raw, raw_same = RawLM(), RawLM(same_gemm_as_app=True)
        text_at, first_view = (lambda v: raw.text(TOKENS, v)), lm_first_view_body
    else:
        raw, raw_same = RawForward(), RawForward(same_gemm_as_app=True)
        text_at, first_view = (lambda v: text_of(TOKENS, v)), first_view_body
    raw_calls = {"raw": lambda v: raw(text_at(v)), "raw_same_gemm": lambda v: raw_same(text_at(v))}
    body_of = lambda v: first_view(text_at(v))  # noqa: E731
    servers = [TreeServer(tree, model, server_env) for tree in trees]
    if floor:
        servers.append(TreeServer(ROOT, model, server_env, floor=True))
    client = httpx.Client(timeout=600)
    samples: dict[str, dict[str, list[float]]] = {name: {"ms": []} for name in raw_calls}
    samples.update({str(s.tree): {"ms": [], "model": [], "app": []} for s in servers})
    load = os.getloadavg()
    try:
        for k in range(3):  # warm both sides
            for call in raw_calls.values():
                call(4900 + k)
            for i, server in enumerate(servers):
                client.post(server.url + "/api/text/attention", json=body_of(4910 + 10 * i + k)).raise_for_status()
        variant = 5000
        ticks_before = {str(s.tree): thread_cpu_ticks(s.proc.pid) for s in servers}
        faults_before = {str(s.tree): minor_faults(s.proc.pid) for s in servers}
        for r in range(rounds):
            for name, call in (raw_calls.items() if r % 2 == 0 else reversed(raw_calls.items())):
                time.sleep(gap_s)
                variant += 1
                start = time.perf_counter()
                call(variant)
                samples[name]["ms"].append((time.perf_counter() - start) * 1000)
            for server in (servers if r % 2 == 0 else servers[::-1]):
                variant += 1
                body = body_of(variant)  # a text no run has seen: a model run in the server
                time.sleep(gap_s)
                start = time.perf_counter()
                response = client.post(server.url + "/api/text/attention", json=body)
                response.read()
                elapsed = (time.perf_counter() - start) * 1000
                response.raise_for_status()
                timing = server_timing(response)
                own = samples[str(server.tree)]
                own["ms"].append(elapsed), own["model"].append(timing.get("model", float("nan")))
                own["app"].append(timing.get("app", float("nan")))
        cpu = {str(s.tree): cpu_by_thread(ticks_before[str(s.tree)], thread_cpu_ticks(s.proc.pid), rounds)
               for s in servers}
        faults = {str(s.tree): (minor_faults(s.proc.pid) - faults_before[str(s.tree)]) / rounds for s in servers}
    finally:
        client.close()
        for server in servers:
            server.stop()
    raw_ms, same_ms = statistics.median(samples["raw"]["ms"]), statistics.median(samples["raw_same_gemm"]["ms"])
    out = {"model": model, "tokens": TOKENS, "rounds": rounds, "load_average_before": load,
           "load_average_after": os.getloadavg(), "raw_ms": raw_ms, "raw_same_gemm_ms": same_ms,
           "trees": {}, "samples_ms": samples}
    print(f"  {model} {TOKENS} tokens: raw forward {raw_ms:.1f} ms plain, {same_ms:.1f} ms with the app's Linear "
          "routing", flush=True)
    floor_ms = statistics.median(samples["floor"]["ms"]) if floor else None
    for server in servers:
        own = samples[str(server.tree)]
        med = {k: statistics.median(v) for k, v in own.items()}
        # the work besides the forward (Server-Timing `app` − `model`) and the rest of the round trip, per view
        besides = statistics.median([a - m for a, m in zip(own["app"], own["model"])])
        trip = statistics.median([c - a for c, a in zip(own["ms"], own["app"])])
        out["trees"][str(server.tree)] = {
            "fresh_ms": med["ms"], "fresh_ratio": med["ms"] / raw_ms, "fresh_ratio_same_gemm": med["ms"] / same_ms,
            "server_model_ms": med["model"],
            "server_model_ratio": med["model"] / raw_ms, "server_app_ms": med["app"],
            "server_work_besides_model_ms": besides, "round_trip_besides_app_ms": trip,
            "over_floor_ms": None if floor_ms is None else med["ms"] - floor_ms,
            "server_cpu_ms_by_thread": cpu[str(server.tree)], "server_minor_faults_a_view": faults[str(server.tree)]}
        over = "" if floor_ms is None or str(server.tree) == "floor" else f", {med['ms'] - floor_ms:+.1f} ms over the floor"
        print(f"  {model} {TOKENS} tokens, {server.tree}: fresh {med['ms']:.1f} ms = {med['ms'] / raw_ms:.3f}× raw "
              f"({raw_ms:.1f} ms), {med['ms'] / same_ms:.3f}× raw with the same GEMMs{over}; in the server: model {med['model']:.1f} ms ({med['model'] / raw_ms:.3f}×), "
              f"{besides:.1f} ms besides it; round trip besides the app {trip:.1f} ms; server CPU ms a view by thread "
              f"{cpu[str(server.tree)][:3]}, {faults[str(server.tree)]:,.0f} page faults a view · "
              f"load {load[0]:.1f} → {out['load_average_after'][0]:.1f}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="names the output file: first_view_<label>.json")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--only", nargs="*", default=["minilm", "lm"], choices=["minilm", "lm"])
    parser.add_argument("--trees", nargs="*", type=Path, default=[ROOT], help="checkouts to serve from (default: this)")
    parser.add_argument("--floor", action="store_true",
                        help="also serve the raw forward behind the same uvicorn (benchmarks/raw_server.py), "
                             "interleaved: the floor of any view served over HTTP")
    parser.add_argument("--gap-s", type=float, default=0.03,
                        help="idle time before each timed call. A server's background work after its answer (a run "
                             "written to disk) lands on whatever runs next unless the gap outlasts it")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="set in the servers' environment only (not in this process, which runs the raw forward)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads on every side (0: each side's own choice, as served)")
    parser.add_argument("--cpu-linear", choices=["auto", "onednn", "blas"], default="auto",
                        help="the Linear routing on every side (auto: each process times it at start)")
    args = parser.parse_args()
    server_env = dict(pair.split("=", 1) for pair in args.server_env)
    server_env["ATTNLAB_CPU_LINEAR"] = args.cpu_linear
    set_cpu_linear(args.cpu_linear)  # this process's raw_same_gemm forward
    if args.threads > 0:
        server_env["ATTNLAB_TORCH_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    out: dict = {"machine": machine(), "rounds": args.rounds, "threads": args.threads, "cpu_linear": args.cpu_linear, "trees": [str(t.resolve()) for t in args.trees],
                 "server_env": server_env, "gap_s": args.gap_s}
    path = RESULTS / f"first_view_{args.label}.json"
    for name in args.only:
        trees = [t.resolve() for t in args.trees]
        out[name] = compare(LM if name == "lm" else "minilm", trees, args.rounds, server_env, args.floor, args.gap_s)
        path.write_text(json.dumps(out, indent=2))  # each part as soon as it is measured
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
