"""What a short run keeps (issue 20, docs/science.md §10): P, q̂/k̂ and the hidden states stay on the device the run
ran on (the result cache holds them there); `attention` is their host view, the kept tensor itself on a CPU; the
result cache re-measures a result whose host copy appeared after it was put; the text mean distance is computed
where P is kept."""
from __future__ import annotations

import pytest
import torch

from app.attention import thumbnails
from app.runtime import ResultCache
from models.adapters.base import AttentionResult
from models.adapters.causal_lm import CausalLMAdapter
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))))


def test_short_run_keeps_p_on_its_device_and_the_host_view_is_no_copy_on_a_cpu(llama):
    result = llama.run(llama.encode(TEXT))
    kept = result.kept_attention
    n = len(result.tokens)
    assert kept.shape == (llama.info.layers, llama.info.heads, n, n) and kept.dtype == torch.float32
    assert kept.device == llama.device and result.hidden_states.device == llama.device
    assert result.attention is kept  # on a CPU the kept P is the host view: nothing copied
    assert result.host_copy is None
    assert not result.is_long
    torch.testing.assert_close(kept.sum(-1), torch.ones(kept.shape[:-1]))


def test_setting_attention_replaces_the_kept_maps(llama):
    result = llama.run(llama.encode(TEXT))
    result._host_attention = torch.zeros(1)  # a stale host copy must go with the maps it copied
    replacement = result.kept_attention.clone() * 0.5
    result.attention = replacement
    assert result.kept_attention is replacement and result.host_copy is None


def _result(host_numbers: int) -> AttentionResult:
    return AttentionResult(tokens=["a"], attention=torch.zeros(host_numbers), hidden_states=torch.zeros(0), output={})


def test_cache_counts_a_host_copy_made_after_put():
    """A GPU run's host copy of P appears only when a consumer reads `attention`: the next put sees it and evicts."""
    cache = ResultCache(max_items=10, max_bytes=4 * 1000)
    first, second = _result(100), _result(100)
    cache.put(("a",), first)
    cache.put(("b",), second)
    assert cache._bytes == 800
    first._host_attention = torch.zeros(800)  # what AttentionResult.attention keeps on a GPU run
    cache.put(("c",), _result(100))
    # 400 + 3,200 (first and its copy) + 400 + 400 > 4,000: the oldest, `first`, goes
    assert cache.get(("a",)) is None and cache.get(("b",)) is not None and cache.get(("c",)) is not None
    assert cache._bytes == 800


def test_thumbnails_of_kept_maps_unchanged(llama):
    """The first view's thumbnails are taken where P is kept: the same pictures as from a host tensor."""
    attention = llama.run(llama.encode(TEXT)).kept_attention
    here, copied = thumbnails(attention, 4), thumbnails(attention.clone(), 4)
    assert here == copied and here["shape"] == [llama.info.layers, llama.info.heads, 4, 4]
