"""float32 Linear layers through oneDNN on CPUs where it outruns the BLAS that torch was built with.

torch's CPU wheel sends a float32 `nn.Linear` to MKL's sgemm. On AMD CPUs MKL runs its AVX2 code, while oneDNN (also
inside the wheel) compiles AVX-512 kernels for the CPU it finds. On this project's machine (AMD EPYC, Zen 5, 2 cores) a
128 × 384 × 1536 product takes 0.33 ms through oneDNN against 0.72 ms through MKL, and Linear layers are ~80% of a
short minilm forward (benchmarks/results/cpu_linear.md). On a CPU where MKL is as fast, `auto` keeps MKL.

The two give the same products summed in another order: results differ by float32 rounding (≤ 4e-6 at unit scale
on that product), well inside what the load-time probe and the parity tests allow.

Only forwards without autograd take the oneDNN path (its op has no derivative): the gradient-based estimates
(models/patching.py, models/faithfulness.py) run their forwards with grad enabled and get F.linear.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

CpuLinear = Literal["auto", "onednn", "blas"]
# `auto` takes oneDNN when it needs at most this share of MKL's time on a short input's MLP product
AUTO_MAX_RATIO = 0.9

_mode: CpuLinear = "auto"


def set_cpu_linear(mode: CpuLinear) -> None:
    """The process's choice for models attached after this call (the app sets it from settings at start)."""
    if mode not in ("auto", "onednn", "blas"):
        raise ValueError(f"cpu_linear must be auto, onednn or blas, not {mode!r}")
    global _mode
    _mode = mode


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def measured_ratio() -> float:
    """oneDNN's time over MKL's for one (128, 384) × (384, 1536) float32 product on this CPU at the process's thread
    count: the best of 15 calls each, after 3 to warm (~20 ms in all).

    Timed on a thread of its own that then ends, taking its OpenMP team with it. On the calling thread (the server's
    event loop at start) the team would stay for the process's life beside the one of the thread that runs forwards:
    libgomp, managing more threads than cores, then cuts every team's spin-wait short, and served 128-token minilm
    forwards took 26 ms instead of 14 (app/openmp_teams.py keeps one team for the same reason)."""
    ratio: list[float] = []
    thread = threading.Thread(target=lambda: ratio.append(_time_both()), name="attnlab-cpu-linear-timing")
    thread.start()
    thread.join()
    return ratio[0]


def _time_both() -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 384, generator=generator)
    weight, bias = torch.randn(1536, 384, generator=generator), torch.randn(1536, generator=generator)

    def best(fn) -> float:
        for _ in range(3):
            fn(x, weight, bias)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            fn(x, weight, bias)
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        return best(_onednn_linear) / best(F.linear)


def use_onednn() -> bool:
    """Whether models attached now route their float32 CPU Linear layers through oneDNN."""
    if _mode == "blas" or not onednn_available():
        return False
    return _mode == "onednn" or measured_ratio() <= AUTO_MAX_RATIO


def describe() -> str:
    """The choice in words, for the start-up log (measures on `auto`)."""
    if not onednn_available():
        return "MKL (this torch build has no oneDNN)"
    if _mode != "auto":
        return f"{'oneDNN' if _mode == 'onednn' else 'MKL'} (cpu_linear={_mode})"
    return (f"{'oneDNN' if use_onednn() else 'MKL'} (cpu_linear=auto: oneDNN takes {measured_ratio():.2f}× MKL's "
            f"time on a short input's product here; oneDNN at ≤ {AUTO_MAX_RATIO})")


class OneDNNLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose inference forward on float32 CPU tensors runs through
    oneDNN. Anything else, a forward with autograd, another dtype or device, an empty input, goes to F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or weight.dtype != torch.float32
                or x.device.type != "cpu" or weight.device.type != "cpu" or x.numel() == 0):
            return F.linear(x, weight, self.bias)
        return _onednn_linear(x, weight, self.bias)


def route_linear(model: nn.Module) -> int:
    """Turn `model`'s nn.Linear modules (exactly that class: quantized and other subclasses keep their own forward)
    into OneDNNLinear in place when use_onednn(); returns how many were turned (0 when not)."""
    if not use_onednn():
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            turned += 1
    return turned
