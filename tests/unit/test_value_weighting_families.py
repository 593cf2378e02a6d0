"""Value-weighted attention beyond text encoders and decoder LMs (docs/science.md "Value-weighted attention"): a tiny
random ViT and the tiny encoder–decoders (BART, Marian, T5: encoder self-, decoder self- and cross-attention) keep
the per-key norms n_j^h = ‖v_j W_O^h‖ on their records, and the value-weighted rows P[i, j]·n_j / Σ_j P[i, j]·n_j
equal a direct computation from the value projection's own output (a forward hook of the test's, not the attention
function) and the output projection's weight — with and without interventions (key masks, β)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from models.adapters.seq2seq import KINDS, KindScopedIntervention
from models.adapters.vit import VitAdapter
from models.attribution import layer_value_norms, value_grams, value_weighted, value_weighted_rows
from models.head_ops import HeadRun, head_run
from models.interventions import Intervention
from models.registry import build_registry
from tests.float32 import assert_close_f32
from tests.tiny_models import SEQ2SEQ_FAMILIES, build_image_model, build_text_model

SOURCE = "the cat sat on the mat because it was tired"
TARGET = "the dog ran on the rug"


def _direct_norms(captured: torch.Tensor, w_o: torch.Tensor, n_heads: int) -> torch.Tensor:
    """‖v_j W_O^h‖ (H, T) in float64: captured (T, H·d) the value projection's output, w_o (D, H·d) the weight of
    the output projection (nn.Linear stores out × in)."""
    head_dim = captured.shape[-1] // n_heads
    v = captured.double().view(-1, n_heads, head_dim).transpose(0, 1)  # (H, T, d)
    w = w_o.double().view(w_o.shape[0], n_heads, head_dim).permute(1, 2, 0)  # (H, d, D)
    return torch.linalg.vector_norm(v @ w, dim=-1)  # (H, T)


def _direct_weighted(probs: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """probs (H, T_q, T_k), norms (H, T_k) → rows of P·n renormalised, in float64 (written out, not value_weighted)."""
    weighted = probs.double() * norms[:, None, :]
    return weighted / weighted.sum(dim=-1, keepdim=True)


def _run_capturing_values(adapter, pairs: dict, encoded, interventions) -> tuple:
    """The adapter's run (keeping value norms) with forward hooks on each value projection: (result, key → that
    projection's output (T, H·d) in the run)."""
    seen: dict = {}
    handles = []
    for key, (v_proj, _) in pairs.items():
        def hook(_m, _a, out, key=key):
            seen[key] = out[0].detach()
        handles.append(v_proj.register_forward_hook(hook))
    try:
        with head_run(HeadRun(value_grams=value_grams(adapter))):
            return adapter.run(encoded, interventions), seen
    finally:
        for handle in handles:
            handle.remove()


# ---- ViT ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> VitAdapter:
    return VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path_factory.mktemp("vit"))), device="cpu")


def _photo() -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 50, 3), dtype=np.uint8))


@pytest.mark.parametrize("interventions", [(), (Intervention("mask_keys", tokens=(0, 3)),
                                                Intervention("temperature", beta=3.0, layers=(1,), heads=(2,)))],
                         ids=["plain", "masked-beta"])
def test_vit_value_weighted_rows_equal_a_direct_computation(vit, interventions):
    layers = vit.model.vit.layers
    pairs = {l: (layer.attention.v_proj, layer.attention.o_proj) for l, layer in enumerate(layers)}
    encoded = vit.encode(_photo(), "id")
    result, seen = _run_capturing_values(vit, pairs, encoded, interventions)
    kept = layer_value_norms(result.atlas, list(range(len(layers))))  # (L, H, T)
    assert kept is not None
    for l, (_, dense) in pairs.items():
        direct = _direct_norms(seen[l], dense.weight, vit.info.heads)  # (H, T)
        assert_close_f32(kept[l], direct, dense.weight.shape[0])  # ‖v W_O‖: float32 sums over the hidden size
        expected = _direct_weighted(result.attention[l], direct)  # (H, T, T)
        ours = value_weighted(result.attention[l], kept[l])
        assert torch.allclose(ours.double(), expected, atol=1e-5)
        assert torch.allclose(ours.sum(-1), torch.ones_like(ours[..., 0]), atol=1e-5)
        assert not torch.allclose(ours, result.attention[l], atol=1e-3)  # the weighting changes the map
    if interventions:  # masked keys get no weight, and the rebuilt rows (windows, /row) agree with the kept P
        assert float(value_weighted(result.attention, kept)[..., [0, 3]].abs().max()) == 0.0
    rows = value_weighted_rows(result.atlas.record(1), [0, 2], 2, 7)  # (2, 5, T) from q̂/k̂ with the run's β, masks
    assert torch.allclose(rows, value_weighted(result.attention[1, [0, 2], 2:7], kept[1, [0, 2]]), atol=1e-5)


# ---- encoder–decoders --------------------------------------------------------------------------------------------
def _seq2seq_pairs(model, family: str) -> dict:
    """(kind, layer within the kind) → (value projection, output projection) of that attention module."""
    pairs = {}
    if family == "t5":
        for kind, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
            for l, block in enumerate(stack.block):
                pairs[(kind, l)] = (block.layer[0].SelfAttention.v, block.layer[0].SelfAttention.o)
                if kind == "decoder":
                    pairs[("cross", l)] = (block.layer[1].EncDecAttention.v, block.layer[1].EncDecAttention.o)
        return pairs
    for kind, stack in (("encoder", model.model.encoder), ("decoder", model.model.decoder)):
        for l, layer in enumerate(stack.layers):
            pairs[(kind, l)] = (layer.self_attn.v_proj, layer.self_attn.out_proj)
            if kind == "decoder":
                pairs[("cross", l)] = (layer.encoder_attn.v_proj, layer.encoder_attn.out_proj)
    return pairs


@pytest.fixture(scope="module", params=SEQ2SEQ_FAMILIES)
def seq2seq(request, tmp_path_factory):
    folder = build_text_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, build_registry(weights_dir="/nonexistent", extra={"m": str(folder)})["m"].load("cpu")


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked-beta"])
def test_seq2seq_value_weighted_rows_of_every_kind_equal_a_direct_computation(seq2seq, masked):
    family, adapter = seq2seq
    encoded = adapter.encode(SOURCE, TARGET)
    interventions = adapter.engine_interventions([
        KindScopedIntervention(Intervention("mask_keys", tokens=(1, 4)), "cross"),
        KindScopedIntervention(Intervention("mask_keys", tokens=(2,)), "encoder"),
        KindScopedIntervention(Intervention("temperature", beta=0.3, layers=(1,), heads=(1,)), "decoder"),
    ]) if masked else ()
    pairs = _seq2seq_pairs(adapter.model, family)
    result, seen = _run_capturing_values(adapter, pairs, encoded, interventions)
    n_heads = {"encoder": adapter.info.heads, "decoder": adapter.info.decoder_heads, "cross": adapter.info.decoder_heads}
    for kind in KINDS:
        kept = layer_value_norms(result.atlas, adapter.kind_layers[kind])  # (L_kind, H, T_k)
        assert kept is not None and kept.shape[-1] == result.by_kind[kind].shape[-1]
        for l in range(adapter.layers_of(kind)):
            captured, w_o = seen[(kind, l)], pairs[(kind, l)][1].weight
            direct = _direct_norms(captured, w_o, n_heads[kind])  # (H, T_k): cross keys are the source tokens
            assert_close_f32(kept[l], direct, w_o.shape[0])  # ‖v W_O‖: float32 sums over the hidden size
            probs = result.by_kind[kind][l]  # (H, T_q, T_k)
            ours = value_weighted(probs, kept[l])
            assert torch.allclose(ours.double(), _direct_weighted(probs, direct), atol=1e-5), (kind, l)
            assert torch.allclose(ours.sum(-1), torch.ones_like(ours[..., 0]), atol=1e-5)
        if masked and kind == "cross":
            assert float(value_weighted(result.by_kind[kind], kept)[..., [1, 4]].abs().max()) == 0.0
    # the cross rows rebuilt from the kept q̂/k̂ (a window or /row of the kept run) weight the same source norms
    cross_layer = adapter.kind_layers["cross"][1]
    kept_cross = layer_value_norms(result.atlas, [cross_layer])[0]
    rows = value_weighted_rows(result.atlas.record(cross_layer), [0, 3], 0, 3)  # (2, 3, M)
    assert torch.allclose(rows, value_weighted(result.by_kind["cross"][1, [0, 3], 0:3], kept_cross[[0, 3]]), atol=1e-5)
