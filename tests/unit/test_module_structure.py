"""The package boundaries the code relies on, checked on the source: the engine (models/) imports nothing of the web
layer or of the offline preparation, and models/head_ops.py does not import models/hooks.py (hooks imports it: the
run in progress is models/run_context.py's, which both read)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_engine_imports_no_web_layer_and_no_preparation():
    forbidden = ("app", "fastapi", "starlette", "uvicorn", "attnlab_prepare")
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "models").rglob("*.py"))
                 for name in imported_modules(path) if name.split(".")[0] in forbidden]
    assert offenders == []


def test_head_ops_does_not_import_hooks():
    names = imported_modules(ROOT / "models" / "head_ops.py")
    assert "models.hooks" not in names  # `from models import hooks` counts as models.hooks too, lazy imports included
    code = "import sys, models.head_ops; print('models.hooks' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
