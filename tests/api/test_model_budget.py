"""A model loaded on first use within memory_budget_bytes (issue 37 §2; the real-limit test under a cgroup is
tests/faults/test_model_memory.py). Its weight files' size is booked before it loads: kept runs leave RAM to make
room, a model that could never fit is refused with a 503 naming memory_budget_bytes, and after the load the books
hold its measured weights. Tiny random decoders (tests/tiny_models.py) as the default and the first-use model."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

MiB = 2**20


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: build_text_model("llama", tmp_path_factory.mktemp(name)) for name in ("default-lm", "later-lm")}


def _client(folders, **settings) -> TestClient:
    return TestClient(create_app(Settings(default_models=["default-lm"], max_response_numbers=200_000,
                                          extra_models={k: str(v) for k, v in folders.items()}, **settings)))


def _view(client, model: str, text: str):
    return client.post("/api/text/attention", json={"model": model, "text": text, "layers": [0], "heads": [0]})


def _weight_files(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_a_model_that_could_never_fit_is_a_503_naming_memory_budget_bytes(folders):
    budget = 512 * MiB
    room = _weight_files(folders["later-lm"]) // 2  # what the budget leaves beside the default model: too little
    with _client(folders, memory_budget_bytes=budget, memory_reserved_bytes=budget - room) as client:
        client.app.state.runtime.warm_up()
        assert _view(client, "default-lm", "the cat sat").status_code == 200
        refused = _view(client, "later-lm", "the cat sat")
        assert refused.status_code == 503, refused.text
        assert "memory_budget_bytes" in refused.json()["detail"] and "later-lm" in refused.json()["detail"]
        memory = client.app.state.runtime.memory
        assert memory.reserved == budget - room and "later-lm" not in memory.models  # nothing left booked
        assert _view(client, "default-lm", "the dog ran").status_code == 200  # the server goes on


def test_kept_runs_leave_ram_to_make_room_for_a_first_use_model(folders):
    """Runs kept by the default model fill what the budget leaves; the first-use model's load then needs room: the
    kept runs leave RAM (no disk tier here: unpinned runs are dropped), so the books stay within the budget."""
    weights = _weight_files(folders["later-lm"])
    with _client(folders, memory_budget_bytes=512 * MiB, memory_reserved_bytes=512 * MiB - 3 * weights,
                 result_pin_s=0, run_store_disk_bytes=0) as client:
        client.app.state.runtime.warm_up()
        runtime = client.app.state.runtime
        memory = runtime.memory
        for i in range(40):
            assert _view(client, "default-lm", f"the cat sat on the mat number {i} " * 8).status_code == 200
        kept = runtime.cache.host_bytes
        assert memory.reserved + kept > memory.budget - weights, "the kept runs should fill the room"
        assert _view(client, "later-lm", "the cat sat").status_code == 200
        assert memory.models["later-lm"] > 0
        assert memory.reserved + runtime.cache.host_bytes <= memory.budget, (memory.reserved, runtime.cache.host_bytes)
        assert runtime.cache.host_bytes < kept
