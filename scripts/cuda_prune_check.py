"""Check on a GPU machine that the CUDA image's pruning (Dockerfile, deps stage) keeps what torch loads.

The Docker image cannot be run on a GPU here, so this applies the same pruning to a copy of the machine's
own torch + NVIDIA wheels (the Dockerfile's `rm -f "$site"/nvidia/...` lines, read from the Dockerfile, plus
its include/ and *.a removal, and Triton made unimportable), then runs the operations attnlab's models use on
the GPU from that copy: linear layers and matmuls in float32/float16/bfloat16 (cuBLAS/cuBLASLt), Conv2d and
Conv1d (cuDNN), softmax, LayerNorm, GELU, embeddings, scaled_dot_product_attention, top-k, plus cuSOLVER,
cuFFT and an NVRTC-compiled (jiterator) kernel. It records which NVIDIA libraries the process mapped.

    python scripts/cuda_prune_check.py [--scratch DIR] [--out FILE.json]

Exit status 0 when every operation ran from the pruned copy and no pruned library was mapped.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOAD = r'''
import json, sys, torch, torch.nn as nn, torch.nn.functional as F
results = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "torch_file": torch.__file__, "gpu": torch.cuda.get_device_name(0), "ops": {}}
dev = torch.device("cuda")
def op(name, fn):
    try:
        out = fn()
        torch.cuda.synchronize()
        results["ops"][name] = "ok" if bool(torch.isfinite(out.float()).all()) else "non-finite"
    except Exception as e:  # noqa: BLE001 - every failure is reported by name
        results["ops"][name] = f"{type(e).__name__}: {e}"[:300]
x = torch.randn(4, 128, 384, device=dev)                                   # (B, T, D)
op("linear_f32", lambda: nn.Linear(384, 1536).to(dev)(x))
op("linear_f16", lambda: nn.Linear(384, 1536).to(dev).half()(x.half()))
op("linear_bf16", lambda: nn.Linear(384, 1536).to(dev).bfloat16()(x.bfloat16()))
op("bmm_softmax", lambda: torch.softmax(x @ x.transpose(1, 2) / 384 ** 0.5, dim=-1))   # (B, T, T)
op("sdpa", lambda: F.scaled_dot_product_attention(x.view(4, 128, 6, 64).transpose(1, 2), x.view(4, 128, 6, 64).transpose(1, 2),
                                                  x.view(4, 128, 6, 64).transpose(1, 2)))
op("sdpa_f16", lambda: F.scaled_dot_product_attention(*(x.half().view(4, 128, 6, 64).transpose(1, 2),) * 3))
op("layernorm_gelu", lambda: F.gelu(nn.LayerNorm(384).to(dev)(x)))
op("embedding", lambda: nn.Embedding(30000, 384).to(dev)(torch.randint(0, 30000, (4, 128), device=dev)))
img = torch.randn(2, 3, 224, 224, device=dev)                               # (B, C, H, W)
op("conv2d_patch_embed", lambda: nn.Conv2d(3, 384, 14, stride=14).to(dev)(img))
op("conv2d_f16", lambda: nn.Conv2d(3, 384, 14, stride=14).to(dev).half()(img.half()))
op("conv1d_whisper", lambda: nn.Conv1d(80, 384, 3, padding=1).to(dev)(torch.randn(1, 80, 3000, device=dev)))
op("topk", lambda: torch.topk(torch.randn(4, 49152, device=dev), 5).values)
op("cusolver_eigh", lambda: torch.linalg.eigh(torch.eye(64, device=dev) + 0.01 * torch.randn(64, 64, device=dev).T @ torch.randn(64, 64, device=dev))[0])
op("cusolver_svd", lambda: torch.linalg.svd(torch.randn(64, 32, device=dev))[1])
op("cufft", lambda: torch.fft.rfft(torch.randn(8, 400, device=dev)).abs())
op("nvrtc_jiterator", lambda: torch.special.i0e(torch.randn(1000, device=dev)))
op("complex_jiterator", lambda: (torch.randn(1000, device=dev, dtype=torch.complex64) * 1j).abs())
try:
    import triton  # noqa: F401
    results["triton"] = "importable"
except ImportError:
    results["triton"] = "absent"
maps = open("/proc/self/maps").read()
results["mapped"] = sorted({m for m in set(__import__("re").findall(r"(/\S+/nvidia/\S+\.so[.\d]*)", maps))})
print(json.dumps(results))
'''


def pruned_names(dockerfile: Path) -> list[str]:
    """The library globs the Dockerfile removes, e.g. 'cu13/lib/libnvrtc.alt.so.*'."""
    return re.findall(r'"\$site"/nvidia/(\S+?)(?=\s|$)', dockerfile.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", default=None, help="where the pruned copy goes (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    spec = importlib.util.find_spec("torch")
    site = Path(spec.origin).parents[1]
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="prune-"))
    started = time.monotonic()
    for name in ("torch", "nvidia"):
        shutil.copytree(site / name, scratch / name, symlinks=True, dirs_exist_ok=True)
    removed = []
    for pattern in pruned_names(ROOT / "Dockerfile"):
        for path in glob.glob(str(scratch / "nvidia" / pattern)):
            os.remove(path)
            removed.append(os.path.relpath(path, scratch))
    for path in list((scratch / "nvidia").rglob("*")):
        if path.exists() and ((path.is_dir() and path.name == "include") or path.suffix == ".a"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(os.path.relpath(path, scratch))
    (scratch / "triton").mkdir(exist_ok=True)  # Triton removed: an import of it must fail, as in the image
    (scratch / "triton" / "__init__.py").write_text("raise ImportError('triton is not in the CUDA image')\n")
    copy_s = time.monotonic() - started
    env = {**os.environ, "PYTHONPATH": str(scratch)}
    run = subprocess.run([sys.executable, "-c", WORKLOAD], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout, run.stderr, file=sys.stderr)
        return 1
    results = json.loads(run.stdout.strip().splitlines()[-1])
    removed_libs = {Path(r).name for r in removed}
    results.update(copy_and_prune_s=round(copy_s, 1), removed=sorted(removed_libs),
                   scratch_is_used=results["torch_file"].startswith(str(scratch)),
                   mapped_outside_scratch=[m for m in results["mapped"] if not m.startswith(str(scratch))],
                   pruned_but_mapped=[m for m in results["mapped"] if Path(m).name in removed_libs])
    results["mapped"] = [os.path.relpath(m, scratch) if m.startswith(str(scratch)) else m for m in results["mapped"]]
    failed = {k: v for k, v in results["ops"].items() if v != "ok"}
    ok = (not failed and results["scratch_is_used"] and not results["pruned_but_mapped"]
          and results["triton"] == "absent" and bool(removed_libs))
    results["ok"] = ok
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
