"""Encoder–decoders on the long path (issue 20, docs/science.md §10): a run whose source or target is over
full_map_tokens keeps an atlas for all three kinds (encoder self-, decoder self- and cross-attention), and its windows
equal the model's own eager attention weights (transformers, `attn_implementation="eager"`, output_attentions) to
≤ 1e-6 in float32 with masks, β and perturbations active. The eager model gets each intervention by its own means:
masks as its attention masks (source keys: encoder and cross attention; target keys: decoder self-attention), β and
the perturbations as forward hooks on its query/key projections (q̂ = c·(α q + ε), k̂ = α k + ε, with the same noise
the product draws, models.interventions.noise_for). Tiny random BART, Marian and T5 models (tests/tiny_models.py),
with small blocks so that several row blocks, a partial last block and pooled overview blocks are all taken."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models.adapters.seq2seq import KINDS, KindScopedIntervention
from models.atlas import window
from models.interventions import Intervention, noise_for
from models.registry import build_registry
from tests.float32 import assert_close_f32
from tests.tiny_models import SEQ2SEQ_FAMILIES, build_text_model

SOURCE = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
          "the small blue house")
TARGET = "the dog sat on the rug because it was tired , the car did not cross the street"
SOURCE_MASKED = (1, 4, 9)  # source keys masked in encoder self- and cross-attention (every layer and head)
TARGET_MASKED = (2, 5)  # target keys masked in decoder self-attention (row 0 keeps its own key: no dead rows here)


def _interventions():
    """(kind, Intervention) pairs: layers count within the kind; every kind gets a β, a mask and a perturbation."""
    return [
        ("encoder", Intervention("temperature", beta=0.2, layers=(1,), heads=(1,))),
        ("cross", Intervention("temperature", beta=2.5, layers=(0,), heads=(2,))),
        ("decoder", Intervention("temperature", beta=0.5, layers=(1,), heads=(0, 3))),
        ("encoder", Intervention("mask_keys", tokens=SOURCE_MASKED)),
        ("cross", Intervention("mask_keys", tokens=SOURCE_MASKED)),
        ("decoder", Intervention("mask_keys", tokens=TARGET_MASKED)),
        ("encoder", Intervention("perturb_keys", noise_std=0.8, seed=3, layers=(0,), heads=(3,), tokens=(0, 2, 6))),
        ("cross", Intervention("perturb_queries", noise_std=0.6, seed=5, layers=(1,), heads=(1,))),
        ("decoder", Intervention("perturb_keys", noise_std=0.5, seed=7, layers=(1,), heads=(2,), tokens=(1, 3))),
    ]


def _adapter(family, tmp_path):
    folder = build_text_model(family, tmp_path / family)
    adapter = build_registry(weights_dir="/nonexistent", extra={"m": str(folder)})["m"].load("cpu")
    return adapter, folder


def _projections(model, family: str, kind: str, layer: int):
    """The attention module of `kind` at `layer` (within the kind) and its (query, key) projections."""
    if family == "t5":
        stack = model.encoder if kind == "encoder" else model.decoder
        block = stack.block[layer]
        attention = block.layer[1].EncDecAttention if kind == "cross" else block.layer[0].SelfAttention
        return attention, attention.q, attention.k
    stack = model.model.encoder if kind == "encoder" else model.model.decoder
    attention = stack.layers[layer].encoder_attn if kind == "cross" else stack.layers[layer].self_attn
    return attention, attention.q_proj, attention.k_proj


def _eager_weights(adapter, folder, family, encoded, items, native_beta: dict[int, float]):
    """The eager model's attention weights per kind, (L, H, T_q, T_k), with `items` applied its own way; β as the
    factor β / β₀ on the query (`native_beta`: β₀ per global layer, as the product read it from each module)."""
    import transformers as tf

    model = tf.AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()
    n_heads, head_dim = adapter.info.heads, adapter.info.head_dim
    # per (kind, layer): query edits (scale c per head, perturbations) and key perturbations
    edits: dict[tuple[str, int], dict[str, list]] = {}
    for kind, iv in items:
        for layer in (iv.layers if iv.layers is not None else range(adapter.layers_of(kind))):
            entry = edits.setdefault((kind, layer), {"q": [], "k": []})
            if iv.op == "temperature":
                entry["q"].append(("beta", iv))
            elif iv.op == "perturb_queries":
                entry["q"].insert(0, ("noise", iv))  # q̂ = c·(α q + ε): the perturbation before β
            elif iv.op == "perturb_keys":
                entry["k"].append(("noise", iv))
    hooks = []
    for (kind, layer), entry in edits.items():
        global_layer = adapter.kind_layers[kind][layer]
        native = native_beta[global_layer]

        def edit(output, ops, global_layer=global_layer, native=native):
            out = output.clone().view(*output.shape[:2], n_heads, head_dim)  # (1, T, H, d)
            for what, iv in ops:
                for head in iv.head_list(n_heads):
                    if what == "beta":
                        out[:, :, head] *= iv.beta / native
                    else:
                        positions = list(range(out.shape[1])) if iv.tokens is None else list(iv.tokens)
                        eps = noise_for(iv.seed, global_layer, head, positions, head_dim, iv.noise_std)  # (n, d)
                        out[0, positions, head] = iv.scale * out[0, positions, head] + eps
            return out.view(output.shape)

        attention, q_module, k_module = _projections(model, family, kind, layer)
        betas = [iv for what, iv in entry["q"] if what == "beta"]
        if family == "t5" and betas and kind != "cross":
            # β multiplies the native logits q·k + b (docs/science.md §9.4): T5's relative position bias too. Layers
            # after the first receive the bias as an argument (and pass it on: here the last layer of each stack)
            assert layer == adapter.layers_of(kind) - 1, "β on T5 self-attention: the test scales the bias of the last layer"

            def scale_bias(module, args, kwargs, betas=betas, native=native):
                bias = kwargs["position_bias"].clone()  # (1, H, T_q, T_k)
                for iv in betas:
                    bias[:, list(iv.head_list(n_heads))] *= iv.beta / native
                return args, {**kwargs, "position_bias": bias}

            hooks.append(attention.register_forward_pre_hook(scale_bias, with_kwargs=True))
        if entry["q"]:
            hooks.append(q_module.register_forward_hook(lambda m, a, o, ops=entry["q"], f=edit: f(o, ops)))
        if entry["k"]:
            hooks.append(k_module.register_forward_hook(lambda m, a, o, ops=entry["k"], f=edit: f(o, ops)))
    source_mask = torch.ones_like(encoded.inputs["input_ids"])
    source_mask[0, list(SOURCE_MASKED)] = 0
    decoder_ids = encoded.inputs["decoder_input_ids"]
    target_mask = torch.ones_like(decoder_ids)
    target_mask[0, list(TARGET_MASKED)] = 0
    try:
        with torch.inference_mode():
            out = model(input_ids=encoded.inputs["input_ids"], attention_mask=source_mask, decoder_input_ids=decoder_ids,
                        decoder_attention_mask=target_mask, output_attentions=True, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
    stack = lambda maps: torch.stack(maps)[:, 0].float()  # noqa: E731
    return {"encoder": stack(out.encoder_attentions), "decoder": stack(out.decoder_attentions),
            "cross": stack(out.cross_attentions)}, out.logits[0]


def _long(adapter, encoded, interventions, block_rows=3, blocks=4):
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=block_rows, overview_blocks=blocks)
    adapter.full_map_tokens = 4
    return adapter.run(encoded, interventions)


@pytest.mark.parametrize("family", SEQ2SEQ_FAMILIES)
def test_seq2seq_windows_equal_eager_with_masks_beta_and_perturbations(family, tmp_path):
    """≤ 1e-6 against eager, beyond float32's own rounding: with these random weights (initializer_range 0.3: sharp
    heads) the residual stream's rounding grows layer by layer, and the product's full maps (the short path) already
    differ from eager by up to ~4e-6 at BART's deeper layers. So per layer: |window − eager| ≤ 1e-6, or at most 1e-6
    more than |full map − eager| of the same layer; and nowhere over 1e-5."""
    adapter, folder = _adapter(family, tmp_path)
    encoded = adapter.encode(SOURCE, TARGET)
    items = _interventions()
    engine = adapter.engine_interventions([KindScopedIntervention(iv, kind) for kind, iv in items])
    long = _long(adapter, encoded, engine)
    assert long.is_long and long.by_kind is None and long.attention is None
    adapter.full_map_tokens = 10**6
    short = adapter.run(encoded, engine)
    native_beta = {g: long.atlas.record(g).native_beta for g in long.atlas.records}
    eager, logits = _eager_weights(adapter, folder, family, encoded, items, native_beta)
    report = {}
    for kind in KINDS:
        maps = eager[kind]  # (L, H, T_q, T_k)
        rows, cols = maps.shape[-2:]
        # the interventions did something the check can see: masked keys get exactly 0
        masked = SOURCE_MASKED if kind != "decoder" else TARGET_MASKED
        assert float(maps[..., list(masked)].abs().max()) == 0.0
        for l, g in enumerate(adapter.kind_layers[kind]):
            windows = torch.stack([window(long.atlas.record(g), h, (0, rows), (0, cols)) for h in range(maps.shape[1])])
            got = float((windows - maps[l]).abs().max())
            floor = float((short.by_kind[kind][l] - maps[l]).abs().max())  # the full maps' own float32 difference
            report[f"{kind}{l}"] = (got, floor)
            assert got <= max(1e-6, floor + 1e-6) and got <= 1e-5, (kind, l, got, floor)
    print(family, {k: f"{g:.1e} (full maps {f:.1e})" for k, (g, f) in report.items()})
    # the model's output is the eager model's under the same interventions (the head outputs are right too)
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(encoded.extra["labels"])[:, None])[:, 0]
    assert torch.allclose(long.output["label_log_probs"], expected, atol=1e-4)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_seq2seq_atlas_equals_the_full_maps_and_its_summaries(family, tmp_path):
    """The long run's windows, overview and received per kind equal the short run's full maps (same interventions)."""
    adapter, _ = _adapter(family, tmp_path)
    encoded = adapter.encode(SOURCE, TARGET)
    engine = adapter.engine_interventions([KindScopedIntervention(iv, kind) for kind, iv in _interventions()])
    long = _long(adapter, encoded, engine, block_rows=5, blocks=6)
    adapter.full_map_tokens = 10**6
    short = adapter.run(encoded, engine)
    assert short.by_kind is not None and not short.is_long
    every_head = list(range(adapter.info.heads))
    for kind in KINDS:
        maps = short.by_kind[kind]  # (L, H, T_q, T_k)
        layers = list(range(maps.shape[0]))
        # q̂·k̂ over the head size, the softmax over T_k keys, a block mean over at most T_q·T_k cells
        terms = long.atlas.record(adapter.kind_layers[kind][0]).keys.shape[-1] + maps.shape[3] * (1 + maps.shape[2])
        overview = adapter.kind_overview(long.atlas, kind, layers, every_head)
        row_edges, col_edges = overview["edges"], overview["col_edges"]
        assert row_edges[-1] == maps.shape[2] and col_edges[-1] == maps.shape[3]
        for a in range(len(row_edges) - 1):
            for b in range(len(col_edges) - 1):
                block = maps[:, :, row_edges[a]:row_edges[a + 1], col_edges[b]:col_edges[b + 1]].mean(dim=(-1, -2))
                assert_close_f32(overview["maps"][:, :, a, b], block, terms, scale=1.0)  # probabilities: at most 1
        received = adapter.kind_received(long.atlas, kind, layers, every_head)  # (L, H, T_k)
        assert_close_f32(received, maps.mean(dim=2), terms, scale=1.0)
        assert torch.allclose(received.sum(dim=-1), torch.ones(received.shape[:2]), atol=1e-5)
        assert torch.allclose(torch.tensor(long.derived["entropy"][kind]), torch.tensor(short.derived["entropy"][kind]),
                              atol=2e-5)
        for l, g in enumerate(adapter.kind_layers[kind]):
            part = window(long.atlas.record(g), 1, (2, 7), (1, 9))
            assert_close_f32(part, maps[l, 1, 2:7, 1:9], long.atlas.record(g).keys.shape[-1] + maps.shape[3], scale=1.0)
    # the logits sum over the hidden size; the log-probabilities carry that error at their own scale (measured
    # 2.1e-6 on bart, where atol=1e-6 passed only through allclose's default rtol=1e-5)
    hidden = adapter.model.config.hidden_size
    assert_close_f32(long.output["label_log_probs"], short.output["label_log_probs"], hidden)
