"""Every family attnlab claims: a tiny random model built from its config loads through the registry's
family detection, passes the load-time probe (its attention is ours and equals eager attention within 1e-4),
and its output moves when β changes. A model whose attention bypasses the AttentionInterface is refused."""
from __future__ import annotations

import pytest
import torch

from models.hooks import UnsupportedAttention
from models.interventions import Intervention
from models.probe import PARITY_TOLERANCE
from models.registry import build_registry, detect_family
from tests.tiny_models import (CAUSAL_FAMILIES, DISTILBERT_FAMILIES, SEQ2SEQ_FAMILIES, TEXT_FAMILIES, build_image_model,
                               build_text_model)

TEXT = "the cat sat on the mat because it was tired"
EXPECTED_FAMILY = {**{f: "causal_lm" for f in CAUSAL_FAMILIES}, **{f: "seq2seq" for f in SEQ2SEQ_FAMILIES}, "bert": "encoder",
                   **{f: "distilbert" for f in DISTILBERT_FAMILIES}}


def _load(model_id: str, folder) -> object:
    spec = build_registry(weights_dir="/nonexistent", extra={model_id: str(folder)})[model_id]
    return spec, spec.load("cpu")


@pytest.mark.parametrize("family", TEXT_FAMILIES + DISTILBERT_FAMILIES)
def test_text_family_loads_passes_parity_and_moves_under_beta(family, tmp_path):
    folder = build_text_model(family, tmp_path / family)
    assert detect_family(str(folder)) == EXPECTED_FAMILY[family]
    spec, adapter = _load(f"tiny-{family}", folder)
    encoded = adapter.encode(TEXT)
    if spec.family == "causal_lm":
        encoded = adapter.at_position(encoded, None)
        assert adapter.info.parity <= PARITY_TOLERANCE
    elif spec.family == "seq2seq":
        assert adapter.info.parity <= PARITY_TOLERANCE
    before = adapter.run(encoded)
    after = adapter.run(encoded, (Intervention("temperature", beta=0.02),))
    effect = adapter.output_effect(before, after, encoded)
    moved = {
        "next_token": lambda: effect["kl"],
        "seq2seq": lambda: max(effect["kl"]),
        "mlm": lambda: 1 - float(torch.nn.functional.cosine_similarity(
            before.output["mlm_logits"].flatten(), after.output["mlm_logits"].flatten(), dim=0)),
        "embedding": lambda: 1 - effect["cls_cosine"],
    }[adapter.info.output]()
    assert moved > 1e-4, f"{family}: the output did not move under β (change {moved:.3g})"


@pytest.mark.parametrize("family", ["vit", "clip_vision"])
def test_image_family_loads_and_moves_under_beta(family, tmp_path):
    from PIL import Image

    from models.adapters.vit import VitAdapter

    folder = build_image_model(family, tmp_path / family)
    if family == "clip_vision":
        pytest.importorskip("transformers")
    adapter = VitAdapter(f"tiny-{family}", str(folder), device="cpu")
    image = Image.linear_gradient("L").convert("RGB").resize((48, 40))
    encoded = adapter.encode(image, "gradient")
    before, after = adapter.run(encoded), adapter.run(encoded, (Intervention("temperature", beta=0.02),))
    assert adapter.info.parity is not None and adapter.info.parity <= PARITY_TOLERANCE
    effect = adapter.output_effect(before, after, encoded)
    assert 1 - effect["cls_cosine"] > 1e-5


def test_attention_outside_the_interface_is_refused(tmp_path):
    """Falcon computes its attention itself (not through AttentionInterface): refused with the reason."""
    from transformers import FalconConfig, FalconForCausalLM

    from tests.tiny_models import save_tokenizer

    vocab = save_tokenizer(tmp_path)
    torch.manual_seed(0)
    FalconForCausalLM(FalconConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   new_decoder_architecture=True, num_kv_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedAttention, match="outside transformers' AttentionInterface"):
        _load("tiny-falcon", tmp_path)


def test_an_unreadable_operator_model_is_listed_and_refused_with_the_reason(tmp_path):
    spec = build_registry(weights_dir="/nonexistent", extra={"broken": str(tmp_path / "missing")})["broken"]
    with pytest.raises(ValueError, match="cannot read its config"):
        spec.load("cpu")


@pytest.mark.parametrize("config_class", ["MPNetConfig", "LlamaConfig", "Wav2Vec2Config"])
def test_an_unknown_model_type_is_refused_naming_the_known_families(config_class, tmp_path):
    """Before issue 54 every model_type no other family claimed went to the BERT adapter: an MPNet encoder, a Llama
    config without its architectures, a speech encoder. Each is now refused with the families attnlab serves."""
    import transformers

    from models.registry import UnknownFamily

    config = getattr(transformers, config_class)()
    config.save_pretrained(tmp_path)  # config.json only: detection reads no weights
    with pytest.raises(UnknownFamily) as refused:
        detect_family(str(tmp_path))
    message = str(refused.value)
    assert repr(config.model_type) in message
    for family in ("decoder LMs", "encoder–decoders", "ViT-family", "BERT-family", "bert, "):
        assert family in message
    spec = build_registry(weights_dir="/nonexistent", extra={"added": str(tmp_path)})["added"]
    assert spec.family == "unknown"
    with pytest.raises(ValueError, match="BERT-family encoders"):
        spec.load("cpu")
