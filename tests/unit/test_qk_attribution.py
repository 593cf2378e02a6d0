"""Query–key attribution (models/qk_attribution.py, docs/science.md "Query–key attribution") on tiny random decoders
of every pre-norm family: the parts sum to the run's own score (with β, masks, perturbations and ablations), a 2-layer
Llama attributed by hand matches part by part, parts name only earlier layers, expansions add up to their part, and
post-norm BERT is refused with the reason."""
from __future__ import annotations

import re

import pytest
import torch

from models.adapters.base import RequestFieldError
from models.interventions import Intervention
from models.qk_attribution import NotPreNorm, qk_attribution
from models.registry import build_registry
from tests.float32 import f32_bound
from tests.tiny_models import CAUSAL_FAMILIES, build_text_model

TEXT = "the cat sat on the mat because it was tired and the dog ran on the street"


def _randomized(adapter, seed: int = 0):
    """Biases and norm gains moved away from their init (zeros / ones), so that every bias (Qwen2's q/k, GPT-2's) and
    every gain convention (Llama's g, Gemma's 1 + g) is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in adapter.model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return adapter


@pytest.fixture(scope="module", params=CAUSAL_FAMILIES)
def family_adapter(request, tmp_path_factory):
    family = request.param
    folder = build_text_model(family, tmp_path_factory.mktemp(family))
    spec = build_registry(weights_dir="/nonexistent", extra={f"tiny-{family}": str(folder)})[f"tiny-{family}"]
    return family, _randomized(spec.load("cpu"))


def _ids(adapter) -> torch.Tensor:
    return torch.tensor([adapter.prompt_ids(TEXT)])  # (1, T)


def _run_scores(adapter, ids, interventions, layer, head):
    """The run's own Ŝ (unscaled, after perturbation) of one head, from a recorded run: (T, T)."""
    encoded = adapter.at_position(adapter.encode(TEXT), None)
    assert encoded.inputs["input_ids"].tolist() == ids.tolist()
    result = adapter.run(encoded, interventions, record_scores=True)
    return result.scores_slice([layer], [head])[0, 0].double()


def test_parts_sum_to_the_runs_own_score_with_beta_masks_and_perturbations(family_adapter):
    family, adapter = family_adapter
    ids = _ids(adapter)
    n_tokens, layer, head = ids.shape[1], 1, 2
    query, key = n_tokens - 2, n_tokens - 4  # within Gemma's sliding windows; the score is what it is either way
    interventions = (
        Intervention("temperature", layers=(1,), heads=(head,), beta=0.9),
        Intervention("mask_keys", layers=(0,), tokens=(2, 5)),
        Intervention("ablate_heads", layers=(0,), heads=(3,)),
        Intervention("perturb_queries", layers=(1,), heads=(head,), tokens=(query,), scale=1.5, noise_std=0.2, seed=3),
        Intervention("perturb_keys", layers=(1,), heads=(head,), tokens=(key,), scale=0.8, noise_std=0.1, seed=4),
    )
    found = qk_attribution(adapter, ids, layer, head, query, key, interventions, expand=4)
    scores = _run_scores(adapter, ids, interventions, layer, head)
    assert found.beta == pytest.approx(0.9)
    assert found.score == pytest.approx(0.9 * float(scores[query, key]), rel=1e-5)
    total = float(found.matrix.sum())
    assert abs(total - found.score) <= 1e-4 * abs(found.score), (family, total, found.score)
    # the perturbations are parts of their own, on both sides; the ablated head contributes nothing
    assert found.query_parts[-1] == found.key_parts[-1] == "perturbation"
    ablated = found.query_parts.index("L0.H3")
    assert float(found.matrix[ablated].abs().max()) == 0.0
    if family in ("qwen2", "gpt2"):  # q/k biases (and GPT-2's LayerNorm and output biases): a part of their own
        assert "bias" in found.query_parts and "bias" in found.key_parts
    # an expanded head part splits over source positions that add up to its column total
    totals = found.matrix.sum(dim=0)
    assert found.expanded
    for entry in found.expanded:
        column = found.key_parts.index(entry["key_part"])
        assert entry["total"] == pytest.approx(float(totals[column]))
        # the total comes from the forward's float32 z = Σ_m P v_m, the sources from float64 P v_m: they differ by the
        # rounding of that float32 sum over the sources, relative to the size of its terms (not of the total)
        values = [s["value"] for s in entry["sources"]]
        bound = f32_bound(len(values), sum(abs(v) for v in values))
        assert abs(sum(values) - entry["total"]) <= bound, (family, sum(values), entry["total"], bound)
        assert all(s["position"] <= key for s in entry["sources"])


def test_without_interventions_the_score_is_the_native_one(family_adapter):
    family, adapter = family_adapter
    ids = _ids(adapter)
    query, key = ids.shape[1] - 1, ids.shape[1] - 2
    found = qk_attribution(adapter, ids, 1, 0, query, key)
    scores = _run_scores(adapter, ids, (), 1, 0)
    assert found.beta == pytest.approx(adapter.info.native_beta)
    assert found.score == pytest.approx(adapter.info.native_beta * float(scores[query, key]), rel=1e-5)
    assert abs(float(found.matrix.sum()) - found.score) <= 1e-4 * abs(found.score)
    assert "perturbation" not in found.query_parts and "rounding" not in found.query_parts


def test_parts_name_only_earlier_layers(family_adapter):
    _, adapter = family_adapter
    ids = _ids(adapter)
    for layer in (0, 1):
        found = qk_attribution(adapter, ids, layer, 1, 6, 3, expand=0)
        for name in found.query_parts + found.key_parts:
            match = re.fullmatch(r"L(\d+)\.(H\d+|mlp)", name)
            assert match is not None or name in ("embed", "bias"), name
            if match:
                assert int(match.group(1)) < layer, (layer, name)
        if layer == 0:  # nothing before the first layer but the embedding (and constants)
            assert set(found.query_parts) <= {"embed", "bias"}


def test_a_two_layer_llama_attributed_by_hand_matches_part_by_part(tmp_path):
    """Layer 0 and the split of layer 1's score written out from the weights (RMSNorm, RoPE, causal softmax, GQA),
    without the lab's run or hooks: every entry of the matrix matches."""
    folder = build_text_model("llama", tmp_path / "llama")
    spec = build_registry(weights_dir="/nonexistent", extra={"tiny": str(folder)})["tiny"]
    adapter = _randomized(spec.load("cpu"), seed=1)
    model, config = adapter.model, adapter.model.config
    ids = _ids(adapter)
    n_tokens = ids.shape[1]
    n_heads, n_kv, d = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    eps = config.rms_norm_eps
    w = {name: p.detach().double() for name, p in model.named_parameters()}

    def rms(x, gain):  # (..., D)
        return gain * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n_tokens, dtype=torch.float64)[:, None] * inv_freq  # (T, d/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (T, d)

    def rope(v, p):  # v (..., d) at position p
        return v * cos[p] + torch.cat([-v[..., d // 2:], v[..., :d // 2]], -1) * sin[p]

    beta = d ** -0.5
    x0 = w["model.embed_tokens.weight"][ids[0]]  # (T, D)
    n0 = rms(x0, w["model.layers.0.input_layernorm.weight"])
    q = (n0 @ w["model.layers.0.self_attn.q_proj.weight"].T).reshape(n_tokens, n_heads, d)
    k = (n0 @ w["model.layers.0.self_attn.k_proj.weight"].T).reshape(n_tokens, n_kv, d)
    v = (n0 @ w["model.layers.0.self_attn.v_proj.weight"].T).reshape(n_tokens, n_kv, d)
    positions = torch.arange(n_tokens)
    q, k = rope(q, positions[:, None]), rope(k, positions[:, None])
    group = n_heads // n_kv
    z = torch.zeros(n_tokens, n_heads, d, dtype=torch.float64)
    for h in range(n_heads):
        logits = beta * q[:, h] @ k[:, h // group].T  # (T, T)
        logits = logits.masked_fill(torch.ones(n_tokens, n_tokens).triu(1).bool(), float("-inf"))
        z[:, h] = torch.softmax(logits, -1) @ v[:, h // group]
    w_o = w["model.layers.0.self_attn.o_proj.weight"].T.reshape(n_heads, d, -1)  # (H, d, D)
    heads = torch.einsum("thd,hdD->thD", z, w_o)  # (T, H, D)
    x_mid = x0 + heads.sum(1)
    with torch.no_grad():
        mlp = model.model.layers[0].mlp.double()(rms(x_mid, w["model.layers.0.post_attention_layernorm.weight"]))
        model.model.layers[0].mlp.float()
    parts = torch.cat([x0[:, None], heads, mlp[:, None]], dim=1)  # (T, A, D): embed, L0.H0..H3, L0.mlp
    x1 = parts.sum(1)

    layer, head, query, key = 1, 3, n_tokens - 1, 4
    gain = w["model.layers.1.input_layernorm.weight"]

    def side(p, weight, which_head):
        frozen = gain / torch.sqrt(x1[p].pow(2).mean() + eps)  # the norm at position p, as a scale
        return rope((parts[p] * frozen) @ weight.T.reshape(-1, weight.shape[0] // d, d)[:, which_head], p)  # (A, d)

    by_hand = beta * side(query, w["model.layers.1.self_attn.q_proj.weight"], head) @ \
        side(key, w["model.layers.1.self_attn.k_proj.weight"], head // group).T  # (A, A)

    found = qk_attribution(adapter, ids, layer, head, query, key)
    assert found.query_parts == found.key_parts == ["embed"] + [f"L0.H{h}" for h in range(n_heads)] + ["L0.mlp"]
    scale = float(by_hand.abs().max())
    assert torch.allclose(found.matrix, by_hand, rtol=1e-4, atol=1e-5 * scale), (found.matrix - by_hand).abs().max()


def test_post_norm_bert_is_refused_naming_the_model(tiny_bert):
    spec = build_registry(weights_dir="/nonexistent", extra={"bert": str(tiny_bert)})["bert"]
    adapter = spec.load("cpu")
    ids = torch.tensor([[2, 8, 9, 10, 3]])
    with pytest.raises(NotPreNorm, match="post-norm") as raised:
        qk_attribution(adapter, ids, 1, 0, 3, 1)
    assert isinstance(raised.value, RequestFieldError) and raised.value.field == "model"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_run_keeps_its_rounding_as_a_part(tmp_path, dtype):
    """A model served in bfloat16/float16 rounds every intermediate; the float64 parts do not. What that rounding moved
    in q̂ and k̂ is a part of its own ("rounding"), so the matrix still adds up to the run's score; float32 has none."""
    from models.adapters.causal_lm import CausalLMAdapter

    folder = build_text_model("llama", tmp_path / "llama")
    adapter = CausalLMAdapter("tiny", str(folder), device="cpu", dtype=dtype)
    ids = _ids(adapter)
    found = qk_attribution(adapter, ids, 1, 1, ids.shape[1] - 1, 3)
    assert found.query_parts[-1] == found.key_parts[-1] == "rounding"
    assert float(found.matrix.sum()) == pytest.approx(found.score, rel=1e-9)
    scores = _run_scores(adapter, ids, (), 1, 1)
    assert found.score == pytest.approx(found.beta * float(scores[ids.shape[1] - 1, 3]), rel=1e-5)
