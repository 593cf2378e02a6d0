"""Parity and engine latency of the built-in models on a device against the CPU (scripts/gpu_check.sh runs this).

For each model (minilm, dinov2-small, vit-fashion, smollm2-135m) it loads the adapter twice, through the same
registry the server uses — on the CPU in float32 (the reference) and on `--device` — runs both on the same
inputs through attnlab's engine (no intervention), and reports the largest absolute difference of:
- every attention map P (L, H, T, T) and
- the model's output (sentence embedding, class logits, next-token logits, …).
Then, for each of `--dtypes` (default float16 and bfloat16 on CUDA, none on the CPU), the model is loaded on
the device as the server loads it with that `dtype` setting (probe in float32, then cast; its `dtype_parity` is
reported too) and the same differences are measured against the float32 CPU reference: the figure a
half-precision deployment has, measured rather than assumed. A dtype that fails is reported with its error.

Latency: the median time of one engine run (`adapter.run`: forward + recorded attention, copied to the CPU) on
`--device`, per model, dtype and length (text: `--lengths` tokens; images: the native size and 448 px for
dinov2-small).

    python scripts/gpu_parity.py --device cuda --out parity.md [--json parity.json]
    python scripts/gpu_parity.py --device cpu --quick          # CPU against CPU: exactly 0 in float32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from models.registry import build_registry

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("minilm", "dinov2-small", "vit-fashion", "smollm2-135m")
WORDS = ("the cat sat on a mat and the dog ran to the park while it was warm so we all went out "
         "for lunch near old river bank").split()
PARITY_TOKENS = 128


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def text_of(adapter, n_tokens: int) -> str:
    """Plain words giving at most n_tokens tokens on this adapter (special tokens included)."""
    words = [WORDS[i % len(WORDS)] for i in range(n_tokens)]
    while words and len(adapter.encode(" ".join(words)).tokens) > n_tokens:
        words = words[:-max(1, (len(adapter.encode(" ".join(words)).tokens) - n_tokens) // 2)]
    return " ".join(words)


def test_image(seed: int = 0) -> Image.Image:
    """A deterministic photo-like image: smooth gradients plus noise, 320 × 240."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:240, 0:320].astype(np.float32)
    base = np.stack([x / 320, y / 240, (x + y) / 560], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def encode(adapter, kind: str, size: int | str):
    if kind == "image":
        return adapter.encode(test_image(), "gpu-parity", None if size == "native" else int(size))
    return adapter.encode(text_of(adapter, int(size)))


def max_diff(reference, other) -> dict[str, float]:
    """Largest |Δ| of the attention maps and of every output tensor (float64 on the CPU)."""
    out = {"attention": float((reference.attention.double() - other.attention.double()).abs().max())}
    for name, value in reference.output.items():
        if isinstance(value, torch.Tensor) and name in other.output and value.shape == other.output[name].shape:
            out[f"output.{name}"] = float((value.double() - other.output[name].double()).abs().max())
    return out


def time_runs(adapter, encoded, device: str, repeats: int) -> float:
    adapter.run(encoded)  # warm-up (CUDA kernels, allocator)
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        adapter.run(encoded)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def latencies(adapter, kind: str, sizes: list, device: str, repeats: int) -> dict[str, float]:
    out = {}
    for size in sizes:
        timed = encode(adapter, kind, size)
        out[f"{len(timed.tokens)} tokens"] = round(time_runs(adapter, timed, device, repeats), 2)
    return out


def measure(model_id: str, spec, device: str, dtypes: list[str], lengths: list[int], repeats: int) -> dict:
    row: dict = {"model": model_id, "kind": spec.kind}
    started = time.perf_counter()
    reference = spec.load("cpu")
    target = spec.load(device)
    row["load_s"] = round(time.perf_counter() - started, 1)
    kind = "image" if spec.kind == "image" else "text"
    parity_size = "native" if kind == "image" else PARITY_TOKENS
    ref_encoded = encode(reference, kind, parity_size)
    encoded = encode(target, kind, parity_size)
    row["parity_tokens"] = len(encoded.tokens)
    ref_result = reference.run(ref_encoded)
    row["float32"] = max_diff(ref_result, target.run(encoded))
    sizes = (["native", 448] if model_id == "dinov2-small" else ["native"]) if kind == "image" else lengths
    row["latency_ms"] = {"float32": latencies(target, kind, sizes, device, repeats)}
    del target
    for name in dtypes:
        try:
            lowered = spec.load(device, name)  # as the server loads it with ATTNLAB_DTYPE=name
            row[name] = max_diff(ref_result, lowered.run(encode(lowered, kind, parity_size)))
            row[name]["dtype_parity"] = lowered.info.dtype_parity
            row["latency_ms"][name] = latencies(lowered, kind, sizes, device, repeats)
            del lowered
        except Exception as exc:  # noqa: BLE001 — reported in the table: a dtype the model cannot serve in
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    del reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], device: str, dtypes: list[str]) -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [f"### Parity on {device} ({name}) against the CPU in float32", "",
             f"Largest |Δ| over the same input ({PARITY_TOKENS} text tokens; images at the native size), attention maps "
             "P and the model's output. float16/bfloat16: the model as the server loads it with that `dtype` setting, "
             "against the float32 CPU reference; `dtype_parity` is the figure the model reports in /api/models (its "
             "output on the probe input against float32 on the device).", "",
             "| model | tokens | dtype | max abs Δ attention | max abs Δ output | dtype_parity |", "|---|---|---|---|---|---|"]
    for row in rows:
        for dtype in ["float32", *dtypes]:
            diff = row[dtype]
            if "error" in diff:
                lines.append(f"| {row['model']} | {row['parity_tokens']} | {dtype} | failed: {diff['error']} | | |")
                continue
            outputs = ", ".join(f"{k.split('.', 1)[1]} {v:.2e}" for k, v in diff.items() if k.startswith("output."))
            reported = diff.get("dtype_parity")
            lines.append(f"| {row['model']} | {row['parity_tokens']} | {dtype} | {diff['attention']:.2e} | "
                         f"{outputs or 'n/a'} | {'—' if reported is None else f'{reported:.2e}'} |")
    measured = [d for d in ["float32", *dtypes] if any(d in row["latency_ms"] for row in rows)]
    lines += ["", f"### Engine latency on {device} (median of one `adapter.run`, ms)", "",
              "| model | input | " + " | ".join(measured) + " |", "|---|---|" + "---|" * len(measured)]
    for row in rows:
        for size in row["latency_ms"]["float32"]:
            cells = [f"{row['latency_ms'][d][size]:.1f}" if d in row["latency_ms"] else "—" for d in measured]
            lines.append(f"| {row['model']} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--dtypes", nargs="*", default=None, help="default: float16 bfloat16 on cuda, none on cpu")
    parser.add_argument("--lengths", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="minilm and vit-fashion, 32 tokens, 2 repeats")
    parser.add_argument("--weights-dir", default=os.environ.get("ATTNLAB_WEIGHTS_DIR", str(ROOT / "weights")))
    parser.add_argument("--out", type=Path, help="write the markdown tables here")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_parity: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.quick:
        args.models, args.lengths, args.repeats = ["minilm", "vit-fashion"], [32], 2
    dtypes = args.dtypes if args.dtypes is not None else (["float16", "bfloat16"] if args.device == "cuda" else [])
    registry = build_registry(weights_dir=args.weights_dir)
    rows = []
    for model_id in args.models:
        print(f"[gpu_parity] {model_id} on {args.device}", flush=True)
        rows.append(measure(model_id, registry[model_id], args.device, dtypes, args.lengths, args.repeats))
        print(f"[gpu_parity]   {json.dumps(rows[-1])}", flush=True)
    text = markdown(rows, args.device, dtypes)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
