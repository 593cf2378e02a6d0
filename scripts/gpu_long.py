"""Long-context step of the GPU check (docs/science.md §10): smollm2-135m's first view at its whole context through the
API in this process, its peak device memory and window latency, and short first views as ratios to a raw forward on
the same device. Runs on a CPU too (with small --tokens) as a smoke test.

    python -m scripts.gpu_long [--long 8192] [--short 128 512] [--repeats 5] [--device auto] [--out FILE.json]

- long: POST /api/text/attention on --long tokens (one head's overview, f16, thumbnails), cache cleared before each
  repeat so the model runs; the peak device memory of that request (torch.cuda.max_memory_allocated, reset before);
  POST /api/runs/{id}/window of 512 × 512 and one row of every head (the retrieval view).
- short: the same first view at each --short length (exactly that many tokens, the adapter's own encoding, at most
  full_map_tokens so the run is a short one) against a raw forward of the model loaded with sdpa (no attention
  weights, float32 like the served model, the same token ids) on the same device, and the engine's run alone
  (adapter.run, no HTTP), interleaved, after warm-up; medians. Also what the cached run keeps on the device and on
  the host (a short run's P stays on the device), and the device → host synchronisations inside one forward
  (torch.cuda.set_sync_debug_mode: there should be none).
  Each short row also has `response_building`: the first view's response building alone (from the run's result to
  the response bytes) before/after the one-read change, interleaved, with op counts and (on a GPU) synchronisations;
  `--response-only` measures just that, on the model alone (no app, no raw model).
Targets (issue 20): long first view ≤ 1 s at 8,192 tokens; 512 tokens ≤ 1.5× raw; 128 tokens ≤ 1.3× raw.

--random-weights: the folder given by --weights holds smollm2-135m's config and tokenizer only; weights are drawn at
random (seeded) and saved there first. Timings do not depend on the weights' values; a device whose transfer limit
does not fit the 98 MB GGUF can still measure (say so next to the figures).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights" / "smollm2-135m"
WORDS = ("the river ran past the old mill and the miller kept a record of every sack of grain that the farmers "
         "brought in autumn while the children counted boats on the water").split()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device) -> float:
    """Seconds of fn(), the device's queued work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _text_of(tokenizer, n: int) -> str:
    """A text of about n tokens (Debian's GPL-3 text when present, else plain repeated words)."""
    source = Path("/usr/share/common-licenses/GPL-3")
    base = source.read_text() if source.is_file() else " ".join(WORDS)
    ids: list[int] = []
    while len(ids) < n + 8:
        ids += tokenizer(base)["input_ids"]
    return tokenizer.decode(ids[:n])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", "--tokens", dest="long", type=int, default=8192, help="tokens of the long input")
    parser.add_argument("--short", type=int, nargs="*", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine", action="store_true", help="the engine alone (no app, no fastapi): adapter runs")
    parser.add_argument("--weights", type=Path, default=WEIGHTS, help="the model folder (default: the prepared weights)")
    parser.add_argument("--block-rows", type=int, nargs="*", default=None,
                        help="engine mode: query rows per block to try on the long input (default: the engine's)")
    parser.add_argument("--random-weights", action="store_true",
                        help="--weights has config and tokenizer only: save seeded random weights there first")
    parser.add_argument("--short-repeats", type=int, default=15, help="interleaved repeats per short length")
    parser.add_argument("--response-only", action="store_true",
                        help="only the short first views' response building, before/after (no app, no raw model)")
    parser.add_argument("--response-repeats", type=int, default=15, help="interleaved repeats of the response building")
    args = parser.parse_args()
    if args.random_weights:
        random_weights(args.weights)
    if args.engine:
        engine(args)
        return
    if args.response_only:
        response_only(args)
        return

    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.main import create_app
    from app.settings import Settings

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    import transformers

    if args.weights.name != "smollm2-135m":
        sys.exit("--weights must be a folder named smollm2-135m (the registry's model folder)")
    settings = Settings(default_models=["smollm2-135m"], device=device.type, max_tokens=max(args.long, 512) + 64,
                        max_tokens_gpu=max(args.long, 512) + 64, max_run_bytes=64 << 30, result_cache_bytes=16 << 30,
                        request_timeout_s=3600, max_text_chars=10**7, weights_dir=str(args.weights.parent),
                        expose_timings=True)  # Server-Timing: where a first view's time goes (model run, whole app)
    tokenizer = AutoTokenizer.from_pretrained(args.weights)
    raw = AutoModelForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa", dtype=torch.float32).eval().to(device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "long_tokens": args.long,
                    "random_weights": args.random_weights}
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.runtime
        runtime.warm_up()
        import threading

        for thread in threading.enumerate():  # the app's own warm-up (the text page's example) must not overlap timings
            if thread.name == "warm-up":
                thread.join(timeout=120)
        server_timings: list[dict[str, float]] = []
        adapter = runtime.adapter("smollm2-135m")

        def first_view(text: str, long: bool) -> tuple[float, dict, int]:
            runtime.cache.clear()
            # one head's maps, as the page's first view asks (all 270 heads of P at 128 tokens are over max_response_numbers)
            body = {"model": "smollm2-135m", "text": text, "encoding": "f16", "thumbnail_size": 24, "layers": [0], "heads": [0]}
            _sync(device)
            start = time.perf_counter()
            response = client.post("/api/text/attention", json=body)
            _sync(device)
            elapsed = time.perf_counter() - start
            if response.status_code != 200:
                sys.exit(f"first view failed: {response.status_code} {response.text[:400]}")
            parts = (part.split(";dur=") for part in response.headers.get("server-timing", "").split(", ") if ";dur=" in part)
            server_timings.append({name: float(ms) / 1000 for name, ms in parts})
            return elapsed, response.json(), len(response.content)

        def raw_forward(ids: torch.Tensor) -> float:
            _sync(device)
            start = time.perf_counter()
            with torch.inference_mode():
                raw(input_ids=ids, logits_to_keep=1)
            _sync(device)
            return time.perf_counter() - start

        def engine_run(encoded) -> float:
            _sync(device)
            start = time.perf_counter()
            adapter.run(encoded)
            _sync(device)
            return time.perf_counter() - start

        # short inputs (≤ full_map_tokens): the first view and the engine's run as ratios to a raw forward, interleaved
        report["short"] = []
        for n in args.short:
            text, encoded = _short_text(adapter, tokenizer, min(n, adapter.full_map_tokens))
            ids = encoded.inputs["input_ids"].to(device)  # the same token ids the first view runs
            for _ in range(3):  # warm-up (allocator, kernels, tokenizer caches), not timed
                first_view(text, False), engine_run(encoded), raw_forward(ids)
            views, engines, raws = [], [], []
            server_timings.clear()
            for _ in range(args.short_repeats):
                views.append(first_view(text, False)[0])
                engines.append(engine_run(encoded))
                raws.append(raw_forward(ids))
            model_s = statistics.median(t.get("model", float("nan")) for t in server_timings)
            app_s = statistics.median(t.get("app", float("nan")) for t in server_timings)
            _, body, size = first_view(text, False)
            kept = runtime.get_run(body["run_id"])
            view, engine_s, base = (statistics.median(x) for x in (views, engines, raws))
            report["short"].append({
                "tokens": ids.shape[1], "long_path": body["attention"] is None, "first_view_s": view,
                "engine_run_s": engine_s, "raw_forward_s": base, "ratio": view / base, "engine_ratio": engine_s / base,
                # each first view over the raw forward run right after it: robust to the host's drifting launch speed
                "pair_ratio_median": statistics.median(v / r for v, r in zip(views, raws)),
                "server_model_s": model_s, "server_app_s": app_s,
                "first_view_all_s": views, "raw_all_s": raws, "first_view_bytes": size,
                "kept_device_bytes": kept.device_nbytes, "kept_host_bytes": kept.nbytes - kept.device_nbytes,
                "p_on": str(kept.kept_attention.device), "host_copy_of_p": "_host_attention" in kept.__dict__,
                "syncs_in_forward": _syncs_in_forward(adapter, encoded, device),
                **rebuild_cost(kept, device),
                # from the run's result to the response bytes, before/after the batched read (below)
                "response_building": response_building(adapter, text, encoded, device, args.response_repeats),
            })
            row = {k: v for k, v in report["short"][-1].items() if not k.endswith("_all_s")}
            row["response_building"] = {k: v for k, v in row["response_building"].items() if not k.endswith("_all_ms")}
            print(json.dumps(row), flush=True)
            if args.out:  # each section as it ends: a later failure keeps what was measured
                args.out.write_text(json.dumps(report, indent=2) + "\n")

        # the long input: first view, peak device memory, windows
        text = _text_of(tokenizer, args.long)
        ids = torch.tensor([tokenizer(text)["input_ids"]], device=device)
        raw_forward(ids)  # warm-up at this length
        raw_long = statistics.median(raw_forward(ids) for _ in range(3))
        times, body, size = [], None, 0
        for _ in range(max(1, min(args.repeats, 3))):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base_memory = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            elapsed, body, size = first_view(text, True)
            times.append(elapsed)
        peak = torch.cuda.max_memory_allocated() - base_memory if device.type == "cuda" else None
        run_id, n = body["run_id"], len(body["tokens"])
        side = min(512, n)
        windows, rows = [], []
        for i in range(5):
            r0 = (i * 997) % max(1, n - side + 1)
            _sync(device)
            start = time.perf_counter()
            window = client.post(f"/api/runs/{run_id}/window", json={
                "layer": i % adapter.info.layers, "head": i % adapter.info.heads, "rows": [r0, r0 + side],
                "cols": [max(0, r0 + side - side), r0 + side], "encoding": "f16"})
            windows.append(time.perf_counter() - start)
            if window.status_code != 200:
                sys.exit(f"window failed: {window.status_code} {window.text[:400]}")
            start = time.perf_counter()
            row = client.post(f"/api/runs/{run_id}/row", json={"row": n - 1, "span": [0, 64], "include_row": False})
            rows.append(time.perf_counter() - start)
            if row.status_code != 200:
                sys.exit(f"row failed: {row.status_code} {row.text[:400]}")
        long_encoded = adapter.encode(text)
        report["long"] = {
            "syncs_in_forward": _syncs_in_forward(adapter, long_encoded, device) if n <= 8192 else None,
            "tokens": n, "long_path": body["attention"] is None, "first_view_s": min(times), "first_view_all_s": times,
            "raw_forward_s": raw_long, "first_view_bytes": size,
            "peak_device_memory_bytes": peak, "window_512_ms": 1000 * statistics.median(windows),
            "row_span_mass_all_heads_ms": 1000 * statistics.median(rows),
            "all_of_p_bytes": adapter.info.layers * adapter.info.heads * n * n * 4,
        }
        print(json.dumps(report["long"]), flush=True)
    report["targets"] = {
        "long_first_view_le_1s": report["long"]["first_view_s"] <= 1.0,
        **{f"short_{r['tokens']}_ratio": r["ratio"] for r in report["short"]},
    }
    print(json.dumps(report["targets"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _short_text(adapter, tokenizer, n: int):
    """A text the adapter encodes into exactly n tokens (or as close below as decoding allows), and its encoding."""
    text = _text_of(tokenizer, n)
    encoded = adapter.encode(text)
    trim = n
    while len(encoded.tokens) > n and trim > 1:  # decode + encode can merge or split a token at the cut
        trim -= 1
        text = _text_of(tokenizer, trim)
        encoded = adapter.encode(text)
    return text, encoded


def _syncs_in_forward(adapter, encoded, device: torch.device) -> int | None:
    """Device → host synchronisations during one recorded forward (the model call only, not the result's copies):
    torch.cuda.set_sync_debug_mode("warn") warns at each. None on a CPU."""
    import warnings

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            adapter._forward({**encoded.inputs, "logits_to_keep": 1}, (), False, encoded)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    for w in syncs[:5]:
        print(f"sync in the forward: {w.filename}:{w.lineno}: {str(w.message)[:120]}", flush=True)
    return len(syncs)


def rebuild_cost(kept, device: torch.device) -> dict:
    """What keeping q̂/k̂ instead of P would cost a short run (issue 20's question): their bytes against P's, and the
    time to rebuild all of P from them (thumbnails, the mean distance and the effects' TV need every head's map)."""
    from models.atlas import full_rows

    attention = kept.kept_attention  # (L, H, T, T)
    n_layers, n_heads, n_tokens = attention.shape[:3]
    records = [kept.atlas.record(layer) for layer in range(n_layers)]

    def rebuild() -> torch.Tensor:
        return torch.stack([full_rows(record, list(range(n_heads)), 0, n_tokens) for record in records])

    error = float((rebuild() - attention).abs().max())
    times = []
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        rebuild()
        _sync(device)
        times.append(time.perf_counter() - start)
    qk = sum(t.numel() * t.element_size() for r in records for t in (r.queries, r.keys))
    return {"p_bytes": attention.numel() * attention.element_size(), "qk_bytes": qk,
            "rebuild_all_p_s": statistics.median(times), "rebuild_max_abs_error": error}


# ---- response building: from a short run's result to the response bytes (issue 20: the last ≈ 7 ms on the GPU) ------
def _previous_pooling_matrix(n: int, size: int) -> torch.Tensor:
    """app/attention.pooling_matrix before the batched read (a loop on the host, then copied to the device)."""
    matrix = torch.zeros(size, n)
    for i in range(size):
        start, end = (i * n) // size, -((-(i + 1) * n) // size)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def _previous_thumbnails(attention: torch.Tensor, size: int) -> dict:
    """app/attention.thumbnails before the batched read: `max` and the levels each read on their own."""
    import base64

    pooled = attention
    if attention.shape[-1] > size:
        pool = _previous_pooling_matrix(attention.shape[-1], size).to(attention.device)  # (size, T)
        pooled = pool @ attention @ pool.T  # (L, H, size, size)
    peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)  # (L, H)
    levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)
    return {"dtype": "uint8", "shape": list(levels.shape), "max": peak.tolist(),
            "data": base64.b64encode(levels.cpu().numpy().tobytes()).decode("ascii")}


def _previous_output_summary(adapter, result, encoded, final_hidden) -> dict:
    """The next-token panel before it joined the one read: the host copy of the final hidden row copied back to the
    device, the head applied, the float64 logits read to the host, softmax and top-k there."""
    from models.adapters.causal_lm import TOP_K

    position = encoded.extra["position"]
    with torch.inference_mode():
        logits = adapter._logits(final_hidden[position])  # (V,)
    probs = torch.softmax(logits.double().cpu(), dim=-1)
    top = torch.topk(probs, min(TOP_K, probs.numel()))
    return {"kind": "next_token", "position": position, "top": [
        {"token": adapter.token_text(int(i)), "id": int(i), "prob": float(p)} for p, i in zip(top.values, top.indices)]}


def previous_run_end(result) -> tuple[list[str], torch.Tensor]:
    """The reads a short run made as it ended before they joined the response's one read (2026-11-26): its entropy
    (.tolist()), its dead-row counts (the warnings) and its output (the final hidden states, .cpu()). Returns
    (warnings, the final hidden states on the host)."""
    if isinstance(result.derived.get("entropy"), torch.Tensor):
        result.derived["entropy"] = result.derived["entropy"].tolist()
    return list(result.warnings), result.output["final_hidden"].cpu()


def previous_short_response(adapter, encoded, req, result, layers: list[int], heads: list[int]) -> dict:
    """A text first view of a short run as app/attention.py built it before the batched read (2026-11-26), field by
    field, each a device → host read of its own (the map, the thumbnails' max and levels, received, the mean distance;
    the output panel's), after the run's own reads as it ended (previous_run_end). Kept here only to measure the
    change against it; the product has only the new path."""
    from app.encoding import tensor_field
    from models.interventions import row_entropy

    warnings, final_hidden = previous_run_end(result)
    kept = result.kept_attention

    def sliced(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[layers][:, heads][:, :, slice(None)]  # (l, h, q, T)

    return {
        "model": adapter.info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layers": layers,
        "heads": heads, "native_beta": adapter.info.native_beta,
        "attention": tensor_field(sliced(kept), req.encoding), "scores": None, "base_attention": None,
        "entropy": result.summary("entropy", lambda: row_entropy(kept).mean(dim=-1).tolist()),
        "output": _previous_output_summary(adapter, result, encoded, final_hidden),
        "thumbnails": result.summary(f"thumbnails{req.thumbnail_size}", lambda: _previous_thumbnails(kept, req.thumbnail_size)),
        "effect": None, "warnings": warnings, "elapsed_s": None, "run_id": result.run_id, "overview": None,
        "received": tensor_field(kept[layers][:, heads].mean(dim=2), req.encoding),
        "mean_distance": result.summary("mean_distance", lambda: _previous_mean_token_distance(kept).tolist()),
    }


def _previous_mean_token_distance(attention: torch.Tensor) -> torch.Tensor:
    """models.summaries.mean_token_distance before |i − j| was kept per length: formed at every call."""
    from models.summaries import _weighted_row_sums

    positions = torch.arange(attention.shape[-1], dtype=torch.float32, device=attention.device)
    distances = (positions[:, None] - positions[None, :]).abs()  # (T, T)
    return _weighted_row_sums(attention.float(), distances).mean(dim=-1).float()  # (L, H)


def response_building(adapter, text: str, encoded, device: torch.device, repeats: int) -> dict:
    """A short first view's response building alone, from the run's result to the response bytes (the page's first
    view: one head's map in f16, thumbnails 24 of every head, summaries, the output panel, JSON), before (the
    previous per-field reads, above) and after (app/pipeline/views.short_response), interleaved; each starts from the
    run's own summaries (a fresh run). Also each path's op count (torch.profiler: aten ops, top-level ones; on a GPU
    the kernel launches and memcpy calls) and on a GPU its device → host synchronisations (set_sync_debug_mode).
    Both paths should give the same bytes (`same_bytes`; tests/unit/test_response_building.py checks it on a CPU)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from app.encoding import fast_json
    from app.pipeline.job import PlainJob
    from app.pipeline.maps import ShortMaps
    from app.pipeline.views import short_response
    from models.families import family_named
    from models.head_ops import HeadRun
    from app.pipeline.views import text_fields
    from app.schemas import TextAttentionRequest

    layers, heads = [0], [0]
    req = TextAttentionRequest(model="smollm2-135m", text=text, encoding="f16", thumbnail_size=24, layers=layers, heads=heads)
    result = adapter.run(encoded)
    # what a new run carries (its entropy on the device, its dead-row counts not yet read): every build starts from it
    fresh = dict(result.derived), list(result.__dict__["_warnings"]), result.__dict__.get("_pending_dead_rows")

    def restore() -> None:
        result.derived, result.__dict__["_warnings"] = dict(fresh[0]), list(fresh[1])
        if fresh[2] is not None:
            result.__dict__["_pending_dead_rows"] = fresh[2]

    def new() -> bytes:
        restore()
        job = PlainJob(None, adapter, encoded, req, family_named("causal_lm"), layers, heads, (), False, HeadRun(),
                       page_fields=text_fields)  # P weighting over these layers/heads: no runtime needed
        response = short_response(job, result, ShortMaps(job, result, None))
        response.update(effect=None, warnings=list(result.warnings), elapsed_s=None)  # as app/pipeline/views.plain_view
        return fast_json(response).body

    def old() -> bytes:
        restore()
        return fast_json(previous_short_response(adapter, encoded, req, result, layers, heads)).body

    same_bytes = new() == old()  # on a CPU they are (tests/unit/test_response_building.py); said, not fatal, here
    if not same_bytes:
        print("response building: the previous and the new path gave different bytes", flush=True)

    timed = partial(_timed, device=device)

    for _ in range(3):  # warm-up (the new path's pooling matrix and distances are kept per length and device)
        new(), old()
    news, olds = [], []
    for _ in range(repeats):
        news.append(timed(new))
        olds.append(timed(old))

    def counts(fn) -> dict:
        try:
            return _counts(fn)
        except Exception as exc:  # noqa: BLE001 - a profiler that fails on some host must not end the timings' run
            return {"error": repr(exc)[:300]}

    def _counts(fn) -> dict:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            fn()
            _sync(device)
        events = prof.events()
        aten = [e for e in events if e.name.startswith("aten::")]
        # ops that do work on data (about a kernel each on a GPU): the innermost aten ops that are not views, metadata,
        # allocations or composites (matmul → mm/bmm)
        composite = {"view", "reshape", "_reshape_alias", "as_strided", "as_strided_", "select", "slice", "unsqueeze",
                     "squeeze", "squeeze_", "expand", "permute", "transpose", "t", "mT", "alias", "detach", "detach_",
                     "lift", "lift_fresh", "resolve_conj", "resolve_neg", "empty", "empty_strided", "empty_like",
                     "unbind", "numpy_T", "_unsafe_view", "to", "_to_copy", "contiguous", "clone", "item",
                     "_local_scalar_dense", "split", "narrow", "view_as", "resize_", "zeros", "matmul", "einsum",
                     "linear", "flatten"}

        def does_work(event) -> bool:
            return event.name.startswith("aten::") and event.name[6:] not in composite

        def innermost(event) -> bool:
            return not any(does_work(c) or not innermost(c) for c in event.cpu_children)

        out = {"aten_ops": len(aten),
               "aten_top_level_ops": sum(e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::") for e in aten),
               "data_ops": sum(does_work(e) and innermost(e) for e in aten)}
        if device.type == "cuda":
            out["kernel_launches"] = sum(e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                    "cuLaunchKernelEx") for e in events)
            out["memcpy_calls"] = sum(e.name.startswith(("cudaMemcpy", "cuMemcpy")) for e in events)
            out["synchronize_calls"] = sum("Synchronize" in e.name for e in events)
        if device.type == "cuda":  # device → host synchronisations as torch's sync debug mode sees them
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        return out

    new_s, old_s = statistics.median(news), statistics.median(olds)
    return {"tokens": len(encoded.tokens), "response_before_ms": 1000 * old_s, "response_after_ms": 1000 * new_s,
            "response_after_over_before": new_s / old_s,
            "response_pair_ratio_median": statistics.median(n / o for n, o in zip(news, olds)),
            "response_before_all_ms": [1000 * t for t in olds], "response_after_all_ms": [1000 * t for t in news],
            "response_bytes": len(new()), "same_bytes": same_bytes, "counts_before": counts(old), "counts_after": counts(new)}


def response_only(args) -> None:
    """--response-only: response_building at each --short length on the model alone (CausalLMAdapter, no app)."""
    from transformers import AutoTokenizer

    from models.adapters.causal_lm import CausalLMAdapter

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.weights)
    adapter = CausalLMAdapter("smollm2-135m", str(args.weights), max_tokens=max(args.short) + 64, device=device.type)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "mode": "response",
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "random_weights": args.random_weights,
                    "short": []}
    for n in args.short:
        text, encoded = _short_text(adapter, tokenizer, min(n, adapter.full_map_tokens))
        report["short"].append(response_building(adapter, text, encoded, device, args.response_repeats))
        print(json.dumps({k: v for k, v in report["short"][-1].items() if not k.endswith("_all_ms")}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")


def random_weights(folder: Path) -> None:
    """Seeded random weights for the model whose config and tokenizer are in `folder` (float32 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "model.safetensors").is_file():
        return
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    print(f"random weights saved in {folder}", flush=True)


def engine(args) -> None:
    """The same measures on the engine alone: CausalLMAdapter.run (blockwise over full_map_tokens=512) against a raw
    sdpa forward, on --weights; for hosts without the app's dependencies."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.adapters.base import Encoded
    from models.adapters.causal_lm import CausalLMAdapter
    from models.atlas import window

    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.weights)
    adapter = CausalLMAdapter("smollm2-135m", str(args.weights), max_tokens=args.long, device=device.type)
    # float32 like the served model (smollm2's config says bfloat16, which transformers would otherwise load)
    raw = AutoModelForCausalLM.from_pretrained(args.weights, attn_implementation="sdpa", dtype=torch.float32).eval().to(device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "mode": "engine"}

    def encoded_of(n: int) -> Encoded:
        ids = torch.tensor([tokenizer(_text_of(tokenizer, n))["input_ids"][:n]])
        return Encoded(key=("gpu_long", n), tokens=["t"] * ids.shape[1],
                       inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, extra={"position": ids.shape[1] - 1})

    timed = partial(_timed, device=device)

    def raw_forward(ids):
        with torch.inference_mode():
            raw(input_ids=ids.to(device), logits_to_keep=1)

    report["short"] = []
    for n in args.short:
        enc = encoded_of(n)
        timed(lambda: adapter.run(enc)), timed(lambda: raw_forward(enc.inputs["input_ids"]))
        views = [timed(lambda: adapter.run(enc)) for _ in range(args.repeats)]
        raws = [timed(lambda: raw_forward(enc.inputs["input_ids"])) for _ in range(args.repeats)]
        report["short"].append({"tokens": n, "run_s": statistics.median(views), "raw_forward_s": statistics.median(raws),
                                "ratio": statistics.median(views) / statistics.median(raws)})
        print(json.dumps(report["short"][-1]), flush=True)
    enc = encoded_of(args.long)
    timed(lambda: raw_forward(enc.inputs["input_ids"]))  # warm-up at this length
    raw_s = statistics.median([timed(lambda: raw_forward(enc.inputs["input_ids"])) for _ in range(3)])
    report["long"] = []
    for block_rows in args.block_rows or [adapter.atlas_config.block_rows]:
        adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=block_rows)
        times, holder = [], {}
        for _ in range(max(1, min(args.repeats, 3))):
            holder.clear()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            times.append(timed(lambda: holder.update(r=adapter.run(enc))))
        result = holder["r"]
        peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
        n = len(enc.tokens)
        side = min(512, n)
        windows = [timed(lambda i=i: window(result.atlas.record(i % adapter.info.layers), i % adapter.info.heads,
                                            (n - side, n), (n - side, n)).cpu()) for i in range(5)]
        report["long"].append({"tokens": n, "block_rows": block_rows, "long_path": result.is_long, "run_s": min(times),
                               "all_s": times, "raw_forward_s": raw_s, "ratio": min(times) / raw_s,
                               "peak_device_memory_bytes": peak, "kept_bytes": result.atlas.nbytes,
                               "window_512_ms": 1000 * statistics.median(windows)})
        print(json.dumps(report["long"][-1]), flush=True)
        del result, holder
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    _ = dataclasses


if __name__ == "__main__":
    main()
