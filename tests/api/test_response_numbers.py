"""A response over max_response_numbers is refused the same way on every route (app/attention.check_response_numbers):
a 413 whose detail names first the request field with the most entries, then the count, the cap by its setting name
and how to ask for less. Text attention (a tiny Llama, long from 9 tokens on), an encoder–decoder (tiny BART),
speech (whisper-tiny-en on the bundled sample) and a kept run's row (POST /api/runs/{id}/row)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.api.helpers import TINY_ATLAS, tiny_models_client
from tests.api.helpers import TINY_TEXT as TEXT

CAP = 200
FORM = re.compile(rf"^(layers|heads|queries|kinds): the response would hold [\d,]+ numbers, over the cap "
                  rf"max_response_numbers={CAP}; ask for fewer ")
SPEECH_SAMPLE = Path(__file__).resolve().parents[2] / "weights" / "samples" / "speech-sample.wav"


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"lm": "llama", "s2s": "bart"}, default_models=[], **TINY_ATLAS,
                            max_response_numbers=CAP) as client:
        yield client


def _refused(response, field: str) -> None:
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert FORM.match(detail) and detail.startswith(f"{field}:"), detail


def test_text_attention(capped):
    # 2 layers × 4 heads × (an overview of 6 × 6 blocks + 38 received) = 592 numbers; heads has the most entries
    _refused(capped.post("/api/text/attention", json={"model": "lm", "text": TEXT}), "heads")
    _refused(capped.post("/api/text/attention", json={"model": "lm", "text": TEXT, "layers": [0, 1], "heads": [0, 1]}),
             "layers")  # 296 numbers; on a tie the first field
    assert capped.post("/api/text/attention", json={"model": "lm", "text": TEXT, "layers": [0], "heads": [0]}).status_code == 200


def test_encoder_decoder_attention(capped):
    response = capped.post("/api/text/attention", json={"model": "s2s", "text": TEXT, "target": TEXT})
    _refused(response, "heads")


def test_a_kept_runs_row(capped):
    run = capped.post("/api/text/attention", json={"model": "lm", "text": TEXT, "layers": [0], "heads": [0]}).json()
    # every layer × head's row of 38 keys: 2 × 4 × 38 = 304 numbers
    _refused(capped.post(f"/api/runs/{run['run_id']}/row", json={"row": 5, "include_row": True}), "heads")
    assert capped.post(f"/api/runs/{run['run_id']}/row", json={"row": 5, "include_row": True, "layers": [0],
                                                               "heads": [0]}).status_code == 200


def test_speech_attention(capped):
    if not SPEECH_SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    audio_id = capped.get("/api/audio/sample").json()["audio_id"]
    # a cross-attention map alone is N × 1,500 numbers per layer × head
    response = capped.post("/api/audio/attention", json={"audio_id": audio_id, "target": "attention", "kinds": ["cross"]})
    _refused(response, "heads")
