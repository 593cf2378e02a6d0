"""scripts/offline_bundle.py's parts that need no network: the pinned closure is this venv's versions (torch and
numpy left to the host), a bundle cut into parts goes back together byte for byte, and --verify catches a changed
file."""
from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "offline_bundle.py"


def _module():
    spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pinned_closure_is_this_venvs_versions_without_the_hosts_own():
    bundle = _module()
    pins = bundle.pinned_closure(bundle.HOST_PROVIDED)
    assert pins["transformers"] == metadata.version("transformers")
    assert pins["fastapi"] == metadata.version("fastapi")
    assert "pydantic-core" in pins and "starlette" in pins  # dependencies, not only the listed pins
    assert "gguf" in pins  # setup's GGUF conversion runs on the host
    assert not {"torch", "numpy", "triton"} & set(pins)
    assert not any(name.startswith("nvidia-") for name in pins)


def _fake_bundle(folder: Path) -> None:
    (folder / "wheels").mkdir(parents=True)
    (folder / "wheels" / "a.whl").write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB
    (folder / "site").mkdir()
    (folder / "site" / "b.bin").write_bytes(b"x" * 1_500_000)
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in folder.rglob("*") if p.is_file()}
    (folder / "MANIFEST.json").write_text(json.dumps({"files": files}))


def test_parts_reassemble_and_verify(tmp_path):
    bundle = _module()
    source = tmp_path / "bundle"
    _fake_bundle(source)
    parts = bundle.split(source, tmp_path / "parts", part_mb=1)
    assert len(parts) == 4 and all(p.stat().st_size <= 1 << 20 for p in parts)
    assert [p.parent.name for p in parts] == ["p1", "p2", "p3", "p4"]  # one part per folder, in order
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "out", filter="data")
    result = subprocess.run([sys.executable, str(SCRIPT), "--verify", str(tmp_path / "out" / "bundle")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 bad" in result.stdout


def test_verify_catches_a_changed_file(tmp_path):
    source = tmp_path / "bundle"
    _fake_bundle(source)
    (source / "site" / "b.bin").write_bytes(b"y" * 1_500_000)
    result = subprocess.run([sys.executable, str(SCRIPT), "--verify", str(source)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "site/b.bin" in result.stdout
