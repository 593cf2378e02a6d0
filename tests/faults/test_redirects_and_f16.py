"""Issue 12 items 12–13: redirects never point at a host the client chose, no `server` header by default,
and f16 never turns large scores into ±inf."""
from __future__ import annotations

import base64

import numpy as np
import torch
from fastapi.testclient import TestClient

from app.encoding import tensor_field
from app.main import create_app
from app.serve import build_args
from app.settings import Settings


def test_redirects_are_paths_not_the_hosts_a_client_sends():
    client = TestClient(create_app(Settings(default_models=[])))
    response = client.get("/static", headers={"host": "evil.example"}, follow_redirects=False)
    assert response.status_code in (301, 307, 308)
    assert response.headers["location"] == "/static/"


def test_the_serving_command_drops_the_server_header():
    assert "--no-server-header" in build_args([])
    assert "--no-server-header" not in build_args(["--server-header"])


def test_f16_falls_back_to_f32_with_a_warning_when_values_overflow():
    big = torch.tensor([[1.0, 70000.0, -1e6]])
    field = tensor_field(big, "f16")
    assert field["dtype"] == "float32" and "float16" in field["warning"]
    decoded = np.frombuffer(base64.b64decode(field["data"]), dtype="<f4")
    assert np.array_equal(decoded, big.numpy().ravel())
    small = tensor_field(torch.tensor([0.5, 60000.0]), "f16")
    assert small["dtype"] == "float16" and "warning" not in small
