"""No write into another object's private fields in app/ (issue 40 §3): `request._body = …` made the upload routes
depend on how Starlette caches a body. An assignment to `x._name` (or setattr(x, "_name", …)) is allowed only on
`self`/`cls`, or on an object of the project's own whose class is in app/ (listed below, each with why)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = {"self", "cls"}


def private_writes(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_"):
                found.append(f"line {node.lineno}: {node.func.id}(…, {name.value!r})")
            continue
        elif isinstance(node, ast.Delete):
            targets = node.targets
        stack = list(targets)
        while stack:
            target = stack.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                stack.extend(target.elts)
            elif (isinstance(target, ast.Attribute) and target.attr.startswith("_") and not target.attr.startswith("__")
                  and not (isinstance(target.value, ast.Name) and target.value.id in OWN)):
                found.append(f"line {node.lineno}: {ast.unparse(target)}")
    return found


def test_the_check_sees_a_request_body_write():
    assert private_writes("async def f(request):\n    request._body = b''\n    setattr(request, '_receive', None)\n") == [
        "line 2: request._body", "line 3: setattr(…, '_receive')"]
    assert private_writes("class A:\n    def f(self):\n        self._body = 1\n") == []


def test_no_private_writes_in_app():
    offenders = [f"{path.relative_to(ROOT)} {where}" for path in sorted((ROOT / "app").rglob("*.py"))
                 for where in private_writes(path.read_text(encoding="utf-8"))]
    assert offenders == []
