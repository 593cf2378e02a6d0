"""Speech bench, in one process (no HTTP), interleaved with its baselines so a loaded machine hurts both alike:

1. view: the engine's run of a 10 s clip (WhisperAdapter.run: encoder with its overview, decoder teacher-forced on
   the transcript, every map kept) + word times + alignment ranking, against a raw eager
   WhisperForConditionalGeneration forward with output_attentions=True on the same tokens (target ≤ 1.3×);
2. first view: the same plus the greedy transcript (WhisperAdapter.encode), against `generate` + that raw forward;
3. the greedy transcript with an intervention active (3–7 s masked in cross-attention) against `generate`
   (target ≤ 1.5×), with eager attention (the same arithmetic) and with PyTorch's sdpa (transformers' default).

    python -m benchmarks.speech [--repeats 5] [--threads 2] [--model whisper-base]
    # from the checkout's root; results → benchmarks/results/speech.json (whisper-base: speech-whisper-base.json)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"
RESULTS = ROOT / "benchmarks" / "results"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ten_second_clip() -> np.ndarray:
    """The espeak-ng sample (6.7 s) followed by its first 3.3 s: 10 s of speech at 16 kHz."""
    from models.audio import decode_path

    samples = decode_path(SAMPLE).samples
    return np.concatenate([samples, samples[: 160_000 - samples.size]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="whisper-tiny-en", choices=["whisper-tiny-en", "whisper-base"])
    args = parser.parse_args(argv)
    weights = ROOT / "weights" / args.model
    torch.set_num_threads(args.threads)
    from transformers import WhisperForConditionalGeneration

    from models.adapters.seq2seq import KindScopedIntervention
    from models.adapters.whisper import WhisperAdapter
    from models.interventions import Intervention

    adapter = WhisperAdapter(args.model, str(weights), device="cpu")
    raw = WhisperForConditionalGeneration.from_pretrained(weights, attn_implementation="eager").eval()
    raw_sdpa = WhisperForConditionalGeneration.from_pretrained(weights, attn_implementation="sdpa").eval()
    # a multilingual model: generate with the adapter's prompt (English, transcribe), as the product decodes it
    language = {"language": "en", "task": "transcribe"} if adapter.multilingual else {}
    clip = ten_second_clip()
    encoded = adapter.encode(clip, ("bench",), language="en" if adapter.multilingual else None)
    features, ids = encoded.inputs["input_features"], encoded.inputs["decoder_input_ids"]
    mask = adapter.engine_interventions([KindScopedIntervention(Intervention(op="mask_keys", tokens=tuple(range(150, 350))), "cross")])

    @torch.inference_mode()
    def raw_forward():
        return raw(input_features=features, decoder_input_ids=ids, output_attentions=True)

    @torch.inference_mode()
    def raw_generate():
        return raw.generate(input_features=features, max_new_tokens=adapter.max_new_tokens, do_sample=False, num_beams=1,
                            **language)

    @torch.inference_mode()
    def raw_generate_sdpa():
        return raw_sdpa.generate(input_features=features, max_new_tokens=adapter.max_new_tokens, do_sample=False,
                                 num_beams=1, **language)

    def view():
        result = adapter.run(encoded)
        adapter.word_times(result, encoded)
        adapter.alignment_ranking(result, encoded)

    def first_view():
        fresh = adapter.encode(clip, ("bench", time.perf_counter()))  # a multilingual model detects the language too
        result = adapter.run(fresh)
        adapter.word_times(result, fresh)
        adapter.alignment_ranking(result, fresh)

    # same transcript from both sides (the product's greedy loop is generate's, suppress lists included)
    generated = raw_generate()[0].tolist()
    plain_ids, _ = adapter.transcribe(features, ())
    same_transcript = adapter.decode(plain_ids) == adapter.decode([t for t in generated if t not in adapter.prompt])
    for fn in (view, raw_forward, raw_generate, raw_generate_sdpa):  # warm-up
        fn()

    times: dict[str, list[float]] = {k: [] for k in ("view", "raw_forward", "first_view", "raw_generate", "raw_generate_sdpa",
                                                     "transcribe_masked")}
    for _ in range(args.repeats):
        times["view"].append(timed(view))
        times["raw_forward"].append(timed(raw_forward))
        times["first_view"].append(timed(first_view))
        times["raw_generate"].append(timed(raw_generate))
        times["transcribe_masked"].append(timed(lambda: adapter.transcribe(features, mask)))
        times["raw_generate_sdpa"].append(timed(raw_generate_sdpa))
    median = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "model": args.model,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads (a shared, loaded 2-core machine)",
        "clip_s": clip.size / 16000, "tokens": len(encoded.tokens), "repeats": args.repeats,
        "same_transcript_as_generate": same_transcript, "median_s": median,
        "ratios": {
            "view / raw eager forward with attentions (target ≤ 1.3)": median["view"] / median["raw_forward"],
            "first view / (generate + raw forward)": median["first_view"] / (median["raw_generate"] + median["raw_forward"]),
            "masked greedy transcript / generate (eager attention; target ≤ 1.5)": median["transcribe_masked"] / median["raw_generate"],
            "masked greedy transcript / generate (sdpa attention)": median["transcribe_masked"] / median["raw_generate_sdpa"],
        },
        "all_s": times,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("speech.json" if args.model == "whisper-tiny-en" else f"speech-{args.model}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("model", "machine", "clip_s", "tokens", "same_transcript_as_generate", "median_s", "ratios")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
