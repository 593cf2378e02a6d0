"""A kept run as a file of the run store's disk tier (app/runstore.py): tensors and plain JSON, never a pickle.

The file is a safetensors file (https://github.com/huggingface/safetensors, "format"): 8 bytes of header length, a
JSON header naming each tensor's dtype, shape and byte range, then the tensors' raw bytes. Every tensor of the run
(P, hidden states, outputs, q̂/k̂, the atlas's records and summaries, derived summaries) is one entry, in the dtype it
was kept in; everything else (tokens, warnings, β, interventions, derived lists, which class holds what) is JSON in
the header's `__metadata__`; a string of LONG_STRING characters or more (a run's thumbnails) is a U8 entry, its UTF-8
bytes. An intervention is kept as its op says (models/ops/ `Op.record`: its op, scope and own
fields) and made again through the engine's check. A reader builds only the classes listed in CLASSES, from JSON and tensors: a file can
name data, never code.

Reads are memory-mapped: `read` maps the file once (copy-on-write, so a tensor of it is writable without touching the
file) and makes each tensor a view of its byte range, so a window reads only the pages of the slices it uses. Tensors
are laid out by element size, largest first, so each starts on a multiple of its element size (the data region
starts on a multiple of 8)."""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.adapters.base import AttentionResult
from models.atlas import Atlas, AtlasConfig, LayerRecord, LayerSummary, PendingRecord
from models.interventions import Intervention, LogitExtras
from models.ops import OPS

META_KEY = "attnlab.run"
FORMAT = "attnlab.run/1"
# the classes a run holds, by name: the only objects a reader builds (anything else in a run is refused on writing)
CLASSES = {cls.__name__: cls for cls in (AttentionResult, Atlas, AtlasConfig, LayerRecord, LayerSummary, PendingRecord,
                                         LogitExtras, Intervention)}
# attributes a run forms again when asked: the memo of its sizes (ids of tensors), a GPU run's host copy of P
SKIPPED = {"_sizes_memo", "_host_attention"}
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
BY_CODE = {code: dtype for dtype, code in DTYPES.items()}
# Strings this long (a run's thumbnails: base64 of every head's levels, 55 kB for minilm) are kept as U8 tensors: in
# the header they were escaped twice (the run's JSON is a string inside the safetensors header), 1.2 ms of the
# request that evicted the run (benchmarks/results/first_view_floor_issue55.md)
LONG_STRING = 1024
_SCALARS = (type(None), bool, int, float)


@dataclass
class RunFile:
    """A run ready to be written: the file's header and its tensors in file order (references, no copies)."""

    header: bytes  # 8-byte little-endian length + the JSON header, padded with spaces to a multiple of 8
    tensors: list[torch.Tensor]
    nbytes: int  # the file's size


class _Encoder:
    """A run's objects as JSON, its tensors collected (each distinct tensor once: a mask every layer shares too)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.names: dict[tuple, str] = {}

    def tensor(self, t: torch.Tensor) -> str:
        if t.dtype not in DTYPES:
            raise TypeError(f"a run's file cannot hold a {t.dtype} tensor")
        same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                str(t.device)) if t.numel() else (id(t),)
        if same not in self.names:
            self.names[same] = f"t{len(self.tensors)}"
            self.tensors.append(t)
        return self.names[same]

    def value(self, value: Any, where: str) -> Any:
        if isinstance(value, str) and len(value) >= LONG_STRING:  # its UTF-8 bytes in the data region, not JSON
            return {"$": "str", "name": self.tensor(torch.frombuffer(bytearray(value.encode("utf-8")), dtype=torch.uint8))}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return {"$": "tensor", "name": self.tensor(value)}
        if isinstance(value, np.ndarray):
            return {"$": "ndarray", "name": self.tensor(torch.from_numpy(np.ascontiguousarray(value)))}
        if isinstance(value, np.generic):
            return {"$": "scalar", "dtype": value.dtype.str, "value": value.item()}
        if isinstance(value, list):
            if all(type(v) in _SCALARS or (type(v) is str and len(v) < LONG_STRING) for v in value):
                return value  # tokens, a row of entropies: JSON as they are (a call per item was 0.3 ms a run)
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"$": "tuple", "items": [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            items = list(value.items())  # a snapshot: a response may add a derived summary meanwhile
            return {"$": "dict", "items": [[self.value(k, where), self.value(v, f"{where}[{k!r}]")] for k, v in items]}
        if isinstance(value, torch.dtype):
            return {"$": "dtype", "name": str(value).removeprefix("torch.")}
        if type(value) is Intervention:  # what its op says a run keeps of it (models/ops/: Op.record)
            return {"$": "intervention", "fields": self.value(OPS[value.op].record(value), where)}
        if type(value).__name__ in CLASSES and CLASSES[type(value).__name__] is type(value):
            state = {k: v for k, v in list(vars(value).items()) if k not in SKIPPED}
            return {"$": "object", "class": type(value).__name__, "state": self.value(state, where)}
        raise TypeError(f"a run's file cannot hold {type(value).__qualname__} (at {where})")


def encode(result: AttentionResult) -> RunFile:
    """The file of `result`: its header and tensors. Only shapes and dtypes are read (no copy, no device sync);
    TypeError naming the place of a value the format cannot hold."""
    encoder = _Encoder()
    tree = encoder.value(result, "run")
    order = sorted(range(len(encoder.tensors)), key=lambda i: -encoder.tensors[i].element_size())  # aligned
    entries, devices, offset = {}, {}, 0
    for i in order:
        t = encoder.tensors[i]
        size = t.numel() * t.element_size()
        entries[f"t{i}"] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        if t.device.type != "cpu":
            devices[f"t{i}"] = str(t.device)
        offset += size
    meta = json.dumps({"format": FORMAT, "run": tree, "devices": devices}, separators=(",", ":"))
    header = json.dumps({"__metadata__": {"format": FORMAT, META_KEY: meta}, **entries},
                        separators=(",", ":")).encode("utf-8")
    header += b" " * (-(8 + len(header)) % 8)
    return RunFile(struct.pack("<Q", len(header)) + header, [encoder.tensors[i] for i in order],
                   len(header) + 8 + offset)


def write(run_file: RunFile, path: Path) -> int:
    """Write the file (GPU tensors copied to the host one at a time); returns its size."""
    with open(path, "wb") as out:
        out.write(run_file.header)
        for t in run_file.tensors:
            if t.numel():
                out.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return run_file.nbytes


def read(path: Path, device: str = "cpu") -> AttentionResult:
    """The run in `path`, every tensor a view of the mapped file (those that were on an accelerator copied back to
    `device` when it is not "cpu"). FileNotFoundError when the file went; ValueError when it is not a run's file."""
    with open(path, "rb") as source:
        (length,) = struct.unpack("<Q", source.read(8))
        header = json.loads(source.read(length))
        mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_COPY)  # pages read on demand; the map outlives f
    meta = header.get("__metadata__", {})
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a run's file ({FORMAT})")
    body = json.loads(meta[META_KEY])
    start = 8 + length
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = BY_CODE[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        t = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin).view(shape) if count
             else torch.empty(shape, dtype=dtype))
        if device != "cpu" and name in body["devices"]:
            t = t.to(device)
        tensors[name] = t
    return _decode(body["run"], tensors)


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    kind = node["$"]
    if kind == "tensor":
        return tensors[node["name"]]
    if kind == "ndarray":
        return tensors[node["name"]].numpy()
    if kind == "str":
        return tensors[node["name"]].numpy().tobytes().decode("utf-8")
    if kind == "scalar":
        return np.dtype(node["dtype"]).type(node["value"])
    if kind == "tuple":
        return tuple(_decode(v, tensors) for v in node["items"])
    if kind == "dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node["items"]}
    if kind == "dtype":
        dtype = getattr(torch, node["name"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {node['name']!r}")
        return dtype
    if kind == "intervention":
        return Intervention(**_decode(node["fields"], tensors))  # checked again by its op, as when it was made
    if kind == "object":
        cls = CLASSES[node["class"]]  # KeyError for a class that is not a run's
        obj = cls.__new__(cls)
        obj.__dict__.update(_decode(node["state"], tensors))  # frozen dataclasses too: no __setattr__ involved
        return obj
    raise ValueError(f"unknown node {kind!r} in a run's file")
