"""The allocator bound (issue 27, docs/deploy.md "Memory allocator"): the server process runs with glibc's malloc
arenas bounded (MALLOC_ARENA_MAX=2), set before its first allocation. `attnlab serve` and `python -m app.serve`
re-execute themselves with it (same pid) unless the environment sets it or preloads an allocator of its own, and
call malloc_trim(0) every malloc_trim_interval_s; `--no-allocator-bound` / ATTNLAB_MALLOC_ARENA_MAX=0 turn the bound
off; both Docker images set it in their environment.
The servers here serve no model (ATTNLAB_DEFAULT_MODELS=[]): what is checked is the process itself."""
from __future__ import annotations

import contextlib
import os
import re
import statistics
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.allocator import allocator_environ
from app.settings import Settings
from tests.faults.conftest import free_port

pytestmark = pytest.mark.slow  # each test execs a real server: the process's own start is what they check

ROOT = Path(__file__).resolve().parents[2]
ATTNLAB = Path(sys.executable).parent / "attnlab"


@contextlib.contextmanager
def running(tmp_path: Path, command: list[str], ready: str = "/api/health", **env: str):
    """`command` (+ --port) started with `env` added to an environment without MALLOC_*/ATTNLAB_*/LD_PRELOAD (no
    model unless `env` names some); once `ready` answers 200, its process, its URL and its log's path."""
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("ATTNLAB_", "MALLOC_")) and k != "LD_PRELOAD"}
    base.update({"ATTNLAB_DEFAULT_MODELS": "[]", "PYTHONPATH": str(ROOT), **env})
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=base,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "no answer after 120 s:\n" + log_path.read_text()
            time.sleep(0.2)
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serve(tmp_path: Path, command: list[str], **env: str) -> tuple[dict[str, str], str]:
    """Start `command` as `running` does; once it answers, the server process's own environment
    (/proc/<pid>/environ: the pid Popen started, which the re-execution keeps) and its log."""
    with running(tmp_path, command, **env) as (proc, _, log_path):
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
        environ = dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"app.serve" in cmdline or cmdline[1].endswith(b"attnlab")  # the server itself (re-executed or not)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        return environ, log_path.read_text()


def test_attnlab_serve_runs_the_server_with_two_arenas(tmp_path):
    environ, log = serve(tmp_path, [str(ATTNLAB), "serve"])
    assert environ.get("MALLOC_ARENA_MAX") == "2", sorted(environ)
    assert "attnlab: allocator: MALLOC_ARENA_MAX=2" in log, log
    assert "attnlab: allocator: malloc_trim(0) every 10 s" in log, log
    assert "attnlab: allocator: warm heap 32 MiB" in log, log


def test_python_m_app_serve_too_and_a_users_value_is_kept(tmp_path):
    environ, log = serve(tmp_path, [sys.executable, "-m", "app.serve"], MALLOC_ARENA_MAX="4")
    assert environ["MALLOC_ARENA_MAX"] == "4"
    assert "allocator: MALLOC_ARENA_MAX=4" in log, log


@pytest.mark.parametrize("how", ["flag", "setting"])
def test_the_bound_can_be_turned_off(tmp_path, how):
    extra = ["--no-allocator-bound"] if how == "flag" else []
    env = {} if how == "flag" else {"ATTNLAB_MALLOC_ARENA_MAX": "0"}
    environ, log = serve(tmp_path, [str(ATTNLAB), "serve", *extra], **env)
    assert "MALLOC_ARENA_MAX" not in environ
    assert "allocator: glibc's default malloc arenas" in log, log
    if how == "flag":  # the flag turns the periodic malloc_trim and the warm heap off too
        assert "allocator: malloc_trim(0) off" in log, log
        assert "allocator: warm heap off" in log, log


def test_which_environments_are_changed():
    assert allocator_environ({})["MALLOC_ARENA_MAX"] == "2"
    assert allocator_environ({"ATTNLAB_MALLOC_ARENA_MAX": "3", "PATH": "/bin"}) == {
        "ATTNLAB_MALLOC_ARENA_MAX": "3", "PATH": "/bin", "MALLOC_ARENA_MAX": "3"}
    assert allocator_environ({"MALLOC_ARENA_MAX": "8"}) is None  # the user's own
    assert allocator_environ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) is None
    assert allocator_environ({"ATTNLAB_MALLOC_ARENA_MAX": "0"}) is None
    with pytest.raises(SystemExit, match="ATTNLAB_MALLOC_ARENA_MAX='two'"):
        allocator_environ({"ATTNLAB_MALLOC_ARENA_MAX": "two"})
    assert Settings().malloc_arena_max == 2  # the documented setting, same default


def _runtime_stage_env(dockerfile: str) -> dict[str, str]:
    """ENV of the Dockerfile's final stage (`FROM base AS runtime`) and of the stage it is built on (`base`)."""
    stages = re.split(r"^FROM ", dockerfile, flags=re.M)[1:]
    by_name = {re.match(r"\S+ AS (\w+)", s).group(1): s for s in stages}
    env: dict[str, str] = {}
    for name in ("base", "runtime"):
        text = by_name[name].replace("\\\n", " ")
        for line in re.findall(r"^ENV (.+)$", text, flags=re.M):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def test_both_docker_images_set_the_bound():
    """The CPU and the CUDA image are the same Dockerfile (TORCH_VARIANT=cuda for the latter, scripts/docker_ci.sh
    --cuda): the final stage's environment holds MALLOC_ARENA_MAX=2 whatever the variant, so `python -m app.serve`
    (the CMD) starts bounded without re-executing; docker_ci.sh checks it in the running container."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert _runtime_stage_env(dockerfile).get("MALLOC_ARENA_MAX") == "2"
    assert "MALLOC_ARENA_MAX" in (ROOT / "scripts" / "docker_ci.sh").read_text()


def test_sigterm_while_it_re_executes_exits_0(tmp_path):
    """`docker stop` of a server that is re-executing itself: a SIGTERM the moment the new image runs (its cmdline is
    `python -m app.serve`, its handlers not yet installed) still ends it with status 0, not killed (-15)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNLAB_", "MALLOC_")) and k != "LD_PRELOAD"}
    env["ATTNLAB_DEFAULT_MODELS"] = "[]"
    proc = subprocess.Popen([str(ATTNLAB), "serve", "--port", str(free_port())], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while b"app.serve" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # the exec has happened
            assert proc.poll() is None and time.monotonic() < end
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TRIM_CHILD = r"""
import sys, time
from app.allocator import MallocTrimmer, _resident_pages
held, pins = [], []
for _ in range(3000):  # 300 MB in 100 KB chunks (under glibc's mmap threshold: from the heap), each followed by a
    held.append(bytearray(100_000))  # small live object, so the freed chunks are not at the heap's top
    pins.append(bytearray(600))  # over pymalloc's 512 bytes: from malloc's heap too, between the big chunks
del held
before = _resident_pages()
trimmer = MallocTrimmer(0.05)
trimmer.start()
deadline = time.monotonic() + 30  # one trim of 3,000 scattered chunks can take a while on a loaded machine
while trimmer.calls < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, _resident_pages(), trimmer.calls, trimmer.returned_bytes)
"""


def test_the_periodic_malloc_trim_returns_freed_memory():
    """Freed heap memory under live small objects stays resident until malloc_trim(0): the server's trimmer thread
    (every malloc_trim_interval_s) gives it back."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, calls, returned = map(int, out.stdout.split())
    page = os.sysconf("SC_PAGE_SIZE")
    assert calls >= 1
    assert (before - after) * page > 200 * 2**20, (before, after)  # most of the 300 MB went back
    assert returned > 200 * 2**20
    assert Settings().malloc_trim_interval_s == 10.0


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _metric(client: httpx.Client, url: str, line_start: str) -> float:
    text = client.get(url + "/metrics").text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)), 0.0)


def fresh_view_faults(tmp_path: Path, **env: str) -> tuple[float, float]:
    """A served minilm's fresh ~130-token views: the median page faults a view took (the server's minor faults across
    it, less the pages the warm heap's top-up after it mapped) and the median pages of the run it kept."""
    with running(tmp_path, [sys.executable, "-m", "app.serve"], ready="/api/ready",
                 ATTNLAB_DEFAULT_MODELS='["minilm"]', **env) as (proc, url, _), httpx.Client(timeout=120) as client:
        def view(k: int) -> None:
            text = f"Sample {k}: " + "the quick brown fox jumps over the lazy dog and runs far away " * 10
            client.post(url + "/api/text/attention", json={
                "model": "minilm", "text": text, "layers": [0], "heads": [0], "include_scores": True,
                "thumbnail_size": 24, "encoding": "f32"}).raise_for_status()
            time.sleep(0.3)  # the top-up after the response: ~2-20 ms

        for k in range(3):
            view(k)
        faults, kept = [], []
        for k in range(3, 9):
            mapped, kept_bytes = (_metric(client, url, "attnlab_warm_heap_mapped_pages_total"),
                                  _metric(client, url, 'attnlab_kept_run_bytes{tier="ram"}'))
            before = _minor_faults(proc.pid)
            view(k)
            after = _minor_faults(proc.pid)
            faults.append(after - before - (_metric(client, url, "attnlab_warm_heap_mapped_pages_total") - mapped))
            kept.append((_metric(client, url, 'attnlab_kept_run_bytes{tier="ram"}') - kept_bytes) / 4096)
    return statistics.median(faults), statistics.median(kept)


def test_the_warm_heap_takes_a_fresh_views_page_faults_off_the_request(tmp_path):
    """A fresh view keeps its run in new memory while the result cache grows; the served process maps it ahead, after
    the previous response (app/allocator.py WarmHeap): the request itself then takes a small part of the faults it
    took with the warm heap off. Both measured the same way, so the bound can fail."""
    warm_faults, kept_pages = fresh_view_faults(tmp_path)
    cold_faults, _ = fresh_view_faults(tmp_path, ATTNLAB_WARM_HEAP_BYTES="0")
    assert kept_pages > 1000, kept_pages  # each view kept its run (~8 MB)
    assert cold_faults > 0.6 * kept_pages, (cold_faults, kept_pages)
    assert warm_faults < 0.25 * kept_pages, (warm_faults, kept_pages)
