"""What runs the float32 Linear layers on this CPU (models/cpu_linear.py): MKL, torch's default, against oneDNN.

In one process, interleaved (each MKL timing beside its oneDNN twin, medians): the Linear products of minilm and
smollm2-135m at a short input's 128 rows, a long input's 512 and a decoding step's 1 (the LM head's 49,152 outputs
included); then whole forwards with attentions of both models at 128 tokens (the same model object, its Linear
layers turned and back), and smollm2-135m's greedy decoding in ms a token, at 2 threads and at 1. Writes
benchmarks/results/cpu_linear.json with the machine; prints a Markdown table.

    python -m benchmarks.cpu_linear [--repeats 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.run_all import RESULTS, RawForward, RawLM, machine, text_of
from models.cpu_linear import OneDNNLinear, _onednn_linear, measured_ratio, onednn_available

# (model, layer, in, out) of the two default text models
SHAPES = [("minilm", "q/k/v/o", 384, 384), ("minilm", "mlp up", 384, 1536), ("minilm", "mlp down", 1536, 384),
          ("smollm2-135m", "q/o", 576, 576), ("smollm2-135m", "k/v", 576, 192),
          ("smollm2-135m", "gate/up", 576, 1536), ("smollm2-135m", "down", 1536, 576),
          ("smollm2-135m", "lm head", 576, 49152)]


def interleaved(a, b, repeats: int) -> tuple[float, float]:
    """Medians in ms of `a` and `b`, called in turn `repeats` times after two calls each to warm."""
    for _ in range(2):
        a(), b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times_a), statistics.median(times_b)


def set_linear(model: nn.Module, onednn: bool) -> None:
    for module in model.modules():
        if type(module) in (nn.Linear, OneDNNLinear):
            module.__class__ = OneDNNLinear if onednn else nn.Linear


@torch.inference_mode()
def products(repeats: int) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for model, layer, n_in, n_out in SHAPES:
        weight = torch.randn(n_out, n_in, generator=generator)
        for rows_in in (1, 128, 512):
            x = torch.randn(1, rows_in, n_in, generator=generator)
            mkl, onednn = interleaved(lambda: F.linear(x, weight), lambda: _onednn_linear(x, weight, None),
                                      repeats if n_out < 10_000 else max(5, repeats // 4))
            rows.append({"model": model, "layer": layer, "in": n_in, "out": n_out, "rows": rows_in,
                         "mkl_ms": mkl, "onednn_ms": onednn, "ratio": onednn / mkl})
    return rows


def forwards(repeats: int) -> list[dict]:
    rows = []
    for name, raw, text in (("minilm", RawForward(), lambda v: text_of(128, v)),
                            ("smollm2-135m", (lm := RawLM()), lambda v: lm.text(128, v))):
        count = iter(range(10_000))
        set_linear(raw.model, False)
        calls = {}
        for onednn in (False, True):
            def call(onednn=onednn):
                set_linear(raw.model, onednn)
                raw(text(next(count)))
            calls[onednn] = call
        mkl, onednn = interleaved(calls[False], calls[True], repeats if name == "minilm" else max(8, repeats // 3))
        rows.append({"model": name, "what": "forward with attentions, 128 tokens (tokenizer included)",
                     "mkl_ms": mkl, "onednn_ms": onednn, "ratio": onednn / mkl})
        if name == "smollm2-135m":
            ids = lm.tokenizer(text(9999), return_tensors="pt")["input_ids"][0, :16].tolist()
            steps = 32

            def decode(onednn: bool) -> None:
                set_linear(raw.model, onednn)
                lm.generate(ids, steps)
            mkl, onednn = interleaved(lambda: decode(False), lambda: decode(True), 5)
            rows.append({"model": name, "what": f"greedy decoding, ms a token ({steps} after 16)",
                         "mkl_ms": mkl / steps, "onednn_ms": onednn / steps, "ratio": onednn / mkl})
        set_linear(raw.model, False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN")
    out: dict = {"machine": machine(), "repeats": args.repeats, "auto_ratio": measured_ratio(), "threads": {}}
    default_threads = torch.get_num_threads()
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        load = __import__("os").getloadavg()
        out["threads"][threads] = {"load_average_before": load, "products": products(args.repeats),
                                   "forwards": forwards(args.repeats)}
        (RESULTS / "cpu_linear.json").write_text(json.dumps(out, indent=2))
    print(f"auto's own measure: oneDNN takes {out['auto_ratio']:.2f}× MKL's time")
    for threads, part in out["threads"].items():
        print(f"\n{threads} thread(s), load {part['load_average_before'][0]:.1f}\n")
        print("| model | product (in → out) | rows | MKL ms | oneDNN ms | oneDNN ÷ MKL |\n|---|---|---:|---:|---:|---:|")
        for r in part["products"]:
            print(f"| {r['model']} | {r['layer']} ({r['in']} → {r['out']}) | {r['rows']} | {r['mkl_ms']:.3f} | "
                  f"{r['onednn_ms']:.3f} | {r['ratio']:.2f} |")
        print("\n| model | what | MKL ms | oneDNN ms | oneDNN ÷ MKL |\n|---|---|---:|---:|---:|")
        for r in part["forwards"]:
            print(f"| {r['model']} | {r['what']} | {r['mkl_ms']:.1f} | {r['onednn_ms']:.1f} | {r['ratio']:.2f} |")
    print(f"\nwrote {RESULTS / 'cpu_linear.json'}")


if __name__ == "__main__":
    main()
