"""GET /api/audio/sample when the sample clip is not there (issue 56 §5): while a speech model is being prepared (its
preparation speaks the sample first) a 503 with Retry-After saying so, not "espeak-ng was not installed"; otherwise a
404 that says whether espeak-ng is installed here (as attnlab_prepare decides: espeak-ng on the PATH)."""
from __future__ import annotations

import shutil

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models import preparing


def test_a_missing_sample_says_why(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    with TestClient(create_app(Settings(default_models=[], weights_dir=str(weights)))) as client:
        with preparing.preparing(weights, "whisper-tiny-en"):  # a fresh `make run`: the speech model being prepared
            response = client.get("/api/audio/sample")
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == str(preparing.RETRY_AFTER_S)
            detail = response.json()["detail"]
            assert "being prepared" in detail and "not installed" not in detail, detail
        response = client.get("/api/audio/sample")
        assert response.status_code == 404, response.text
        detail = response.json()["detail"]
        installed = shutil.which("espeak-ng") is not None
        assert ("espeak-ng is not installed" in detail) == (not installed), detail
        assert ("espeak-ng is installed" in detail) == installed, detail
