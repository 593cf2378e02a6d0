"""scripts/gpu_check.sh's parts that run without a GPU: its parity script on the CPU (CPU against CPU must be
exactly 0 in float32; bfloat16 must differ but stay small), and the shell script's syntax and options. The whole
check (`bash scripts/gpu_check.sh --device cpu --quick`) takes minutes here and is run by hand (docs/deploy.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_parity_script_on_cpu(tmp_path):
    out, raw = tmp_path / "parity.md", tmp_path / "parity.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_parity.py"), "--device", "cpu", "--models", "vit-fashion",
         "--dtypes", "bfloat16", "--lengths", "32", "--repeats", "1", "--out", str(out), "--json", str(raw)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads(raw.read_text())["rows"]
    assert row["model"] == "vit-fashion" and row["parity_tokens"] == 17  # 4×4 patches + CLS
    assert row["float32"]["attention"] == 0.0 and row["float32"]["output.logits"] == 0.0
    half = row["bfloat16"]
    assert "error" not in half, half
    assert 0 < half["attention"] < 0.05 and 0 < half["output.logits"] < 0.5
    table = out.read_text()
    assert "| vit-fashion | 17 | float32 | 0.00e+00 |" in table and "| vit-fashion | 17 | bfloat16 |" in table


def test_gpu_check_script_syntax_and_options():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0 and "--device cpu --quick" in usage.stdout
    bad = subprocess.run(["bash", str(script), "--device", "tpu", "--no-setup"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "cuda or cpu" in bad.stderr


def test_every_module_the_check_runs_exists():
    """gpu_check.sh runs its steps as modules from the checkout's root (`"$PY" -m benchmarks.gpu_lm_api`): each named
    module is a file here (a script moved between scripts/ and benchmarks/ must take the check's line with it)."""
    import re

    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    named = sorted(set(re.findall(r'-m ((?:scripts|benchmarks)\.[A-Za-z_.]+)', text)))
    assert "benchmarks.gpu_lm_api" in named
    missing = [name for name in named if not (ROOT / (name.replace(".", "/") + ".py")).is_file()]
    assert missing == []
