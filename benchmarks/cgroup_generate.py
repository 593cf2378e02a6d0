"""A generate stream with attention on every head, in a 4 GiB memory cgroup (issue 53 §5 "Done means": it stays within
memory_budget_bytes + 0.5 GiB; before, one stream took the cgroup from 564 to 1,903 MiB and, with gemma3 loaded,
VmHWM reached 4.28 GB against the 3.5 GiB budget: ~19 MB of JSON rows a step, 256 events kept with no byte cap).

`python -m app.serve` with the default settings (memory_budget_bytes 3.5 GiB, job_event_buffer_bytes ...) and
gemma3-270m loaded beside the default models (a first view of it before the streams), in a fresh cgroup v1 memory
group limited to 4 GiB (needs root, as benchmarks/cgroup_compares.py). Then `--streams` generate streams sent at
once (each its own client) on smollm2-135m: a prompt of about `--tokens` tokens of the page's long sample,
`--new-tokens` steps, one intervention (both sides decode), `attention: {"layers": null, "heads": null}` (every
layer and head) as JSON numbers; generate_timeout_s is raised to `--give-up-s` (a loaded 2-core machine). Per
stream: accepted or refused, its ETA, the steps it made, its end and the bytes it received. For the server: VmHWM and
peak VmRSS (sampled), the cgroup's max_usage_in_bytes, failcnt and oom_kill, against the budget + 0.5 GiB.

    .venv/bin/python -m benchmarks.cgroup_generate [--streams 1] [--out benchmarks/results/cgroup_generate.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.cgroup_compares import CGROUP_ROOT, LIMIT, SAMPLE, cgroup_read, long_text, sample_memory
from benchmarks.served import server

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
BUDGET = 3584 * 2**20  # app/settings.py memory_budget_bytes' default
MARGIN = 512 * 2**20  # issue 53: within the budget + 0.5 GiB


def vm_hwm(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def prompt(tokens: int, tag: str) -> str:
    """About `tokens` smollm2 tokens of the long sample (2,932 tokens whole; cut at a word), behind a tag."""
    if tokens >= 2932:
        return long_text(tokens, tag)
    return f"[{tag}] " + SAMPLE[: int(len(SAMPLE) * tokens / 2932)].rsplit(" ", 1)[0]


def stream(base: str, k: int, tokens: int, new_tokens: int, timeout: float) -> dict:
    """One generate stream with every head's attention rows on both sides (one intervention: with and without
    it); counts what it received."""
    body = {"model": MODEL, "text": prompt(tokens, f"gen{k}-{time.time():.3f}"), "max_new_tokens": new_tokens,
            "interventions": [{"op": "mask_keys", "tokens": [1, 2, 3]}],
            "attention": {"layers": None, "heads": None, "encoding": "json"}}
    out: dict = {"client": f"generate-{k}", "steps": 0, "bytes": 0}
    sent = time.monotonic()
    try:
        with httpx.stream("POST", f"{base}/api/text/generate", json=body, timeout=timeout,
                          headers={"Accept": "text/event-stream", "X-Attnlab-Client": out["client"]}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["detail"] = r.read().decode()[:300]
                return out
            for line in r.iter_lines():
                out["bytes"] += len(line) + 1
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                at = round(time.monotonic() - sent, 2)
                if event.get("accepted"):
                    out.update(accepted_after_s=at, eta_s=event.get("eta_s"), queue_position=event.get("queue_position"))
                elif "step" in event:
                    out["steps"] += 1
                    out.setdefault("first_step_s", at)
                if "done" in event or "error" in event:
                    out.update(end="done" if "done" in event else str(event.get("error"))[:300], end_s=at,
                               prompt_tokens=event.get("prompt_tokens"))
    except httpx.HTTPError as exc:
        out.update(end=type(exc).__name__, end_s=round(time.monotonic() - sent, 2))
    return out


def run(streams: int, tokens: int, new_tokens: int, give_up_s: float, log: Path) -> dict:
    cgroup = CGROUP_ROOT / f"attnlab-cggenerate-{os.getpid()}"
    log.write_text("")
    started = time.monotonic()
    # the default settings but the stream's time limit: this machine (2 cores shared with other work) takes minutes
    # for what the took in one; the memory is what is measured
    env = {"ATTNLAB_DEFAULT_MODELS": json.dumps(["minilm", MODEL, "gemma3-270m"]),
           "ATTNLAB_GENERATE_TIMEOUT_S": str(give_up_s)}
    with server(env=env, log=log, ready_s=900, cgroup=cgroup, cgroup_bytes=LIMIT) as (base, proc):
        ready_s = round(time.monotonic() - started, 1)
        gemma = httpx.post(f"{base}/api/text/attention", timeout=300, headers={"X-Attnlab-Client": "gemma-view"},
                           json={"model": "gemma3-270m", "text": "the keeper lit the lamp", "layers": [0], "heads": [0]})
        idle = {"cgroup_usage_bytes": int(cgroup_read(cgroup, "memory.usage_in_bytes") or 0),
                "vm_hwm_bytes": vm_hwm(proc.pid), "gemma_view_status": gemma.status_code}
        stop, memory = threading.Event(), []
        sampler = threading.Thread(target=sample_memory, args=(proc.pid, cgroup, stop, memory), daemon=True)
        sampler.start()
        results: list[dict] = []
        workers = [threading.Thread(target=lambda k=k: results.append(stream(base, k, tokens, new_tokens, give_up_s)),
                                    daemon=True) for k in range(streams)]
        for t in workers:
            t.start()
        deadline = time.monotonic() + give_up_s
        for t in workers:
            t.join(max(1.0, deadline - time.monotonic()))
        time.sleep(2)
        stop.set()
        sampler.join(5)
        oom = dict(line.split() for line in cgroup_read(cgroup, "memory.oom_control").splitlines())
        hwm = vm_hwm(proc.pid)
        server_view = {"alive": proc.poll() is None, "ready_s": ready_s, "idle": idle, "vm_hwm_bytes": hwm,
                       "peak_rss_sampled_bytes": max((m[1] for m in memory), default=0),
                       "peak_cgroup_usage_sampled_bytes": max((m[2] for m in memory), default=0),
                       "cgroup_max_usage_bytes": int(cgroup_read(cgroup, "memory.max_usage_in_bytes") or 0),
                       "cgroup_failcnt": int(cgroup_read(cgroup, "memory.failcnt") or 0),
                       "oom_kill": int(oom.get("oom_kill", 0))}
    server_view["within_budget_plus_half_gib"] = hwm <= BUDGET + MARGIN and server_view["oom_kill"] == 0
    return {"server": server_view, "streams": sorted(results, key=lambda r: r["client"]),
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1, help="generate streams sent at once")
    ap.add_argument("--tokens", type=int, default=1900, help="about this many prompt tokens (the issue's 1,900)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--give-up-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cgroup_generate.json")
    args = ap.parse_args()
    if not os.access(CGROUP_ROOT, os.W_OK):
        sys.exit(f"{CGROUP_ROOT} is not writable here (cgroup v1 memory controller, as root)")
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_at_start": os.getloadavg(),
              "streams": args.streams, "tokens": args.tokens, "new_tokens": args.new_tokens,
              "cgroup_limit_bytes": LIMIT, "budget_bytes": BUDGET, "allowed_bytes": BUDGET + MARGIN}
    result.update(run(args.streams, args.tokens, args.new_tokens, args.give_up_s, args.out.with_suffix(".log")))
    result["load_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
