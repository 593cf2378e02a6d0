"""The analysis routes are thin (issue 54): app/routes/analysis.py hands each request's work, made and checked in
app/pipeline/ (patching.py, patching_set.py, lens.py, faithfulness.py), to app/streams.py and does nothing else: no
engine import (models/), and every handler is at most a choice of work and one `respond*` call. Read with ast."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROUTES = ROOT / "app" / "routes" / "analysis.py"
MAX_STATEMENTS = 2  # a choice of work (the patching set) and the hand-over


def handler_bodies(source: str) -> dict[str, list[ast.stmt]]:
    """Each route handler (a function decorated with @router.<method>) → its statements, docstring left out."""
    bodies = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and isinstance(d.func.value, ast.Name)
                and d.func.value.id == "router" for d in node.decorator_list):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            bodies[node.name] = body
    return bodies


def engine_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("models")]
    return found


def test_the_check_sees_a_handler_at_work():
    fat = ('from models.lens import logit_lens\n@router.post("/x")\ndef x(req):\n    """doc"""\n'
           '    ids = req.ids\n    found = logit_lens(ids)\n    return respond(found)\n')
    assert len(handler_bodies(fat)["x"]) == 3 and engine_imports(fat) == ["models.lens"]
    thin = '@router.post("/x")\ndef x(req, request):\n    """doc"""\n    return respond(request, work(req), "x")\n'
    assert len(handler_bodies(thin)["x"]) == 1 and engine_imports(thin) == []


def test_the_analysis_routes_only_hand_their_work_over():
    source = ROUTES.read_text(encoding="utf-8")
    bodies = handler_bodies(source)
    assert {"patching", "lens", "faithfulness_check"} <= set(bodies)
    fat = {name: len(body) for name, body in bodies.items() if len(body) > MAX_STATEMENTS}
    assert not fat, f"handlers doing work of their own (move it to app/pipeline/): {fat}"
    assert engine_imports(source) == [], "the routes import the engine: its work belongs in app/pipeline/"
    for name, body in bodies.items():
        last = body[-1]
        assert isinstance(last, ast.Return) and isinstance(last.value, ast.Call), name
        assert getattr(last.value.func, "id", "").startswith("respond"), f"{name} does not hand its work to respond*"
