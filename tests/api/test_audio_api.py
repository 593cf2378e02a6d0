"""The speech API over HTTP: uploads and their faults (each a clear 4xx naming the problem), spectrogram and wav,
and POST /api/audio/attention on the real whisper-tiny-en (shapes, words, compare, validation)."""
from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.ids import is_valid_run_id
from app.main import create_app
from app.settings import Settings
from tests.float32 import assert_close_f32
from tests.unit.test_audio_decode import encode, tone

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


@pytest.fixture(scope="module")
def audio_client():
    settings = Settings(default_models=[], max_audio_bytes=200_000, max_upload_bytes=1_000_000, max_audio_s=10.0)
    with TestClient(create_app(settings)) as client:
        yield client


def upload(client, data: bytes, name: str = "clip.wav"):
    return client.post("/api/audio", files={"file": (name, data, "application/octet-stream")})


def test_upload_flac_then_spectrogram_and_wav(audio_client):
    response = upload(audio_client, encode(tone(2.0), 16000, "flac", "flac", out_rate=44100), "a.flac")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["format"] == "flac" and body["sample_rate"] == 44100 and body["channels"] == 1
    assert abs(body["duration_s"] - 2.0) < 0.05 and len(body["audio_id"]) == 32
    spectrogram = audio_client.get(f"/api/audio/{body['audio_id']}/spectrogram").json()
    assert spectrogram["frame_s"] == 0.01 and len(spectrogram["mel"]) == 80 and len(spectrogram["mel"][0]) == 200
    mel = np.array(spectrogram["mel"])
    assert mel.max() <= 1.6 and mel.max() - mel.min() <= 2.01  # Whisper's log-mel: floored 8 (÷4) below the max
    wav = audio_client.get(f"/api/audio/{body['audio_id']}/wav")
    assert wav.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(wav.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 32000)
    # ids are random: the same bytes again get another id
    again = upload(audio_client, encode(tone(2.0), 16000, "flac", "flac", out_rate=44100), "a.flac").json()
    assert again["audio_id"] != body["audio_id"]


@pytest.mark.parametrize("data,status,words", [
    (b"just some text, not audio at all", 415, "not audio"),
    (b"\x89PNG\r\n\x1a\n" + bytes(64), 415, "not audio"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(8), 400, "cannot be read"),
])
def test_bad_uploads(audio_client, data, status, words):
    response = upload(audio_client, data)
    assert response.status_code == status
    assert words in response.json()["detail"][0]["msg"]


def test_truncated_too_long_and_too_big(audio_client):
    full = encode(tone(3.0), 16000, "wav", "pcm_s16le")
    truncated = upload(audio_client, full[: len(full) // 2])
    assert truncated.status_code == 400 and "truncated" in truncated.json()["detail"][0]["msg"]
    long = upload(audio_client, encode(tone(12.0), 16000, "flac", "flac"), "long.flac")  # small file, 12 s > 10 s
    assert long.status_code == 413 and "max_audio_s" in long.json()["detail"][0]["msg"]
    big = upload(audio_client, encode(tone(8.0), 16000, "wav", "pcm_s16le"))  # 256 kB > max_audio_bytes
    assert big.status_code == 413 and "max_audio_bytes" in big.json()["detail"]


def test_no_file_field_and_not_multipart(audio_client):
    assert audio_client.post("/api/audio", files={"other": ("x", b"1")}).status_code == 422
    assert audio_client.post("/api/audio", content=b"RIFF", headers={"content-type": "audio/wav"}).status_code == 415


def test_unknown_and_malformed_ids(audio_client):
    assert audio_client.get("/api/audio/" + "0" * 32 + "/wav").status_code == 404
    assert audio_client.get("/api/audio/not-an-id/spectrogram").status_code == 422
    assert audio_client.post("/api/audio/attention", json={"audio_id": "0" * 32}).status_code == 404


# ---- attention on the real model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_id(audio_client):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    response = audio_client.get("/api/audio/sample")
    assert response.status_code == 200
    return response.json()["audio_id"]


def test_attention_shapes_words_and_alignment(audio_client, sample_id):
    response = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, "layers": [2], "heads": [0, 5],
                                                               "kinds": ["cross", "decoder", "encoder"]})
    assert response.status_code == 200, response.text
    body = response.json()
    n = len(body["tokens"])
    assert body["positions"] == 1500 and body["frame_s"] == 0.02 and body["clip_positions"] == 334
    assert np.array(body["attention"]["cross"]).shape == (1, 2, n, 1500)
    assert np.array(body["attention"]["decoder"]).shape == (1, 2, n, n)
    overview = body["attention"]["encoder"]
    assert np.array(overview["overview"]).shape == (4, 2, 167, 167) and overview["block_positions"] == 2
    assert "Attention" in body["transcript"] and body["output"]["kind"] == "transcript"
    assert len(body["output"]["tokens"]) == n - 1  # every target token and <|endoftext|>, not the prompt
    words = {w["word"].strip("."): w for w in body["words"]}
    assert 3.0 <= words["Attention"]["start_s"] <= 4.5
    assert len(body["alignment"]) == 24 and body["effect"] is None
    # sink mass per kept kind, every layer and head: the mean over rows of P[i, 0] (the first audio frame for cross)
    for kind in ("cross", "decoder"):
        assert np.array(body["sink_mass"][kind]).shape == (4, 6)
        first = np.array(body["attention"][kind])[0, :, :, 0].mean(-1)  # layer 2, heads 0 and 5
        assert_close_f32(np.array(body["sink_mass"][kind])[2, [0, 5]], first, n, scale=1.0)  # a mean over n rows


def test_compare_with_a_masked_span(audio_client, sample_id):
    response = audio_client.post("/api/audio/attention", json={
        "audio_id": sample_id, "layers": [0], "heads": [0], "compare": True,
        "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(150, 350))}]})
    assert response.status_code == 200, response.text
    output = response.json()["effect"]["output"]
    assert "Attention" in output["text_before"] and "Attention" not in output["text_after"]
    assert len(output["prob_change"]) == len(output["kl"]) == len(response.json()["output"]["tokens"])
    assert min(output["prob_change"]) < -0.5


@pytest.mark.parametrize("extra,field", [
    ({"interventions": [{"op": "mask_keys", "tokens": [3]}]}, "kind"),
    ({"interventions": [{"op": "mask_keys", "kind": "cross", "tokens": [1500]}]}, "tokens"),
    ({"interventions": [{"op": "mask_keys", "kind": "decoder", "tokens": [999]}]}, "tokens"),
    # cross-attention's queries are decoder tokens (its keys are encoder positions): row 1000 is not there
    ({"interventions": [{"op": "perturb_queries", "kind": "cross", "tokens": [1000], "noise_std": 1.0}]}, "tokens"),
    ({"interventions": [{"op": "temperature", "beta": 1.0, "kind": "encoder", "layers": [4]}]}, "layers"),
    ({"layers": [4]}, "layers"),
    ({"task": "translate"}, "task"),
    ({"language": "de"}, "language"),
    ({"model": "minilm"}, "model"),
])
def test_attention_validation_names_the_field(audio_client, sample_id, extra, field):
    response = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **extra})
    assert response.status_code == 422, response.text
    assert field in str(response.json()["detail"][0]["loc"])


def test_streamed_transcript(audio_client, sample_id):
    """The transcript streams through the one event-stream pump (app/streams.py) as a job: accepted first, a token
    event per new token (the text so far), then done with the whole text."""
    from tests.api.helpers import job_events

    r = audio_client.post("/api/audio/transcribe", json={
        "audio_id": sample_id, "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(150, 350))}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    accepted, *events = job_events(r)
    assert accepted["accepted"] is True and "eta_s" in accepted
    tokens, done = events[:-1], events[-1]
    assert len(tokens) >= 5 and all(set(e) == {"token", "prob", "text"} for e in tokens)
    assert done["done"] is True and done["text"] == tokens[-1]["text"] and done["text"].strip()


def test_windows_of_the_kept_run_match_the_response(audio_client, sample_id):
    """POST /api/runs/{run_id}/window rebuilds any window from the run's q̂/k̂: the encoder's (whose 1,500² maps are
    not kept) agrees with the pooled overview, the cross-attention's with the returned map."""
    body = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, "layers": [1], "heads": [2],
                                                           "encoder_layers": [1], "kinds": ["cross", "encoder"]}).json()
    run_id = body["run_id"]
    assert run_id and is_valid_run_id(run_id)
    encoder = audio_client.post(f"/api/runs/{run_id}/window", json={
        "layer": 1, "head": 2, "kind": "encoder", "rows": [40, 60], "cols": [0, 1500]})
    assert encoder.status_code == 200, encoder.text
    rows = np.array(encoder.json()["attention"])  # (20, 1500)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)
    overview = np.array(body["attention"]["encoder"]["overview"])[0, 0]  # blocks of 2 positions
    block = body["attention"]["encoder"]["block_positions"]
    np.testing.assert_allclose(rows[:block, 100:100 + block].mean(), overview[40 // block, 100 // block], rtol=1e-4)
    cross = audio_client.post(f"/api/runs/{run_id}/window", json={
        "layer": 1, "head": 2, "kind": "cross", "rows": [0, 6], "cols": [0, 1500]}).json()
    assert np.array_equal(np.array(cross["attention"]), np.array(body["attention"]["cross"])[0, 0, :6])  # kept maps


BASE_PREPARED = (ROOT / "weights" / "whisper-base" / "prepared.json").is_file()


def test_tiny_en_refuses_translate_naming_the_field(audio_client, sample_id):
    response = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, "task": "translate"})
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"][-1] == "task" and "English-only" in detail["msg"] and "whisper-base" in detail["msg"]


@pytest.mark.skipif(not BASE_PREPARED, reason="whisper-base is not prepared here (optional: `make whisper-base`)")
def test_whisper_base_translates_detects_and_names_a_bad_language(audio_client, sample_id):
    models = {m["id"]: m for m in audio_client.get("/api/models", params={"kind": "audio"}).json()["models"]}
    assert models["whisper-base"]["multilingual"] and "de" in models["whisper-base"]["languages"]
    assert models["whisper-tiny-en"]["multilingual"] is False and models["whisper-tiny-en"]["tasks"] == ["transcribe"]
    body = {"model": "whisper-base", "audio_id": sample_id, "layers": [5], "heads": [2], "kinds": ["cross"]}
    translated = audio_client.post("/api/audio/attention", json={**body, "task": "translate", "language": "en"})
    assert translated.status_code == 200, translated.text
    out = translated.json()
    assert out["task"] == "translate" and out["language"] == "en" and out["tokens"][:3] == [
        "<|startoftranscript|>", "<|en|>", "<|translate|>"]
    assert np.array(out["attention"]["cross"]).shape == (1, 1, len(out["tokens"]), 1500)
    assert out["shape"] == {"encoder_layers": 6, "decoder_layers": 6, "heads": 8} and len(out["languages"]) == 99
    detected = audio_client.post("/api/audio/attention", json=body).json()
    assert detected["language"] == "en" and detected["language_prob"] > 0.5 and detected["tokens"][2] == "<|transcribe|>"
    bad = audio_client.post("/api/audio/attention", json={**body, "language": "xx"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "language" and "de" in bad.json()["detail"][0]["msg"]


def test_attention_streamed_is_a_job_with_progress_and_the_same_answer(audio_client, sample_id):
    """docs/api.md "Jobs": with Accept: text/event-stream the speech attention is a job: accepted (ETA), a progress
    event per attention layer of the runs it makes, then the same answer as the plain request."""
    from tests.api.helpers import job_events

    body = {"audio_id": sample_id, "layers": [1], "heads": [3], "kinds": ["cross"],
            "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(40, 60))}]}
    streamed = audio_client.post("/api/audio/attention", json=body, headers={"Accept": "text/event-stream"})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    accepted, *events = job_events(streamed)
    assert accepted["accepted"] is True and accepted["runs"] >= 1 and accepted["eta_s"] > 0
    progress = [e for e in events if "progress" in e]
    assert progress and progress[-1]["progress"] == progress[-1]["total"]
    done = events[-1]
    assert done["done"] is True
    plain = audio_client.post("/api/audio/attention", json=body).json()  # now from the result cache
    assert done["attention"]["cross"] == plain["attention"]["cross"] and done["transcript"] == plain["transcript"]
