"""A greedy continuation with every head's attention rows, against transformers' own (issue 55 §1): smollm2-135m on
the CPU, N new tokens, interleaved in one process, medians.

- lab: POST /api/text/generate (in-process app, FastAPI's TestClient) with `"attention": {"layers": null, "heads":
  null, "encoding": "f32"}` and no interventions: every layer and head's row of every step, float32, read whole (the
  stream to its done event, its kept runs named);
- transformers: `model.generate(…, max_new_tokens=N, do_sample=False, output_attentions=True,
  return_dict_in_generate=True)` on AutoModelForCausalLM with eager attention, and every step's last rows taken as
  float32 numpy (L, H, T_k), as the lab sends them; as transformers loads it (its Linear layers on MKL) and with the
  app's Linear routing on this CPU (models/cpu_linear.py: oneDNN where faster), "same GEMM"; on one torch thread, as
  the lab runs a decoding step of fewer than single_thread_max_tokens tokens (app/runtime.py threads_wanted), and with
  `--two-threads` also on torch's default count (on a loaded 2-core machine two spinning OpenMP threads took 6×
  longer than one: 38 s against the lab's 6.6 s at load 9.7).

Each round runs the variants in turn; the load average (os.getloadavg, 1 min) is read beside every timing. Writes
benchmarks/results/generate_vs_transformers[_TAG].json and .md.

    .venv/bin/python -m benchmarks.generate_vs_transformers [--rounds 9] [--new-tokens 20] [--two-threads] [--tag NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from benchmarks.run_all import LM_PROMPTS, RawLM

ROOT = Path(__file__).resolve().parents[1]
PROMPT = LM_PROMPTS[0]


def lab(client: TestClient, new_tokens: int) -> int:
    body = {"model": "smollm2-135m", "text": PROMPT, "max_new_tokens": new_tokens,
            "attention": {"layers": None, "heads": None, "encoding": "f32"}}
    response = client.post("/api/text/generate", json=body)
    lines = [line for line in response.text.splitlines() if line.startswith("data:")]
    assert response.status_code == 200 and '"done"' in lines[-1], response.text[-500:]
    return len(lines) - 2  # the accepted and done events aside


@torch.inference_mode()
def transformers_generate(raw: RawLM, new_tokens: int, threads: int | None) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _generate(raw, new_tokens)
    finally:
        torch.set_num_threads(before)


def _generate(raw: RawLM, new_tokens: int) -> int:
    inputs = raw.tokenizer(PROMPT, return_tensors="pt")
    out = raw.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True, pad_token_id=raw.tokenizer.eos_token_id)
    rows = [torch.stack([layer[0, :, -1] for layer in step]).float().numpy() for step in out.attentions]  # (L, H, T_k)
    return len(rows)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def cpu_seconds() -> float:
    """This process's CPU time, every thread (the app's worker threads included): user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(call) -> tuple[float, float, float, int]:
    """(wall s, load average over 1 min before, CPU s, steps): CPU time is steadier than wall time on a machine
    shared with others (a thread waiting for a core costs no CPU time), but leaves out that waiting."""
    load = os.getloadavg()[0]
    cpu, started = cpu_seconds(), time.perf_counter()
    steps = call()
    return time.perf_counter() - started, load, cpu_seconds() - cpu, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--tag", default="")
    parser.add_argument("--two-threads", action="store_true")
    args = parser.parse_args()
    settings = Settings(default_models=["smollm2-135m"], max_new_tokens=max(64, args.new_tokens),
                        generate_timeout_s=600, request_timeout_s=600)
    plain, same = RawLM(), RawLM(same_gemm_as_app=True)
    runs = {"lab": None, "transformers": (plain, 1), "transformers, same GEMM": (same, 1)}
    if args.two_threads:
        runs["transformers, torch's threads"] = (plain, None)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    with TestClient(create_app(settings)) as client:
        client.app.state.runtime.warm_up()

        def call(name):
            return (lambda: lab(client, args.new_tokens)) if runs[name] is None else \
                (lambda: transformers_generate(*runs[name][:1], args.new_tokens, runs[name][1]))

        for name in runs:  # one unmeasured call each: caches, allocator
            call(name)()
        for _ in range(args.rounds):
            for name in runs:
                seconds, load, cpu, steps = timed(call(name))
                assert steps == args.new_tokens, (name, steps)
                times[name].append((seconds, load, cpu))
    median = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
    median_cpu = {name: statistics.median(t[2] for t in ts) for name, ts in times.items()}
    report = {
        "machine": {"platform": platform.platform(), "cpu": cpu_name(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "lab_step_threads": client.app.state.runtime.threads_wanted(1)},
        "new_tokens": args.new_tokens, "rounds": args.rounds, "prompt": PROMPT, "median_s": median,
        "median_cpu_s": median_cpu,
        "median_load": {name: statistics.median(t[1] for t in ts) for name, ts in times.items()},
        "lab_over_transformers": median["lab"] / median["transformers"],
        "lab_over_same_gemm": median["lab"] / median["transformers, same GEMM"],
        "times_wall_s_load_cpu_s": times, "tag": args.tag,
    }
    out = ROOT / "benchmarks" / "results"
    stem = "generate_vs_transformers" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# A {args.new_tokens}-token generate with every head's rows (f32): lab vs transformers "
             "(benchmarks/generate_vs_transformers.py)", "",
             f"smollm2-135m, CPU; {args.rounds} interleaved rounds, medians; machine {report['machine']}.", "",
             "| work | median wall s | lab ÷ this (wall) | median CPU s | lab ÷ this (CPU) | median load (1 min) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in runs:
        lines.append(f"| {name} | {median[name]:.3f} | {median['lab'] / median[name]:.3f} | {median_cpu[name]:.3f} | "
                     f"{median_cpu['lab'] / median_cpu[name]:.3f} | {report['median_load'][name]:.2f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
