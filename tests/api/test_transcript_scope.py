"""The speech route's cache of greedy transcripts with interventions (app/routes/audio.py) follows
result_cache_scope like the result cache: with "client" a client never reads a transcript decoded for another
(each decodes its own, a repeat of its own is cached); with "shared" the second client reads the first's.
whisper-tiny-en on the bundled sample; decodings with interventions are counted."""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.adapters.whisper import WhisperAdapter

SAMPLE = Path(__file__).resolve().parents[2] / "weights" / "samples" / "speech-sample.wav"
BODY = {"layers": [0], "heads": [0], "kinds": ["cross"], "compare": True, "target": " Attention",
        "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(150, 350))}]}


@pytest.fixture
def decodings(monkeypatch) -> list[tuple]:
    """Every greedy decoding with interventions, as it happens."""
    calls = []
    original = WhisperAdapter.transcribe

    def counted(self, features, interventions, *args, **kwargs):
        if interventions:
            calls.append(interventions)
        return original(self, features, interventions, *args, **kwargs)

    monkeypatch.setattr(WhisperAdapter, "transcribe", counted)
    return calls


def test_with_client_scope_each_client_decodes_its_own(decodings):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    with TestClient(create_app(Settings(default_models=[], result_cache_scope="client"))) as client:
        audio_id = client.get("/api/audio/sample").json()["audio_id"]

        def ask(who: str) -> dict:
            response = client.post("/api/audio/attention", json={"audio_id": audio_id, **BODY},
                                   headers={"X-Attnlab-Client": who})
            assert response.status_code == 200, response.text
            return response.json()["effect"]["output"]

        first = ask("client-one")
        assert len(decodings) == 1
        assert ask("client-one") == first and len(decodings) == 1  # a repeat: from the cache
        assert ask("client-two") == first and len(decodings) == 2  # not client-one's


def test_the_transcript_cache_key_is_the_scope():
    """Without the model: what app/pipeline/views.transcript keeps and reads, per cache_scope (shared: None, one entry for all)."""
    from types import SimpleNamespace
    from contextlib import nullcontext

    from app.context import RequestContext
    from app.pipeline import views

    calls = []
    adapter = SimpleNamespace(info=SimpleNamespace(id="w"),
                              transcribe=lambda *args, **kwargs: calls.append(1) or ([1, 2], [0.5, 0.5]))
    class Runtime:  # what transcript uses of one: its settings and the model's turn
        settings = Settings(default_models=[])
        admitted = staticmethod(lambda interactive=None, ctx=None: nullcontext())

    runtime = Runtime()
    encoded = SimpleNamespace(key="clip", inputs={"input_features": None}, extra={"prompt": []})
    ivs = ("mask",)

    def under(scope):
        return views.transcript(runtime, adapter, encoded, ivs, RequestContext(cache_scope=scope))

    assert under(None) == under(None) == ([1, 2], [0.5, 0.5]) and len(calls) == 1  # shared: kept once
    under("client-one"), under("client-one")
    assert len(calls) == 2
    under("client-two")
    assert len(calls) == 3
