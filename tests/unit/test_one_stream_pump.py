"""One place builds an event stream (issue 40 §3): every streamed answer goes through app/streams.py's pump (run_job:
the job board, the accepted event, heartbeats, cancel on leave). Speech transcribe had its own thread, queue and
StreamingResponse; this fails on any other module of app/ that names StreamingResponse, writes `event:` lines itself, or
holds a queue.Queue while importing the web framework (a queue in a module that serves no response, the run store's
disk writer, feeds no stream)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUMP = ROOT / "app" / "streams.py"


def _web_facing(tree: ast.AST) -> bool:
    """Whether a module imports the web framework (fastapi, starlette): a queue there feeds a response; one in a
    module without it (the run store's disk writer) feeds no stream."""
    for node in ast.walk(tree):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        if any(name.split(".")[0] in ("fastapi", "starlette", "sse_starlette") for name in names):
            return True
    return False


def stream_builders(source: str) -> list[str]:
    found, tree = [], ast.parse(source)
    web = _web_facing(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("StreamingResponse", "EventSourceResponse"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and (node.attr == "StreamingResponse" or
                                                   web and node.attr in ("Queue", "SimpleQueue")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif web and isinstance(node, ast.ImportFrom) and node.module == "queue":
            found.append(f"line {node.lineno}: from queue import …")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("event: ")) or (
                isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant)
                and str(node.values[0].value).startswith("event: ")):
            found.append(f"line {node.lineno}: an `event:` line")
    return sorted(set(found))


def test_the_check_sees_a_pump_of_its_own():
    old = ("import queue\nfrom fastapi.responses import StreamingResponse\n"
           "def r(c):\n    q = queue.Queue()\n    yield f'event: {c}\\n'\n    return StreamingResponse(iter(()))\n")
    assert len(stream_builders(old)) == 3
    # a worker's queue in a module that serves no response (app/runstore.py's disk writer) is not a stream
    assert stream_builders("import queue\ndef w():\n    q = queue.Queue(4)\n") == []
    assert len(stream_builders("import queue\nimport fastapi\ndef w():\n    q = queue.Queue(4)\n")) == 1


def test_only_app_streams_builds_an_event_stream():
    offenders = [f"{path.relative_to(ROOT)} {where}" for path in sorted((ROOT / "app").rglob("*.py")) if path != PUMP
                 for where in stream_builders(path.read_text(encoding="utf-8"))]
    assert offenders == []
