"""The ViT-family adapter on tiny random models built here: token labels, geometry, interpolation,
and that the recorded attention is the model's own (no interventions = eager attention)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from models.adapters.vit import VitAdapter
from models.summaries import attention_rollout, cls_rollout_map, mean_attention_distance
from tests.float32 import assert_close_f32, attention_terms


@pytest.fixture(scope="module")
def tiny_deit(tmp_path_factory):
    from transformers import DeiTConfig, DeiTModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-deit")
    DeiTModel(DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         image_size=32, patch_size=8)).save_pretrained(folder)
    return folder


def photo(seed=0, size=(50, 40)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_deit_distillation_token_and_geometry(tiny_deit):
    adapter = VitAdapter("deit", str(tiny_deit), device="cpu")
    assert adapter.info.output == "embedding" and adapter.info.layers == 2 and adapter.native_size == 32
    encoded = adapter.encode(photo(), "id")
    assert encoded.tokens[:3] == ["CLS", "dist", "p(0,0)"] and len(encoded.tokens) == 2 + 16
    assert encoded.extra["prefix_tokens"] == 2 and encoded.extra["crop_box"] == (5, 0, 45, 40)
    result = adapter.run(encoded)
    assert result.attention.shape == (2, 2, 18, 18) and result.hidden_states.shape == (3, 18, 32)
    assert torch.allclose(result.attention.sum(-1), torch.ones(2, 2, 18), atol=1e-5)


def test_higher_resolution_interpolates_position_embeddings(tiny_deit):
    adapter = VitAdapter("deit", str(tiny_deit), device="cpu")
    encoded = adapter.encode(photo(), "id", image_size=64)
    assert encoded.extra["grid"] == (8, 8) and encoded.inputs["pixel_values"].shape == (1, 3, 64, 64)
    assert adapter.run(encoded).attention.shape == (2, 2, 66, 66)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        adapter.check_image_size(60)


def test_recorded_attention_equals_eager(tiny_deit):
    from transformers import DeiTModel

    adapter = VitAdapter("deit", str(tiny_deit), device="cpu")
    eager = DeiTModel.from_pretrained(tiny_deit, attn_implementation="eager").eval()
    encoded = adapter.encode(photo(1), "id")
    result = adapter.run(encoded)
    with torch.inference_mode():
        reference = eager(pixel_values=encoded.inputs["pixel_values"], output_attentions=True)
    terms = attention_terms(eager.config, result.attention.shape[-1])  # q·k over the head size, softmax over keys
    for layer in range(2):
        assert_close_f32(result.attention[layer], reference.attentions[layer][0], terms, scale=1.0)


def test_rollout_and_distance_by_hand():
    # one layer, one head, 1 prefix + 2×2 patches; P = identity → Ã = I, rollout = I, distance 0
    identity = torch.eye(5).reshape(1, 1, 5, 5)
    assert torch.allclose(attention_rollout(identity), torch.eye(5))
    assert cls_rollout_map(identity, 1, (2, 2)).abs().sum() == 0
    assert mean_attention_distance(identity, 1, (2, 2), 10).item() == 0
    # every patch attends to the patch diagonally opposite: distance √2 · 10 px
    opposite = torch.zeros(1, 1, 5, 5)
    opposite[0, 0, 0, 0] = 1
    for i, j in ((1, 4), (2, 3), (3, 2), (4, 1)):
        opposite[0, 0, i, j] = 1
    assert mean_attention_distance(opposite, 1, (2, 2), 10).item() == pytest.approx(10 * 2**0.5, rel=1e-6)
    # rollout rows stay distributions: ½P + ½I renormalised, multiplied
    uniform = torch.full((3, 2, 5, 5), 0.2)
    rollout = attention_rollout(uniform)
    assert_close_f32(rollout.sum(-1), torch.ones(5), 3 * 5, scale=1.0)  # 3 products of 5-term sums, then a row sum


def test_cls_rollout_row_equals_the_full_product():
    torch.manual_seed(0)
    attention = torch.softmax(torch.randn(4, 3, 10, 10), dim=-1)  # (L, H, T, T)
    full = attention_rollout(attention)  # (T, T)
    # a row carried through 4 layers against the full product: 4 matrix products of 10-term sums, at most 1
    assert_close_f32(cls_rollout_map(attention, 1, (3, 3)), full[0, 1:].reshape(3, 3), 4 * 10, scale=1.0)
