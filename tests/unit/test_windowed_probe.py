"""Issue 29, step 2: a model with sliding-window layers is probed at load on an input longer than its window, so a
mismatch inside or outside the band is refused; and a long run's windows on such a model equal eager attention.

The model: tests/tiny_models.py "gemma3" (Gemma3ForCausalLM, sliding window 8, local and global layers).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

from models import hooks
from models.adapters import causal_lm
from models.atlas import window
from models.hooks import UnsupportedAttention
from models.probe import layer_facts, window_probe_length
from models.registry import build_registry
from tests.tiny_models import build_text_model

# 37 tokens with the tiny WordPiece vocabulary, far past the window of 8
TEXT = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
        "the small blue house , it was the capital of france")
SHORT_PROBE = "the cat sat"  # 5 tokens with [CLS]/[SEP]: inside the window, so only the long probe sees past it


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_text_model("gemma3", tmp_path_factory.mktemp("gemma3"))


def _load(folder):
    return build_registry(weights_dir="/nonexistent", extra={"g": str(folder)})["g"].load("cpu")


def _window_ignored(*args, **kwargs):
    """A broken mask function: every layer gets the plain causal mask, the sliding window dropped (what an attention
    function that forgot the window would compute). Eager attention keeps its own, correct mask."""
    kwargs.update(mask_function=causal_mask_function, local_size=None, allow_is_causal_skip=False)
    return sdpa_mask(*args, **kwargs)


@pytest.fixture
def broken_window(monkeypatch):
    monkeypatch.setattr(hooks, "_materialized_mask", _window_ignored)
    yield
    monkeypatch.undo()
    hooks.register()  # the registry is process-wide: put the real mask function back


def test_layer_facts_and_probe_length(gemma3):
    adapter = _load(gemma3)
    info = adapter.info.to_dict()
    assert info["layer_types"] == ["sliding", "full"] and info["sliding_window"] == 8
    assert window_probe_length(adapter.config) > 8
    long = adapter.window_probe_inputs(adapter.config)["input_ids"]
    assert long.shape[1] == window_probe_length(adapter.config) > 8
    # a model without a window: one short probe, and sliding_window reported as null
    from transformers import LlamaConfig

    plain = LlamaConfig(num_hidden_layers=3)
    assert layer_facts(plain) == {"layer_types": ["full"] * 3, "sliding_window": None}
    assert window_probe_length(plain) is None


def test_a_wrong_window_is_refused_by_the_long_probe(gemma3, monkeypatch, broken_window):
    monkeypatch.setattr(causal_lm, "PROBE_TEXT", SHORT_PROBE)
    # without the long probe the broken model would pass: the short input never reaches past the window
    monkeypatch.setattr(causal_lm.CausalLMAdapter, "window_probe_inputs", lambda self, config: None)
    accepted = _load(gemma3)
    assert accepted.info.parity <= 1e-4
    monkeypatch.undo()
    monkeypatch.setattr(hooks, "_materialized_mask", _window_ignored)  # undo() put the real one back: break it again
    monkeypatch.setattr(causal_lm, "PROBE_TEXT", SHORT_PROBE)
    with pytest.raises(UnsupportedAttention, match="differ from the model's own eager attention"):
        _load(gemma3)


def test_the_correct_window_passes_the_long_probe(gemma3, monkeypatch):
    monkeypatch.setattr(causal_lm, "PROBE_TEXT", SHORT_PROBE)
    assert _load(gemma3).info.parity <= 1e-4


def test_long_run_windows_equal_eager_attention(gemma3):
    """Blockwise (atlas) run of 37 tokens, window 8: every window of every layer equals transformers' eager
    attention weights, so the local layer is zero outside its band and the global one is not."""
    import transformers as tf

    adapter = _load(gemma3)
    encoded = adapter.at_position(adapter.encode(TEXT), None)
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=4, overview_blocks=5)
    adapter.full_map_tokens = 4
    long = adapter.run(encoded, ())
    assert long.atlas is not None
    eager = tf.AutoModelForCausalLM.from_pretrained(gemma3, attn_implementation="eager").eval()
    with torch.inference_mode():
        inputs = {k: v for k, v in encoded.inputs.items() if k in ("input_ids", "attention_mask")}
        weights = torch.stack(eager(**inputs, output_attentions=True).attentions)[:, 0]  # (L, H, T, T)
    n = weights.shape[-1]
    assert n > 3 * 8
    worst = max(float((window(long.atlas.record(l), h, (0, n), (0, n)) - weights[l, h]).abs().max())
                for l in range(weights.shape[0]) for h in range(weights.shape[1]))
    assert worst <= 2e-6, worst
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    outside = rows - cols >= 8  # keys at least a window behind the query
    local = window(long.atlas.record(0), 0, (0, n), (0, n))
    global_ = window(long.atlas.record(1), 0, (0, n), (0, n))
    assert float(local[outside].abs().max()) == 0.0 and float(global_[outside].sum()) > 0.0
