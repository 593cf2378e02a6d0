"""The CTranslate2 reader on small files written here, and the Whisper name mapping (fused QKV / KV split)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from models.ctranslate2 import (
    CTranslate2FormatError, read_model, split_fused, whisper_layers, whisper_state_dict, write_model,
)


def test_reader_reads_every_dtype_shape_and_alias(tmp_path):
    rng = np.random.default_rng(0)
    variables = {
        "a/weight": rng.standard_normal((3, 4)).astype(np.float16),
        "a/bias": rng.standard_normal(3).astype(np.float32),
        "b/int8": rng.integers(-100, 100, (2, 2, 2)).astype(np.int8),
        "b/int16": np.array(7, dtype=np.int16),  # rank 0
        "b/int32": rng.integers(-5, 5, 5).astype(np.int32),
    }
    path = tmp_path / "model.bin"
    write_model(path, "TestSpec", 2, variables, aliases={"alias/w": "a/weight"})
    model = read_model(path)
    assert (model.spec, model.revision, model.binary_version) == ("TestSpec", 2, 6)
    assert list(model.variables) == list(variables)
    for name, array in variables.items():
        assert model.variables[name].dtype == array.dtype and model.variables[name].shape == array.shape
        np.testing.assert_array_equal(model.variables[name], array)
    np.testing.assert_array_equal(model.get("alias/w"), variables["a/weight"])


def test_reader_string_length_counts_the_nul(tmp_path):
    """The header is u32 version, string (u16 length incl. NUL), u32 revision: check the bytes themselves."""
    path = tmp_path / "model.bin"
    write_model(path, "WhisperSpec", 3, {})
    raw = path.read_bytes()
    assert struct.unpack("<I", raw[:4])[0] == 6
    assert struct.unpack("<H", raw[4:6])[0] == len("WhisperSpec") + 1 and raw[6 + 11] == 0
    assert struct.unpack("<I", raw[18:22])[0] == 3


def test_reader_widens_bfloat16(tmp_path):
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)  # exact in bfloat16
    path = tmp_path / "model.bin"
    write_model(path, "S", 1, {"x": np.zeros(3, np.float32)})
    raw = bytearray(path.read_bytes())
    # patch the one variable into bfloat16: dtype code 5, 6 bytes, the top halves of the float32s
    header_end = raw.index(b"x\0") + 2 + 1 + 4  # name, rank, dims
    raw[header_end] = 5
    raw[header_end + 1: header_end + 5] = struct.pack("<I", 6)
    body = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    raw = raw[: header_end + 5] + body + struct.pack("<I", 0)
    path.write_bytes(bytes(raw))
    np.testing.assert_array_equal(read_model(path).variables["x"], values)


def test_reader_refuses_a_truncated_file(tmp_path):
    path = tmp_path / "model.bin"
    write_model(path, "S", 1, {"w": np.ones((64, 64), np.float32)})
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CTranslate2FormatError, match="truncated"):
        read_model(path)


def test_split_fused_is_row_blocks_in_order():
    q, k, v = (np.full((4, 3), value, np.float32) for value in (1, 2, 3))
    parts = split_fused(np.concatenate([q, k, v]), 3, "qkv")
    for part, expected in zip(parts, (q, k, v)):
        np.testing.assert_array_equal(part, expected)
    with pytest.raises(CTranslate2FormatError):
        split_fused(np.zeros((7, 3)), 3, "qkv")


def _tiny_whisper_spec(d=8, heads=2, ffn=16, vocab=11, k_bias=0.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float16)

    def lin(name, out, inp):
        return {f"{name}/weight": r(out, inp), f"{name}/bias": r(out)}

    def norm(name):
        return {f"{name}/gamma": r(d), f"{name}/beta": r(d)}

    v = {"encoder/num_heads": np.array(heads, np.int16), "decoder/num_heads": np.array(heads, np.int16),
         "decoder/activation": np.array(3, np.int8), "decoder/pre_norm": np.array(1, np.int8)}
    v |= lin("encoder/conv1", d, 4) | lin("encoder/conv2", d, d)
    v["encoder/conv1/weight"], v["encoder/conv2/weight"] = r(d, 4, 3), r(d, d, 3)
    for side in ("encoder", "decoder"):
        v[f"{side}/position_encodings/encodings"] = r(6, d)
        v |= norm(f"{side}/layer_norm")
        layer = f"{side}/layer_0"
        qkv = lin(f"{layer}/self_attention/linear_0", 3 * d, d)
        qkv[f"{layer}/self_attention/linear_0/bias"][d:2 * d] = k_bias  # the k slice: zero in real files
        v |= qkv | lin(f"{layer}/self_attention/linear_1", d, d) | norm(f"{layer}/self_attention/layer_norm")
        if side == "decoder":
            kv = lin(f"{layer}/attention/linear_1", 2 * d, d)
            kv[f"{layer}/attention/linear_1/bias"][:d] = 0
            v |= lin(f"{layer}/attention/linear_0", d, d) | kv | lin(f"{layer}/attention/linear_2", d, d)
            v |= norm(f"{layer}/attention/layer_norm")
        v |= norm(f"{layer}/ffn/layer_norm") | lin(f"{layer}/ffn/linear_0", ffn, d) | lin(f"{layer}/ffn/linear_1", d, ffn)
    v["decoder/embeddings/weight"] = r(vocab, d)
    return v


def test_whisper_mapping_loads_into_transformers_strictly(tmp_path):
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    variables = _tiny_whisper_spec()
    path = tmp_path / "model.bin"
    write_model(path, "WhisperSpec", 3, variables, aliases={"decoder/projection/weight": "decoder/embeddings/weight"})
    model_file = read_model(path)
    assert whisper_layers(model_file) == (1, 1, 2, 8)
    state = whisper_state_dict(model_file, 1, 1)
    d = 8
    np.testing.assert_array_equal(state["model.encoder.layers.0.self_attn.k_proj.weight"],
                                  variables["encoder/layer_0/self_attention/linear_0/weight"][d:2 * d])
    np.testing.assert_array_equal(state["model.decoder.layers.0.encoder_attn.v_proj.bias"],
                                  variables["decoder/layer_0/attention/linear_1/bias"][d:])
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in state
    config = WhisperConfig(vocab_size=11, num_mel_bins=4, d_model=d, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                           max_source_positions=6, max_target_positions=6, pad_token_id=0, decoder_start_token_id=1,
                           tie_word_embeddings=True)
    model = WhisperForConditionalGeneration(config)
    result = model.load_state_dict({k: torch.from_numpy(a.astype(np.float32)) for k, a in state.items()}, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["proj_out.weight"]  # tied, not stored
    model.tie_weights()
    assert torch.equal(model.proj_out.weight, torch.from_numpy(variables["decoder/embeddings/weight"].astype(np.float32)))


def test_whisper_mapping_refuses_a_nonzero_k_bias_and_leftovers(tmp_path):
    path = tmp_path / "model.bin"
    write_model(path, "WhisperSpec", 3, _tiny_whisper_spec(k_bias=0.5))
    with pytest.raises(CTranslate2FormatError, match="k_proj bias is not zero"):
        whisper_state_dict(read_model(path), 1, 1)
    write_model(path, "WhisperSpec", 3, _tiny_whisper_spec() | {"decoder/extra/weight": np.ones(2, np.float16)})
    with pytest.raises(CTranslate2FormatError, match="unmapped"):
        whisper_state_dict(read_model(path), 1, 1)


def test_concatenated_parts_read_as_the_whole_file(tmp_path):
    """whisper-base ships its model.bin in two packages: the parts' bytes in order are the file; a missing or
    reordered part is refused by the reader."""
    from models.ctranslate2 import concatenate_parts

    variables = {name: array for name, array in _tiny_whisper_spec().items()}
    whole = tmp_path / "whole.bin"
    write_model(whole, "WhisperSpec", 3, variables, aliases={"decoder/projection/weight": "decoder/embeddings/weight"})
    raw = whole.read_bytes()
    cuts = [0, len(raw) // 3, 2 * len(raw) // 3, len(raw)]
    parts = []
    for i in range(3):
        part = tmp_path / f"model.bin.part{i + 1}"
        part.write_bytes(raw[cuts[i]:cuts[i + 1]])
        parts.append(part)
    joined = tmp_path / "model.bin"
    assert concatenate_parts(parts, joined, chunk_bytes=1000) == len(raw)
    assert joined.read_bytes() == raw and not (tmp_path / "model.bin.partial").exists()
    model = read_model(joined)
    assert list(model.variables) == list(variables) and model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    for name, array in variables.items():
        np.testing.assert_array_equal(model.variables[name], array)
    concatenate_parts(parts[:2], joined)  # the last part missing
    with pytest.raises(CTranslate2FormatError, match="truncated"):
        read_model(joined)
    concatenate_parts([parts[1], parts[0], parts[2]], joined)  # out of order
    with pytest.raises(CTranslate2FormatError):
        read_model(joined)


def test_whisper_prompts_english_only_and_multilingual():
    from models.whisper_front import WhisperTokens

    english = WhisperTokens(eot=50256, sot=50257, no_timestamps=50362, transcribe=None, translate=None, languages={})
    assert not english.multilingual and english.prompt() == [50257, 50362] == english.prompt("en")
    multi = WhisperTokens(eot=50257, sot=50258, no_timestamps=50363, transcribe=50359, translate=50358,
                          languages={"en": 50259, "de": 50261})
    assert multi.multilingual
    assert multi.prompt() == [50258, 50259, 50359, 50363]
    assert multi.prompt("de", "translate") == [50258, 50261, 50358, 50363]


def test_special_tokens_come_from_the_tokenizer(tmp_path):
    """whisper_tokens reads the ids from tokenizer.json (a small one written here), and only a model with 51,865 or
    more embeddings is multilingual."""
    from tokenizers import Tokenizer, models

    from models.whisper_front import whisper_tokens

    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
                "<|notimestamps|>"]
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, **{t: 2 + i for i, t in enumerate(specials)}}, unk_token="a"))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    multi = whisper_tokens(path, 51865, [4, 5])
    assert (multi.eot, multi.sot, multi.no_timestamps, multi.translate, multi.transcribe) == (2, 3, 8, 6, 7)
    assert multi.languages == {"en": 4, "de": 5} and multi.prompt("de", "translate") == [3, 5, 6, 8]
    english = whisper_tokens(path, 51864, [4, 5])
    assert not english.multilingual and english.prompt() == [3, 8]
    with pytest.raises(SystemExit, match="not a <"):
        whisper_tokens(path, 51865, [0])
