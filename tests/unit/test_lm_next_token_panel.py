"""The next-token panel of a decoder LM (issue 20, the last device → host reads of a short first view): it is the
softmax of the model's own logits at the query position, formed on the run's device from the logits the forward
computed (logits_to_keep=1) and read to the host with the rest of the first view in one copy. Checked against a
plain transformers forward (eager attention, no attnlab) of the same tiny random models: Llama, and Gemma 2 whose
final logit soft-cap is part of the model's logits."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.pipeline.job import PlainJob
from app.pipeline.maps import ShortMaps
from app.pipeline.views import short_response as pipeline_short_response
from models.families import family_named
from models.head_ops import HeadRun
from app.schemas import TextAttentionRequest
from models.adapters.causal_lm import TOP_K, CausalLMAdapter
from tests.tiny_models import build_text_model


def short_response(adapter, encoded, req, result, base, layers, heads, requested_queries, queries, page_fields=None):
    """The first view of a short run through app/pipeline (its ShortMaps and view), for given layers, heads and rows:
    a job built here without a runtime (P weighting needs none)."""
    job = PlainJob(None, adapter, encoded, req, family_named("causal_lm"), layers, heads, (), False, HeadRun(),
                   queries=queries, requested_queries=requested_queries, page_fields=page_fields)
    return pipeline_short_response(job, result, ShortMaps(job, result, base))


TEXT = "the cat sat on the mat because it was tired and the dog lay by the door"


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def family(request, tmp_path_factory) -> tuple[CausalLMAdapter, torch.nn.Module]:
    """(the adapter, the same weights loaded plainly by transformers with eager attention)."""
    folder = build_text_model(request.param, tmp_path_factory.mktemp(request.param))
    plain = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    return CausalLMAdapter(f"tiny-{request.param}", str(folder), device="cpu"), plain


def _plain_probs(plain: torch.nn.Module, encoded) -> torch.Tensor:
    """p(· | tokens ≤ i) of every position from the plain forward, float64: (T, V)."""
    with torch.inference_mode():
        logits = plain(**encoded.inputs).logits[0]  # (T, V)
    return torch.softmax(logits.double(), dim=-1)


def _assert_panel_is(top: list[dict], probs: torch.Tensor) -> None:
    """The panel's items are the k most probable tokens of `probs` (V,), in order, with their probabilities."""
    assert len(top) == min(TOP_K, probs.numel())
    ids = [item["id"] for item in top]
    assert len(set(ids)) == len(ids)
    for item in top:
        assert item["prob"] == pytest.approx(float(probs[item["id"]]), abs=1e-6), item
    assert [item["prob"] for item in top] == sorted((item["prob"] for item in top), reverse=True)
    others = torch.ones_like(probs, dtype=torch.bool)
    others[ids] = False
    assert top[-1]["prob"] >= float(probs[others].max()) - 1e-6  # nothing left out is more probable


def test_panel_is_softmax_of_the_models_last_position_logits(family):
    adapter, plain = family
    encoded = adapter.at_position(adapter.encode(TEXT), None)
    last = len(encoded.tokens) - 1
    result = adapter.run(encoded)
    expected = _plain_probs(plain, encoded)  # (T, V)
    assert float((expected[last] - expected[last - 1]).abs().max()) > 1e-3  # another row would be caught

    summary = adapter.output_summary(result, encoded)
    assert summary["kind"] == "next_token" and summary["position"] == last
    _assert_panel_is(summary["top"], expected[last])
    # the kept logits are the forward's own (its last position) and the panel is exactly their softmax, in float64
    with torch.inference_mode():
        plain_logits = plain(**encoded.inputs).logits[0, -1]  # (V,)
    assert float((result.output["last_logits"] - plain_logits).abs().max()) < 1e-5
    own = torch.softmax(result.output["last_logits"].double(), dim=-1)
    assert [item["prob"] for item in summary["top"]] == [float(own[item["id"]]) for item in summary["top"]]
    assert torch.equal(adapter.distribution(result, last), own)


def test_panel_at_an_earlier_position_uses_the_head_on_that_hidden_state(family):
    adapter, plain = family
    encoded = adapter.at_position(adapter.encode(TEXT), 3)
    result = adapter.run(encoded)
    summary = adapter.output_summary(result, encoded)
    assert summary["position"] == 3
    _assert_panel_is(summary["top"], _plain_probs(plain, encoded)[3])


def test_first_view_reads_the_panel_and_entropy_with_the_rest(family, monkeypatch):
    """short_response takes the panel from its one copy (output_parts), never through output_summary's own read, and
    the run's entropy, kept on its device as a tensor, from that copy too."""
    adapter, plain = family
    encoded = adapter.at_position(adapter.encode(TEXT), None)
    result = adapter.run(encoded)
    expected = adapter.output_summary(result, encoded)
    entropy = result.derived["entropy"]
    assert isinstance(entropy, torch.Tensor) and entropy.dtype == torch.float64
    assert entropy.shape == (adapter.info.layers, adapter.info.heads) and entropy.device == adapter.device
    assert result.output["last_logits"].device == adapter.device  # kept where the run ran

    def separate_read(*args, **kwargs):
        raise AssertionError("the panel was read on its own (output_summary), not with the first view")

    monkeypatch.setattr(adapter, "output_summary", separate_read)
    req = TextAttentionRequest(model=adapter.info.id, text=TEXT, encoding="f32", thumbnail_size=8, layers=[0], heads=[0])
    n = len(encoded.tokens)
    out = short_response(adapter, encoded, req, result, None, [0], [0], None, list(range(n)))
    assert out["output"] == expected
    assert out["entropy"] == entropy.tolist()  # the same float64 numbers, now lists
    assert result.derived["entropy"] == out["entropy"]  # read once per cached run


def test_dead_row_warnings_read_with_the_first_view_or_on_their_own(family):
    """A short run keeps the counts behind its 'every key masked' warnings on its device; they are read with the first
    view's one copy, or on their own at the first read of `warnings`: either way the lines RunScope.warnings writes."""
    from models.interventions import Intervention

    adapter, _ = family
    encoded = adapter.at_position(adapter.encode(TEXT), None)
    n = len(encoded.tokens)
    masked = (Intervention("mask_keys", tokens=tuple(range(n)), heads=(1,), layers=(1,)),)  # head 1 of layer 1: dead
    _, scope = adapter._forward({**encoded.inputs, "logits_to_keep": 1}, masked, False, encoded)
    expected = list(scope.warnings)
    assert len(expected) == 1 and expected[0].startswith(f"layer 1: {n} query rows in heads [1]")

    on_their_own = adapter.run(encoded, masked)
    assert on_their_own.warnings == expected
    assert adapter.run(encoded).warnings == []  # nothing masked: no line

    with_the_view = adapter.run(encoded, masked)
    req = TextAttentionRequest(model=adapter.info.id, text=TEXT, encoding="f32", thumbnail_size=None, layers=[1], heads=[1])
    out = short_response(adapter, encoded, req, with_the_view, None, [1], [1], None, list(range(n)))
    assert with_the_view.pending_dead_rows() is None  # settled by the response's read
    assert with_the_view.warnings == expected
    assert out["output"] == adapter.output_summary(with_the_view, encoded)
