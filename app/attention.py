"""What every route checks and reads the same way: the settings' limits on a request (check_request_limits), the
response-size 413 (check_response_numbers), and the maps' thumbnails and one device → host read.
An attention response is built by app/pipeline (job → maps → view)."""
from __future__ import annotations

import base64
import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from fastapi import HTTPException
from pydantic import BaseModel

from app.errors import field_error
from app.settings import Settings

# Request fields that hold text, each at most max_text_chars characters.
TEXT_FIELDS = ("text", "text_pair", "target", "clean", "corrupt")


def check_pair_texts(limits: Settings, req: BaseModel) -> None:
    """A circuit's prompt pairs (`pairs: [{clean, corrupt, …}]`, `pair: {…}`) hold text too: max_text_chars each, the
    422 naming the pair's field (pairs.0.clean)."""
    pairs = getattr(req, "pairs", None) or ()
    single = getattr(req, "pair", None)
    located = [(("pairs", i), pair) for i, pair in enumerate(pairs)] + ([(("pair",), single)] if single else [])
    for loc, pair in located:
        for name in ("clean", "corrupt"):
            value = getattr(pair, name, None)
            if isinstance(value, str) and len(value) > limits.max_text_chars:
                raise field_error((*loc, name), f"{name} has {len(value):,} characters; the limit is "
                                  f"{limits.max_text_chars:,} (max_text_chars)")


def check_request_limits(limits: Settings, req: BaseModel) -> None:
    """The settings' limits on what one request may ask (docs/configuration.md), in one place: every route calls it
    first, before any model loads or runs (text attention, generate, image, speech attention and transcript,
    patching, lens, faithfulness). A 422 naming the field and the setting. What depends on the model or the input
    (indices, tokens, response size, run bytes, cost) is checked once they are known."""
    for name in TEXT_FIELDS:
        value = getattr(req, name, None)
        if isinstance(value, str) and len(value) > limits.max_text_chars:
            raise field_error((name,), f"{name} has {len(value):,} characters; the limit is {limits.max_text_chars:,} "
                              "(max_text_chars)")
    check_pair_texts(limits, req)
    new_tokens = getattr(req, "max_new_tokens", None)
    if new_tokens is not None and new_tokens > limits.max_new_tokens:
        raise field_error(("max_new_tokens",), f"max_new_tokens={new_tokens}; the limit is {limits.max_new_tokens} "
                          "(max_new_tokens)")
    interventions = getattr(req, "interventions", ())
    if len(interventions) > limits.max_interventions:
        raise field_error(("interventions",), f"{len(interventions)} interventions; the limit is "
                          f"{limits.max_interventions} (max_interventions)")
    samples = getattr(req, "samples", 1)
    if samples > limits.max_samples:
        raise field_error(("samples",), f"samples={samples}; the limit is {limits.max_samples} (max_samples)")
    thumbnail = getattr(req, "thumbnail_size", None)
    if thumbnail is not None and thumbnail > limits.max_thumbnail_size:
        raise field_error(("thumbnail_size",), f"thumbnail_size={thumbnail}; the limit is {limits.max_thumbnail_size} "
                          "(max_thumbnail_size)")


def check_response_numbers(limits: Settings, numbers: int, counts: dict[str, int], ask: str) -> None:
    """413 before any work when the response would hold more than max_response_numbers numbers, naming first the
    request field among `counts` ({field: entries asked}, e.g. layers and heads) with the most entries (the first
    on a tie); `ask` says how to ask for less. Every route's refusal has this one form."""
    cap = limits.max_response_numbers
    if numbers > cap:
        field = max(counts, key=counts.__getitem__)
        raise HTTPException(413, detail=f"{field}: the response would hold {numbers:,} numbers, over the cap "
                            f"max_response_numbers={cap:,}; {ask}")


def thumbnails(attention: torch.Tensor, size: int) -> dict[str, Any]:
    """Every head's map average-pooled to at most size × size, as pictures: uint8 relative to each head's
    maximum (`max`, (L, H)), base64. (L, H, T, T) → {"dtype": "uint8", "shape": [L, H, t, t], "max", "data"}.
    The first view forms the same levels inside its one read (short_response); this reads them on their own."""
    levels, peak = thumbnail_levels(attention, size)
    host = read_to_host({"levels": levels, "max": peak})  # one copy for both
    return thumbnail_field(host["levels"], host["max"])


def thumbnail_levels(attention: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The thumbnails of every head at once, on the maps' device: one pooled product over the stacked maps, levels
    0-255 relative to each head's maximum. (L, H, T, T) → levels (L, H, t, t) uint8, max (L, H) float32."""
    pooled = attention
    if attention.shape[-1] > size:
        pool = _pooling_on(attention.shape[-1], size, attention.device)  # (size, T), kept where the maps are
        pooled = pool @ attention @ pool.T  # (L, H, size, size): two batched products, no copy of the maps
    peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)  # (L, H)
    levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)  # (L, H, t, t)
    return levels, peak


def thumbnail_field(levels: np.ndarray, peak: np.ndarray) -> dict[str, Any]:
    """The thumbnails' response field from host arrays: levels (L, H, t, t) uint8, base64; max (L, H)."""
    return {"dtype": "uint8", "shape": list(levels.shape), "max": peak.tolist(),
            "data": base64.b64encode(np.ascontiguousarray(levels, dtype=np.uint8).tobytes()).decode("ascii")}


def read_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors of one device → numpy arrays on the host, in ONE device → host copy: their bytes concatenated on the
    device (widest element first, so every part stays aligned), copied once, then viewed per tensor. On a GPU each
    `.cpu()`, `.tolist()` or `float(t)` is a synchronisation and a copy of its own (a first view made six). The
    arrays are fresh host memory: they never alias a tensor of the run (on a CPU the concatenation copies)."""
    if not tensors:
        return {}
    names = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: the given order within a width
    parts = [tensors[name].detach().contiguous().reshape(-1).view(torch.uint8) for name in names]  # bytes of each
    data = torch.cat(parts).cpu().numpy()  # the one transfer
    host, offset = {}, 0
    for name, part in zip(names, parts):
        tensor = tensors[name]
        dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        host[name] = data[offset:offset + part.numel()].view(dtype).reshape(tuple(tensor.shape))
        offset += part.numel()
    return host


def pooling_matrix(n: int, size: int) -> torch.Tensor:
    """The averaging of adaptive_avg_pool over one axis as a (size, n) matrix: bin i covers
    [⌊i n / size⌋, ⌈(i + 1) n / size⌉), so A M Aᵀ equals adaptive_avg_pool2d(M, size). Each weight is 1 / (bin width)
    rounded once to float32."""
    bins = torch.arange(size)
    start, end = (bins * n) // size, -((-(bins + 1) * n) // size)  # (size,): each bin's first and past-the-last index
    columns = torch.arange(n)
    inside = (columns[None, :] >= start[:, None]) & (columns[None, :] < end[:, None])  # (size, n)
    weights = (1.0 / (end - start).double()).float()  # (size,): as a Python float rounded to float32
    return inside.float() * weights[:, None]


@functools.lru_cache(maxsize=32)
def _pooling_on(n: int, size: int, device: torch.device) -> torch.Tensor:
    """pooling_matrix on `device`, once per (n, size, device): a first view neither rebuilds it nor copies it to a
    GPU again. A plain tensor (not an inference tensor), usable in and outside inference mode."""
    with torch.inference_mode(False):
        return pooling_matrix(n, size).to(device)


@functools.lru_cache(maxsize=1)
def _torch_cpu() -> ctypes.CDLL | None:
    """torch's CPU library: its symbols resolve through the OpenMP and MKL it loaded. None where it is not found."""
    try:
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _thread_controls() -> tuple[Any, Any, Any] | None:
    """OpenMP's and MKL's per-thread settings in the libraries torch loaded (omp_get_max_threads, omp_set_num_threads,
    mkl_set_num_threads_local), or None where torch has neither (another build: a GPU wheel without MKL, macOS)."""
    try:
        torch_cpu = _torch_cpu()
        get_omp, set_omp, set_mkl = (torch_cpu.omp_get_max_threads, torch_cpu.omp_set_num_threads,
                                     torch_cpu.mkl_set_num_threads_local)
    except AttributeError:  # no library (None), or one without these
        return None
    set_omp.argtypes, get_omp.restype = [ctypes.c_int], ctypes.c_int
    set_mkl.argtypes, set_mkl.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int  # the exported name takes a pointer
    return get_omp, set_omp, set_mkl


@contextlib.contextmanager
def threads_on_this_thread(threads: int) -> Iterator[None]:
    """Torch's CPU work on the calling thread runs on `threads` threads meanwhile; other threads keep theirs.

    torch.set_num_threads is not confined to its caller: it also sets MKL's process-wide count (every thread's
    matrix products) and the count new threads start with, so outside the model lock it would change a run in
    progress. OpenMP's count is per thread once set (torch's parallel regions read the caller's), and MKL has a
    per-thread override: setting those two changes this thread alone. Where torch has neither, nothing changes."""
    controls = _thread_controls()
    if controls is None or threads < 1:
        yield
        return
    get_omp, set_omp, set_mkl = controls
    # torch sets a thread's OpenMP count to the process's at its first parallel region on that thread (its lazy
    # per-thread init), which would undo the count set below on a thread new to torch; get_num_threads runs that init
    torch.get_num_threads()
    before = get_omp()
    if before == threads:
        yield
        return
    wanted = ctypes.c_int(threads)
    set_omp(threads)
    mkl_before = ctypes.c_int(set_mkl(ctypes.byref(wanted)))  # 0: this thread followed MKL's process-wide count
    try:
        yield
    finally:
        set_mkl(ctypes.byref(mkl_before))
        set_omp(before)


@functools.lru_cache(maxsize=1)
def _pause_openmp() -> Any:
    """OpenMP 5.0's omp_pause_resource_all in the OpenMP torch loaded, or None (another build, an older OpenMP)."""
    try:
        pause = _torch_cpu().omp_pause_resource_all
    except AttributeError:
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


OMP_PAUSE_SOFT = 1  # OpenMP's omp_pause_soft: the thread's helper threads end; the next parallel region starts new ones


def drop_openmp_team() -> bool:
    """End the calling thread's OpenMP team (its helper threads exit; its next parallel region starts a new team).
    False where the OpenMP torch loaded cannot (app/openmp_teams.py says when this is worth doing)."""
    pause = _pause_openmp()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
