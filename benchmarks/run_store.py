"""The run store (app/runstore.py, issue 36 §1): the page's order on one process, and the disk tier's cost per window.

Three parts:

- `page_order`: a fresh `python -m app.serve` with default settings (from `--root`, default this checkout: point it at
  an export of an older commit to measure "before"), then the text page's own order on the long sample
  (static/samples/long-sample.txt, smollm2-135m): its first view streamed as a job, then a compare with mask_keys on
  three early tokens, streamed. Reported: the compare's accepted `runs` and the largest progress `total` it sent (a
  total over runs × 30 layers means a run was computed twice), `/api/jobs` kept bytes, and how many of 10 windows of
  each run (the intervened `run_id`, the `base_run_id`, and `minus` windows) answer right after `done` and 60 s later.
- `disk_window`: in one process, a long run of smollm2-135m (the same sample) put into two run stores whose RAM tiers
  are too small for it, so it lives on disk in both: the store of BEFORE (a torch.save file, read with
  torch.load(mmap=True)) and today's (a safetensors file, app/runfile.py): the time to write it, its file size, and
  the time of a window (40 × 40 and 128 × 512, exact, from q̂/k̂, with its rows' entropy over every key: what POST
  /api/runs/{id}/window computes) from RAM and from each file: a first read (the file mapped afresh, its pages dropped
  from the page cache with posix_fadvise) and warm reads, interleaved RAM / before / after so that the machine's load
  weighs on all alike.
- `fresh_view`: fresh 128-token views of smollm2-135m with the RAM tier full, before and after interleaved: the time
  in the request's thread of the run and of put + make_room (before: the leaving run written there; after: queued for
  the writer thread).

Writes benchmarks/results/run_store.md (figures) and run_store.json (raw).

    .venv/bin/python -m benchmarks.run_store [--parts page_order,disk_window,fresh_view] [--root DIR] [--label before]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import served

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = (ROOT / "static" / "samples" / "long-sample.txt").read_text().rstrip()
MASKED = [1, 2, 3]  # "a few early tokens"
WINDOWS = [(layer, head, r0) for layer, head, r0 in
           [(0, 0, 100), (3, 1, 400), (6, 2, 700), (9, 3, 1000), (12, 4, 1300), (15, 5, 1600), (18, 6, 1900),
            (21, 7, 2200), (24, 8, 2500), (29, 0, 2800)]]


@contextlib.contextmanager
def server(root: Path, env: dict[str, str] | None = None, ready_s: float = 600):
    """`python -m app.serve` from `root` with default settings (+ env) on a free loopback port (benchmarks/served.py)."""
    with served.server(env, tree=root, log=ROOT / "benchmarks" / "results" / "run_store-server.log",
                       ready_s=ready_s) as running:
        yield running


def page_body(interventions: list[dict]) -> dict:
    """What static/js/text.js request() sends for the long sample on smollm2-135m (layer 0, head 0, thumbnails)."""
    compare = bool(interventions)
    return {"model": "smollm2-135m", "text": SAMPLE, "layers": [0], "heads": [0], "include_scores": True,
            "interventions": interventions, "compare": compare, "include_base": compare, "samples": 1,
            "thumbnail_size": 24, "encoding": "f32", "position": None, "chat": False}


def job(base: str, body: dict, client: str) -> dict:
    """One streamed request: its accepted event, the largest progress total, the final event and the real time."""
    started, out, totals = time.time(), {}, set()
    for _, event in served.job_events(base, "/api/text/attention", body, client, 1200, out):
        if event.get("accepted"):
            out["accepted"] = {k: event.get(k) for k in ("runs", "eta_s", "queue_position")}
        if "total" in event:
            totals.add(event["total"])
        if "done" in event or "error" in event:
            out["final"] = event
    out["real_s"], out["totals"] = round(time.time() - started, 2), sorted(totals)
    return out


def windows(base: str, run_id: str, client: str, minus: str | None = None) -> dict:
    """10 windows (40 × 40 near the diagonal) of a run: how many answer, their statuses' details, the times."""
    answered, details, times = 0, [], []
    for layer, head, r0 in WINDOWS:
        body = {"layer": layer, "head": head, "rows": [r0, r0 + 40], "cols": [r0 - 20, r0 + 20], "minus": minus}
        started = time.perf_counter()
        response = httpx.post(f"{base}/api/runs/{run_id}/window", json=body, headers={"X-Attnlab-Client": client},
                              timeout=120)
        times.append(time.perf_counter() - started)
        if response.status_code == 200:
            answered += 1
        else:
            details.append(f"{response.status_code}: {response.text[:160]}")
    return {"answered": answered, "of": len(WINDOWS), "median_s": round(statistics.median(times), 4),
            "details": sorted(set(details))}


def part_page_order(root: Path, env: dict[str, str]) -> dict:
    client = "page-order"
    with server(root, env) as (base, _proc):
        first = job(base, page_body([]), client)
        compare = job(base, page_body([{"op": "mask_keys", "tokens": MASKED}]), client)
        out = {"first_view": {k: v for k, v in first.items() if k != "final"},
               "compare": {k: v for k, v in compare.items() if k != "final"}}
        final = compare.get("final") or {}
        run, base_run = final.get("run_id"), final.get("base_run_id")
        out["tokens"] = len(final.get("tokens") or [])
        out["kept"] = httpx.get(f"{base}/api/jobs", timeout=30).json().get("memory")
        if run and base_run:
            for when in ("at_done", "after_60s"):
                if when == "after_60s":
                    time.sleep(60 - min(60.0, sum(w["median_s"] * 10 for w in out["at_done"].values())))
                out[when] = {"run_id": windows(base, run, client), "base_run_id": windows(base, base_run, client),
                             "minus": windows(base, run, client, minus=base_run)}
        else:
            out["error"] = {k: final.get(k) for k in ("error", "status")} or compare.get("detail")
    return out


def _time(fn, repeat: int) -> float:
    best = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best.append(time.perf_counter() - started)
    return statistics.median(best)


def _drop_file_pages(path: Path) -> bool:
    """This file's pages out of the page cache (posix_fadvise DONTNEED; only this file, nobody else's)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


BEFORE = "faf6c2c"  # the run store before the safetensors files and the writer thread (torch.save / torch.load)


def _store_before():
    """ResultCache as of BEFORE (app/runstore.py from git: torch.save in the thread that puts, torch.load(mmap=True)),
    loaded beside today's so that both run interleaved in one process on the same run."""
    import importlib.util
    import tempfile

    source = subprocess.run(["git", "show", f"{BEFORE}:app/runstore.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="runstore-before-")) / "runstore_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("runstore_before", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ResultCache


def part_disk_window() -> dict:
    import torch

    from app.runstore import ResultCache
    from models.adapters.causal_lm import CausalLMAdapter
    from models.atlas import full_row_entropy, window

    torch.set_num_threads(2)
    adapter = CausalLMAdapter("smollm2-135m", str(ROOT / "weights" / "smollm2-135m"), max_tokens=4096, device="cpu")
    adapter.full_map_tokens = 512  # the default: the sample (2,932 tokens) is a long run, q̂/k̂ and summaries kept
    encoded = adapter.encode(SAMPLE)
    result = adapter.run(encoded)
    result.run_id, result.model_id = "bench.run", "smollm2-135m"
    stores, out = {}, {"tokens": len(encoded.tokens), "kept_bytes": result.nbytes, "formats": {}}
    for name, store_class in (("before", _store_before()), ("after", ResultCache)):
        store = stores[name] = store_class(max_items=8, max_bytes=1, pin_s=600, disk_bytes=4 * 2**30)
        started = time.perf_counter()
        store.put(("k",), result, "bench")  # larger than the RAM tier: written to disk
        put_s = time.perf_counter() - started
        if hasattr(store, "flush"):
            store.flush()
        out["formats"][name] = {"put_s": round(put_s, 3), "written_s": round(time.perf_counter() - started, 3),
                                "file_bytes": store.disk_bytes,
                                "file": next(iter(store._disk.values())).path.suffix}
    n = len(encoded.tokens)
    cases = {"40x40": ((n // 2, n // 2 + 40), (n // 2 - 20, n // 2 + 20)), "128x512": ((n - 128, n), (n - 512, n))}

    def one(run, rows, cols):  # what POST /api/runs/{id}/window computes: the window and its rows' entropy
        record = run.atlas.record(15)
        window(record, 3, rows, cols, None)
        full_row_entropy(record, [3], rows[0], rows[1], None, 128)

    out["windows"] = {}
    for case, (rows, cols) in cases.items():
        cold = {name: [] for name in stores}
        for _ in range(5):  # a first read each time, interleaved: mapped afresh, its pages out of the page cache
            for name, store in stores.items():
                entry = next(iter(store._disk.values()))
                dropped = _drop_file_pages(entry.path)
                started = time.perf_counter()
                one(type(store)._load(entry.path), rows, cols)
                cold[name].append(time.perf_counter() - started)
        mapped = {name: store.by_run_id("bench.run") for name, store in stores.items()}
        for run in (result, *mapped.values()):
            one(run, rows, cols)  # the records built once on each (a short run's are lazy)
        warm = {"ram": [], **{name: [] for name in stores}}
        for _ in range(15):  # interleaved: RAM, before's file, after's file, RAM, ...
            warm["ram"].append(_time(lambda: one(result, rows, cols), 1))
            for name, run in mapped.items():
                warm[name].append(_time(lambda run=run: one(run, rows, cols), 1))
        out["windows"][case] = {"ram_ms": round(1000 * statistics.median(warm["ram"]), 2),
                                **{f"{name}_mapped_ms": round(1000 * statistics.median(warm[name]), 2) for name in stores},
                                **{f"{name}_first_read_ms": round(1000 * statistics.median(cold[name]), 2)
                                   for name in stores},
                                "page_cache_dropped": dropped}
    for store in stores.values():
        store.close()
    return out


def part_fresh_view(rounds: int = 12, tokens: int = 128) -> dict:
    """A fresh 128-token view of smollm2-135m with the run store's RAM tier full (max_items runs kept, so each new run
    makes the least recent one leave for disk): the time in the request's thread of the run and of put + make_room,
    before (the store of BEFORE: the leaving run written there) and after (queued for the writer), interleaved. After
    each round the writer is waited for (flush, untimed) so that its work does not fall into the next round's
    times; its write time is reported apart."""
    import torch

    from app.runstore import ResultCache
    from models.adapters.causal_lm import CausalLMAdapter

    torch.set_num_threads(2)
    adapter = CausalLMAdapter("smollm2-135m", str(ROOT / "weights" / "smollm2-135m"), max_tokens=4096, device="cpu")
    ids = adapter.encode(SAMPLE).inputs["input_ids"][0].tolist()
    kept = 4
    stores = {name: cls(max_items=kept, max_bytes=2**34, pin_s=120, disk_bytes=2**34)
              for name, cls in (("before", _store_before()), ("after", ResultCache))}
    times = {name: {"run_ms": [], "put_ms": [], "write_ms": []} for name in stores}
    views = 0
    for round_ in range(kept + rounds):
        for name, store in stores.items():
            encoded = adapter.encode_ids(ids[views * 7 % (len(ids) - tokens):][:tokens])  # a new input each time
            views += 1
            started = time.perf_counter()
            result = adapter.run(encoded)
            ran = time.perf_counter()
            result.run_id, result.model_id = f"{name}.{views}", "smollm2-135m"
            store.put(("k", views), result, "bench", make_room=False)
            store.make_room(keep=("k", views))  # as app/runtime.py does, in the request's thread
            done = time.perf_counter()
            if hasattr(store, "flush"):
                store.flush()
            if round_ >= kept:  # the RAM tier is full from here on: every view makes a run leave
                times[name]["run_ms"].append(1000 * (ran - started))
                times[name]["put_ms"].append(1000 * (done - ran))
                times[name]["write_ms"].append(1000 * (time.perf_counter() - ran))
    out = {"tokens": tokens, "rounds": rounds, "run_bytes": result.nbytes,
           "spills": {name: store.spills for name, store in stores.items()}}
    for name, figures in times.items():
        out[name] = {key: round(statistics.median(values), 2) for key, values in figures.items()}
        out[name]["put_share_of_request"] = round(statistics.median(
            p / (r + p) for r, p in zip(figures["run_ms"], figures["put_ms"])), 4)
    for store in stores.values():
        store.close()
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{platform.node()}: {os.cpu_count()} cores ({cpu}), load {os.getloadavg()[0]:.1f}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="page_order,disk_window,fresh_view")
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree the server runs from")
    parser.add_argument("--label", default="after")
    parser.add_argument("--job-timeout-s", type=float, default=None,
                        help="job_timeout_s for the server (default: the default setting); on a machine under heavy "
                        "load the estimate may refuse the long sample, which says nothing about the run store")
    args = parser.parse_args()
    results_path = ROOT / "benchmarks" / "results" / "run_store.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for part in args.parts.split(","):
        started = time.time()
        env = {} if args.job_timeout_s is None else {"ATTNLAB_JOB_TIMEOUT_S": str(args.job_timeout_s)}
        parts = {"page_order": lambda: part_page_order(args.root, env), "disk_window": part_disk_window,
                 "fresh_view": part_fresh_view}
        figures = parts[part]()
        figures["settings"] = env or "defaults"
        figures["machine"], figures["wall_s"] = machine(), round(time.time() - started, 1)
        results[f"{part}:{args.label}"] = figures
        print(json.dumps({part: figures}, indent=1, default=str), flush=True)
        results_path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
