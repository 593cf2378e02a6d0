"""The cost estimate's default throughput must admit what the defaults allow: a first view of the longest text
input (settings.max_tokens) on the default LM, alone and with compare, before the model has timed runs of its own.
At the earlier default (8 GMAC/s) a 3,000-token first view was estimated at 89 s and refused with 413."""
import json
from pathlib import Path

import pytest

from app.costs import ModelShape, forward_macs, request_runs
from app.settings import Settings

CONFIG = Path(__file__).resolve().parents[2] / "weights" / "smollm2-135m" / "config.json"


def smollm2_shape() -> ModelShape:
    if not CONFIG.is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    c = json.loads(CONFIG.read_text())
    d, layers, vocab, ffn = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ffn  # q, o, k, v, gate/up/down (norms are negligible)
    return ModelShape(params=layers * per_layer + vocab * d, layers=layers, heads=c["num_attention_heads"],
                      head_dim=d // c["num_attention_heads"])


@pytest.mark.parametrize("compare", [False, True])
def test_a_first_view_at_max_tokens_is_admitted_by_the_default_estimate(compare):
    settings = Settings()
    shape = smollm2_shape()
    macs = request_runs(1, compare) * forward_macs(shape, settings.max_tokens, settings.max_tokens)
    seconds = macs / (settings.compute_gmacs_per_s * 1e9)
    assert seconds < settings.request_timeout_s, (settings.max_tokens, compare, seconds)


def test_sixteen_samples_at_max_tokens_are_still_refused():
    """The estimate still does its job: 17 runs of the longest input cannot finish in time."""
    settings = Settings()
    macs = request_runs(16, True) * forward_macs(smollm2_shape(), settings.max_tokens, settings.max_tokens)
    assert macs / (settings.compute_gmacs_per_s * 1e9) > settings.request_timeout_s
