"""models/lru.BoundedLRU, the small caches' one class: least recently used first out, bounded by entries and bytes,
safe across threads."""
from __future__ import annotations

import threading

import pytest

from models.lru import BoundedLRU


def test_the_least_recently_used_goes_first():
    cache = BoundedLRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a read makes "a" the most recent
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
    cache.put("a", 10)  # a write too, and it replaces
    cache.put("d", 4)
    assert "c" not in cache and cache.get("a") == 10 and len(cache) == 2
    assert cache.get("missing") is None


def test_bytes_bound_the_total_and_replacing_counts_once():
    cache = BoundedLRU(10, max_bytes=10, size=len)
    cache.put("a", b"xxxx")
    cache.put("b", b"yyyy")
    assert cache.nbytes == 8
    cache.put("a", b"zzzzzz")  # replaced: 6 + 4, not 4 + 6 + 4
    assert cache.nbytes == 10 and len(cache) == 2
    cache.put("c", b"w")  # 11 > 10: the least recent ("b") goes
    assert "b" not in cache and cache.nbytes == 7
    cache.put("d", b"q" * 11)  # alone over the bound: nothing is kept, itself included
    assert len(cache) == 0 and cache.nbytes == 0


def test_no_entries_kept_with_a_zero_bound():
    cache = BoundedLRU(0)
    assert cache.put("a", 1) == 1 and "a" not in cache and len(cache) == 0


def test_max_bytes_needs_a_size():
    with pytest.raises(ValueError):
        BoundedLRU(2, max_bytes=10)


def test_clear():
    cache = BoundedLRU(3, max_bytes=100, size=len)
    cache.put("a", "xyz")
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.get("a") is None


def test_threads_keep_both_bounds():
    cache = BoundedLRU(50, max_bytes=50 * 3, size=len)
    errors = []

    def worker(offset: int) -> None:
        try:
            for i in range(2000):
                cache.put((offset, i % 80), "abc"[: 1 + i % 3])
                cache.get((offset, (i * 7) % 80))
                assert len(cache) <= 50
        except Exception as exc:  # reported below: an assertion in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    kept = [cache.get((t, i)) for t in range(6) for i in range(80)]
    assert len(cache) <= 50 and cache.nbytes == sum(len(v) for v in kept if v is not None) <= 150
