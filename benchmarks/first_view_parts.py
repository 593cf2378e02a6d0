"""Where a fresh first view's CPU time goes outside the forward, without a profiler's own cost: named parts of the
request path are wrapped with thread CPU-time counters (time.thread_time: a part is not charged while the machine
runs other processes), and fresh 128-token first views are posted through FastAPI's TestClient on one torch thread,
interleaved with a raw eager forward (process CPU time) for scale. A sampling profiler on the shared, loaded machine
charges a part for the time it waited for a core; a deterministic one (cProfile) charges each small call its own
overhead (it made the result cache's size bookkeeping look 20× dearer than it was).

    python -m benchmarks.first_view_parts [--model minilm|smollm2-135m] [--rounds 20]
"""
from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import time

import torch

from benchmarks.first_view_cpu import app_client
from benchmarks.run_all import LM, RawForward, RawLM, first_view_body, lm_first_view_body, text_of

PARTS = [
    ("app.routes.text", "respond"), ("app.pipeline.views", "plain_view"), ("app.runtime", "Runtime.run"),
    ("models.adapters.base", "AttentionAdapter._forward"), ("models.adapters.base", "AttentionAdapter._result"),
    ("app.runstore", "ResultCache.put"), ("app.pipeline.views", "short_response"),
    ("app.pipeline.maps", "ShortMaps.device_parts"), ("app.attention", "thumbnail_levels"),
    ("app.pipeline.views", "text_fields"), ("app.pipeline.views", "sink_mass"), ("app.attention", "read_to_host"),
    ("app.pipeline.maps", "ShortMaps.fields"), ("app.pipeline.job", "ComparedJob.admit"),
    ("app.streams", "fast_json"), ("models.adapters.bert", "BertAdapter.encode"),
    ("models.adapters.causal_lm", "CausalLMAdapter.encode"), ("models.adapters.causal_lm", "CausalLMAdapter.output_parts"),
]


def wrap(module_name: str, name: str, spent: dict[str, float], calls: collections.Counter) -> None:
    """Replace module_name.name (or Class.method) by a wrapper that adds its thread CPU time to spent[name]."""
    owner, attr = importlib.import_module(module_name), name
    if "." in name:
        cls, attr = name.split(".")
        owner = getattr(owner, cls)
    fn = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.thread_time() - start
            calls[name] += 1

    setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", choices=["minilm", LM])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for module_name, name in PARTS:
        wrap(module_name, name, spent, calls)
    client = app_client(args.model)
    if args.model == LM:
        raw = RawLM()
        raw_call, body_of = (lambda v: raw(raw.text(128, v))), (lambda v: lm_first_view_body(raw.text(128, v)))
    else:
        raw = RawForward()
        raw_call, body_of = (lambda v: raw(text_of(128, v))), (lambda v: first_view_body(text_of(128, v)))
    for k in range(3):  # warm both sides
        raw_call(9000 + k)
        client.post("/api/text/attention", json=body_of(9100 + k)).raise_for_status()
    spent.clear(), calls.clear()
    raws, posts = [], []
    for i in range(args.rounds):
        start = time.process_time()
        raw_call(2 * i)
        raws.append((time.process_time() - start) * 1000)
        body = body_of(2 * i + 1)
        start = time.process_time()
        client.post("/api/text/attention", json=body).raise_for_status()
        posts.append((time.process_time() - start) * 1000)
    raw_ms, post_ms = statistics.median(raws), statistics.median(posts)
    print(f"{args.model}, 128 tokens, 1 thread: raw forward {raw_ms:.2f} ms, POST {post_ms:.2f} ms "
          f"({post_ms / raw_ms:.3f}×), process CPU")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        per = seconds / args.rounds * 1000
        print(f"  {name:32s} {per:8.3f} ms a request ({per / raw_ms:6.1%} of raw; {calls[name] / args.rounds:.0f} calls)")
    client.__exit__(None, None, None)


if __name__ == "__main__":
    main()
