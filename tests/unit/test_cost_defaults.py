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



def test_the_result_cache_on_a_gpu_holds_a_long_run():
    """On a GPU a long run's atlas stays in device memory, which has its own budget: an 8,192-token smollm2-135m run
    keeps about 0.9 GB there (benchmarks/results/long_inputs_h100_engine.json). Counted against the host share
    (~0.7 GB) it was evicted on arrival and its run_id answered 404 at once."""
    from app.runtime import result_cache_device_bytes

    settings = Settings()
    long_run = 903_812_851
    assert settings.result_cache_bytes < long_run  # why the host budget alone failed
    assert result_cache_device_bytes(settings, None) == 0  # a CPU keeps nothing in device memory
    assert result_cache_device_bytes(settings, 80 * 2**30) > 4 * long_run  # an 80 GB GPU keeps several long runs
    assert result_cache_device_bytes(settings, 16 * 2**30) > long_run  # so does a 16 GB card
    assert result_cache_device_bytes(Settings(result_cache_bytes_gpu=123456), 80 * 2**30) == 123456


class _Result:
    """What ResultCache reads of a result: its bytes, the device part and its run id."""

    def __init__(self, host: int, device: int, run_id: str):
        self.nbytes, self.device_nbytes, self.run_id = host + device, device, run_id


def test_the_cache_bounds_host_and_device_bytes_separately():
    from app.runtime import ResultCache

    cache = ResultCache(max_items=10, max_bytes=100, max_device_bytes=1000)
    cache.put(("a",), _Result(host=10, device=900, run_id="a"))  # big on the device, small on the host: kept
    assert cache.by_run_id("a") is not None
    cache.put(("b",), _Result(host=10, device=200, run_id="b"))  # device total 1,100 > 1,000: the oldest goes
    assert cache.by_run_id("a") is None and cache.by_run_id("b") is not None
    cache.put(("c",), _Result(host=95, device=0, run_id="c"))  # host total 105 > 100: "b" goes
    assert cache.by_run_id("b") is None and cache.by_run_id("c") is not None
    cpu_only = ResultCache(max_items=10, max_bytes=100)  # no device budget: a run held on a device is not kept
    cpu_only.put(("d",), _Result(host=1, device=1, run_id="d"))
    assert cpu_only.by_run_id("d") is None
