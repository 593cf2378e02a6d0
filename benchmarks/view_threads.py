"""Where the served forward runs, and what that costs: fresh 128-token minilm views posted to `python -m app.serve`,
the server's model part (Server-Timing) as the median of each phase, and the server's CPU a view by thread (how many
threads did the work: each worker thread that runs a two-thread forward keeps an OpenMP team of its own, and with
more OpenMP threads than cores GNU OpenMP sleeps between parallel regions instead of spinning).

Phases, on one server: one client back to back; one client with 30 ms gaps; two clients at once (30 ms gaps each);
one client right after; one client after anyio's idle workers have exited (12 s later). Each phase also records the
times the server's threads ended their OpenMP teams (app/openmp_teams.py; compare with ATTNLAB_OPENMP_ONE_TEAM=0 via --server-env).

With `--job-tokens N` (smollm2-135m served too) instead: a first view of N tokens sent as a job, alone and while one
client posts minilm views 30 ms apart, twice; the job's time and the views' model part.

    python -m benchmarks.view_threads [--views 20] [--tree .] [--server-env NAME=VALUE ...] [--job-tokens N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.first_view import TreeServer, cpu_by_thread, thread_cpu_ticks
from benchmarks.run_all import RESULTS, ROOT, first_view_body, machine, server_timing, text_of


def post_views(url: str, first_variant: int, views: int, gap_s: float, out: list[float],
               going_on=lambda: True) -> None:
    """`views` fresh 128-token minilm first views, `gap_s` apart, while `going_on()`; each one's model part into out."""
    with httpx.Client(timeout=120) as client:
        for k in range(views):
            if not going_on():
                break
            time.sleep(gap_s)
            response = client.post(url + "/api/text/attention", json=first_view_body(text_of(128, first_variant + k)))
            response.raise_for_status()
            out.append(server_timing(response)["model"])


def team_releases(url: str) -> int | None:
    """The server's attnlab_openmp_team_releases_total (app/openmp_teams.py), None where it has no such metric."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("attnlab_openmp_team_releases_total "):
            return int(float(line.split()[1]))
    return None


def views_fields(server: TreeServer, models: list[float], releases: int | None) -> dict:
    """A phase's views: their count, model parts and median, and the server's team releases since `releases`."""
    fields = {"views": len(models), "model_ms_median": statistics.median(models) if models else None,
              "model_ms": [round(ms, 2) for ms in models]}
    if releases is not None:
        fields["openmp_team_releases"] = team_releases(server.url) - releases
    return fields


def phase(server: TreeServer, name: str, clients: int, views: int, gap_s: float, variant: int) -> dict:
    ticks, releases = thread_cpu_ticks(server.proc.pid), team_releases(server.url)
    models: list[float] = []
    threads = [threading.Thread(target=post_views, args=(server.url, variant + 1000 * c, views, gap_s, models))
               for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    row = {"phase": name, "clients": clients, "gap_s": gap_s, **views_fields(server, models, releases),
           "server_cpu_ms_a_view_by_thread": cpu_by_thread(ticks, thread_cpu_ticks(server.proc.pid), len(models))[:6]}
    print(f"  {name:32s} model part {row['model_ms_median']:5.1f} ms; server CPU ms a view by thread "
          f"{row['server_cpu_ms_a_view_by_thread']}; OpenMP team releases {row.get('openmp_team_releases', '-')}",
          flush=True)
    return row


def stream_job(url: str, tokens: int, variant: int, started: threading.Event, out: dict) -> None:
    """A long smollm2-135m first view sent as a job (Accept: text/event-stream), read to its end: its wall time."""
    body = {"model": "smollm2-135m", "text": text_of(tokens, variant), "layers": [0], "heads": [0]}
    begun = time.perf_counter()
    with httpx.Client(timeout=600) as client, client.stream(
            "POST", url + "/api/text/attention", json=body, headers={"Accept": "text/event-stream"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and '"progress"' in line:
                started.set()
    started.set()
    out["job_s"] = time.perf_counter() - begun


def job_phase(server: TreeServer, name: str, tokens: int, views: int, variant: int) -> dict:
    """A long job alone (`views` 0), or with one client posting fresh minilm views 30 ms apart while it runs."""
    started, job, models = threading.Event(), {}, []
    releases = team_releases(server.url)
    runner = threading.Thread(target=stream_job, args=(server.url, tokens, variant, started, job))
    runner.start()
    started.wait(600)
    post_views(server.url, variant, views, 0.03, models, going_on=runner.is_alive)
    runner.join()
    row = {"phase": name, "job_tokens": tokens, "job_s": round(job["job_s"], 3),
           **views_fields(server, models, releases)}
    print(f"  {name:32s} job {row['job_s']:.2f} s; {len(models)} views, model part "
          f"{row['model_ms_median'] or 0:5.1f} ms; OpenMP team releases {row.get('openmp_team_releases', '-')}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--views", type=int, default=20, help="views a client posts in each phase")
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--label", default="", help="names the output file: view_threads[_<label>].json")
    parser.add_argument("--job-tokens", type=int, default=0,
                        help="also serve smollm2-135m and time a first view of this many tokens sent as a job, alone "
                             "and while one client posts minilm views (only those phases)")
    args = parser.parse_args()
    server_env = dict(pair.split("=", 1) for pair in args.server_env)
    if args.job_tokens:
        server_env.setdefault("ATTNLAB_DEFAULT_MODELS", json.dumps(["minilm", "smollm2-135m"]))
    server = TreeServer(args.tree.resolve(), "minilm", server_env)
    try:
        warm: list[float] = []
        post_views(server.url, 100, 5, 0.0, warm)
        if args.job_tokens:
            rows = [job_phase(server, "a job alone", args.job_tokens, 0, 11000),
                    job_phase(server, "a job and one client", args.job_tokens, args.views, 12000),
                    job_phase(server, "a job alone, again", args.job_tokens, 0, 13000),
                    job_phase(server, "a job and one client, again", args.job_tokens, args.views, 14000)]
        else:
            rows = view_phases(server, args.views)
    finally:
        server.stop()
    path = RESULTS / f"view_threads{'_' + args.label if args.label else ''}.json"
    path.write_text(json.dumps({"machine": machine(), "tree": str(args.tree.resolve()), "server_env": server_env,
                                "phases": rows}, indent=2))
    print(f"wrote {path}")


def view_phases(server: TreeServer, views: int) -> list[dict]:
    rows = [phase(server, "one client, back to back", 1, views, 0.0, 1000),
            phase(server, "one client, 30 ms apart", 1, views, 0.03, 3000),
            phase(server, "two clients at once", 2, views, 0.03, 5000),
            phase(server, "one client, right after", 1, views, 0.03, 8000)]
    time.sleep(12)  # anyio's idle worker threads exit after 10 s, and their OpenMP teams with them
    rows.append(phase(server, "one client, 12 s later", 1, views, 0.03, 9000))
    return rows


if __name__ == "__main__":
    main()
