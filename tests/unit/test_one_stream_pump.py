"""One place builds an event stream (issue 40 §3): every streamed answer goes through app/streams.py's pump (run_job:
the job board, the accepted event, heartbeats, cancel on leave). Speech transcribe had its own thread, queue and
StreamingResponse; this fails on any other module of app/ that names StreamingResponse, a queue.Queue, or writes
`event:` lines itself."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUMP = ROOT / "app" / "streams.py"


def stream_builders(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in ("StreamingResponse", "EventSourceResponse"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("StreamingResponse", "Queue", "SimpleQueue"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "queue":
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


def test_only_app_streams_builds_an_event_stream():
    offenders = [f"{path.relative_to(ROOT)} {where}" for path in sorted((ROOT / "app").rglob("*.py")) if path != PUMP
                 for where in stream_builders(path.read_text(encoding="utf-8"))]
    assert offenders == []
