"""Value-weighted attention wherever P is (docs/science.md "Value-weighted attention"): a run keeps the per-key norms
n_j^h = ‖v_j W_O^h‖ on its records, and a window, a row or the overview of a long run (rebuilt from q̂/k̂) weighted by
them equals the same part of the full value-weighted map of a short run of the same input, and a direct computation
from the model's own V and W_O. Tiny random decoder (grouped K/V heads) and encoder."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models.adapters.bert import BertAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.attribution import (
    kept_value_norms, run_value_norms, value_grams, value_weighted, value_weighted_overview, value_weighted_rows,
)
from models.head_ops import HeadRun, head_run
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired and the dog ran"


@pytest.fixture(scope="module", params=["llama", "bert"])
def model(request, tmp_path_factory):
    folder = str(build_text_model(request.param, tmp_path_factory.mktemp(request.param)))
    if request.param == "llama":
        return CausalLMAdapter("tiny-llama", folder, device="cpu")
    return BertAdapter("tiny-bert", folder, device="cpu")


def _direct_norms(adapter) -> torch.Tensor:
    """‖v_j W_O^h‖ (L, H, T) in float64 from the layers' own value and output projections (hooks of the test's own
    on the value projection's output), not from the attention function."""
    n_heads, head_dim = adapter.info.heads, adapter.info.head_dim
    encoded = adapter.encode(TEXT)
    if isinstance(adapter, CausalLMAdapter):
        layers = [(l.self_attn.v_proj, l.self_attn.o_proj) for l in adapter.model.model.layers]
    else:
        layers = [(l.attention.self.value, l.attention.output.dense) for l in adapter.model.bert.encoder.layer]
    values: list[torch.Tensor] = []
    handles = [v.register_forward_hook(lambda _m, _a, out: values.append(out[0].detach())) for v, _ in layers]
    try:
        with torch.no_grad():
            adapter.model(**encoded.inputs)
    finally:
        for handle in handles:
            handle.remove()
    norms = []
    for value, (_, o_proj) in zip(values, layers):
        v = value.double().view(value.shape[0], -1, head_dim).transpose(0, 1)  # (H_kv, T, d)
        v = v.repeat_interleave(n_heads // v.shape[0], dim=0)  # (H, T, d)
        w_o = o_proj.weight.double()  # (D, H·d)
        norms.append(torch.stack([(v[h] @ w_o[:, h * head_dim:(h + 1) * head_dim].T).norm(dim=-1)
                                  for h in range(n_heads)]))  # (H, T)
    return torch.stack(norms)  # (L, H, T)


def _runs(adapter, block_rows: int = 4, overview_blocks: int = 5):
    """A short run (keeps P) and a long run (blockwise, keeps q̂/k̂: full_map_tokens below the input) of TEXT, both
    with the norms kept."""
    encoded = adapter.encode(TEXT)
    saved = adapter.full_map_tokens, adapter.atlas_config
    with head_run(HeadRun(value_grams=value_grams(adapter))):
        short = adapter.run(encoded)
        adapter.full_map_tokens = 2
        adapter.atlas_config = dataclasses.replace(saved[1], block_rows=block_rows, overview_blocks=overview_blocks)
        try:
            long = adapter.run(encoded)
        finally:
            adapter.full_map_tokens, adapter.atlas_config = saved
    assert short.attention is not None and long.is_long
    return encoded, short, long


def test_kept_norms_equal_the_direct_ones_and_the_second_forward(model):
    encoded, short, long = _runs(model)
    direct = _direct_norms(model).float()
    hidden = model.model.config.hidden_size  # ‖v W_O‖: float32 sums over the hidden size, against float64
    assert_close_f32(kept_value_norms(short.atlas), direct, hidden)
    assert_close_f32(kept_value_norms(long.atlas), direct, hidden)
    assert torch.allclose(run_value_norms(model, encoded), direct, rtol=1e-5, atol=1e-5)


def test_a_short_run_forms_its_norms_only_when_asked(model):
    """A short run keeps references to V (no per-layer norm work in the forward: on a GPU that was ~5 ms of a 27 ms
    run at 128 tokens); the norms formed on first access equal the direct ones, and V is let go then."""
    encoded, short, _ = _runs(model)
    pending = [short.atlas.records[l] for l in sorted(short.atlas.records)]
    assert all(p.norms_from is not None and p._norms is None for p in pending), "norms were formed in the forward"
    # V as the model made it: one per K/V head (the tiny Llama: 2 for 4 query heads), not a copy per query head
    kv_heads = getattr(model.model.config, "num_key_value_heads", None) or model.info.heads
    assert {p.norms_from[0].shape[0] for p in pending} == {kv_heads}
    direct = _direct_norms(model).float()
    assert_close_f32(torch.stack([p.value_norms for p in pending]), direct, model.model.config.hidden_size)
    assert all(p.norms_from is None and p._norms is not None for p in pending)


def test_value_weighted_windows_and_rows_equal_the_full_map(model):
    _, short, long = _runs(model)
    full = value_weighted(short.attention.double(), _direct_norms(model))  # (L, H, T, T) float64, the reference
    n_layers, n_heads, n_tokens = full.shape[:3]
    # float32 P (q·k over the head size, softmax over the keys) and norms (sums over the hidden size) against float64:
    # independent roundings add in quadrature, so their terms add
    terms = attention_terms(model.model.config, n_tokens) + model.model.config.hidden_size
    assert not torch.allclose(full, short.attention.double(), atol=1e-2)  # value weighting moves the maps
    for layer in range(n_layers):
        record = long.atlas.record(layer)
        for head in range(n_heads):
            for rows, cols in [((0, n_tokens), (0, n_tokens)), ((3, 9), (1, 6)), ((n_tokens - 1, n_tokens), (0, 2))]:
                window = value_weighted_rows(record, [head], rows[0], rows[1])[0, :, cols[0]:cols[1]]
                expected = full[layer, head, rows[0]:rows[1], cols[0]:cols[1]]
                assert_close_f32(window, expected, terms, scale=1.0)  # probabilities: at most 1
        # the short run's kept P weighted by its kept norms: the same rows
        kept = value_weighted_rows(short.atlas.record(layer), list(range(n_heads)), 2, 5,
                                   probs=short.attention[layer, :, 2:5])
        assert_close_f32(kept, full[layer, :, 2:5], terms, scale=1.0)
    # a whole row of every head (the row view)
    rows = torch.stack([value_weighted_rows(long.atlas.record(l), list(range(n_heads)), 4, 5)[:, 0] for l in range(n_layers)])
    assert_close_f32(rows, full[:, :, 4], terms, scale=1.0)
    assert_close_f32(rows.sum(-1), torch.ones(n_layers, n_heads), n_tokens, scale=1.0)  # a row: n_tokens summed


def test_value_weighted_overview_is_the_block_sums_of_the_full_map(model):
    _, short, long = _runs(model, block_rows=4, overview_blocks=5)
    full = value_weighted(short.attention.double(), _direct_norms(model))  # (L, H, T, T)
    sums, received = value_weighted_overview(long.atlas, block_rows=4)
    row_edges, col_edges = long.atlas.row_edges(), long.atlas.col_edges()
    assert sums.shape == (*full.shape[:2], len(row_edges) - 1, len(col_edges) - 1)
    for a, (r0, r1) in enumerate(zip(row_edges, row_edges[1:])):
        for b, (c0, c1) in enumerate(zip(col_edges, col_edges[1:])):
            expected = full[:, :, r0:r1, c0:c1].sum(dim=(-1, -2))
            assert (sums[:, :, a, b].double() - expected).abs().max() <= 1e-5
    # float32 P and norms against float64 (as above), then a mean over the queries
    terms = attention_terms(model.model.config, full.shape[-1]) + model.model.config.hidden_size + full.shape[-2]
    assert_close_f32(received, full.mean(dim=2), terms, scale=1.0)
    # the thumbnails of the value-weighted overview differ from P's
    assert long.atlas.thumbnails(3, sums)["data"] != long.atlas.thumbnails(3)["data"]
