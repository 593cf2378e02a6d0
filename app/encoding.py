"""Turning tensors into response fields: JSON floats (float32's shortest repr), or base64 float16/float32; or, for a
request sent with `Accept: application/octet-stream`, the binary body (`binary_fields`, `binary_response`): a JSON
header, then the f16/f32 fields' raw little-endian bytes, never base64-encoded, parsed or copied on the way.

The binary body (docs/api.md "The binary form"):
    bytes 0-3        n, the header's length, uint32 little-endian
    bytes 4 … 4+n    the header: the answer as JSON (UTF-8), padded with spaces so that the data starts at a multiple
                     of 8; each f16/f32 field is {"dtype", "shape", "offset", "nbytes"} instead of {"dtype", "shape",
                     "data"}: its bytes at `offset` from the data's start (each part 8-byte aligned)
    bytes 4+n …      the data
"""
from __future__ import annotations

import base64
import contextlib
import contextvars
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import torch
from fastapi import Response


BINARY_ENCODINGS = {"f16": ("float16", "<f2"), "f32": ("float32", "<f4")}
F16_MAX = float(np.finfo(np.float16).max)  # 65504
BINARY_MEDIA_TYPE = "application/octet-stream"
ALIGN = 8  # every part of the binary body's data starts at a multiple of this: a Float32Array or numpy view of it
# the f16/f32 fields of the answer being built, while a request for the binary body is answered (binary_fields)
_PARTS: contextvars.ContextVar[list[np.ndarray] | None] = contextvars.ContextVar("attnlab_binary_parts", default=None)


@contextlib.contextmanager
def binary_fields() -> Iterator[list[np.ndarray]]:
    """While in it, this thread's tensor_field calls with f16/f32 put their arrays in the returned list (the binary
    body's data, in order) rather than base64 text: for `binary_response`."""
    parts: list[np.ndarray] = []
    token = _PARTS.set(parts)
    try:
        yield parts
    finally:
        _PARTS.reset(token)


def binary_response(payload: dict[str, Any], parts: list[np.ndarray]) -> Response:
    """The binary body of `payload` (see the module doc): one copy of each part's bytes, into the body."""
    header = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    header += b" " * (-(4 + len(header)) % ALIGN)
    chunks: list[Any] = [struct.pack("<I", len(header)), header]
    for part in parts:
        chunks.append(memoryview(part).cast("B"))
        chunks.append(b"\0" * (-part.nbytes % ALIGN))
    return Response(b"".join(chunks), media_type=BINARY_MEDIA_TYPE)


def _binary_part(array: np.ndarray, dtype: str, parts: list[np.ndarray]) -> dict[str, Any]:
    offset = sum(part.nbytes + (-part.nbytes % ALIGN) for part in parts)
    parts.append(array)
    return {"dtype": dtype, "shape": list(array.shape), "offset": offset, "nbytes": array.nbytes}


def tensor_field(tensor: torch.Tensor, encoding: str = "json") -> object:
    """A numpy float32 array (serialised by `fast_json` as nested lists, full float32 precision), or for
    encoding 'f16'/'f32' {"dtype": "float16"|"float32", "shape", "data": base64 little-endian}: 'f32' is
    exact and about 2.5× smaller than JSON text, and a browser decodes it without parsing numbers."""
    array = np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype=np.float32)
    if encoding in BINARY_ENCODINGS:
        warning = None
        if encoding == "f16" and array.size and float(np.abs(array).max()) > F16_MAX:  # would become ±inf
            encoding = "f32"
            warning = f"values beyond float16's range (|x| > {F16_MAX:g}): sent as float32 instead of f16"
        dtype, layout = BINARY_ENCODINGS[encoding]
        parts = _PARTS.get()
        if parts is not None:  # the binary body: the array itself (float32: no copy), sent as its bytes
            field = _binary_part(np.ascontiguousarray(array.astype(layout, copy=False)), dtype, parts)
            if warning:
                field["warning"] = warning
            return field
        field = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data": base64.b64encode(array.astype(layout, copy=False).tobytes()).decode("ascii"),
        }
        if warning:
            field["warning"] = warning
        return field
    return array


def fast_json(payload: dict[str, Any]) -> Response:
    """orjson writes numpy arrays natively (~50× faster than json on millions of floats); float32 values
    come out in their shortest round-trip form, so every probability keeps its full precision."""
    return Response(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")
