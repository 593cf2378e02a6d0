"""Positions off on the real default models (docs/science.md "Positions off"): without positions, self-attention is
permutation-equivariant, P(πx) = Π P(x) Πᵀ. MiniLM runs as served (float32); DINOv2 in float64, because in float32
its 12 layers of GEMMs summed in another row order leave about 1e-5 of rounding (1.2e-5 measured), the size of the
bound itself, while the identity is exact."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from models.adapters.bert import BertAdapter, minilm_source
from models.adapters.vit import VitAdapter
from models.interventions import Intervention
from models.positions import permutation

OFF = (Intervention("positions", mode="off"),)
SENTENCE = "A quick brown fox jumps over the lazy dog near the riverbank."


def error(maps: torch.Tensor, maps_moved: torch.Tensor, order: list[int]) -> float:
    """max |P(πx) − Π P(x) Πᵀ| over every layer and head (new token i is old token order[i]); maps (L, H, T, T)."""
    index = torch.tensor(order)
    return float((maps_moved.double() - maps.double()[:, :, index][:, :, :, index]).abs().max())


@pytest.fixture(scope="module")
def minilm():
    return BertAdapter("minilm", minilm_source(), device="cpu")


@pytest.fixture(scope="module")
def dinov2():
    adapter = VitAdapter("dinov2-small", "weights/dinov2-small", device="cpu")
    adapter.model.double()
    adapter.dtype = torch.float64
    return adapter


def test_minilm_positions_off_permutes_the_map(minilm):
    encoded = minilm.encode(SENTENCE)
    n = len(encoded.tokens)
    order = [0, *(permutation(n - 2, 7) + 1).tolist(), n - 1]  # [CLS] and [SEP] stay in place
    moved = copy.copy(encoded)
    moved.inputs = {k: v[:, order] for k, v in encoded.inputs.items()}
    assert error(minilm.run(encoded, OFF).attention, minilm.run(moved, OFF).attention, order) <= 1e-5
    assert error(minilm.run(encoded).attention, minilm.run(moved).attention, order) > 0.05  # positions on


def test_dinov2_positions_off_permutes_the_map(dinov2):
    rng = np.random.default_rng(0)
    encoded = dinov2.encode(Image.fromarray((rng.random((224, 224, 3)) * 255).astype("uint8")), "noise")
    pixels = encoded.inputs["pixel_values"]  # (1, 3, 224, 224)
    rows, cols = encoded.extra["grid"]
    size = dinov2.patch_size
    patches = permutation(rows * cols, 3)
    tiles = pixels.unfold(2, size, size).unfold(3, size, size).reshape(1, 3, rows * cols, size, size)[:, :, patches]
    moved = copy.copy(encoded)
    moved.inputs = {"pixel_values": tiles.reshape(1, 3, rows, cols, size, size).permute(0, 1, 2, 4, 3, 5)
                    .reshape(pixels.shape)}
    order = [0, *(patches + 1).tolist()]  # the CLS stays in place
    assert error(dinov2.run(encoded, OFF).attention, dinov2.run(moved, OFF).attention, order) <= 1e-5
    assert error(dinov2.run(encoded).attention, dinov2.run(moved).attention, order) > 0.05  # positions on
