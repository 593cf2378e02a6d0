from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.helpers import make_settings


@pytest.fixture(scope="session")
def api_settings(tiny_bert, tiny_mlm) -> Settings:
    return Settings(
        default_models=["tiny"],
        extra_text_models={"tiny": str(tiny_bert), "tiny-mlm": str(tiny_mlm)},
        max_text_chars=2000,
        max_response_numbers=20_000,
        expose_timings=True,  # Server-Timing is off by default (issue 12); its tests read it
    )


@pytest.fixture(scope="session")
def client(api_settings):
    with TestClient(create_app(api_settings)) as c:
        c.app.state.runtime.warm_up()  # deterministic: don't race the background warm-up
        yield c


@pytest.fixture
def limited_client(tiny_bert, request):
    settings = make_settings(tiny_bert, **getattr(request, "param", {}))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.app.state.runtime.warm_up()
        yield client
