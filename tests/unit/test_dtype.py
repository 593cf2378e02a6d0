"""The `dtype` setting: a model served in float16/bfloat16 passes the probe in float32 first, then reports what
the lower precision costs (`dtype_parity`, max |Δ output| against float32) and runs the whole engine in it:
attention maps still float32 rows that sum to 1, interventions and continuations working."""
from __future__ import annotations

import pytest
import torch

from models.adapters.base import resolve_dtype
from models.interventions import Intervention
from models.registry import build_registry
from tests.tiny_models import build_image_model, build_text_model

TEXT = "the cat sat on the mat because it was tired"


def _load(model_id: str, folder, dtype: str):
    return build_registry(weights_dir="/nonexistent", extra={model_id: str(folder)})[model_id].load("cpu", dtype)


@pytest.mark.parametrize("family", ["llama", "bert", "bart"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_text_model_in_half_precision(family, dtype, tmp_path):
    folder = build_text_model(family, tmp_path / family)
    full, half = _load("full", folder, "float32"), _load("half", folder, dtype)
    assert full.info.dtype == "float32" and full.info.dtype_parity is None
    assert half.info.dtype == dtype
    assert next(half.model.parameters()).dtype == resolve_dtype(dtype)
    assert 0 < half.info.dtype_parity < 0.5, half.info.dtype_parity  # measured: it rounds, but stays close

    encoded = half.encode(TEXT)
    if half.info.output == "next_token":
        encoded = half.at_position(encoded, None)
    before = half.run(encoded)
    assert before.attention.dtype == torch.float32
    rows = before.attention.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)
    reference = full.run(full.at_position(full.encode(TEXT), None) if full.info.output == "next_token" else full.encode(TEXT))
    assert float((before.attention - reference.attention).abs().max()) < 0.05

    after = half.run(encoded, (Intervention("temperature", beta=0.02), Intervention("perturb_keys", noise_std=1.0)))
    assert all(torch.isfinite(t).all() for t in after.output.values() if isinstance(t, torch.Tensor))
    assert float((after.attention - before.attention).abs().max()) > 1e-3
    if half.info.output == "next_token":
        effect = half.output_effect(before, after, encoded)
        assert effect["kl"] > 0
        prompt = encoded.inputs["input_ids"][0].tolist()
        steps = list(half.continuation(prompt, (Intervention("temperature", beta=0.5),), 4))
        assert 0 < len(steps) <= 4


def test_image_model_in_bfloat16(tmp_path):
    from PIL import Image

    from models.adapters.vit import VitAdapter

    folder = build_image_model("vit", tmp_path / "vit")
    adapter = VitAdapter("tiny-vit", str(folder), device="cpu", dtype="bfloat16")
    assert adapter.info.dtype == "bfloat16" and adapter.info.dtype_parity > 0
    image = Image.linear_gradient("L").convert("RGB").resize((48, 40))
    result = adapter.run(adapter.encode(image, "gradient"))  # float32 pixels cast to the model's dtype
    assert result.attention.dtype == torch.float32 and torch.isfinite(result.attention).all()


def test_unknown_dtype_is_refused(tmp_path):
    folder = build_text_model("bert", tmp_path / "bert")
    with pytest.raises(ValueError, match="dtype must be one of"):
        _load("x", folder, "float8")
