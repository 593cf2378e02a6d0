"""Hardening: no stack traces in responses, registry-only model ids, security headers, no cross-origin access by
default, safetensors only, no unpickling or URL fetching in server code, the result cache scoped per client when
configured."""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.api.helpers import make_settings, post_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_internal_error_leaks_no_stack_trace(limited_client, monkeypatch):
    runtime = limited_client.app.state.runtime

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail /srv/attnlab/models.py line 42")

    monkeypatch.setattr(runtime, "encode", broken)
    r = post_text(limited_client, "the cat sat")
    assert r.status_code == 500
    assert "Traceback" not in r.text and "secret internal detail" not in r.text and ".py" not in r.text
    assert r.json() == {"detail": "internal error (logged on the server)"}


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_model_ids_only_from_the_registry(limited_client, tiny_bert):
    # A real model folder on this machine is still refused: a request names ids, never paths.
    for name in (str(tiny_bert), "../weights/dinov2-small", "/etc/passwd", "https://example.invalid/model"):
        r = limited_client.post("/api/text/attention", json={"model": name, "text": "the cat"})
        assert r.status_code == 422, name
        assert name not in limited_client.app.state.runtime.loaded_adapters()


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_security_headers_on_pages_and_api(limited_client):
    for path in ("/", "/api/health"):
        r = limited_client.get(path)
        assert r.status_code == 200, path
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY"
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
        assert r.headers["Referrer-Policy"]


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_no_cross_origin_allowed_by_default(limited_client):
    r = limited_client.options(
        "/api/text/attention", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_pickled_checkpoints_are_refused(tiny_bert, tmp_path):
    """Safetensors only: a checkpoint that holds only a pickle (pytorch_model.bin) never reaches torch.load."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from models.adapters.bert import BertAdapter

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_bert, folder)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    BertAdapter("ok", str(tiny_bert), max_tokens=16, device="cpu")  # the same model as safetensors loads
    with pytest.raises((OSError, ValueError)):
        BertAdapter("pickled", str(folder), max_tokens=16, device="cpu")


def test_server_code_never_unpickles_or_fetches_urls():
    """No torch.load / pickle of anything (user data included), no server-side URL fetching, no remote code."""
    forbidden = ("torch.load(", "pickle.load", "import pickle", "weights_only=False", "cloudpickle", "dill.load",
                 "joblib.load", "allow_pickle=True", "urllib.request", "urlopen(", "import httpx", "import requests",
                 "trust_remote_code=True")
    # The internal exceptions, for URLs the server itself got, never a request's: a fleet replica forwards a run's
    # requests to the replica that owns it, and a draining replica hands its jobs to a peer (app/handover.py), each at
    # the URL that replica registered in Redis. (The run store's disk tier reads its own files as safetensors + JSON,
    # app/runfile.py: no unpickling there either.)
    allowed = {"app/fleet.py: import httpx", "app/handover.py: import httpx"}
    assert sorted(set(_offenders(ROOT, forbidden)) - allowed) == []


def _offenders(root: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(root)}: {needle}" for folder in ("app", "models") for path in (root / folder).rglob("*.py")
            for needle in forbidden if needle in path.read_text(encoding="utf-8")]


def test_the_unpickling_check_sees_torch_load_and_pickle_in_app(tmp_path):
    """The check above is not vacuous: a torch.load or a pickle.load anywhere under app/ (the run store included) is
    an offender."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "runstore.py").write_text("x = torch.load(path, mmap=True, weights_only=False)\n")
    (tmp_path / "app" / "other.py").write_text("import pickle\nrun = pickle.loads(data)\n")
    assert sorted(_offenders(tmp_path, ("torch.load(", "pickle.load"))) == [
        "app/other.py: pickle.load", "app/runstore.py: torch.load("]


def test_result_cache_scoped_per_client_when_configured(tiny_bert):
    """§11: a cache hit is visible in the response time (0.03 s vs 0.2 s), so a client could tell what others
    asked. With result_cache_scope="client" each client (cookie or X-Attnlab-Client) has its own entries."""
    body = {"model": "tiny", "text": "a secret sentence someone typed", "layers": [0], "heads": [0]}
    for scope, other_hits in (("shared", 1), ("client", 0)):
        app = create_app(make_settings(tiny_bert, result_cache_scope=scope))
        with TestClient(app) as alice, TestClient(app) as bob:
            app.state.runtime.warm_up()
            cache = app.state.runtime.cache
            first = alice.post("/api/text/attention", json=body)
            assert first.status_code == 200
            if scope == "client":
                assert "attnlab_client=" in first.headers["set-cookie"] and "HttpOnly" in first.headers["set-cookie"]
            else:
                assert "set-cookie" not in first.headers
            hits = cache.hits
            assert alice.post("/api/text/attention", json=body).status_code == 200
            assert cache.hits == hits + 1  # the same client: its own entry
            hits = cache.hits
            assert bob.post("/api/text/attention", json=body).status_code == 200  # another browser (no cookie yet)
            assert cache.hits - hits == other_hits, scope
            hits = cache.hits
            r = bob.post("/api/text/attention", json=body, headers={"X-Attnlab-Client": "api-client-0001"})
            assert r.status_code == 200 and cache.hits - hits == other_hits  # a header names an API client
