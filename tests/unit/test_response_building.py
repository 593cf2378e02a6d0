"""The short first view's response building (issue 20): everything taken from the run's device tensors is formed
there, batched over every head, and read to the host in one copy (app/attention.py short_response, read_to_host).
The numbers must be exactly those of the previous per-field reads, whose definitions are restated here."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from app.attention import pooling_matrix, read_to_host, thumbnail_levels, thumbnails
from app.pipeline.job import PlainJob
from app.pipeline.maps import ShortMaps
from app.pipeline.views import short_response as pipeline_short_response
from models.families import family_named
from models.head_ops import HeadRun
from app.pipeline.views import text_fields
from app.schemas import TextAttentionRequest
from models.adapters.causal_lm import CausalLMAdapter
from models.interventions import row_entropy
from models.summaries import mean_token_distance
from tests.tiny_models import build_text_model


def short_response(adapter, encoded, req, result, base, layers, heads, requested_queries, queries, page_fields=None):
    """The first view of a short run through app/pipeline (its ShortMaps and view), for given layers, heads and rows:
    a job built here without a runtime (P weighting needs none)."""
    job = PlainJob(None, adapter, encoded, req, family_named("causal_lm"), layers, heads, (), False, HeadRun(),
                   queries=queries, requested_queries=requested_queries, page_fields=page_fields)
    return pipeline_short_response(job, result, ShortMaps(job, result, base))


TEXT = "the cat sat on the mat because it was tired and the dog lay by the door all day long"


def previous_pooling_matrix(n: int, size: int) -> torch.Tensor:
    """The loop that built the pooling matrix before (one bin a row)."""
    matrix = torch.zeros(size, n)
    for i in range(size):
        start, end = (i * n) // size, -((-(i + 1) * n) // size)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def previous_thumbnails(attention: torch.Tensor, size: int) -> dict:
    """The thumbnails as they were read before: pooled, then `max` and the levels read separately."""
    pooled = attention
    if attention.shape[-1] > size:
        pool = previous_pooling_matrix(attention.shape[-1], size)
        pooled = pool @ attention @ pool.T
    peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)
    levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)
    return {"dtype": "uint8", "shape": list(levels.shape), "max": peak.tolist(),
            "data": base64.b64encode(levels.numpy().tobytes()).decode("ascii")}


def random_maps(n_layers: int, n_heads: int, n_tokens: int, seed: int) -> torch.Tensor:
    """Row-stochastic, causal maps with a wide spread of values (some heads sharp, some flat)."""
    torch.manual_seed(seed)
    scores = torch.randn(n_layers, n_heads, n_tokens, n_tokens) * torch.linspace(0.5, 8, n_heads)[None, :, None, None]
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)  # (L, H, T, T)


@pytest.mark.parametrize("n", [1, 7, 24, 25, 100, 130, 511, 512, 1000])
def test_pooling_matrix_is_bit_for_bit_the_loops(n):
    assert torch.equal(pooling_matrix(n, 24), previous_pooling_matrix(n, 24))


@pytest.mark.parametrize("n_tokens", [130, 61, 20])  # not divisible by 24; fewer tokens than 24: no pooling
def test_batched_thumbnails_equal_the_previous_definition(n_tokens):
    maps = random_maps(3, 5, n_tokens, seed=n_tokens)
    assert thumbnails(maps, 24) == previous_thumbnails(maps, 24)
    levels, peak = thumbnail_levels(maps, 24)
    assert levels.dtype == torch.uint8 and peak.dtype == torch.float32
    assert levels.shape == (3, 5, min(24, n_tokens), min(24, n_tokens)) and int(levels.amax(dim=(-1, -2)).min()) == 255


def test_read_to_host_is_one_exact_copy_of_mixed_tensors():
    torch.manual_seed(0)
    wide = torch.randn(3, 4, dtype=torch.float64)
    maps = torch.rand(2, 3, 5, 7)[:, 1:, :, ::2]  # non-contiguous
    levels = torch.randint(0, 256, (2, 9), dtype=torch.uint8)
    odd = torch.rand(3)  # 12 bytes after 9 uint8 bytes would be misaligned: the widest go first
    host = read_to_host({"levels": levels, "maps": maps, "odd": odd, "wide": wide})
    assert set(host) == {"levels", "maps", "odd", "wide"}
    for name, tensor in {"levels": levels, "maps": maps, "odd": odd, "wide": wide}.items():
        assert host[name].dtype == tensor.numpy().dtype and host[name].shape == tuple(tensor.shape)
        assert np.array_equal(host[name], tensor.numpy()), name
        assert host[name].flags.aligned
    maps.zero_()  # host memory of its own: never a view of the device tensor (on a CPU the same memory)
    assert host["maps"].any()
    assert read_to_host({}) == {}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))))


def _decoded(field: dict) -> np.ndarray:
    dtype = {"float32": "<f4", "float16": "<f2"}[field["dtype"]]
    return np.frombuffer(base64.b64decode(field["data"]), dtype=dtype).reshape(field["shape"])


def test_short_response_numbers_equal_the_previous_per_field_reads(llama):
    encoded = llama.encode(TEXT)
    result = llama.run(encoded, (), True)  # with q̂/k̂: the scores slice is read in the same copy
    base = llama.run(encoded, (), False)
    kept, n = result.kept_attention, len(encoded.tokens)
    assert n > 8 and n % 8  # the thumbnails pool over bins of unequal widths
    layers, heads = [1, 0], [2, 0]
    req = TextAttentionRequest(model="tiny-llama", text=TEXT, encoding="f32", thumbnail_size=8, layers=layers,
                               heads=heads, include_scores=True, compare=True, include_base=True)
    entropy = result.derived.pop("entropy")  # formed by the builder when a run has none
    out = short_response(llama, encoded, req, result, base, layers, heads, None, list(range(n)), text_fields)

    selected = kept[layers][:, heads]  # (l, h, T, T)
    assert np.array_equal(_decoded(out["attention"]), selected.numpy())
    assert np.array_equal(_decoded(out["received"]), selected.mean(dim=2).numpy())
    assert np.array_equal(_decoded(out["scores"]), result.scores_slice(layers, heads).numpy())
    assert np.array_equal(_decoded(out["base_attention"]), base.kept_attention[layers][:, heads].numpy())
    assert out["thumbnails"] == previous_thumbnails(kept, 8)
    assert out["mean_distance"] == mean_token_distance(kept).tolist()
    assert out["entropy"] == row_entropy(kept).mean(dim=-1).tolist()
    assert np.allclose(out["entropy"], entropy, atol=1e-5)  # the forward's own (taken per layer) agrees
    assert out["output"] == llama.output_summary(result, encoded)
    assert out["layers"] == layers and out["heads"] == heads and "queries" not in out

    again = short_response(llama, encoded, req, result, base, layers, heads, None, list(range(n)), text_fields)
    assert again["thumbnails"] is result.derived["thumbnails8"]  # formed once per cached run
    assert again["mean_distance"] == out["mean_distance"] and again["entropy"] == out["entropy"]


def test_short_response_query_rows_and_json_encoding(llama):
    encoded = llama.encode(TEXT)
    result = llama.run(encoded)
    kept = result.kept_attention
    layers, heads = [0, 1], [1, 2]  # runs of one step: taken as slices
    req = TextAttentionRequest(model="tiny-llama", text=TEXT, encoding="json", thumbnail_size=None, layers=layers,
                               heads=heads)
    out = short_response(llama, encoded, req, result, None, layers, heads, [3, 1], [3, 1])
    assert np.array_equal(out["attention"], kept[layers][:, heads][:, :, [3, 1]].numpy())  # (2, 2, 2, T): the rows asked
    assert np.array_equal(out["received"], kept[layers][:, heads].mean(dim=2).numpy())  # over every query row
    assert out["queries"] == [3, 1] and out["thumbnails"] is None and out["scores"] is None
    assert out["base_attention"] is None and "mean_distance" not in out
