"""The layers' import rules, read from the source (issue 40 §2, issue 54): no import circle between the modules of app/,
models/ and attnlab/ (imports inside functions count: they only hide a circle; so do imports under
`if TYPE_CHECKING:`, which never run but still tie two modules together: a type both need lives in a module of its
own), models/ and attnlab/ import nothing of app/, importing attnlab loads no app module (a Lab talking to a remote
server needs none of the server's code), no route imports another route (helpers two routes share live in a module
of app/), and nothing imports a higher layer: attnlab_prepare.py (run at setup, and by app/cli.py and
app/preparation.py) imports nothing of app/, and scripts/ import nothing of benchmarks/ (a script that needs the bench
lives in benchmarks/)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "models", "attnlab")
# the layers above app/, models/ and attnlab/: the setup script, the scripts and the bench
HIGHER = ("attnlab_prepare.py", "scripts", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(packages=PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        where = ROOT / package
        for path in ([where] if where.suffix == ".py" else sorted(where.rglob("*.py"))):
            found[module_name(path)] = path
    return found


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom, at any depth: inside functions and under `if TYPE_CHECKING:` too."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific project module `name` lies in (a.b.c → a.b when a.b.c is a name inside a.b)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        for target in targets:
            module = _known(target, modules)
            if module and module != name:
                found.add(module)
    return found


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    modules = project_modules(packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    modules = {"app.a": tmp_path / "a.py", "app.b": tmp_path / "b.py"}
    modules["app.a"].write_text("from app.b import thing\n")
    modules["app.b"].write_text("def late():\n    from app import a  # hidden\n    return a\n")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert import_circles(graph) == [["app.a", "app.b"]]


def test_the_checker_sees_a_type_only_circle(tmp_path):
    modules = {"attnlab.a": tmp_path / "a.py", "attnlab.b": tmp_path / "b.py"}
    modules["attnlab.a"].write_text("from attnlab.b import thing\n")
    modules["attnlab.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attnlab.a import A\n")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert import_circles(graph) == [["attnlab.a", "attnlab.b"]]


def test_no_import_circles():
    assert import_circles(import_graph()) == []


def test_models_and_attnlab_import_nothing_of_app():
    offenders = [f"{name} imports {target}" for name, targets in sorted(import_graph().items())
                 if name.split(".")[0] in ("models", "attnlab") for target in sorted(targets)
                 if target.split(".")[0] == "app"]
    assert offenders == []


def route_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a imports b` for each route module importing another route module (app/routes/*.py, the package aside)."""
    def is_route(name: str) -> bool:
        return name.startswith("app.routes.")
    return [f"{name} imports {target}" for name, targets in sorted(graph.items()) if is_route(name)
            for target in sorted(targets) if is_route(target)]


def test_the_checker_sees_a_route_importing_a_route(tmp_path):
    modules = {"app.routes.a": tmp_path / "a.py", "app.routes.b": tmp_path / "b.py", "app.shared": tmp_path / "s.py"}
    modules["app.routes.a"].write_text("def late():\n    from app.routes.b import handler\n    return handler\n")
    modules["app.routes.b"].write_text("from app.shared import helper\n")
    modules["app.shared"].write_text("")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert route_imports(graph) == ["app.routes.a imports app.routes.b"]


def test_no_route_imports_a_route():
    """Helpers two routes share live in a module of app/ (app/uploads.py, app/model_sources.py, app/pipeline/...)."""
    assert route_imports(import_graph()) == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run from a lower layer into a higher one: the setup script (which app/cli.py and app/preparation.py
    run) into app/, scripts/ into benchmarks/, models/ or attnlab/ into the setup script, and app/, models/ or attnlab/
    into scripts/ or benchmarks/."""
    top = {name: name.split(".")[0] for name in graph}
    forbidden = {"attnlab_prepare": {"app", "scripts", "benchmarks"}, "scripts": {"benchmarks"},
                 "app": {"scripts", "benchmarks"}, "models": {"attnlab_prepare", "scripts", "benchmarks"},
                 "attnlab": {"attnlab_prepare", "scripts", "benchmarks"}}
    return [f"{name} imports {target}" for name, targets in sorted(graph.items())
            for target in sorted(targets) if target.split(".")[0] in forbidden.get(top[name], ())]


def test_the_checker_sees_an_upward_import(tmp_path):
    modules = {"attnlab_prepare": tmp_path / "p.py", "app.settings": tmp_path / "s.py",
               "scripts.x": tmp_path / "x.py", "benchmarks.run_all": tmp_path / "r.py"}
    modules["attnlab_prepare"].write_text("def served():\n    from app.settings import Settings\n    return Settings\n")
    modules["app.settings"].write_text("")
    modules["scripts.x"].write_text("import benchmarks.run_all as bench\n")
    modules["benchmarks.run_all"].write_text("")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert upward_imports(graph) == ["attnlab_prepare imports app.settings", "scripts.x imports benchmarks.run_all"]


def test_no_import_runs_from_a_lower_layer_into_a_higher_one():
    assert upward_imports(import_graph(PACKAGES + HIGHER)) == []


def test_importing_attnlab_loads_no_app_module():
    code = ("import sys, attnlab, attnlab.client, attnlab.export, attnlab.results\n"
            "print(sorted(m for m in sys.modules if m == 'app' or m.startswith('app.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def sys_path_edits(source: str) -> list[str]:
    """Calls that change sys.path (insert, append, extend, remove, …) and assignments to it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name) \
                and target.value.id == "sys":
            found.append(f"line {node.lineno}")
    return sorted(found)


def test_no_sys_path_edits():
    """Scripts run with `python -m` from the checkout's root, tests through pyproject's pythonpath: nothing edits
    sys.path (it made a script work from one folder and hid a broken install)."""
    assert sys_path_edits("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n") == ["line 2", "line 3"]
    skip = {".venv", "weights", "node_modules", ".git"}
    offenders = [f"{path.relative_to(ROOT)} {where}" for path in sorted(ROOT.rglob("*.py"))
                 if not skip & set(path.relative_to(ROOT).parts)
                 for where in sys_path_edits(path.read_text(encoding="utf-8"))]
    assert offenders == []
