"""POST /api/text/export.html (app/routes/export.py): the text page's "Export HTML" as one standalone file: every
layer and head of the run with the scores view-mode β needs, the page's modules and plotly.js inlined; bad input is
the same 4xx as POST /api/text/attention, naming the field."""
from __future__ import annotations

import base64
import json

import numpy as np

TEXT = "the cat sat on the mat"


def inlined(page: str, element_id: str) -> dict:
    start = page.index(f'<script type="application/json" id="{element_id}">')
    return json.loads(page[page.index(">", start) + 1: page.index("</script>", start)])


def tensor(field: dict) -> np.ndarray:
    assert field["dtype"] == "float32"
    return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])


def test_export_is_one_file_with_every_layer_head_and_the_scores(client):
    res = client.post("/api/text/export.html", json={"model": "tiny", "text": TEXT})
    assert res.status_code == 200, res.text
    assert res.headers["content-type"].startswith("text/html")
    assert res.headers["content-disposition"] == 'attachment; filename="attnlab-tiny.html"'
    page = res.text
    data = inlined(page, "attnlab-data")
    response, request = data["response"], data["request"]
    assert request["text"] == TEXT and request["include_scores"] is True
    T = len(response["tokens"])
    P, S = tensor(response["attention"]), tensor(response["scores"])
    assert P.shape == S.shape == (2, 4, T, T)
    # the same numbers as the attention route's
    plain = client.post("/api/text/attention", json={"model": "tiny", "text": TEXT, "include_scores": True}).json()
    assert np.array_equal(P, np.array(plain["attention"], dtype=np.float32))  # the same run's float32, exactly
    modules = inlined(page, "attnlab-modules")
    assert "views/embed.js" in modules and "views/heatmap.js" in modules
    assert " src=" not in page  # every script inline: it opens offline
    assert data["layer"] is None and data["head"] is None  # opens on the first head unless told


def test_the_file_opens_on_the_head_asked_for(client):
    res = client.post("/api/text/export.html?layer=1&head=2", json={"model": "tiny", "text": TEXT})
    assert res.status_code == 200, res.text
    data = inlined(res.text, "attnlab-data")
    assert (data["layer"], data["head"]) == (1, 2)
    res = client.post("/api/text/export.html?layer=-1", json={"model": "tiny", "text": TEXT})
    assert res.status_code == 422 and "layer" in res.text


def test_bad_input_is_a_4xx_naming_the_field(client):
    cases = [({"model": "tiny", "text": "   "}, 422, "text"), ({"model": "tiny", "text": TEXT, "layers": [7]}, 422, "layers"),
             ({"model": "no-such-model", "text": TEXT}, 422, "model"), ({"model": "tiny"}, 422, "text")]
    for body, status, field in cases:
        res = client.post("/api/text/export.html", json=body)
        assert res.status_code == status, (body, res.text)
        assert field in json.dumps(res.json()["detail"]), (body, res.text)
    res = client.post("/api/text/export.html", json={"model": "tiny", "text": TEXT}, headers={"Accept": "text/event-stream"})
    assert res.status_code == 406 and "Accept" in res.json()["detail"]


def test_decoder_and_encoder_decoder_models_export(tmp_path_factory):
    """A causal LM exports with its scores; an encoder–decoder (scores not offered for it) exports its maps without."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings
    from tests.tiny_models import build_text_model

    models = {name: str(build_text_model(family, tmp_path_factory.mktemp(family)))
              for name, family in (("tiny-llama", "llama"), ("tiny-bart", "bart"))}
    with TestClient(create_app(Settings(default_models=[], extra_models=models))) as client:
        llama = client.post("/api/text/export.html", json={"model": "tiny-llama", "text": TEXT})
        bart = client.post("/api/text/export.html", json={"model": "tiny-bart", "text": TEXT})
    assert llama.status_code == 200, llama.text
    response = inlined(llama.text, "attnlab-data")["response"]
    assert response["scores"] is not None and response["output"]["kind"] == "next_token"
    assert bart.status_code == 200, bart.text
    data = inlined(bart.text, "attnlab-data")
    assert data["request"]["include_scores"] is False
    encoder = tensor(data["response"]["attention"]["encoder"])  # the file shows the encoder's self-attention
    assert encoder.shape[-1] == len(data["response"]["tokens"])
