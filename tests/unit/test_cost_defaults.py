"""The cost estimate's default throughput must admit what the defaults allow: a first view of the longest text
input (settings.max_tokens) on the default LM, alone and with compare, before the model has timed runs of its own.
At the earlier default (8 GMAC/s) a 3,000-token first view was estimated at 89 s and refused with 413. Admission is
app/costs.check_request_cost itself, on an adapter with smollm2-135m's shape (its config, no weights loaded)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import HTTPException

from app.admission import check_request_cost
from app.costs import CostMeasures, request_runs
from app.settings import Settings

CONFIG = Path(__file__).resolve().parents[2] / "weights" / "smollm2-135m" / "config.json"


def smollm2_like_adapter(model_id: str) -> SimpleNamespace:
    """What check_request_cost reads of an adapter (app/costs.model_shape): info, and the model's parameters and
    config; `model_id` is fresh per test, so no timed runs of another test's make the estimate a measured one."""
    if not CONFIG.is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    c = json.loads(CONFIG.read_text())
    d, layers, vocab, ffn = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d // heads
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * ffn  # q, o, k, v, gate/up/down (norms are negligible)
    params = layers * per_layer + vocab * d
    model = SimpleNamespace(parameters=lambda: [SimpleNamespace(numel=lambda: params)],
                            config=SimpleNamespace(hidden_size=d))
    info = SimpleNamespace(id=model_id, layers=layers, heads=heads, head_dim=d // heads, decoder_layers=None,
                           kv_heads=c["num_key_value_heads"])
    return SimpleNamespace(info=info, model=model)


@pytest.mark.parametrize("compare", [False, True])
def test_a_first_view_at_max_tokens_is_admitted_by_the_default_estimate(compare):
    settings = Settings()
    adapter = smollm2_like_adapter(f"smollm2-shape-admitted-{compare}")
    seconds = check_request_cost(adapter, SimpleNamespace(settings=settings, measures=CostMeasures()), settings.max_tokens, request_runs(1, compare), 0)
    assert seconds < settings.request_timeout_s, (settings.max_tokens, compare, seconds)


def test_sixteen_samples_at_max_tokens_are_still_refused():
    """The estimate still does its job: 17 runs of the longest input cannot finish in time: 413 naming the field."""
    settings = Settings()
    adapter = smollm2_like_adapter("smollm2-shape-refused")
    with pytest.raises(HTTPException) as refused:
        check_request_cost(adapter, SimpleNamespace(settings=settings, measures=CostMeasures()), settings.max_tokens, request_runs(16, True), 0)
    assert refused.value.status_code == 413 and "request_timeout_s" in refused.value.detail, refused.value.detail



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
        self.host_and_device_nbytes = (host, device)


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
