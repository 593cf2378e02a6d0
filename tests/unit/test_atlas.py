"""Long inputs (docs/science.md §10): a run over full_map_tokens keeps an atlas (q̂/k̂, β, masks, extras and per-block
summaries) instead of P. Windows rebuilt from it equal the full map and the model's own eager attention weights (to
float32 rounding: tests/float32.py); the overview, received, entropy and mean distance equal the same summaries of the full map; the
model's outputs do not change. Tiny random models of each family, with small blocks so that every path (several
row blocks, a partial last block, pooled overview blocks) is taken."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from models.atlas import window
from models.interventions import Intervention
from models.registry import build_registry
from models.summaries import mean_attention_distance, mean_token_distance
from tests.float32 import assert_close_f32
from tests.tiny_models import build_image_model, build_text_model

TEXT = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
        "the small blue house , it was the capital of france")
INTERVENTIONS = {
    "none": lambda n: (),
    "beta+perturb": lambda n: (Intervention("temperature", beta=0.3, heads=(1,)),
                               Intervention("perturb_keys", noise_std=0.7, seed=3, heads=(2,), tokens=(1, 5, 9)),
                               Intervention("perturb_queries", noise_std=0.4, seed=5, layers=(1,))),
    "masks": lambda n: (Intervention("mask_keys", tokens=(0, 2, 3), heads=(0, 3)),
                        Intervention("mask_keys", tokens=tuple(range(n)), heads=(1,), layers=(0,)),  # dead rows
                        Intervention("causal", heads=(2,)), Intervention("ablate_heads", heads=(3,), layers=(1,))),
}


def _text_adapter(family, tmp_path):
    folder = build_text_model(family, tmp_path / family)
    adapter = build_registry(weights_dir="/nonexistent", extra={"m": str(folder)})["m"].load("cpu")
    return adapter, folder


def _long_and_short(adapter, encoded, interventions, block_rows=3, blocks=4):
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=block_rows, overview_blocks=blocks)
    adapter.full_map_tokens = 4
    long = adapter.run(encoded, interventions)
    adapter.full_map_tokens = 10**6
    short = adapter.run(encoded, interventions)
    return long, short


def _pooled(maps: torch.Tensor, row_edges: list[int], col_edges: list[int]) -> torch.Tensor:
    """The mean of P over each overview block, from the full maps (L, H, T, T)."""
    out = torch.zeros(*maps.shape[:2], len(row_edges) - 1, len(col_edges) - 1, dtype=torch.float64)
    for a in range(len(row_edges) - 1):
        for b in range(len(col_edges) - 1):
            out[:, :, a, b] = maps[:, :, row_edges[a]:row_edges[a + 1], col_edges[b]:col_edges[b + 1]].double().mean(dim=(-1, -2))
    return out


def _attention_terms(record, n_keys: int) -> int:
    """The most terms a float32 sum takes in computing one probability: q̂·k̂ over the head size, then the softmax's
    normaliser over the keys."""
    return record.keys.shape[-1] + n_keys


def _check_atlas(long, short, mean_distance):
    maps = short.attention  # (L, H, T, T)
    n_layers, n_heads, n_tokens, _ = maps.shape
    assert long.attention is None and long.is_long
    atlas = long.atlas
    terms = _attention_terms(atlas.record(0), n_tokens)
    for layer in range(n_layers):
        for head in range(n_heads):
            got = window(atlas.record(layer), head, (0, n_tokens), (0, n_tokens))
            assert_close_f32(got, maps[layer, head], terms, scale=1.0)  # probabilities: at most 1
            part = window(atlas.record(layer), head, (3, 7), (2, 9))
            assert_close_f32(part, maps[layer, head, 3:7, 2:9], terms, scale=1.0)
    # the model's outputs do not depend on how attention was computed
    for name, value in short.output.items():
        assert float((long.output[name] - value).abs().max()) < 1e-5, name
    # a long run keeps its hidden states in float16 (for the effects' cosine only)
    assert torch.allclose(long.hidden_states.float(), short.hidden_states, rtol=2e-3, atol=2e-3)
    # summaries equal the full map's
    every = list(range(n_heads))
    received = atlas.received(list(range(n_layers)), every)  # (L, H, T)
    assert_close_f32(received, maps.mean(dim=2), terms, scale=1.0)  # a mean over the queries of probabilities
    overview = atlas.overview(list(range(n_layers)), every).double()
    assert_close_f32(overview, _pooled(maps, atlas.row_edges(), atlas.col_edges()), terms, scale=1.0)
    # a short run keeps its entropy on its device as a float64 tensor (until a response reads it), a long one lists
    assert torch.allclose(torch.as_tensor(long.derived["entropy"], dtype=torch.float64),
                          torch.as_tensor(short.derived["entropy"], dtype=torch.float64), atol=2e-5)
    assert torch.allclose(atlas.mean_distance(), mean_distance(maps), atol=2e-5)
    assert long.warnings == short.warnings


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "gemma2"])
@pytest.mark.parametrize("case", sorted(INTERVENTIONS))
def test_atlas_equals_full_maps_text(family, case, tmp_path):
    adapter, _ = _text_adapter(family, tmp_path)
    encoded = adapter.encode(TEXT)
    if adapter.info.output == "next_token":
        encoded = adapter.at_position(encoded, None)
    long, short = _long_and_short(adapter, encoded, INTERVENTIONS[case](len(encoded.tokens)))
    _check_atlas(long, short, mean_token_distance)
    if family == "llama":  # GQA: with no key perturbation, k̂ is kept once per K/V head
        kv = adapter.info.kv_heads
        assert long.atlas.record(0).keys.shape[0] == (adapter.info.heads if case == "beta+perturb" else kv)


def test_atlas_vit_positions_and_prefix(tmp_path):
    from models.adapters.vit import VitAdapter

    adapter = VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path / "vit")), device="cpu")
    encoded = adapter.encode(Image.linear_gradient("L").convert("RGB").resize((48, 40)), "gradient", image_size=48)
    grid, prefix = encoded.extra["grid"], encoded.extra["prefix_tokens"]
    for case in ("none", "masks"):
        long, short = _long_and_short(adapter, encoded, INTERVENTIONS[case](len(encoded.tokens)), block_rows=5, blocks=6)
        _check_atlas(long, short, lambda maps: mean_attention_distance(maps, prefix, grid, adapter.info.patch_size))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_windows_equal_eager_attention_weights(family, tmp_path):
    """Against transformers' own eager attention (output_attentions=True) on the same weights."""
    import transformers as tf

    adapter, folder = _text_adapter(family, tmp_path)
    encoded = adapter.encode(TEXT)
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=4, overview_blocks=5)
    adapter.full_map_tokens = 4
    long = adapter.run(encoded, ())
    eager_class = tf.AutoModelForCausalLM if adapter.info.output == "next_token" else tf.AutoModel
    eager = eager_class.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode():
        inputs = {k: v for k, v in encoded.inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        weights = torch.stack(eager(**inputs, output_attentions=True).attentions)[:, 0]  # (L, H, T, T)
    n = weights.shape[-1]
    terms = _attention_terms(long.atlas.record(0), n)
    for l in range(weights.shape[0]):
        for h in range(weights.shape[1]):
            assert_close_f32(window(long.atlas.record(l), h, (0, n), (0, n)), weights[l, h], terms, scale=1.0)


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_view_beta_window_equals_a_run_at_that_beta(family, tmp_path):
    """View-mode β re-normalises one head's rows from q̂ k̂ᵀ without a re-run; the run-mode temperature on that head
    alone gives the same map for that head (docs/science.md §2). Short (kept P) and long (atlas) runs alike; for
    an encoder–decoder the global layer of the cross-attention."""
    adapter, _ = _text_adapter(family, tmp_path)
    encoded = adapter.encode(TEXT)
    layer, head, beta = 1, 2, 0.9
    if family == "bart":
        layer = adapter.kind_layers["cross"][1]
        plain = adapter.run(encoded, ())
        scoped = adapter.engine_interventions([_cross(Intervention("temperature", beta=beta, layers=(1,), heads=(head,)))])
        rerun = adapter.run(encoded, scoped)
        expected = rerun.by_kind["cross"][1, head]
        got = window(plain.atlas.record(layer), head, (0, expected.shape[0]), (0, expected.shape[1]), beta=beta)
        assert_close_f32(got, expected, _attention_terms(plain.atlas.record(layer), expected.shape[1]), scale=1.0)
        return
    rerun_ivs = (Intervention("temperature", beta=beta, layers=(layer,), heads=(head,)),)
    for full_map_tokens in (4, 10**6):
        adapter.full_map_tokens = 10**6
        expected = adapter.run(encoded, rerun_ivs).attention[layer, head]
        adapter.full_map_tokens = full_map_tokens
        plain = adapter.run(encoded, ())
        n = expected.shape[0]
        got = window(plain.atlas.record(layer), head, (0, n), (0, n), beta=beta)
        assert_close_f32(got, expected, _attention_terms(plain.atlas.record(layer), n), scale=1.0)
        assert not torch.allclose(got, window(plain.atlas.record(layer), head, (0, n), (0, n)), atol=1e-3)


def _cross(iv):
    from models.adapters.seq2seq import KindScopedIntervention

    return KindScopedIntervention(iv, "cross")


def test_overview_invariants_and_received(tmp_path):
    """SPEC §10: every block-row of the overview sums to 1 weighted by block widths; blocks above the causal
    diagonal are exactly 0; received sums to 1 over the keys."""
    adapter, _ = _text_adapter("llama", tmp_path)
    encoded = adapter.encode(TEXT)
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=4, overview_blocks=7)
    adapter.full_map_tokens = 4
    atlas = adapter.run(encoded, ()).atlas
    every_layer, every_head = list(range(adapter.info.layers)), list(range(adapter.info.heads))
    overview = atlas.overview(every_layer, every_head).double()  # (L, H, B, B)
    edges = atlas.col_edges()
    widths = torch.tensor(edges).diff().double()
    n_tokens = len(encoded.tokens)
    assert_close_f32((overview * widths).sum(dim=-1), torch.ones(overview.shape[:3]), n_tokens, scale=1.0)
    for a in range(len(edges) - 1):
        for b in range(len(edges) - 1):
            if edges[b] > edges[a + 1] - 1:  # every key of block b is after every query of block-row a
                assert bool((overview[:, :, a, b] == 0).all())
    received = atlas.received(every_layer, every_head)
    assert_close_f32(received.sum(dim=-1), torch.ones(received.shape[:2]), n_tokens, scale=1.0)
    assert received.shape[-1] == len(encoded.tokens)
    thumbs = atlas.thumbnails(3)
    assert thumbs["shape"] == [adapter.info.layers, adapter.info.heads, 3, 3]


def test_cls_rollout_from_the_atlas_equals_the_full_maps(tmp_path):
    from models.adapters.vit import VitAdapter
    from models.summaries import cls_rollout_map

    adapter = VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path / "vit")), device="cpu")
    encoded = adapter.encode(Image.linear_gradient("L").convert("RGB").resize((48, 40)), "gradient", image_size=48)
    grid, prefix = encoded.extra["grid"], encoded.extra["prefix_tokens"]
    long, short = _long_and_short(adapter, encoded, INTERVENTIONS["masks"](len(encoded.tokens)), block_rows=5, blocks=6)
    expected = cls_rollout_map(short.attention, prefix, grid)
    # a product of one (T, T) matrix per layer: each layer's sums over T keys round anew
    n_terms = len(encoded.tokens) * adapter.info.layers
    assert_close_f32(long.atlas.cls_rollout(prefix, grid, block=7), expected, n_terms, scale=1.0)
