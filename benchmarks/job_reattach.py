"""A job's stream cut mid-way, before and after re-attaching (issue 36 §3): the work redone, from outside.

Two servers (`python -m app.serve`) on a random 12-layer BERT at about 460 tokens (tests/faults/conftest.py
build_big_bert, full_map_tokens 64: the long path): one from `--old-tree` (a checkout from before re-attaching, e.g.
`git archive 35e4c62 | tar -x -C /tmp/old`), one from this tree. Each call is `attnlab.Lab.attention` (the client of
that tree, in its own process) of a compare with `mask_keys` on a token of its own (the base run is cached after the
first call, so the job is one pass of 12 layers), through a TCP relay (tests/api/test_job_reattach.py CuttingRelay)
that cuts the job's first stream after its `"progress":6` event, or does not cut. Per call: wall seconds, the
server's CPU seconds (utime + stime of its process) and how many jobs reached the server. Old and new alternate, so
the machine's load hits both alike.

    .venv/bin/python -m benchmarks.job_reattach --old-tree /tmp/old [--reps 3] [--out benchmarks/results/job_reattach.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.api.test_job_reattach import CuttingRelay
from tests.faults.conftest import LONG_TEXT, build_big_bert, free_port

ROOT = Path(__file__).resolve().parents[1]
CLIENT = """
import json, sys, time
from attnlab import Lab
lab = Lab(sys.argv[1], progress=False, timeout=300)
started = time.monotonic()
lab.attention(sys.argv[2], "big", layers=[0], heads=[0], compare=True,
              interventions=[{"op": "mask_keys", "tokens": [int(sys.argv[3])]}])
print(json.dumps({"wall_s": time.monotonic() - started}))
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(tree: str, model: Path, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    env.update(ATTNLAB_DEFAULT_MODELS='["big"]', ATTNLAB_EXTRA_TEXT_MODELS=json.dumps({"big": str(model)}),
               ATTNLAB_FULL_MAP_TOKENS="64", PYTHONPATH=tree)
    proc = subprocess.Popen([sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port)], cwd=tree,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/ready", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server of {tree} was not ready in 300 s: {log}")


def one_call(tree: str, proc: subprocess.Popen, port: int, cut: bool, token: int) -> dict:
    relay = CuttingRelay(port, cut_after=b'"progress":6,' if cut else b"(never)")
    before = cpu_seconds(proc.pid)
    out = subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{relay.port}", LONG_TEXT, str(token)],
                         cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, timeout=600)
    relay.close()
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return {"wall_s": round(json.loads(out.stdout.strip().splitlines()[-1])["wall_s"], 2),
            "server_cpu_s": round(cpu_seconds(proc.pid) - before, 2), "jobs_sent": len(relay.posts),
            "was_cut": relay.cut.is_set()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-tree", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "job_reattach.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="job-reattach-"))
    model = build_big_bert(work / "big")
    trees = {"old": args.old_tree, "new": str(ROOT)}
    servers = {name: start(tree, model, work / f"{name}.log") for name, tree in trees.items()}
    rows, token = [], 10
    try:
        for rep in range(args.reps):
            for name, tree in trees.items():
                for cut in (False, True):
                    token += 1
                    row = {"rep": rep, "tree": name, "cut": cut, **one_call(tree, *servers[name], cut, token)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(20)
    Path(args.out).write_text(json.dumps({"load_avg_end": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
