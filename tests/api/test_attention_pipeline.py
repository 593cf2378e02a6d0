"""The attention response is built once (issue 32): the request is checked once (one pass of the intervention
validator), each planned model run is asked of the runtime once, and with `weighting: "value_norm"` the maps are
read already weighted — P's fields are never encoded first and then overwritten. Tiny random Llama, short and long
(full_map_tokens 8)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import app.encoding
import app.interventions
from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"
MASK = [{"op": "mask_keys", "tokens": [2]}]


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    folder = str(build_text_model("llama", tmp_path_factory.mktemp("pipeline-llama"), seed=3))
    common = dict(default_models=[], extra_models={"lm": folder}, max_response_numbers=200_000)
    with TestClient(create_app(Settings(**common))) as short, \
            TestClient(create_app(Settings(**common, full_map_tokens=8, overview_blocks=4, atlas_block_rows=4))) as long:
        yield short, long


def _counting(monkeypatch, client) -> dict[str, int]:
    """Calls of the runtime's runs, of the intervention validator and of map encodings while a request is answered."""
    counts = {"runs": 0, "validations": 0, "encoded_maps": 0}
    runtime = client.app.state.runtime
    run, validate, encode = runtime.run, app.interventions.engine_interventions, app.encoding.tensor_field

    def counted(name, function):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(runtime, "run", counted("runs", run))
    for module in ("app.pipeline.job", "app.attention", "app.routes.analysis", "app.routes.text"):  # where it is imported
        monkeypatch.setattr(f"{module}.engine_interventions", counted("validations", validate), raising=False)
    for module in ("app.pipeline.maps", "app.pipeline.views", "app.attention", "app.routes.analysis", "app.encoding"):
        monkeypatch.setattr(f"{module}.tensor_field", counted("encoded_maps", encode), raising=False)
    return counts


@pytest.mark.parametrize("size", ["short", "long"])
def test_a_value_weighted_view_runs_validates_and_encodes_once(clients, monkeypatch, size):
    client = dict(zip(("short", "long"), clients))[size]
    body = {"model": "lm", "text": f"{TEXT} {size}", "layers": [1], "heads": [0, 2], "interventions": MASK,
            "weighting": "value_norm", "encoding": "f32"}
    counts = _counting(monkeypatch, client)
    r = client.post("/api/text/attention", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["weighting"] == "value_norm"
    # one run (no compare), validated once, and each map field (short: attention and received; long: the overview
    # and received) encoded once: never P's first
    assert counts == {"runs": 1, "validations": 1, "encoded_maps": 2}, counts
