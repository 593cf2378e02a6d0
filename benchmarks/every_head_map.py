"""Every head's map over HTTP, decoded by the client, against an eager forward with attentions (issue 55 §2):
smollm2-135m, a fresh input of N tokens each time (no cached run answers), interleaved round after round, medians.

- lab, json: `attnlab.Lab.attention(text, layers=None, heads=None, encoding="f32", binary=False)`: the job's event
  stream, every head's map as base64 float32 in the done event's JSON, decoded to numpy by the client;
- lab, binary: the same with `binary=True` (what Lab does by default for this request): one plain POST with
  `Accept: application/octet-stream`, a JSON header and the raw float32 bytes, viewed as numpy without a copy;
- eager: in this process, the tokenizer and AutoModelForCausalLM (eager attention, the app's Linear routing on this
  CPU, benchmarks/run_all.py RawLM) with `output_attentions=True`, the maps stacked into one (L, H, T, T) float32
  numpy array; on one torch thread and on torch's default count (the server decides its own: app/runtime.py).

The server is `attnlab serve` in a subprocess (Lab.start) on the same 2 cores; the load average (1 min) is read
before every timing, and the CPU time of both processes around it. Writes benchmarks/results/every_head_map[_TAG].json and .md.

    .venv/bin/python -m benchmarks.every_head_map [--tokens 120] [--rounds 9] [--tag NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from attnlab import Lab
from benchmarks.generate_vs_transformers import cpu_name, cpu_seconds
from benchmarks.run_all import LM, RawLM

ROOT = Path(__file__).resolve().parents[1]


def eager(raw: RawLM, text: str, threads: int | None) -> np.ndarray:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        out = raw(text)
        return torch.stack([a[0] for a in out.attentions]).numpy()  # (L, H, T, T)
    finally:
        torch.set_num_threads(before)


def server_cpu_seconds(lab: Lab) -> float:
    """The server process's CPU time (utime + stime of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{lab._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parts(maps: np.ndarray, repeats: int = 5) -> dict[str, float]:
    """The write and the read of one set of maps in each form, in this process (medians, ms): the server's field and
    body (app/encoding.py; the JSON form as the job's done event writes it, orjson), and the client's decode
    (attnlab.results: json.loads then base64, or read_binary on the body's buffer)."""
    import json as json_module

    import orjson

    from app.encoding import binary_fields, binary_response, tensor_field
    from attnlab.results import decode, read_binary

    tensor = torch.from_numpy(maps)
    steps = {
        "json: write (base64 + orjson)": lambda: orjson.dumps({"attention": tensor_field(tensor, "f32")}),
        "binary: write (header + one copy)": lambda: _binary_body(tensor, binary_fields, binary_response, tensor_field),
    }
    times: dict[str, list[float]] = {name: [] for name in [*steps, "json: read (json.loads + base64)",
                                                           "binary: read (read_binary, with a copy into a bytearray)"]}
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            body = step()
            times[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            if name.startswith("json"):
                decode(json_module.loads(body)["attention"])
                times["json: read (json.loads + base64)"].append(time.perf_counter() - started)
            else:
                read_binary(bytearray(body))["attention"]  # with the copy into a buffer (readinto fills one)
                times["binary: read (read_binary, with a copy into a bytearray)"].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def _binary_body(tensor, binary_fields, binary_response, tensor_field) -> bytes:
    with binary_fields() as parts:
        payload = {"attention": tensor_field(tensor, "f32")}
    return binary_response(payload, parts).body


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    raw = RawLM(same_gemm_as_app=True)
    settings = {"default_models": [LM]}
    variant = iter(range(10_000))
    (ROOT / "artifacts").mkdir(exist_ok=True)
    with Lab.start(settings=settings, log=ROOT / "artifacts" / "every-head-map-server.log", progress=False) as lab:

        def run(name: str) -> tuple[int, ...]:
            text = raw.text(args.tokens, next(variant))  # a fresh input: no kept run answers it
            if name.startswith("lab"):
                maps = lab.attention(text, LM, encoding="f32", binary=name == "lab, binary").attention
            else:
                maps = eager(raw, text, 1 if name == "eager, 1 thread" else None)
            return maps.shape

        names = ["lab, json", "lab, binary", "eager, 1 thread", "eager, torch's threads"]
        for name in names:  # one unmeasured call each
            run(name)
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                load = os.getloadavg()[0]
                cpu = cpu_seconds() + server_cpu_seconds(lab)
                started = time.perf_counter()
                shape = run(name)
                wall = time.perf_counter() - started
                times[name].append((wall, load, cpu_seconds() + server_cpu_seconds(lab) - cpu))
                assert shape[-1] == args.tokens, (name, shape)
    pieces = parts(eager(raw, raw.text(args.tokens, next(variant)), 1))
    median = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
    median_cpu = {name: statistics.median(t[2] for t in ts) for name, ts in times.items()}
    floor = min(median["eager, 1 thread"], median["eager, torch's threads"])
    floor_cpu = min(median_cpu["eager, 1 thread"], median_cpu["eager, torch's threads"])
    report = {"machine": {"platform": platform.platform(), "cpu": cpu_name(), "cpus": os.cpu_count(),
                          "torch": torch.__version__},
              "tokens": args.tokens, "numbers": int(np.prod(shape)), "rounds": args.rounds, "median_s": median,
              "median_cpu_s": median_cpu,
              "median_load": {name: statistics.median(t[1] for t in ts) for name, ts in times.items()},
              "over_faster_eager": {name: m / floor for name, m in median.items()},
              "cpu_over_cheaper_eager": {name: m / floor_cpu for name, m in median_cpu.items()},
              "times_wall_s_load_cpu_s": times, "parts_ms": pieces, "parts_load": os.getloadavg()[0]}
    out = ROOT / "benchmarks" / "results"
    stem = "every_head_map" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Every head's map at {args.tokens} tokens over HTTP, decoded (benchmarks/every_head_map.py)", "",
             f"{LM}, CPU, {report['numbers']:,} numbers a map set; {args.rounds} interleaved rounds, fresh inputs, "
             f"medians; machine {report['machine']}.", "",
             "CPU: this process's and the server's CPU time together (a thread waiting for a core costs none).", "",
             "| work | median wall ms | ÷ the faster eager | median CPU ms | ÷ the cheaper eager | median load (1 min) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in names:
        lines.append(f"| {name} | {median[name] * 1000:.0f} | {median[name] / floor:.3f} | "
                     f"{median_cpu[name] * 1000:.0f} | {median_cpu[name] / floor_cpu:.3f} | "
                     f"{report['median_load'][name]:.2f} |")
    lines += ["", f"The write and the read of one set of maps in each form, in one process (medians of 5, load "
              f"{report['parts_load']:.1f}):", "", "| part | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in pieces.items()]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
