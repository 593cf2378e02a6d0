"""The `positions` intervention on tiny random models (docs/science.md "Positions off"): with positions off, permuting
the input permutes the attention map; rotary models see every token at position 0, as transformers' own forward does
when given position ids all 0; and the op leaves no state on the model (a run without it is the plain run)."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM

from models.adapters.bert import BertAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.adapters.vit import VitAdapter
from models.interventions import Intervention
from models.positions import permutation
from tests.tiny_models import build_image_model, build_text_model

OFF = (Intervention("positions", mode="off"),)
SHUFFLE = (Intervention("positions", mode="shuffle", seed=5),)
TEXT = "the cat sat on the mat because it was tired"


def permuted(encoded, order: list[int]):
    """The same input with its tokens in `order` (new token i is old token order[i])."""
    moved = copy.copy(encoded)
    moved.inputs = {k: v[:, order] if k != "logits_to_keep" else v for k, v in encoded.inputs.items()}
    return moved


def inner_order(n_tokens: int, seed: int = 0) -> list[int]:
    """A permutation that keeps the first and last tokens ([CLS], [SEP]) in place and moves the others."""
    inner = torch.randperm(n_tokens - 2, generator=torch.Generator().manual_seed(seed)) + 1
    order = [0, *inner.tolist(), n_tokens - 1]
    assert order != list(range(n_tokens))
    return order


def permutation_error(maps: torch.Tensor, maps_moved: torch.Tensor, order: list[int]) -> float:
    """max |P(πx) − Π P(x) Πᵀ| over every layer and head; maps (L, H, T, T)."""
    index = torch.tensor(order)
    return float((maps_moved - maps[:, :, index][:, :, :, index]).abs().max())


@pytest.fixture(scope="module")
def bert(tiny_bert) -> BertAdapter:
    return BertAdapter("tiny", str(tiny_bert), device="cpu")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def llama(llama_folder) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", llama_folder, device="cpu")


def test_kinds_found(bert, llama):
    assert bert.positions_kind == "absolute" and llama.positions_kind == "rotary"


def test_bert_positions_off_permutes_the_map_exactly(bert):
    encoded = bert.encode(TEXT)
    order = inner_order(len(encoded.tokens))
    moved = permuted(encoded, order)
    assert permutation_error(bert.run(encoded, OFF).attention, bert.run(moved, OFF).attention, order) < 1e-5
    assert permutation_error(bert.run(encoded).attention, bert.run(moved).attention, order) > 1e-3  # positions on: 100× the bound


def test_bert_shuffle_is_seeded_and_changes_the_map(bert):
    encoded = bert.encode(TEXT)
    base, shuffled = bert.run(encoded).attention, bert.run(encoded, SHUFFLE).attention
    assert float((shuffled - base).abs().max()) > 1e-3
    assert torch.equal(shuffled, bert.run(encoded, SHUFFLE).attention)
    other = bert.run(encoded, (Intervention("positions", mode="shuffle", seed=6),)).attention
    assert not torch.equal(other, shuffled)


def test_no_state_left_on_the_model(bert):
    encoded = bert.encode(TEXT)
    base = bert.run(encoded).attention
    bert.run(encoded, OFF)
    assert torch.equal(bert.run(encoded).attention, base)


def test_concurrent_runs_do_not_see_each_others_op(bert):
    """Two threads, one with positions off and one without, many times over: each gets its own answer."""
    encoded = bert.encode(TEXT)
    expected = {False: bert.run(encoded).attention, True: bert.run(encoded, OFF).attention}
    wrong = []

    def work(off: bool):
        for _ in range(20):
            got = bert.run(encoded, OFF if off else ()).attention
            if not torch.equal(got, expected[off]):
                wrong.append(off)

    threads = [threading.Thread(target=work, args=(flag,)) for flag in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


def test_rope_off_equals_the_models_own_forward_at_position_zero(llama, llama_folder):
    """Positions off on a RoPE model: the maps of transformers' eager forward given position_ids all 0."""
    encoded = llama.encode(TEXT)
    ids = encoded.inputs["input_ids"]
    eager = AutoModelForCausalLM.from_pretrained(llama_folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = eager(input_ids=ids, position_ids=torch.zeros_like(ids), output_attentions=True)
        ref_on = eager(input_ids=ids, output_attentions=True)
    maps_ref = torch.stack([a[0] for a in ref.attentions])  # (L, H, T, T)
    off = llama.run(encoded, OFF).attention
    assert float((off - maps_ref).abs().max()) < 1e-5
    assert float((llama.run(encoded).attention - torch.stack([a[0] for a in ref_on.attentions])).abs().max()) < 1e-5
    assert float((off - llama.run(encoded).attention).abs().max()) > 1e-3  # the op did something


def test_rope_off_layer0_last_row_follows_a_permuted_prefix(llama):
    """Causal and without positions, layer 0's last query sees its prefix as a set: permuting the tokens before it
    permutes its row. (Later layers' keys see different prefixes, so only layer 0 is exact.)"""
    encoded = llama.encode(TEXT)
    n = len(encoded.tokens)
    order = [*(torch.randperm(n - 1, generator=torch.Generator().manual_seed(1))).tolist(), n - 1]
    moved = permuted(encoded, order)
    index = torch.tensor(order)

    def row_error(ivs):
        a, b = llama.run(encoded, ivs).attention[0, :, -1], llama.run(moved, ivs).attention[0, :, -1]  # (H, T)
        return float((b - a[:, index]).abs().max())

    assert row_error(OFF) < 1e-6
    assert row_error(()) > 1e-3


def test_rope_off_applies_while_generating(llama):
    """A continuation's steps (KV cache) run with the op too: the same tokens as without the cache."""
    prompt = llama.prompt_ids(TEXT)
    cached = [s.id for s in llama.continuation(prompt, OFF, 6)]
    uncached = [s.id for s in llama.continuation(prompt, OFF, 6, use_cache=False)]
    assert cached == uncached


def test_vit_positions_off_permutes_patches_exactly(tmp_path_factory):
    vit = VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path_factory.mktemp("vit"))), device="cpu")
    assert vit.positions_kind == "patch"
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    encoded = copy.copy(vit.encode(Image.new("RGB", (32, 32)), "x"))
    encoded.inputs = {"pixel_values": pixels}
    rows, cols = encoded.extra["grid"]
    order_patches = permutation(rows * cols, 2)
    tiles = pixels.unfold(2, 8, 8).unfold(3, 8, 8).reshape(1, 3, rows * cols, 8, 8)[:, :, order_patches]
    moved = copy.copy(encoded)
    moved.inputs = {"pixel_values": tiles.reshape(1, 3, rows, cols, 8, 8).permute(0, 1, 2, 4, 3, 5).reshape(1, 3, 32, 32)}
    order = [0, *(order_patches + 1).tolist()]
    assert permutation_error(vit.run(encoded, OFF).attention, vit.run(moved, OFF).attention, order) < 1e-5
    assert permutation_error(vit.run(encoded).attention, vit.run(moved).attention, order) > 1e-3


def test_the_standalone_exports_footer_names_the_op():
    from attnlab.export import run_note

    note = run_note([{"op": "positions", "mode": "shuffle", "seed": 3}, {"op": "positions", "mode": "off"}])
    assert "positions shuffle (seed 3); positions off." in note and "every head" not in note
