"""What stays in the allocator once the result cache is emptied, and whether malloc_trim(0) gives it back.

One process per configuration (glibc's default arenas, MALLOC_ARENA_MAX=2), each: the app in-process (TestClient,
the default text models), `--threads` threads posting text attention back to back for `--duration` seconds (fresh
sentences of 20-400 words: short runs and a few long ones over full_map_tokens, whose atlases the cache keeps),
then RSS after the load, after the result cache is cleared (+ gc), and after glibc's malloc_trim(0) (ctypes).

    .venv/bin/python benchmarks/allocator_trim.py [--threads 8 --duration 60]

Prints one JSON line per configuration; benchmarks/results/allocator.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import ctypes, gc, json, os, random, sys, threading, time
from pathlib import Path
from fastapi.testclient import TestClient
from app.main import create_app
from app.settings import Settings

def rss():
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

threads, duration = int(sys.argv[1]), float(sys.argv[2])
words = "the a cat dog sat on mat river bank money bird flew over house red green small old book city night rain".split()
with TestClient(create_app(Settings(default_models=["minilm", "smollm2-135m"]))) as client:
    client.app.state.runtime.warm_up()
    start_rss = rss()
    until = time.monotonic() + duration
    statuses = {}
    def work(seed):
        rng = random.Random(seed)
        while time.monotonic() < until:
            n = rng.choice([20, 40, 80, 150, 400]) if rng.random() < 0.9 else 700  # 700 words: a long run
            body = {"model": rng.choice(["minilm", "smollm2-135m"]), "text": " ".join(rng.choice(words) for _ in range(n)),
                    "layers": [rng.randrange(6)], "heads": [rng.randrange(9)]}
            r = client.post("/api/text/attention", json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool: t.start()
    peak = 0.0
    while any(t.is_alive() for t in pool):
        peak = max(peak, rss()); time.sleep(0.5)
    after_load = rss()
    client.app.state.runtime.cache.clear(); gc.collect(); time.sleep(1)
    after_clear = rss()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after_trim = rss()
    print(json.dumps({"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"), "statuses": statuses,
                      "rss_start_mb": round(start_rss), "rss_peak_sampled_mb": round(peak),
                      "rss_after_load_mb": round(after_load), "rss_after_cache_cleared_mb": round(after_clear),
                      "rss_after_malloc_trim_mb": round(after_trim)}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--arenas", nargs="+", default=["default", "2"], help="'default' (glibc's) or a number")
    args = ap.parse_args()
    for arenas in args.arenas:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        if arenas != "default":
            env["MALLOC_ARENA_MAX"] = arenas
        load = os.getloadavg()[0]
        child = subprocess.run([sys.executable, "-c", CHILD, str(args.threads), str(args.duration)], cwd=ROOT, env=env,
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(f"MALLOC_ARENA_MAX={arenas}: failed\n{child.stderr[-3000:]}", flush=True)
            continue
        out = child.stdout.strip().splitlines()[-1]
        print(json.dumps({**json.loads(out), "load_average_before": round(load, 1),
                          "load_average_after": round(os.getloadavg()[0], 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
