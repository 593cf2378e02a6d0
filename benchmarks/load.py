"""Load and soak test of the real server, on loopback only.

Starts `python -m app.serve` (uvicorn, default settings unless ATTNLAB_* are set) on 127.0.0.1 and a free
port, waits for /api/ready, then:

1. load: N concurrent clients (default 50) for D seconds (default 60), each posting text-attention
   requests back to back (fresh sentences and repeats, so both forwards and cache hits); only 200 and
   503 (+ Retry-After) are allowed; p50/p99 latency of admitted (200) requests, latency of rejections
   (503), server RSS before/after;
   At the same time (issue 12): `--stalled` clients (default 40) that send headers and a few body bytes
   and then stall (reconnecting after each 408), `--heavy` clients (default 2) asking for oversized work
   (image_size 1036 on dinov2-small → 413 max_image_tokens; 16 samples of a 512-token text), and a
   health probe every 100 ms: only 200/4xx/503 answers, health p99 < 100 ms, RSS sampled every second;
   Issue 19 (the second probe's mix): `--mixed` makes a share of each client's requests image uploads, model
   views and image attention, and short generate streams; `--header-flood` clients (default 1) send 16 MB
   header floods back to back (each must be a 431 after at most a few hundred KB); `--heavy-generate` clients
   (default 1) ask for a 64-intervention, 500-word, 64-token stream (refused 413 by the cost estimate, or ended
   by generate_timeout_s). Peak RSS must stay under the memory_budget_bytes setting, and the server's CPU must
   be idle within 2 s of the clients leaving (sampled every 0.1 s from /proc).
2. soak: M clients (default 8) for S seconds (default 300), RSS sampled every 5 s: drift between the
   first minute's mean and the last minute's mean must stay under 5 %, with no error.

Writes a Markdown report (default benchmarks/results/load.md) and the raw numbers as JSON beside it.
Every request loop is bounded in time; the server is stopped (SIGTERM, by PID) at the end.

    .venv/bin/python benchmarks/load.py [--clients 50 --duration 60 --soak 300 --soak-clients 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the a animal street cat dog tired because it was did not cross sat on mat rug river bank money "
    "bird flew over house quickly slowly red green small large old young teacher student book read "
    "wrote letter friend city night morning rain sun"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def idle_after(pid: int, limit_s: float = 20.0, window_s: float = 0.5, idle_share: float = 0.05) -> float | None:
    """Seconds from now until the server's CPU use over a `window_s` window falls under `idle_share` of a core."""
    started = time.monotonic()
    samples = [(0.0, cpu_seconds(pid))]
    while time.monotonic() - started < limit_s:
        time.sleep(0.1)
        now = time.monotonic() - started
        samples.append((now, cpu_seconds(pid)))
        older = [(t, c) for t, c in samples if t <= now - window_s]
        if older:
            t0, c0 = older[-1]
            if (samples[-1][1] - c0) / (now - t0) < idle_share:
                return round(max(0.0, t0), 2)
    return None


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def machine() -> dict:
    model = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), model)
    except OSError:
        pass
    import torch

    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 1) for x in os.getloadavg()],
    }


def make_request(rng: random.Random, repeat_pool: list[str]) -> dict:
    if rng.random() < 0.3:
        text = rng.choice(repeat_pool)  # a slider move / re-view of the same input: cache hit
    else:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))) + "."
    layer = rng.randrange(6)
    return {"text": text, "layers": [layer], "heads": [rng.randrange(12)], "encoding": rng.choice(["json", "f16"])}


MIXED: dict = {"image_id": None}  # the street photo's id, for the mixed clients' image requests


def mixed_request(rng: random.Random, repeat_pool: list[str]) -> tuple[str, str, dict]:
    """(method, path, body) of one request of the probe's mix: mostly text attention, some image work, a stream."""
    roll = rng.random()
    if MIXED["image_id"] and roll < 0.08:
        return "GET", f"/api/images/{MIXED['image_id']}/view?size={rng.choice([224, 448])}", {}
    if MIXED["image_id"] and roll < 0.16:
        return "POST", "/api/image/attention", {"model": "dinov2-small", "image_id": MIXED["image_id"],
                                                 "layers": [rng.randrange(12)], "heads": [rng.randrange(6)]}
    if roll < 0.22:
        return "UPLOAD", "/api/images", {}
    if roll < 0.28:
        return "POST", "/api/text/generate", {"model": "smollm2-135m", "max_new_tokens": 4,
                                              "text": " ".join(rng.choice(WORDS) for _ in range(10))}
    return "POST", "/api/text/attention", make_request(rng, repeat_pool)


def small_png(rng: random.Random) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(rng.randrange(10**6)).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


async def client_loop(client: httpx.AsyncClient, url: str, until: float, seed: int, log: dict, mixed: bool = False) -> None:
    rng = random.Random(seed)
    repeat_pool = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(4)]
    while time.monotonic() < until:
        method, path, body = mixed_request(rng, repeat_pool) if mixed else ("POST", url, make_request(rng, repeat_pool))
        started = time.perf_counter()
        try:
            if method == "GET":
                r = await client.get(path)
            elif method == "UPLOAD":
                r = await client.post(path, files={"file": ("x.png", small_png(rng), "image/png")})
            else:
                r = await client.post(path, json=body)
            if path != "/api/text/attention":  # only text attention counts towards the latencies below
                key = str(r.status_code)
                log["mixed"].setdefault(path.split("?")[0] if "/view" not in path else "/api/images/{id}/view", {})
                group = log["mixed"][path.split("?")[0] if "/view" not in path else "/api/images/{id}/view"]
                group[key] = group.get(key, 0) + 1
                if r.status_code == 200 and path.endswith("generate") and '"done": true' not in r.text:
                    # ended by an error event (a step that waited past request_timeout_s, generate_timeout_s)
                    kind = "200 error-event" if '"error"' in r.text else "200-without-done"
                    group[kind] = group.get(kind, 0) + 1
                continue
            elapsed = time.perf_counter() - started
            status = r.status_code
            if status == 503 and "retry-after" not in r.headers:
                status = "503-without-Retry-After"
            if status == 200:
                data = r.json()
                if not data.get("tokens"):
                    status = "200-without-tokens"
        except httpx.HTTPError as exc:
            elapsed, status = time.perf_counter() - started, f"transport:{type(exc).__name__}"
        log["statuses"][str(status)] = log["statuses"].get(str(status), 0) + 1
        if status == 200:
            log["ok"].append(elapsed)
        elif status == 503:
            log["rejected"].append(elapsed)
            await asyncio.sleep(0.05)  # a client would honour Retry-After; keep the pressure on anyway
        else:
            log["errors"].append(f"{status} after {elapsed:.3f}s")


async def stalled_loop(port: int, until: float, log: dict) -> None:
    """A client that announces a body, sends 10 bytes of it and stalls; after the server's 408 (or close)
    it does it again. Counts the answers it gets."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            key = f"connect:{type(exc).__name__}"
            log["stalled"][key] = log["stalled"].get(key, 0) + 1
            await asyncio.sleep(0.5)
            continue
        try:
            writer.write(b"POST /api/text/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"text\": \"")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout=max(0.1, until - time.monotonic()))
            key = line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.1 ") else "closed"
        except (asyncio.TimeoutError, OSError):
            key = "still-stalled-at-end" if time.monotonic() >= until - 0.2 else "error"
        finally:
            writer.close()
        log["stalled"][key] = log["stalled"].get(key, 0) + 1


async def heavy_loop(client: httpx.AsyncClient, until: float, image_id: str | None, log: dict) -> None:
    """Oversized work, back to back: a 1036-px dinov2-small request and 16 samples of a 512-token text."""
    rng = random.Random(99)
    while time.monotonic() < until:
        requests = [("/api/text/attention", {"text": " ".join(rng.choice(WORDS) for _ in range(600)), "compare": True,
                                             "samples": 16, "layers": [0], "heads": [0],
                                             "interventions": [{"op": "perturb_keys", "noise_std": 0.3,
                                                                "seed": rng.randrange(10**6)}]})]
        if image_id:
            requests.append(("/api/image/attention", {"model": "dinov2-small", "image_id": image_id, "image_size": 1036,
                                                      "layers": [0], "heads": [0]}))
        for path, body in requests:
            started = time.perf_counter()
            try:
                r = await client.post(path, json=body, timeout=120)
                key = f"{path} {r.status_code}"
            except httpx.HTTPError as exc:
                key = f"{path} transport:{type(exc).__name__}"
            log["heavy"].setdefault(key, []).append(round(time.perf_counter() - started, 3))
            if key.endswith(" 503"):
                await asyncio.sleep(1.0)


HEALTH_PROBE = """
import json, sys, time, httpx
base, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
out = {"latencies": [], "errors": []}
with httpx.Client(base_url=base, timeout=30) as client:
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            r = client.get("/api/health")
            out["latencies"].append(time.perf_counter() - started)
            if r.status_code != 200:
                out["errors"].append(r.status_code)
        except httpx.HTTPError as exc:
            out["errors"].append(type(exc).__name__)
        time.sleep(0.1)
print(json.dumps(out))
"""


async def header_flood_loop(port: int, until: float, log: dict) -> None:
    """GET /api/health with 16 MB of `X-A: b` header lines, back to back: each must be answered 431 after the
    server read a few hundred KB at most (the probe's 64 MB flood was answered 200 and cost ~1 GB of RSS)."""
    chunk = b"X-A: b\r\n" * 8192
    while time.monotonic() < until:
        sent = 0
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            answer = asyncio.ensure_future(reader.readline())  # read while flooding, as a client would
            try:
                while sent < 16 * 2**20 and not answer.done():
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), timeout=5)
                    sent += len(chunk)
            except (OSError, asyncio.TimeoutError):
                pass  # the server answered and closed
            line = await asyncio.wait_for(answer, timeout=10)
            key = line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.1 ") else "closed"
            writer.close()
        except (OSError, asyncio.TimeoutError) as exc:
            key = f"error:{type(exc).__name__}"
        log["header_flood"][key] = log["header_flood"].get(key, 0) + 1
        log["header_flood_sent_max"] = max(log.get("header_flood_sent_max", 0), sent)
        await asyncio.sleep(0.2)


async def heavy_generate_loop(client: httpx.AsyncClient, until: float, log: dict) -> None:
    """The probe's heavy stream: 64 interventions on a 500-word prompt, 64 new tokens (13 minutes a stream
    before): refused 413 by the cost estimate, or ended by generate_timeout_s with an error event."""
    rng = random.Random(7)
    while time.monotonic() < until:
        body = {"model": "smollm2-135m", "text": " ".join(rng.choice(WORDS) for _ in range(500)), "max_new_tokens": 64,
                "interventions": [{"op": "perturb_keys", "noise_std": 0.2, "seed": rng.randrange(10**6)}] * 64}
        started = time.perf_counter()
        try:
            r = await client.post("/api/text/generate", json=body, timeout=300)
            key = str(r.status_code)
            if r.status_code == 200:
                key += " error-event" if '"error"' in r.text else " done"
        except httpx.HTTPError as exc:
            key = f"transport:{type(exc).__name__}"
        log["heavy_generate"].setdefault(key, []).append(round(time.perf_counter() - started, 3))
        await asyncio.sleep(0.5)


async def health_loop(base: str, seconds: float, log: dict) -> None:
    """/api/health every 100 ms from a process of its own (like a container's health check): the load
    generator's event loop, busy with 90 clients, must not add its own delays to the figure."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", HEALTH_PROBE, base, str(seconds),
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    probe = json.loads(out or b'{"latencies": [], "errors": ["probe failed"]}')
    log["health"] += probe["latencies"]
    log["health_errors"] += probe["errors"]


async def _until_then_leave(coroutines, until: float) -> None:
    """Run the clients until `until`, then leave: requests still in flight (a long stream, a queued request) are
    abandoned, their connections closed, as the probe's clients did; the server must then stop their work."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    await asyncio.wait(tasks, timeout=max(0.0, until - time.monotonic()) + 0.5)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_phase(base: str, clients: int, seconds: float, pid: int, sample_every: float | None = None,
                    stalled: int = 0, heavy: int = 0, image_id: str | None = None, mixed: bool = False,
                    header_flood: int = 0, heavy_generate: int = 0) -> dict:
    log: dict = {"statuses": {}, "ok": [], "rejected": [], "errors": [], "rss": [], "stalled": {}, "heavy": {},
                 "health": [], "health_errors": [], "mixed": {}, "header_flood": {}, "heavy_generate": {}}
    MIXED["image_id"] = image_id
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def sampler():
            start = time.monotonic()
            while time.monotonic() < until:
                log["rss"].append((round(time.monotonic() - start, 1), rss_mb(pid)))
                await asyncio.sleep(sample_every)

        tasks = [client_loop(client, "/api/text/attention", until, seed, log, mixed) for seed in range(clients)]
        if sample_every:
            tasks.append(sampler())
        if stalled or heavy or header_flood or heavy_generate:
            port = int(base.rsplit(":", 1)[1])
            tasks += [stalled_loop(port, until, log) for _ in range(stalled)]
            tasks += [header_flood_loop(port, until, log) for _ in range(header_flood)]
            async with httpx.AsyncClient(base_url=base, timeout=120) as side:  # its own pool: not queued behind the load
                tasks += [heavy_loop(side, until, image_id, log) for _ in range(heavy)]
                tasks += [heavy_generate_loop(side, until, log) for _ in range(heavy_generate)]
                health = asyncio.ensure_future(health_loop(base, until - time.monotonic(), log))  # ends by itself
                started = time.monotonic()
                await _until_then_leave(tasks, until)
                log["wall_s"] = time.monotonic() - started
                await health
            return log
        started = time.monotonic()
        await asyncio.gather(*tasks)
        log["wall_s"] = time.monotonic() - started
    return log


def summary(log: dict) -> dict:
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    n = sum(log["statuses"].values())
    return {
        "requests": n,
        "statuses": log["statuses"],
        "throughput_rps": round(n / log["wall_s"], 1),
        "admitted_rps": round(len(log["ok"]) / log["wall_s"], 2),
        "admitted_p50_ms": ms(percentile(log["ok"], 0.5)),
        "admitted_p99_ms": ms(percentile(log["ok"], 0.99)),
        "rejected_p50_ms": ms(percentile(log["rejected"], 0.5)),
        "rejected_p99_ms": ms(percentile(log["rejected"], 0.99)),
        "errors": log["errors"][:20],
        "error_count": len(log["errors"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--soak", type=float, default=300)
    ap.add_argument("--soak-clients", type=int, default=8)
    ap.add_argument("--stalled", type=int, default=40, help="slow-body clients during the load phase")
    ap.add_argument("--heavy", type=int, default=2, help="oversized-work clients during the load phase")
    ap.add_argument("--mixed", action="store_true", help="the probe's mix: image uploads/views/attention, streams")
    ap.add_argument("--header-flood", type=int, default=1, help="16 MB header-flood clients during the load phase")
    ap.add_argument("--heavy-generate", type=int, default=1, help="64-intervention 500-word stream clients")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "load.md")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = open(args.out.with_suffix(".server.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
        cwd=ROOT, stdout=server_log, stderr=subprocess.STDOUT,
    )
    result: dict = {"machine": machine(), "settings": {}}
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit("server exited during start-up; see the server log")
            try:
                if httpx.get(base + "/api/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server not ready after 300 s")
            time.sleep(0.5)
        from app.settings import Settings

        s = Settings()
        result["settings"] = {"queue_depth": s.queue_depth, "request_timeout_s": s.request_timeout_s,
                              "torch_threads": s.torch_threads, "default_models": s.default_models,
                              "memory_budget_bytes": s.memory_budget_bytes, "result_cache_bytes": s.result_cache_bytes,
                              "image_cache_bytes": s.image_cache_bytes, "generate_timeout_s": s.generate_timeout_s}
        image_id = None
        if args.heavy or args.mixed:
            with open(ROOT / "static" / "samples" / "street.jpg", "rb") as f:
                up = httpx.post(base + "/api/images", files={"file": ("street.jpg", f, "image/jpeg")}, timeout=60)
            image_id = up.json().get("image_id") if up.status_code == 200 else None
        rss_before = rss_mb(server.pid)
        print(f"ready; RSS {rss_before:.0f} MB; load: {args.clients} clients × {args.duration:.0f} s "
              f"+ {args.stalled} stalled + {args.heavy} heavy", flush=True)
        load = run_phase_sync(base, args.clients, args.duration, server.pid, sample_every=1.0,
                              stalled=args.stalled, heavy=args.heavy, image_id=image_id, mixed=args.mixed,
                              header_flood=args.header_flood, heavy_generate=args.heavy_generate)
        cpu_idle_s = idle_after(server.pid)  # the clients have left: how soon does the server stop working?
        rss_after = rss_mb(server.pid)
        peak_rss_mb = int(Path(f"/proc/{server.pid}/status").read_text().split("VmHWM:")[1].split()[0]) / 1024
        health = load["health"]
        result["load"] = {**summary(load), "clients": args.clients, "duration_s": args.duration,
                          "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
                          "rss_max_mb": round(max([v for _, v in load["rss"]] or [rss_after]), 1),
                          "rss_peak_mb": round(peak_rss_mb, 1),  # VmHWM: the kernel's own high-water mark
                          "memory_budget_mb": round(s.memory_budget_bytes / 2**20, 1),
                          "cpu_idle_after_s": cpu_idle_s, "mixed": load["mixed"],
                          "header_flood": load["header_flood"],
                          "header_flood_sent_max_bytes": load.get("header_flood_sent_max", 0),
                          "heavy_generate": {k: {"n": len(v), "max_s": max(v)} for k, v in load["heavy_generate"].items()},
                          "stalled_clients": args.stalled, "stalled_answers": load["stalled"],
                          "heavy_clients": args.heavy,
                          "heavy": {k: {"n": len(v), "p50_s": percentile(v, 0.5), "max_s": max(v)}
                                    for k, v in load["heavy"].items()},
                          "health_n": len(health), "health_errors": load["health_errors"][:20],
                          "health_p50_ms": round(percentile(health, 0.5) * 1000, 1) if health else None,
                          "health_p99_ms": round(percentile(health, 0.99) * 1000, 1) if health else None,
                          "health_max_ms": round(max(health) * 1000, 1) if health else None}
        print(json.dumps(result["load"], indent=1), flush=True)
        if args.soak > 0:
            print(f"soak: {args.soak_clients} clients × {args.soak:.0f} s", flush=True)
            soak = run_phase_sync(base, args.soak_clients, args.soak, server.pid, sample_every=5.0)
            rss = soak["rss"]
            first = [v for t, v in rss if t <= 60] or [rss[0][1]]
            last = [v for t, v in rss if t >= rss[-1][0] - 60] or [rss[-1][1]]
            drift = (statistics.mean(last) - statistics.mean(first)) / statistics.mean(first) * 100
            result["soak"] = {**summary(soak), "clients": args.soak_clients, "duration_s": args.soak,
                              "rss_first_minute_mb": round(statistics.mean(first), 1),
                              "rss_last_minute_mb": round(statistics.mean(last), 1),
                              "rss_min_mb": round(min(v for _, v in rss), 1),
                              "rss_max_mb": round(max(v for _, v in rss), 1),
                              "rss_drift_percent": round(drift, 2), "rss_samples": rss}
            print(json.dumps({k: v for k, v in result["soak"].items() if k != "rss_samples"}, indent=1), flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                result["server_exit_code"] = server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                result["server_exit_code"] = "killed"
        server_log.close()
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.write_text(report(result))
    ok = verdicts(result)
    print("\n".join(f"{'PASS' if good else 'FAIL'}: {what}" for what, good in ok))
    return 0 if all(good for _, good in ok) else 1


def run_phase_sync(*a, **kw) -> dict:
    return asyncio.run(run_phase(*a, **kw))


def verdicts(result: dict) -> list[tuple[str, bool]]:
    load = result.get("load", {})
    out = [
        ("load: only 200 and 503 (with Retry-After), no transport error", load.get("error_count", 1) == 0
         and set(load.get("statuses", {})) <= {"200", "503"}),
        ("load: some requests admitted", load.get("statuses", {}).get("200", 0) > 0),
        ("server exited 0 on SIGTERM", result.get("server_exit_code") == 0),
    ]
    if load.get("health_n"):
        heavy_codes = {k.rsplit(" ", 1)[1] for k in load.get("heavy", {})}
        out += [
            ("load: /api/health p99 < 100 ms with the stalled and heavy clients",
             load["health_p99_ms"] < 100 and not load["health_errors"]),
            ("load: stalled bodies answered 408 (or still stalled at the end), nothing else",
             set(load.get("stalled_answers", {})) <= {"408", "still-stalled-at-end"}),
            ("load: heavy clients got only 200/4xx/503, no 500",
             all(c.isdigit() and (c[0] in "24" or c == "503") for c in heavy_codes)),
        ]
    if "rss_peak_mb" in load:
        mixed_codes = {code for group in load.get("mixed", {}).values() for code in group}
        out += [
            ("load (issue 19): /api/health p99 < 50 ms", bool(load.get("health_p99_ms")) and load["health_p99_ms"] < 50),
            ("load (issue 19): peak RSS (VmHWM) under memory_budget_bytes", load["rss_peak_mb"] < load["memory_budget_mb"]),
            ("load (issue 19): server CPU idle within 2 s of the clients leaving",
             load["cpu_idle_after_s"] is not None and load["cpu_idle_after_s"] <= 2.0),
            ("load (issue 19): mixed requests only 200/4xx/503 (a stream may end with an error event)",
             all((c.isdigit() and (c[0] in "24" or c == "503")) or c == "200 error-event" for c in mixed_codes)),
            ("load (issue 19): header floods answered 431 only", set(load.get("header_flood", {})) <= {"431"}),
            ("load (issue 19): heavy streams refused 413 or ended by their budget",
             set(load.get("heavy_generate", {})) <= {"413", "200 error-event", "503"}),
        ]
    if "soak" in result:
        soak = result["soak"]
        out += [
            ("soak: no error", soak["error_count"] == 0 and set(soak["statuses"]) <= {"200", "503"}),
            ("soak: RSS drift < 5 %", abs(soak["rss_drift_percent"]) < 5),
        ]
    return out


def report(result: dict) -> str:
    m, load = result["machine"], result["load"]
    lines = [
        "# Load and soak test",
        "",
        f"`benchmarks/load.py` against `python -m app.serve` on 127.0.0.1 (uvicorn, one process), "
        f"settings {json.dumps(result['settings'])}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['device']} (no GPU), torch {m['torch']}, "
        f"Python {m['python']}; shared with other work: load average at start {m['load_average_at_start']}. "
        "Client and server share the 2 cores.",
        "",
        "Requests: `POST /api/text/attention` (minilm, 6–40 random words or one of 4 repeated sentences per client, "
        "one random layer × head, json or f16); each client posts back to back (after a 503 it waits 50 ms).",
        "",
        f"## Load: {load['clients']} clients × {load['duration_s']:.0f} s",
        "",
        "| | |",
        "|---|---:|",
        f"| requests | {load['requests']} ({load['throughput_rps']} /s) |",
        f"| status counts | {', '.join(f'{k}: {v}' for k, v in sorted(load['statuses'].items()))} |",
        f"| admitted (200) | {load['statuses'].get('200', 0)} ({load['admitted_rps']} /s) |",
        f"| admitted latency p50 / p99 | {load['admitted_p50_ms']} ms / {load['admitted_p99_ms']} ms |",
        f"| rejected (503) latency p50 / p99 | {load['rejected_p50_ms']} ms / {load['rejected_p99_ms']} ms |",
        f"| errors (anything but 200/503) | {load['error_count']} |",
        f"| server RSS before / after | {load['rss_before_mb']} MB / {load['rss_after_mb']} MB |",
        "",
    ]
    if load.get("health_n"):
        lines[-1:] = [
            f"| server RSS max (sampled every second) | {load['rss_max_mb']} MB |",
            f"| alongside: stalled-body clients | {load['stalled_clients']}: answers "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(load['stalled_answers'].items()))} |",
            f"| alongside: oversized-work clients | {load['heavy_clients']}: "
            + "; ".join(f"{k}: {v['n']} (p50 {v['p50_s']:.2f} s, max {v['max_s']:.2f} s)"
                        for k, v in sorted(load['heavy'].items())) + " |",
            f"| `/api/health` every 100 ms: p50 / p99 / max | {load['health_p50_ms']} / {load['health_p99_ms']} / "
            f"{load['health_max_ms']} ms ({load['health_n']} probes, errors {load['health_errors'] or 'none'}) |",
            "",
        ]
    if "soak" in result:
        s = result["soak"]
        lines += [
            f"## Soak: {s['clients']} clients × {s['duration_s']:.0f} s",
            "",
            "| | |",
            "|---|---:|",
            f"| requests | {s['requests']} ({s['throughput_rps']} /s) |",
            f"| status counts | {', '.join(f'{k}: {v}' for k, v in sorted(s['statuses'].items()))} |",
            f"| admitted latency p50 / p99 | {s['admitted_p50_ms']} ms / {s['admitted_p99_ms']} ms |",
            f"| errors | {s['error_count']} |",
            f"| RSS mean of first minute → last minute | {s['rss_first_minute_mb']} MB → {s['rss_last_minute_mb']} MB "
            f"(**drift {s['rss_drift_percent']:+.2f} %**) |",
            f"| RSS min / max | {s['rss_min_mb']} MB / {s['rss_max_mb']} MB |",
            "",
        ]
    if "rss_peak_mb" in load:
        lines += [
            "## Issue 19: the second probe's mix", "",
            "| | |", "|---|---:|",
            f"| peak RSS (VmHWM) / memory_budget_bytes | {load['rss_peak_mb']} MB / {load['memory_budget_mb']} MB |",
            f"| server CPU idle after the clients left | {load['cpu_idle_after_s']} s |",
            f"| mixed requests (besides text attention) | "
            + "; ".join(f"{k}: {v}" for k, v in sorted(load['mixed'].items())) + " |",
            f"| header floods (16 MB each) | {load['header_flood']} (the client got at most "
            f"{load['header_flood_sent_max_bytes']:,} bytes of one into the socket before the answer) |",
            f"| heavy streams (64 interventions, 500 words, 64 tokens) | {load['heavy_generate']} |",
            "",
        ]
    lines += ["## Verdicts", ""] + [f"- {'PASS' if good else 'FAIL'}: {what}" for what, good in verdicts(result)]
    lines += ["", f"Server exit code after SIGTERM: {result.get('server_exit_code')}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
