"""The entropy computed once after the forward from the recorded P (what a GPU run does, RunScope.deferred_entropy)
equals the per-layer entropy from the logits (what a CPU run does), for every family and with masks, dead rows
and perturbations; the maps themselves are bit-identical either way."""
from __future__ import annotations

import pytest
import torch

from models.interventions import Intervention
from models.registry import build_registry
from tests.tiny_models import build_image_model, build_text_model

TEXT = "the cat sat on the mat because it was tired"
INTERVENTIONS = (
    lambda n: (),
    lambda n: (Intervention("temperature", beta=0.3), Intervention("perturb_keys", noise_std=0.5, seed=3)),
    lambda n: (Intervention("mask_keys", tokens=tuple(range(n)), heads=(1,)),),  # every key of head 1: dead rows
)


def _both(adapter, encoded, interventions):
    adapter.deferred_entropy = False
    per_layer = adapter.run(encoded, interventions)
    adapter.deferred_entropy = True
    deferred = adapter.run(encoded, interventions)
    adapter.deferred_entropy = False
    return per_layer, deferred


def _flat(entropy) -> torch.Tensor:
    if isinstance(entropy, dict):
        return torch.cat([torch.tensor(entropy[k]).flatten() for k in sorted(entropy)])
    return torch.as_tensor(entropy).flatten()


@pytest.mark.parametrize("family", ["llama", "bert", "bart"])
@pytest.mark.parametrize("case", range(len(INTERVENTIONS)))
def test_deferred_entropy_matches_per_layer(family, case, tmp_path):
    folder = build_text_model(family, tmp_path / family)
    adapter = build_registry(weights_dir="/nonexistent", extra={"m": str(folder)})["m"].load("cpu")
    encoded = adapter.encode(TEXT)
    if adapter.info.output == "next_token":
        encoded = adapter.at_position(encoded, None)
    per_layer, deferred = _both(adapter, encoded, INTERVENTIONS[case](len(encoded.tokens)))
    assert torch.equal(per_layer.attention, deferred.attention)
    a, b = _flat(per_layer.derived["entropy"]), _flat(deferred.derived["entropy"])
    assert a.shape == b.shape and float(a.abs().max()) > 0
    assert float((a - b).abs().max()) < 1e-5, float((a - b).abs().max())
    assert per_layer.warnings == deferred.warnings
    if case == 2 and family != "bart":
        assert any("every key masked" in w for w in deferred.warnings)


def test_deferred_entropy_on_an_image_model(tmp_path):
    from PIL import Image

    from models.adapters.vit import VitAdapter

    adapter = VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path / "vit")), device="cpu")
    encoded = adapter.encode(Image.linear_gradient("L").convert("RGB").resize((48, 40)), "gradient")
    per_layer, deferred = _both(adapter, encoded, (Intervention("temperature", beta=2.0),))
    assert torch.equal(per_layer.attention, deferred.attention)
    assert float((_flat(per_layer.derived["entropy"]) - _flat(deferred.derived["entropy"])).abs().max()) < 1e-5
