"""What per-step attention rows cost a continuation (POST /api/text/generate with `attention`, docs/api.md): the same
24-token stream of smollm2-135m, plain and with every layer and head's row at every step (whole rows as JSON, as
float32 base64, and as top-k), through the app in this process (the events as the server writes them, both sides,
the kept runs at the end included in every variant).

Variants are interleaved, round after round, so the machine's load (shared, and reported: the load average before
and after) hits each alike; the figure is the median of each variant's times over the median of the plain stream's.
Writes benchmarks/results/generate_attention.md and .json.

    .venv/bin/python benchmarks/generate_attention.py [--rounds 7] [--new-tokens 24] [--long 4000]

`--long N` also streams an N-token prompt with top_k 8 (every layer and head) and reports its time and the process's
peak RSS beside the plain stream's (the prompt's forward runs blockwise: no T × T map).
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

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The lab streams a greedy continuation with and without the interventions, and now the attention of every "
          "token it writes: the row of the query that produced it, over the prompt and the tokens before it.")
VARIANTS = {
    "plain": None,
    "all rows, json": {"layers": None, "heads": None},
    "all rows, f32": {"layers": None, "heads": None, "encoding": "f32"},
    "all rows, top_k 8": {"layers": None, "heads": None, "top_k": 8},
}


def stream(client: TestClient, text: str, new_tokens: int, attention: dict | None) -> tuple[float, int, int]:
    """One stream to its done event: (seconds, steps, bytes of the answer)."""
    body = {"model": "smollm2-135m", "text": text, "max_new_tokens": new_tokens}
    if attention is not None:
        body["attention"] = attention
    started = time.perf_counter()
    response = client.post("/api/text/generate", json=body)
    seconds = time.perf_counter() - started
    lines = [line for line in response.text.splitlines() if line.startswith("data:")]
    assert response.status_code == 200 and '"done"' in lines[-1], response.text[-500:]
    return seconds, len(lines) - 2, len(response.content)


def long_text(client: TestClient, tokens: int) -> str:
    """A prompt of about `tokens` tokens: the long sample repeated."""
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    tokenizer = client.app.state.runtime.adapter("smollm2-135m").tokenizer
    text = sample
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " " + sample
    ids = tokenizer(text)["input_ids"][: tokens - 1]
    return tokenizer.decode(ids[1:] if ids and ids[0] == tokenizer.bos_token_id else ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--long", type=int, default=0)
    args = parser.parse_args()
    settings = Settings(default_models=["smollm2-135m"], max_new_tokens=max(64, args.new_tokens),
                        generate_timeout_s=600, request_timeout_s=600, max_response_numbers=50_000_000)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    sizes: dict[str, int] = {}
    with TestClient(create_app(settings)) as client:
        client.app.state.runtime.warm_up()
        for name, attention in VARIANTS.items():  # one unmeasured stream each: caches, allocator
            stream(client, PROMPT, args.new_tokens, attention)
        for _ in range(args.rounds):
            for name, attention in VARIANTS.items():
                seconds, steps, size = stream(client, PROMPT, args.new_tokens, attention)
                times[name].append(seconds)
                sizes[name] = size
        long = None
        if args.long:
            text = long_text(client, args.long)
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            plain_s = stream(client, text, args.new_tokens, None)[0]
            rss_plain = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            top_s, _, top_bytes = stream(client, text, args.new_tokens, {"top_k": 8})
            long = {"prompt_tokens": args.long, "plain_s": plain_s, "top_k_8_s": top_s, "top_k_8_bytes": top_bytes,
                    "peak_rss_mb_before": rss_before / 1024, "peak_rss_mb_after_plain": rss_plain / 1024,
                    "peak_rss_mb_after_top_k": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    load_after = os.getloadavg()
    plain = statistics.median(times["plain"])
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "load_before": load_before, "load_after": load_after},
        "new_tokens": args.new_tokens, "rounds": args.rounds, "prompt": PROMPT,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "ratio_to_plain": {name: statistics.median(t) / plain for name, t in times.items()},
        "answer_bytes": sizes, "times_s": times, "long": long,
    }
    out = ROOT / "benchmarks" / "results"
    (out / "generate_attention.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# Attention rows while the model writes: cost (benchmarks/generate_attention.py)", "",
        f"smollm2-135m on the CPU, {args.new_tokens} new tokens, both sides (with and without interventions: none "
        f"here), the kept runs at the end included; {args.rounds} interleaved rounds, medians. Machine: "
        f"{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (shared with other work).", "",
        "| variant | median s | × plain | answer bytes |", "|---|---|---|---|",
    ]
    for name in VARIANTS:
        lines.append(f"| {name} | {report['median_s'][name]:.3f} | {report['ratio_to_plain'][name]:.3f} | "
                     f"{sizes[name]:,} |")
    if long:
        lines += ["", f"A {long['prompt_tokens']:,}-token prompt: plain {long['plain_s']:.1f} s, every layer and head "
                  f"with top_k 8 {long['top_k_8_s']:.1f} s ({long['top_k_8_bytes']:,} bytes); peak RSS of the process "
                  f"{long['peak_rss_mb_before']:.0f} MB before, {long['peak_rss_mb_after_plain']:.0f} MB after the "
                  f"plain stream, {long['peak_rss_mb_after_top_k']:.0f} MB after the top-k one."]
    (out / "generate_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
