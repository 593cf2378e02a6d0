"""docs/architecture.md stays true: every file or folder path it names exists, and every function it names in the
request's path is defined in the file it is drawn beside (the layer rules it states are tests/unit/test_imports.py)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"\b((?:app|models|attnlab|static|templates|tests|docs|scripts|benchmarks)/[\w./-]*|attnlab_prepare\.py)")


def named_paths(text: str) -> set[str]:
    return {match.rstrip(".") for match in PATH.findall(text)}


def test_the_doc_names_paths_and_the_check_sees_a_missing_one():
    paths = named_paths(DOC.read_text(encoding="utf-8"))
    assert {"app/pipeline/text.py", "models/atlas.py", "static/js/lab/lab.js"} <= paths
    assert [p for p in named_paths("see app/nothing_here.py") if not (ROOT / p).exists()] == ["app/nothing_here.py"]


def test_every_path_the_doc_names_exists():
    missing = sorted(p for p in named_paths(DOC.read_text(encoding="utf-8")) if not (ROOT / p).exists())
    assert missing == []


def test_the_drawn_path_names_functions_where_they_are():
    """In the drawing, a line `<file>  <function>` names a function (or class/method) defined in that file."""
    text = DOC.read_text(encoding="utf-8")
    drawing = text.split("## One request's path", 1)[1].split("```", 2)[1]
    wrong = []
    for line in drawing.splitlines():
        found = re.match(r"\s*((?:app|models)/[\w/]+\.py)\s+(\w+)", line)
        if found:
            path, name = found.groups()
            source = (ROOT / path).read_text(encoding="utf-8")
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^{name}\s*=", source, re.M):
                wrong.append(f"{path}: {name}")
    assert wrong == []
