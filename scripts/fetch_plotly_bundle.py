"""Fetch plotly.js's cartesian partial bundle (scatter, bar, heatmap: every trace attnlab draws) from npm.

The plotly pip package ships only the full bundle (4.8 MB), which takes about 2 s to evaluate in Chromium
on the 2-core CI machine; the cartesian bundle of the same plotly.js version (1.5 MB) takes about 1.1 s
(benchmarks/results/NOTES.md). The app serves the partial bundle when this script has put it beside the
installed packages (<venv>/share/attnlab/), and the full one otherwise, so a machine without npm works.

Usage: python scripts/fetch_plotly_bundle.py   (a no-op when the file is already there)
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from attnlab.vendor import cartesian_bundle_path, full_bundle_path, plotly_js_version  # noqa: E402


def main() -> int:
    version = plotly_js_version(full_bundle_path())
    target = cartesian_bundle_path(version)
    if target.is_file():
        print(f"[plotly] {target} present")
        return 0
    npm = shutil.which("npm")
    if npm is None:
        print("[plotly] npm not found: the app will serve the full plotly.js bundle from the plotly package")
        return 0
    package = f"plotly.js-cartesian-dist-min@{version}"
    with tempfile.TemporaryDirectory() as tmp:
        # Offline, npm would retry for minutes: one try with a short timeout, then the full bundle is served.
        command = [npm, "pack", package, "--silent", "--fetch-retries=0", "--fetch-timeout=30000"]
        try:
            done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            print(f"[plotly] npm pack {package} timed out; serving the full bundle")
            return 0
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            print(f"[plotly] npm pack {package} failed ({done.stderr.strip()[-300:]}); serving the full bundle")
            return 0
        with tarfile.open(tarballs[0]) as archive:
            member = archive.getmember("package/plotly-cartesian.min.js")
            data = archive.extractfile(member).read()
    found = re.search(rb"plotly\.js[^\n]*? v([\d.]+)", data[:400])
    if not found or found.group(1).decode() != version:
        print(f"[plotly] {package} does not say plotly.js v{version}; not used")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    print(f"[plotly] {package}: {len(data) / 1e6:.1f} MB → {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
