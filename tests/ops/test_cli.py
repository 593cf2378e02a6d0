"""The installed `attnlab` command (pyproject.toml's console script, `pip install -e .`), run from the venv's
bin/ as an operator would, from a directory outside the checkout."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ATTNLAB = Path(sys.executable).parent / "attnlab"
WEIGHTS = ROOT / "weights"


def run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(ATTNLAB), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def installed():
    if not ATTNLAB.is_file():
        pytest.fail(f"{ATTNLAB} is missing: `pip install -e .` (make setup) installs the console script")


def test_help_lists_the_commands(tmp_path):
    result = run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for command in ("serve", "prepare", "bench"):
        assert f"\n  {command} " in result.stdout
    unknown = run("frobnicate", cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr


def test_serve_help_shows_model_and_uvicorn_options(tmp_path):
    result = run("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--model [ID=]SOURCE" in result.stdout  # attnlab's own option
    assert "--port INTEGER" in result.stdout and "--host TEXT" in result.stdout  # uvicorn's, passed through


def test_the_package_is_the_checkout(tmp_path):
    """An editable install: app/, models/ and attnlab_prepare import from this checkout (static/, templates/ sit beside
    them)."""
    code = "import app, models, attnlab_prepare; print(app.__file__); print(attnlab_prepare.ROOT)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    app_file, root = result.stdout.split()
    assert Path(app_file) == ROOT / "app" / "__init__.py" and Path(root) == ROOT
    assert (Path(root) / "templates").is_dir() and (Path(root) / "static").is_dir()


def prepared_files() -> dict[Path, int]:
    """Every prepared file under weights/ with its mtime; weights/.measured/ is left out: it is the record of model
    loads (each load's parity, docs/api.md), written by the servers other tests start at the same time."""
    return {p: p.stat().st_mtime_ns for p in WEIGHTS.rglob("*")
            if p.is_file() and ".measured" not in p.relative_to(WEIGHTS).parts}


def test_prepare_is_a_fast_no_op_when_weights_exist(tmp_path):
    if not (WEIGHTS / "dinov2-small" / "prepared.json").is_file() or not (WEIGHTS / "smollm2-135m" / "prepared.json").is_file():
        pytest.skip("weights not prepared here (make weights)")
    before = prepared_files()
    start = time.perf_counter()
    result = run("prepare", cwd=tmp_path)  # outside the checkout: the weights are still the checkout's
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    defaults = ("dinov2-small", "smollm2-135m", "whisper-tiny-en", "gemma3-270m")
    prepared = [m for m in defaults if (WEIGHTS / m / "prepared.json").is_file()]
    assert result.stdout.count("skipping") == len(prepared) == len(defaults), result.stdout  # each one is skipped
    assert prepared_files() == before
    assert elapsed < 30, f"a no-op prepare took {elapsed:.1f} s"
    assert not (tmp_path / "weights").exists()
    # the Docker image's preparation leaves gemma3-270m out (its packages are not installed there)
    without = run("prepare", "--without", "gemma3-270m", cwd=tmp_path)
    assert without.returncode == 0, without.stderr
    assert "gemma3-270m: left out" in without.stdout and "gemma3-270m: up to date" not in without.stdout


def test_wrapper_script_runs_the_same_code(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_weights.py"), "--help"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: attnlab prepare" in result.stdout and "--weights-dir" in result.stdout


def test_serve_from_outside_the_checkout(tmp_path):
    """`attnlab serve` started elsewhere finds its templates, static files and prepared weights (the checkout's),
    answers, and exits 0 on SIGTERM."""
    import os
    import signal

    import httpx

    from tests.faults.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    env["ATTNLAB_DEFAULT_MODELS"] = '["vit-fashion"]'
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([str(ATTNLAB), "serve", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(base + "/api/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("not ready after 180 s:\n" + (tmp_path / "serve.log").read_text())
        page = httpx.get(base + "/image", timeout=30)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(base + "/static/samples/fruit.jpg", timeout=30).status_code == 200
        models = httpx.get(base + "/api/models?kind=image", timeout=120).json()["models"]
        assert "dinov2-small" in [m["id"] for m in models]  # loaded from the checkout's weights/
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
