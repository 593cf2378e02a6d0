"""Pinned runs count against the memory budget when the disk tier is full (issue 53 item 7: with the disk tier full,
pinned runs stayed in RAM past the budget, 2,941 MiB kept against 2,048, and work was still admitted). A tiny Llama,
a RAM tier that keeps no run (every run leaves RAM at once), and a disk tier with room for one run's file: the first
run's file fills it, pinned; the second run finds no room and stays in RAM, pinned; the memory budget counts it, and
the next request, which would not fit beside it, is refused at once with 503 + Retry-After naming why. Once the pins
end, work is admitted again. Sizes are measured on a probe server, not written down."""
from __future__ import annotations

import pytest

from tests.api.helpers import tiny_lm_client, wait_until
from tests.tiny_models import build_text_model

TEXTS = ["the cat sat on the mat", "the dog sat on the mat", "the car sat on the mat"]  # one token count each
PIN_S = 15.0  # longer than two tiny runs take on a loaded machine: the first run's pin holds when the second comes


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


def _sizes(llama) -> tuple[int, int, int]:
    """(a run's file on disk, its bytes in RAM, a request's reserved peak) of one plain run of TEXTS[0]."""
    peaks = []
    with tiny_lm_client(llama, run_store_min_free_bytes=0, memory_watch_rss=False) as probe:
        memory = probe.app.state.runtime.memory
        check_fits = memory.check_fits

        def noting(nbytes, field, what):  # the request's peak, as the app computes it
            peaks.append(nbytes)
            return check_fits(nbytes, field, what)

        memory.check_fits = noting
        body = {"model": "lm", "text": TEXTS[0]}
        assert probe.post("/api/text/attention", json=body).status_code == 200
        store = probe.app.state.runtime.cache
        in_ram = store.host_bytes
        store.make_room()  # nothing: it fits
        with store._lock:
            key = next(iter(store._items))
        write = store._leave_ram(key, may_drop=False)  # to disk, to learn its file's size
        write.done.wait(60)
        on_disk = store.stats()["disk_bytes"]
    assert on_disk > 0 and in_ram > 0 and peaks
    return on_disk, in_ram, max(peaks)


def test_pins_beyond_a_full_disk_tier_refuse_work_up_front_until_they_end(llama):
    on_disk, in_ram, peak = _sizes(llama)
    limit = peak + in_ram // 2  # a request fits alone, not beside a run kept in RAM
    budget = 512 * 2**20
    with tiny_lm_client(llama, result_cache_bytes=1, result_pin_s=PIN_S, run_store_disk_bytes=on_disk + on_disk // 2,
                        run_store_min_free_bytes=0, memory_watch_rss=False, memory_budget_bytes=budget,
                        memory_reserved_bytes=budget - limit) as client:
        runtime = client.app.state.runtime
        store, memory = runtime.cache, runtime.memory
        first = client.post("/api/text/attention", json={"model": "lm", "text": TEXTS[0]})
        assert first.status_code == 200, first.text
        assert store.flush(timeout=60) and store.stats()["disk_runs"] == 1  # its file fills the disk tier, pinned
        second = client.post("/api/text/attention", json={"model": "lm", "text": TEXTS[1]})
        assert second.status_code == 200, second.text
        store.make_room()  # the writer may still hold the store's books: the second run has tried to leave
        stats = store.stats()
        assert stats["ram_runs"] == 1 and stats["disk_runs"] == 1 and stats["writing_runs"] == 0, stats
        assert memory.pinned_stuck_bytes() == store.host_bytes > 0  # the budget sees the pinned run that stayed

        third = client.post("/api/text/attention", json={"model": "lm", "text": TEXTS[2]})
        assert third.status_code == 503, third.text[:300]
        detail = third.json()["detail"]
        assert "pinned" in detail and "run_store_disk_bytes" in detail and "memory_budget_bytes" in detail, detail
        assert 1 <= int(third.headers["Retry-After"]) <= PIN_S + 1
        assert store.host_bytes + memory.in_flight_bytes <= limit  # refused rather than overrun
        # a window of the run that stayed still answers (its pin renews: it is the client's next step)
        window = {"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]}
        assert client.post(f"/api/runs/{second.json()['run_id']}/window", json=window).status_code == 200

        wait_until(lambda: memory.pinned_stuck_bytes() == 0, "the pins ended", limit_s=10 * PIN_S)
        again = client.post("/api/text/attention", json={"model": "lm", "text": TEXTS[2]})
        assert again.status_code == 200, again.text


def test_without_a_full_disk_tier_pinned_runs_spill_and_nothing_is_refused(llama):
    """The same sizes with room on disk for every run: pinned runs go to disk, the budget counts none, work goes on."""
    on_disk, in_ram, peak = _sizes(llama)
    budget = 512 * 2**20
    with tiny_lm_client(llama, result_cache_bytes=1, result_pin_s=PIN_S, run_store_disk_bytes=8 * on_disk,
                        run_store_min_free_bytes=0, memory_watch_rss=False, memory_budget_bytes=budget,
                        memory_reserved_bytes=budget - (peak + in_ram // 2)) as client:
        runtime = client.app.state.runtime
        for text in TEXTS:
            response = client.post("/api/text/attention", json={"model": "lm", "text": text})
            assert response.status_code == 200, response.text
        assert runtime.cache.flush(timeout=60)
        assert runtime.memory.pinned_stuck_bytes() == 0 and runtime.cache.stats()["disk_runs"] == len(TEXTS)
