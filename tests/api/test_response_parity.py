"""Every number of an attention response, before and after a change of the request pipeline (issue 32): the text
route (encoder, decoder LM, encoder–decoder; short and long; P and value-weighted; compare with samples, scores,
base maps, query rows), the image route (short and long) and the speech route on whisper-tiny-en, on tiny random
models and on the prepared real ones (smollm2-135m, whisper-tiny-en; skipped where they are not prepared).

Bit for bit: the maps are asked as f32 (their bytes), and a few as json; only what changes by design between two
runs of the same request is left out (random run ids, timings).

- `ATTNLAB_PARITY_RECORD=/tmp/before.json pytest tests/api/test_response_parity.py` writes the responses (run it on
  the code before the change);
- `ATTNLAB_PARITY_REFERENCE=/tmp/before.json pytest …` compares every response with the recorded one;
- without either, the tiny models' requests are answered twice by fresh apps and the two answers must be equal (the
  pipeline draws nothing from state it should not: caches, context variables, the order of requests).
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_image_model, build_text_model

ROOT = Path(__file__).resolve().parents[2]
SPEECH_SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"
VOLATILE = {"run_id", "base_run_id", "image_id", "elapsed_s"}  # random ids and timings: equal by design only in kind

TEXT = "the cat sat on the mat because it was tired , the dog ran to the park"
TARGET = "the dog sat on the rug"
MASK_AND_BETA = [{"op": "mask_keys", "tokens": [2, 5]}, {"op": "temperature", "beta": 0.4, "layers": [1], "heads": [1]}]
NOISE = [{"op": "perturb_keys", "noise_std": 0.5, "seed": 3, "tokens": [1, 3, 4]}]

# (name, body): every field that changes which maps are read or how they are weighted
TEXT_CASES = [
    ("plain", {}),
    ("thumbs", {"thumbnail_size": 4}),
    ("scores", {"include_scores": True}),
    ("compare", {"interventions": MASK_AND_BETA, "compare": True, "include_base": True, "thumbnail_size": 4}),
    ("samples", {"interventions": NOISE, "compare": True, "samples": 3}),
    ("json", {"encoding": "json", "interventions": MASK_AND_BETA, "thumbnail_size": 5}),
    ("value", {"weighting": "value_norm", "thumbnail_size": 4}),
    ("value-compare", {"weighting": "value_norm", "interventions": MASK_AND_BETA, "compare": True,
                       "include_base": True, "thumbnail_size": 4}),
    ("value-scores", {"weighting": "value_norm", "include_scores": True, "layers": [1], "heads": [0, 2]}),
    ("value-json", {"weighting": "value_norm", "encoding": "json", "layers": [0], "heads": [3]}),
]
SEQ2SEQ_CASES = [
    ("plain", {}),
    ("compare", {"interventions": [{"op": "mask_keys", "tokens": [2], "kind": "cross"}], "compare": True,
                 "include_base": True}),
    ("value", {"weighting": "value_norm"}),
    ("value-compare", {"weighting": "value_norm", "interventions": [{"op": "mask_keys", "tokens": [2], "kind": "cross"}],
                       "compare": True, "include_base": True}),
]
IMAGE_CASES = [
    ("plain", {"thumbnail_size": 4}),
    ("queries", {"queries": [0, 3, 5]}),
    ("compare", {"interventions": [{"op": "mask_keys", "tokens": [3, 7]}], "compare": True, "include_base": True}),
    ("value", {"weighting": "value_norm", "thumbnail_size": 4}),
    ("value-queries", {"weighting": "value_norm", "queries": [0, 3, 5], "thumbnail_size": 4}),
]
AUDIO_CASES = [
    ("plain", {"layers": [1], "heads": [0, 2], "encoder_layers": [1], "kinds": ["cross", "decoder", "encoder"]}),
    ("compare", {"layers": [2], "heads": [1], "kinds": ["cross", "decoder"], "compare": True,
                 "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(100, 150))}]}),
    ("value", {"layers": [1], "heads": [2], "encoder_layers": [1], "kinds": ["cross", "decoder", "encoder"],
               "weighting": "value_norm"}),
]


def _stable(body):
    """The response without its random ids and timings (nested: seq2seq and speech keep theirs at the top too)."""
    if isinstance(body, dict):
        return {k: _stable(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [_stable(v) for v in body]
    return body


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {"tiny-llama": str(build_text_model("llama", root / "llama", seed=7)),
            "tiny-bert": str(build_text_model("bert", root / "bert", seed=8)),
            "tiny-bart": str(build_text_model("bart", root / "bart", seed=9)),
            "tiny-vit": str(build_image_model("vit", root / "vit", seed=10))}


def _app(folders, long: bool) -> TestClient:
    text = {k: v for k, v in folders.items() if k != "tiny-vit"}
    limits = dict(full_map_tokens=8, full_map_tokens_image=8, overview_blocks=5, atlas_block_rows=4) if long else {}
    settings = Settings(default_models=[], extra_models=text, extra_image_models={"tiny-vit": folders["tiny-vit"]},
                        max_response_numbers=400_000, max_text_chars=4000, **limits)
    return TestClient(create_app(settings))


def _answers(folders) -> dict[str, object]:
    """Every case's response (or its status and detail when refused), by name."""
    out: dict[str, object] = {}

    def record(name: str, response) -> None:
        out[name] = _stable(response.json()) if response.status_code == 200 else [response.status_code, response.text]

    for long in (False, True):
        size = "long" if long else "short"
        with _app(folders, long) as client:
            for model in ("tiny-llama", "tiny-bert"):
                for name, body in TEXT_CASES:
                    request = {"model": model, "text": TEXT, "encoding": "f32", **body}
                    record(f"text/{model}/{size}/{name}", client.post("/api/text/attention", json=request))
            for name, body in SEQ2SEQ_CASES:
                request = {"model": "tiny-bart", "text": TEXT, "target": TARGET, "encoding": "f32", **body}
                record(f"text/tiny-bart/{size}/{name}", client.post("/api/text/attention", json=request))
            upload = client.post("/api/images", files={"file": ("p.png", _png(11), "image/png")})
            assert upload.status_code == 200, upload.text
            for name, body in IMAGE_CASES:
                request = {"model": "tiny-vit", "image_id": upload.json()["image_id"], "image_size": 32,
                           "encoding": "f32", **body}
                record(f"image/tiny-vit/{size}/{name}", client.post("/api/image/attention", json=request))
    return out


def _real_answers() -> dict[str, object]:
    """smollm2-135m (short and value-weighted) and whisper-tiny-en on the bundled clip, where they are prepared."""
    out: dict[str, object] = {}
    weights = ROOT / "weights"
    settings = Settings(default_models=[], max_response_numbers=400_000, max_audio_s=10.0)
    with TestClient(create_app(settings)) as client:
        if (weights / "smollm2-135m" / "prepared.json").is_file():
            for name, body in [("plain", {"layers": [3], "heads": [0, 5], "thumbnail_size": 8}),
                               ("value-compare", {"layers": [3], "heads": [0, 5], "weighting": "value_norm",
                                                  "interventions": MASK_AND_BETA, "compare": True,
                                                  "include_base": True, "thumbnail_size": 8})]:
                response = client.post("/api/text/attention", json={"model": "smollm2-135m", "text": TEXT,
                                                                     "encoding": "f32", **body})
                out[f"text/smollm2-135m/{name}"] = _stable(response.json()) if response.status_code == 200 else [
                    response.status_code, response.text]
        if (weights / "whisper-tiny-en" / "prepared.json").is_file() and SPEECH_SAMPLE.is_file():
            audio_id = client.get("/api/audio/sample").json()["audio_id"]
            for name, body in AUDIO_CASES:
                response = client.post("/api/audio/attention", json={"audio_id": audio_id, "encoding": "f32", **body})
                out[f"audio/whisper-tiny-en/{name}"] = _stable(response.json()) if response.status_code == 200 else [
                    response.status_code, response.text]
    return out


def _compare(found: dict, expected: dict) -> None:
    assert sorted(found) == sorted(expected)
    different = [name for name in expected if found[name] != expected[name]]
    for name in different[:3]:  # the first differing keys of the first cases, to see what moved
        a, b = found[name], expected[name]
        keys = sorted(set(a) | set(b)) if isinstance(a, dict) and isinstance(b, dict) else ["(whole)"]
        print(name, [k for k in keys if not isinstance(a, dict) or a.get(k) != b.get(k)])
    assert not different, f"{len(different)} responses differ: {different}"


def test_responses_equal_the_recorded_ones(folders):
    found = {**_answers(folders), **_real_answers()}
    assert not any(isinstance(v, list) for v in found.values()), [k for k, v in found.items() if isinstance(v, list)]
    record, reference = os.environ.get("ATTNLAB_PARITY_RECORD"), os.environ.get("ATTNLAB_PARITY_REFERENCE")
    if record:
        Path(record).write_text(json.dumps(found, sort_keys=True))
        return
    if reference:
        _compare(found, json.loads(Path(reference).read_text()))
        return
    # neither: fresh apps answer the tiny models' requests again with the same numbers (the real models once only)
    _compare({k: v for k, v in found.items() if "/tiny-" in k}, _answers(folders))
