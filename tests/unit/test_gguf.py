"""Issue 29, step 3: any GGUF of a supported family. A tiny random Llama is written as a llama.cpp-style GGUF in the
test (tests/tiny_models.py build_llama_gguf); models/gguf.py joins split files with size/SHA-256 checks, dequantizes
into safetensors checked against transformers' GGUF loader, and the registry serves `NAME=/path/model.gguf`, probed
like any model; `attnlab prepare --gguf PATH --name NAME` does the same from the command line."""
from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models import gguf
from attnlab_prepare import main as prepare_main
from models.registry import build_registry
from tests.tiny_models import build_llama_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    original = build_llama_gguf(path)
    return path, original


def test_the_written_gguf_is_the_model_it_was_written_from(tiny_gguf):
    """The writer is right: transformers' GGUF loader gives the original model's logits exactly."""
    from transformers import AutoModelForCausalLM

    path, original = tiny_gguf
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 3, 4]])
    with torch.inference_mode():
        assert float((loaded(input_ids=ids).logits - original(input_ids=ids).logits).abs().max()) == 0.0


def test_join_checks_size_sha256_and_magic(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = path.read_bytes()
    parts = []
    for i, (a, b) in enumerate([(0, 100), (100, len(data) // 2), (len(data) // 2, len(data))]):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(data[a:b])
    sha = gguf.sha256_of(path)
    joined = gguf.join_parts(parts, tmp_path / "out" / "joined.gguf", len(data), sha)
    assert joined.read_bytes() == data
    with pytest.raises(gguf.GgufError, match="not a GGUF file"):
        gguf.join_parts(parts[::-1], tmp_path / "bad" / "x.gguf", len(data), sha)  # out of order: wrong digest/magic
    with pytest.raises(gguf.GgufError, match="bytes, expected"):
        gguf.join_parts(parts[:2], tmp_path / "short" / "x.gguf", len(data), sha)  # a part missing
    with pytest.raises(gguf.GgufError, match="SHA-256"):
        gguf.join_parts(parts, tmp_path / "sha" / "x.gguf", len(data), "0" * 64)
    assert not any((tmp_path / d / "x.gguf").exists() or (tmp_path / d / "x.gguf.part").exists()
                   for d in ("bad", "short", "sha"))  # nothing left behind on failure


def test_prepare_file_is_checked_recorded_and_idempotent(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = gguf.prepare_file(path, tmp_path / "tiny", "tiny", source="test file")
    record = json.loads((out / "prepared.json").read_text())
    assert record["max_abs_diff"] <= gguf.PARITY_TOLERANCE and record["architecture"] == "LlamaForCausalLM"
    assert record["layer_types"] == ["full", "full"] and record["sliding_window"] is None
    assert (out / "model.safetensors").is_file() and not (tmp_path / "tiny.tmp").exists()
    capsys.readouterr()
    gguf.prepare_file(path, tmp_path / "tiny", "tiny", source="test file")
    assert "up to date" in capsys.readouterr().out


def test_registry_serves_a_gguf_path_prepared_on_first_use(tiny_gguf, tmp_path):
    path, original = tiny_gguf
    spec = build_registry(weights_dir=tmp_path, extra={"tiny-gguf": str(path)})["tiny-gguf"]
    assert spec.family == "causal_lm"
    adapter = spec.load("cpu")
    assert (tmp_path / "tiny-gguf" / "prepared.json").is_file()
    assert adapter.info.parity <= 1e-4 and adapter.info.origin.startswith("GGUF file tiny-llama.gguf")
    assert adapter.info.to_dict()["sliding_window"] is None
    encoded = adapter.at_position(adapter.encode("the cat sat on the mat"), None)
    with torch.inference_mode():
        expected = original(input_ids=encoded.inputs["input_ids"]).logits[0, -1]
    result = adapter.run(encoded)
    assert float((result.output["last_logits"].reshape(-1).cpu() - expected).abs().max()) <= 1e-4
    bad = build_registry(weights_dir=tmp_path, extra={"../up": str(path)})["../up"]
    with pytest.raises(ValueError, match="letters, digits"):
        bad.load("cpu")


def test_served_through_the_api(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    settings = Settings(default_models=["g"], extra_models={"g": str(path)}, weights_dir=str(tmp_path))
    with TestClient(create_app(settings)) as client:
        response = client.post("/api/text/attention", json={"model": "g", "text": "the cat sat on the mat"})
        assert response.status_code == 200, response.text
        info = next(m for m in client.get("/api/models", params={"kind": "text"}).json()["models"] if m["id"] == "g")
        assert info["layer_types"] == ["full", "full"] and info["sliding_window"] is None
        assert str(tmp_path) not in json.dumps(info)  # no server path


def test_prepare_command(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    assert prepare_main(["--weights-dir", str(tmp_path), "--gguf", str(path), "--name", "mine"]) == 0
    assert (tmp_path / "mine" / "prepared.json").is_file()
    with pytest.raises(SystemExit) as refused:
        prepare_main(["--weights-dir", str(tmp_path), "--gguf", str(path), "--name", "../x"])
    assert refused.value.code == 2 and "--name" in capsys.readouterr().err
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SystemExit, match="not a GGUF file"):
        prepare_main(["--weights-dir", str(tmp_path), "--gguf", str(not_gguf), "--name", "other"])


def test_a_preparation_reads_the_gguf_metadata_once(tiny_gguf, tmp_path, monkeypatch):
    """transformers' loader reads the metadata for the config, the tokenizer and the model; a preparation reuses one
    reader (gemma3-270m: about 20 CPU-seconds a read), and the loader has its own reader back after."""
    import gguf as gguf_py

    path, _ = tiny_gguf
    opened = []

    class CountingReader(gguf_py.GGUFReader):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_py, "GGUFReader", CountingReader)
    out = gguf.prepare_file(path, tmp_path / "tiny", "tiny", source="test file")
    assert json.loads((out / "prepared.json").read_text())["max_abs_diff"] <= gguf.PARITY_TOLERANCE
    assert len(opened) == 1, opened
    assert gguf_py.GGUFReader is CountingReader


def test_a_preparation_turns_the_metadata_into_values_once(tiny_gguf, tmp_path, monkeypatch):
    """The config's, the tokenizer's and the model's loads each asked transformers for the whole metadata as Python
    values (gemma3-270m: its 262k tokens, about 5 CPU-seconds a time); a preparation converts it once and hands each
    caller its own copy, and the loader has its own function back after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    path, _ = tiny_gguf
    original, parsed = gguf_utils.load_gguf_checkpoint, []

    def counting(checkpoint, return_tensors=False, *args, **kwargs):
        if not return_tensors:
            parsed.append(checkpoint)
        return original(checkpoint, return_tensors, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    gguf.prepare_file(path, tmp_path / "tiny", "tiny", source="test file")
    assert len(parsed) == 1, parsed
    assert gguf_utils.load_gguf_checkpoint is counting
