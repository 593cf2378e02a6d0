"""JSON bodies are parsed once, by RequestGuard (off the event loop when large), and handed to FastAPI by the API
routers' route class, app/lifecycle.ParsedJsonRoute (FastAPI's documented `route_class`), instead of create_app
patching every route's handler and writing Starlette's private `_body`/`_json` (issue 32 item 4)."""
from __future__ import annotations

import json

import pytest
from starlette.requests import Request

import app.lifecycle as lifecycle
from app.lifecycle import JSON_IN_THREAD_BYTES, ParsedJsonRoute
from app.main import api_routes


def test_every_json_post_route_takes_the_guards_parse(client):
    posts = [route for route in api_routes(client.app.router.routes)
             if route.body_field is not None and "POST" in route.methods]
    assert len(posts) >= 10
    assert [route.path for route in posts if not isinstance(route, ParsedJsonRoute)] == []


@pytest.mark.parametrize("padding", [0, JSON_IN_THREAD_BYTES + 1])  # parsed on the loop, and in a worker thread
def test_a_body_is_parsed_once_and_never_by_starlette(client, monkeypatch, padding):
    parses = []
    guard_parse = lifecycle.parse_json_body

    def counted(body: bytes):
        parses.append(len(body))
        return guard_parse(body)

    def starlette_parse(self):
        raise AssertionError("Starlette's Request.json() parsed the body again")

    monkeypatch.setattr(lifecycle, "parse_json_body", counted)
    monkeypatch.setattr(Request, "json", starlette_parse)
    body = json.dumps({"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [1]}) + " " * padding
    r = client.post("/api/text/attention", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["heads"] == [1] and parses == [len(body)]
    # a field error still names the field (FastAPI validated the guard's value)
    r = client.post("/api/text/attention", json={"model": "tiny", "text": "the cat", "heads": ["0"]})
    assert r.status_code == 422 and ["body", "heads", 0] in [e["loc"] for e in r.json()["detail"]]
