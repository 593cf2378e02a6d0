"""What the app's recorded forward costs over an eager one, step by step (issue 55 §3), in one process: minilm's
128-token forward four ways, interleaved in every round (the order turned every round), each timed by the CPU time of
the thread that runs it (time.thread_time: the machine's other processes do not count) and, beside it, by wall time:

- `eager`: plain transformers with `attn_implementation="eager"` and `output_attentions=True`, its Linear layers routed
  as the app routes them (benchmarks/run_all.py same_gemm);
- `unrecorded`: the app's model (its attention function, models/hooks.py) outside a run: nothing recorded;
- `recorded_no_entropy`: the app's run (AttentionAdapter.run, as a first view makes it: P into the run's buffer,
  q̂/k̂ and the hidden states kept, the sentence embedding) with each layer's entropy replaced by zeros;
- `recorded`: the app's run as served.

Each side's figure is the median of its paired difference to `eager` in the same round. The process is set up as the
served one is for its memory: glibc's arenas bounded and the warm heap topped up after every forward (app/allocator.py),
and the last 64 runs kept, as the result cache keeps them, so a run's buffers are new memory as in the server.
Writes benchmarks/results/first_view_recording_<label>.json.

    python -m benchmarks.first_view_recording --label quiet [--rounds 120] [--threads 1]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

from app.allocator import bound_allocator, start_warm_heap
from app.settings import Settings
from benchmarks.run_all import RESULTS, RawForward, machine, text_of

SIDES = ("eager", "unrecorded", "recorded_no_entropy", "recorded")
DEFAULTS = Settings.model_fields  # the served process's defaults: its kept runs and its warm heap


def no_entropy(logits: torch.Tensor, probs: torch.Tensor, blocked=None, masked_logits=None) -> torch.Tensor:
    """models/interventions.mean_row_entropy's shape, without its passes over the layer's T × T maps."""
    return probs.new_zeros(probs.shape[:-2])


class Forwards:
    """The four sides on one minilm adapter and one eager model (the same weights, the same Linear routing)."""

    def __init__(self) -> None:
        from models.registry import build_registry

        self.adapter = build_registry()["minilm"].load("cpu")
        self.eager_model = RawForward(same_gemm_as_app=True).model
        self.kept: collections.deque = collections.deque(maxlen=DEFAULTS["result_cache_items"].default)

    @torch.inference_mode()
    def eager(self, encoded) -> None:
        self.eager_model(**encoded.inputs, output_attentions=True)

    @torch.inference_mode()
    def unrecorded(self, encoded) -> None:
        from models.hooks import run_scope

        with run_scope(None):
            self.adapter.model(**self.adapter.model_inputs(encoded.inputs), output_hidden_states=True, return_dict=True)

    def recorded(self, encoded) -> None:
        self.kept.append(self.adapter.run(encoded, (), record_scores=True))

    def recorded_no_entropy(self, encoded) -> None:
        from models import interventions

        served = interventions.mean_row_entropy
        interventions.mean_row_entropy = no_entropy
        try:
            self.recorded(encoded)
        finally:
            interventions.mean_row_entropy = served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--warm-up", type=int, default=5)
    args = parser.parse_args(bound_allocator("benchmarks.first_view_recording", sys.argv[1:]))
    if args.threads:
        torch.set_num_threads(args.threads)
    heap = start_warm_heap(DEFAULTS["warm_heap_bytes"].default)
    forwards = Forwards()
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    wall: dict[str, list[float]] = {side: [] for side in SIDES}
    info = {**machine(), "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX")}
    for i in range(args.warm_up + args.rounds):
        encoded = forwards.adapter.encode(text_of(128, i))
        order = SIDES if i % 2 else SIDES[::-1]
        for side in order:
            started_cpu, started = time.thread_time(), time.perf_counter()
            getattr(forwards, side)(encoded)
            took_cpu, took = time.thread_time() - started_cpu, time.perf_counter() - started
            if heap is not None:
                heap.reserve()  # as the server does after each response
            time.sleep(0.02)  # the warm heap's mapping done before the next side
            if i >= args.warm_up:
                cpu[side].append(took_cpu * 1000)
                wall[side].append(took * 1000)
    out = {"machine": info, "rounds": args.rounds, "tokens": 128, "load_average_after": os.getloadavg(), "sides": {}}
    for side in SIDES:
        paired_cpu = statistics.median(a - b for a, b in zip(cpu[side], cpu["eager"]))
        paired_wall = statistics.median(a - b for a, b in zip(wall[side], wall["eager"]))
        out["sides"][side] = {"cpu_ms": statistics.median(cpu[side]), "wall_ms": statistics.median(wall[side]),
                              "cpu_over_eager_ms": paired_cpu, "wall_over_eager_ms": paired_wall,
                              "samples_cpu_ms": cpu[side], "samples_wall_ms": wall[side]}
        print(f"  {side:20s} CPU {statistics.median(cpu[side]):7.2f} ms ({paired_cpu:+6.2f} over eager, paired), "
              f"wall {statistics.median(wall[side]):7.2f} ms ({paired_wall:+6.2f})")
    print(f"  load {info['load_average_at_start'][0]:.1f} → {out['load_average_after'][0]:.1f}")
    path = RESULTS / f"first_view_recording_{args.label}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
