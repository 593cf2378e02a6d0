"""The request path's limits (issue 20 §2): settings are their only source (the schemas carry types), and one check,
app.attention.check_request_limits, answers every route the same way: a 422 naming the field and the setting."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app import schemas
from app.main import create_app
from app.settings import Settings
from models.ops import OPS

# Request fields whose limit is a setting (max_samples, max_interventions, max_thumbnail_size, max_new_tokens,
# max_text_chars, max_tokens): their JSON schema must not carry a second, different number.
SETTING_LIMITED = {"samples", "interventions", "thumbnail_size", "max_new_tokens", "text", "text_pair", "target",
                   "clean", "corrupt", "layers", "heads", "queries", "tokens"}
BOUNDS = {"maximum", "exclusiveMaximum", "maxItems", "maxLength"}


def _bounds(schema: dict, components: dict) -> set[str]:
    """The upper bounds a property's schema carries, through $ref, anyOf and array items."""
    found = set(BOUNDS) & set(schema)
    if "$ref" in schema:
        found |= _bounds(components[schema["$ref"].rsplit("/", 1)[1]], components)
    for part in schema.get("anyOf", []) + schema.get("allOf", []):
        found |= _bounds(part, components)
    if isinstance(schema.get("items"), dict) and "$ref" not in schema["items"]:
        found |= _bounds(schema["items"], components)
    return found


def test_request_schemas_carry_no_limit_that_a_setting_owns():
    components = create_app(Settings(default_models=[])).openapi()["components"]["schemas"]
    # the request models of app/schemas.py, the interventions' items (the ops', models/ops/) and the image and
    # speech routes'
    owned = {name for name, value in vars(schemas).items() if isinstance(value, type) and issubclass(value, BaseModel)}
    owned |= {op.schema.__name__ for op in OPS.values()}
    owned |= {"ImageAttentionRequest", "AudioAttentionRequest"}
    checked = []
    for name, schema in components.items():
        if name not in owned:
            continue
        for field, prop in schema.get("properties", {}).items():
            if field in SETTING_LIMITED:
                checked.append(f"{name}.{field}")
                assert not _bounds(prop, components), f"{name}.{field} has {_bounds(prop, components)} in its schema"
    # the request models are all there (a renamed one would make this test check nothing)
    for expected in ("TextAttentionRequest.samples", "TextAttentionRequest.interventions", "GenerateRequest.max_new_tokens",
                     "ImageAttentionRequest.queries", "PatchingRequest.clean", "MaskKeys.tokens", "LensRequest.text"):
        assert expected in checked


@pytest.fixture(scope="module")
def raised(tiny_bert):
    """Settings above the numbers the schemas used to carry (samples ≤ 64, interventions ≤ 256, thumbnails ≤ 64)."""
    settings = Settings(default_models=["tiny"], extra_text_models={"tiny": str(tiny_bert)}, max_samples=80,
                        max_interventions=300, max_thumbnail_size=100)
    with TestClient(create_app(settings)) as client:
        client.app.state.runtime.warm_up()
        yield client


BODY = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0]}
BETA = {"op": "temperature", "beta": 0.5}


def test_settings_alone_set_the_limits(raised):
    r = raised.post("/api/text/attention", json={**BODY, "samples": 70, "thumbnail_size": 80, "interventions": [BETA] * 257})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["thumbnails"]["shape"][:2] == [2, 4]
    for field, value, setting in (("samples", 81, "max_samples"), ("thumbnail_size", 101, "max_thumbnail_size"),
                                  ("interventions", [BETA] * 301, "max_interventions")):
        r = raised.post("/api/text/attention", json={**BODY, field: value})
        assert r.status_code == 422, (field, r.status_code)
        assert r.json()["detail"][0]["loc"] == ["body", field] and setting in r.json()["detail"][0]["msg"]


# One over-the-limit field per route, with a model and an image/clip that do not exist: the one check runs first,
# so each answer is the limit's 422, not "unknown model" or a 404 (no model loads, no store is read).
NOPE = "0" * 32
ROUTES = {
    "/api/text/attention": {"model": "nope", "text": "a"},
    "/api/text/generate": {"model": "nope", "text": "a", "max_new_tokens": 1},
    "/api/image/attention": {"model": "nope", "image_id": NOPE},
    "/api/audio/attention": {"model": "nope", "audio_id": NOPE},
    "/api/audio/transcribe": {"model": "nope", "audio_id": NOPE},
    "/api/text/patching": {"model": "nope", "clean": "a", "corrupt": "b", "answer": "x", "wrong": "y"},
    "/api/text/lens": {"model": "nope", "text": "a"},
}
OVER = [(path, "interventions", [BETA] * 3, "max_interventions") for path in ROUTES]
OVER += [("/api/text/attention", "samples", 3, "max_samples"), ("/api/text/attention", "thumbnail_size", 9, "max_thumbnail_size"),
         ("/api/image/attention", "samples", 3, "max_samples"), ("/api/text/generate", "max_new_tokens", 3, "max_new_tokens")]
OVER += [(path, field, "x" * 41, "max_text_chars") for path, field in (
    ("/api/text/attention", "text"), ("/api/text/attention", "text_pair"), ("/api/text/attention", "target"),
    ("/api/text/generate", "text"), ("/api/text/patching", "clean"), ("/api/text/patching", "corrupt"),
    ("/api/text/lens", "text"), ("/api/text/faithfulness", "text"), ("/api/audio/attention", "target"))]


@pytest.fixture(scope="module")
def strict():
    settings = Settings(default_models=[], max_interventions=2, max_samples=2, max_thumbnail_size=8, max_new_tokens=2,
                        max_text_chars=40)
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("path,field,value,setting", OVER, ids=[f"{p.removeprefix('/api/')}:{f}" for p, f, _, _ in OVER])
def test_every_route_answers_its_limits_with_the_one_check(strict, path, field, value, setting):
    body = {**ROUTES.get(path, {"model": "nope", "text": "a"}), field: value}
    r = strict.post(path, json=body)
    assert r.status_code == 422, r.text[:300]
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", field] and f"({setting})" in detail["msg"], detail
