"""The fixed cost of a fresh short view in CPU time, in one process on one torch thread: a raw eager forward with
attentions (tokenizer included, as benchmarks/run_all.py's baselines) interleaved with the same app's fresh first view
(POST /api/text/attention through FastAPI's TestClient: validation, admission, tokenizing, the run, the response and
its JSON; no socket). On a shared, loaded machine the process's CPU time moves much less than wall time does (a
descheduled process is not charged), so its ratio is the steadier figure; wall time is recorded beside it.

    python -m benchmarks.first_view_cpu --label after [--rounds 30] [--only minilm lm]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from fastapi.testclient import TestClient

from benchmarks.run_all import (
    LM, RESULTS, RawForward, RawLM, first_view_body, lm_first_view_body, machine, text_of,
)


def measured(fn) -> tuple[float, float]:
    """(CPU ms of the whole process, wall ms) of fn()."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return (time.process_time() - cpu) * 1000, (time.perf_counter() - wall) * 1000


def app_client(model: str) -> TestClient:
    from app.main import create_app
    from app.settings import Settings

    settings = Settings(default_models=[model], torch_threads=1, expose_timings=True)
    client = TestClient(create_app(settings))
    client.__enter__()
    client.app.state.runtime.warm_up()
    return client


def compare(name: str, raw_call, view_body, rounds: int) -> dict:
    """Interleaved rounds of raw_call(variant) and a fresh first view (view_body(variant)); medians and ratios."""
    client = app_client(name)
    url = "/api/text/attention"
    for k in range(3):  # warm both sides
        raw_call(9000 + k)
        client.post(url, json=view_body(9100 + k)).raise_for_status()
    raw_cpu, raw_wall, view_cpu, view_wall = [], [], [], []
    load = os.getloadavg()
    for i in range(rounds):
        c, w = measured(lambda: raw_call(2 * i))
        raw_cpu.append(c), raw_wall.append(w)
        body = view_body(2 * i + 1)
        c, w = measured(lambda: client.post(url, json=body).raise_for_status())
        view_cpu.append(c), view_wall.append(w)
    med = statistics.median
    out = {"model": name, "tokens": 128, "rounds": rounds, "torch_threads": torch.get_num_threads(),
           "load_average_before": load, "load_average_after": os.getloadavg(),
           "raw_cpu_ms": med(raw_cpu), "view_cpu_ms": med(view_cpu), "cpu_ratio": med(view_cpu) / med(raw_cpu),
           "raw_wall_ms": med(raw_wall), "view_wall_ms": med(view_wall), "wall_ratio": med(view_wall) / med(raw_wall),
           "samples_ms": {"raw_cpu": raw_cpu, "view_cpu": view_cpu, "raw_wall": raw_wall, "view_wall": view_wall}}
    print(f"  {name} 128 tokens, {rounds} rounds, load {load[0]:.1f}→{out['load_average_after'][0]:.1f}: CPU raw "
          f"{out['raw_cpu_ms']:.1f} ms · view {out['view_cpu_ms']:.1f} ms ({out['cpu_ratio']:.3f}×) | wall raw "
          f"{out['raw_wall_ms']:.1f} ms · view {out['view_wall_ms']:.1f} ms ({out['wall_ratio']:.3f}×)", flush=True)
    client.__exit__(None, None, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="names the output file: first_view_cpu_<label>.json")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--only", nargs="*", default=["minilm", "lm"], choices=["minilm", "lm"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict = {"machine": machine()}
    path = RESULTS / f"first_view_cpu_{args.label}.json"
    if "minilm" in args.only:
        raw = RawForward()
        out["minilm"] = compare("minilm", lambda v: raw(text_of(128, 3000 + v)),
                                lambda v: first_view_body(text_of(128, 3000 + v)), args.rounds)
        path.write_text(json.dumps(out, indent=2))
    if "lm" in args.only:
        raw_lm = RawLM()
        out["lm"] = compare(LM, lambda v: raw_lm(raw_lm.text(128, 6000 + v)),
                            lambda v: lm_first_view_body(raw_lm.text(128, 6000 + v)), args.rounds)
        path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
