"""The real app plus one slow test route, served by uvicorn in a subprocess by test_server_lifecycle.py.

`GET /test/slow?seconds=S&marker=PATH` takes the model lock like a forward does, touches PATH once it
runs (so the test knows the request is in flight) and answers after S seconds.
"""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import Request

from app.main import create_app
from app.settings import Settings

app = create_app(Settings(default_models=[]))


@app.get("/test/slow")
def slow(request: Request, seconds: float, marker: str) -> dict:
    with request.app.state.runtime.admitted():
        Path(marker).touch()
        time.sleep(seconds)
    return {"slept": seconds}
