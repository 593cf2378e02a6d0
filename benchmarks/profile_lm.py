"""Where the time of an LM first view and of a continuation goes, in one process (no HTTP): the engine's
run (CausalLMAdapter.run with scores, as a first view asks) vs a raw eager forward with attentions, and
continuation() vs model.generate, interleaved; then torch.profiler's top operators for each.

    python -m benchmarks.profile_lm [--tokens 128] [--repeats 5] [--new-tokens 32]    # from the checkout's root
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.run_all import LM, LM_PROMPTS, LM_WEIGHTS, RawLM, lm_interventions


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def top_ops(fn, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from models.adapters.causal_lm import CausalLMAdapter
    from models.interventions import Intervention

    raw = RawLM()
    adapter = CausalLMAdapter(LM, str(LM_WEIGHTS))
    text = raw.text(args.tokens, 1)
    encoded = adapter.encode(text)

    def engine_run():
        with torch.inference_mode():
            return adapter.run(encoded, (), record_scores=True)

    @torch.inference_mode()
    def raw_no_attn():
        inputs = raw.tokenizer(text, return_tensors="pt")
        return raw.model(**inputs)

    engine_run(), raw(text), raw_no_attn()  # warm
    r, e, n = [], [], []
    for _ in range(args.repeats):
        r.append(timed(lambda: raw(text)))
        e.append(timed(engine_run))
        n.append(timed(raw_no_attn))
    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(f"{args.tokens} tokens, {torch.get_num_threads()} threads: raw eager with attentions {med(r):.1f} ms · "
          f"raw eager without {med(n):.1f} ms · engine run with scores {med(e):.1f} ms ({med(e) / med(r):.2f}×)")
    print("\n== raw eager forward with attentions: top operators"); print(top_ops(lambda: raw(text)))
    print("\n== engine run (record P, entropy, q/k, hidden states): top operators"); print(top_ops(engine_run))

    ivs_json = lm_interventions(adapter.info.native_beta)
    ivs = tuple(Intervention(op="temperature", beta=iv["beta"], layers=tuple(iv["layers"])) for iv in ivs_json)
    ids = raw.tokenizer(LM_PROMPTS[0])["input_ids"]
    k = args.new_tokens
    cont = lambda iv: [s.id for s in adapter.continuation(ids, iv, k)]  # noqa: E731
    gen = lambda: raw.generate(ids, k)  # noqa: E731
    gen(), cont(ivs)
    g, c, c0 = [], [], []
    for _ in range(max(2, args.repeats // 2)):
        g.append(timed(gen))
        c.append(timed(lambda: cont(ivs)))
        c0.append(timed(lambda: cont(())))
    print(f"\n{k} new tokens: generate {med(g):.0f} ms · continuation with β {med(c):.0f} ms ({med(c) / med(g):.2f}×) · "
          f"without {med(c0):.0f} ms ({med(c0) / med(g):.2f}×)")
    print("\n== generate: top operators"); print(top_ops(gen))
    print("\n== continuation with β: top operators"); print(top_ops(lambda: cont(ivs)))
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    cont(ivs)
    prof.disable()
    print("\n== continuation with β: cProfile, cumulative"); pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
