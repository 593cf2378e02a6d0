"""Functions in app/, models/ and attnlab/: at most 90 lines and at most 9 parameters (self/cls not counted; *args
and **kwargs count as one each), read from the source with ast (issue 40 §4). A function over either limit that is
not yet split is listed in OVER with its size; the list may only shrink: a new offender, or a listed one that grew,
fails."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES, MAX_PARAMS = 90, 9

# Not split yet (issue 40 §4): "path:qualified name" → (lines, parameters) when this list was made.
OVER: dict[str, tuple[int, int]] = {}


def function_sizes(source: str) -> dict[str, tuple[int, int]]:
    sizes = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                params = [p for p in params if p not in ("self", "cls")]
                count = len(params) + (args.vararg is not None) + (args.kwarg is not None)
                sizes[prefix + child.name] = (child.end_lineno - child.lineno + 1, count)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def offenders() -> dict[str, tuple[int, int]]:
    found = {}
    for package in ("app", "models", "attnlab"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, (lines, params) in function_sizes(path.read_text(encoding="utf-8")).items():
                if lines > MAX_LINES or params > MAX_PARAMS:
                    found[f"{path.relative_to(ROOT)}:{name}"] = (lines, params)
    return found


def test_the_checker_counts_lines_and_parameters():
    source = "class A:\n    def f(self, a, b, *c, d, **e):\n        x = 1\n        return x\n"
    assert function_sizes(source) == {"A.f": (3, 5)}


def test_no_function_over_90_lines_or_9_parameters():
    found = offenders()
    new = {name: size for name, size in found.items() if name not in OVER}
    grown = {name: size for name, size in found.items() if name in OVER and
             (size[0] > max(OVER[name][0], MAX_LINES) or size[1] > max(OVER[name][1], MAX_PARAMS))}
    assert new == {} and grown == {}
