"""/api/luong/* on the models `attnlab prepare` trained (weights/luong/): the served alignment is recomputed here from
the model's own hidden states and each score's formula, the output is the model's own greedy decode, the
Transformer's cross-attention is its own, and bad input is a 422 naming the field."""
from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from app.deps import get_app_settings
from app.main import create_app
from app.settings import Settings
from models import luong
from tests.luong_weights import scores_by_hand, trained_folder

TEXT = "the 3rd of March 2021"


@pytest.fixture(scope="module")
def client():
    folder = trained_folder()
    app = create_app(Settings(default_models=[], weights_dir=str(folder.parent)))
    with TestClient(app) as c:
        yield c


def post(client, **body):
    r = client.post("/api/luong/attention", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def recomputed(score: str, text: str, out_tokens: list[str], beta=1.0, mask=(), noise=None):
    """The alignment softmax(β score(h_t, h̄_s) + M) from the model's hidden states along the served output."""
    model = luong.load_model(str(trained_folder()), score)
    with torch.no_grad():
        src = torch.tensor([[luong.SOURCE_VOCAB.stoi[c] for c in text]])
        hs, _ = model.encoder(model.src_embed(src))                                   # (1, S, H)
        h0 = hs[:, -1][None]                                                          # the last source state
        if noise is not None:
            hs = hs + noise
        ids = [luong.BOS] + [luong.TARGET_VOCAB.stoi[t] for t in out_tokens[:-1]]
        h, _ = model.decoder(model.tgt_embed(torch.tensor([ids])), h0)                # (1, T, H)
        raw = scores_by_hand(model, h, hs)[0]                                         # (T, S)
        logits = beta * raw
        logits[:, list(mask)] = float("-inf")
        return logits.softmax(-1), raw


@pytest.mark.parametrize("score", luong.SCORES)
def test_the_served_alignment_is_the_softmax_of_the_score_from_the_models_states(client, score):
    for text in (TEXT, "03/03/2021", "July the 21st, 1969"):
        a = post(client, score=score, text=text)
        expected, raw = recomputed(score, text, a["output"]["tokens"])
        assert (torch.tensor(a["alignment"], dtype=torch.float64) - expected).abs().max() <= 1e-6
        assert (torch.tensor(a["scores"], dtype=torch.float64) - raw).abs().max() <= 1e-6
        assert a["source_tokens"] == list(text) and a["effect"] is None


@pytest.mark.parametrize("score", luong.SCORES)
def test_the_decoded_output_is_the_models_own_greedy_decode(client, score):
    model = luong.load_model(str(trained_folder()), score)
    transformer = luong.load_model(str(trained_folder()), "transformer")
    for text in (TEXT, "3 March 2021", "14.7.1989", "Mar 3 2021"):
        a = post(client, score=score, text=text)
        ids = luong.greedy(model, [text])[0]
        assert a["output"]["tokens"] == [luong.TARGET_VOCAB.itos[i] for i in ids]
        assert a["output"]["text"] == luong.TARGET_VOCAB.decode(ids)
        assert a["transformer"]["output"]["tokens"] == [luong.TARGET_VOCAB.itos[i] for i in luong.greedy(transformer, [text])[0]]


def test_interventions_are_the_formula_with_beta_masks_and_the_seeded_noise(client):
    S = len(TEXT)
    a = post(client, score="general", text=TEXT, beta=2.5, mask=[17, 18], perturb={"sigma": 0.3, "seed": 11, "positions": [4, 5]})
    noise = torch.randn(1, S, 64, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    keep = torch.zeros(S, dtype=torch.bool)
    keep[[4, 5]] = True
    expected, _ = recomputed("general", TEXT, a["output"]["tokens"], beta=2.5, mask=(17, 18), noise=0.3 * noise * keep[None, :, None])
    assert (torch.tensor(a["alignment"], dtype=torch.float64) - expected).abs().max() <= 1e-6
    plain = post(client, score="general", text=TEXT)
    effect = a["effect"]
    assert effect["baseline"]["output"] == plain["output"] and effect["baseline"]["alignment"] == plain["alignment"]
    assert effect["changed"] == (plain["output"]["tokens"] != a["output"]["tokens"])
    assert len(effect["kl"]) == len(plain["output"]["tokens"]) and min(effect["kl"]) >= 0
    assert all(row[17] == 0 == row[18] for row in a["alignment"])


def test_masking_the_year_changes_the_year_written(client):
    plain = post(client, score="dot", text=TEXT)
    year = [TEXT.index("2021") + i for i in range(4)]
    masked = post(client, score="dot", text=TEXT, mask=year)
    assert masked["effect"]["changed"] and masked["output"]["text"][:4] != plain["output"]["text"][:4]
    assert masked["effect"]["kl_mean"] > 0.1


def test_the_transformers_cross_attention_is_per_layer_and_head_and_sums_to_one(client):
    a = post(client, score="concat", text=TEXT)
    tr = a["transformer"]
    P = torch.tensor(tr["cross_attention"], dtype=torch.float64)                      # (L, h, T, S)
    assert P.shape == (tr["layers"], tr["heads"], len(tr["output"]["tokens"]), len(TEXT))
    assert (P.sum(-1) - 1).abs().max() < 1e-9
    model = luong.load_model(str(trained_folder()), "transformer")
    ids = [luong.BOS] + [luong.TARGET_VOCAB.stoi[t] for t in tr["output"]["tokens"][:-1]]
    with torch.no_grad():
        memory, allowed = model.encode(*luong.batch_sources([TEXT], luong.MAX_SOURCE))
        _, cross = model.decode(torch.tensor([ids]), memory, allowed)
    assert (torch.stack([c[0] for c in cross]) - P).abs().max() <= 1e-9


def test_the_models_are_listed_with_their_heldout_accuracy(client):
    listing = client.get("/api/luong/models").json()
    results = luong.load_results(str(trained_folder()))
    assert [m["name"] for m in listing["models"]] == [*luong.SCORES, "transformer"]
    for m in listing["models"]:
        assert m["heldout_exact_match"] == results["models"][m["name"]]["heldout_exact_match"]
    assert listing["split"]["heldout"] > 0 and listing["train_s_total"] > 0


@pytest.mark.parametrize("body, field", [
    ({"text": "the 3rd of MARCH 2021"}, "text"),
    ({"text": ""}, "text"),
    ({"text": "x" * 40}, "text"),
    ({"text": "3.3.2021", "mask": list(range(8))}, "mask"),
    ({"text": "3.3.2021", "mask": [8]}, "mask"),
    ({"text": "3.3.2021", "mask": [40]}, "mask"),
    ({"beta": -1}, "beta"),
    ({"beta": 1e9}, "beta"),
    ({"score": "bilinear"}, "score"),
    ({"perturb": {"sigma": 1.0, "positions": [30]}, "text": "3.3.2021"}, "perturb"),
    ({"perturb": {"sigma": -1.0}}, "perturb"),
    ({"temperature": 2}, "temperature"),
])
def test_bad_input_is_a_422_naming_the_field(client, body, field):
    r = client.post("/api/luong/attention", json=body)
    assert r.status_code == 422, r.text
    assert any(field in [str(x) for x in d["loc"]] for d in r.json()["detail"]), r.json()


def test_not_prepared_is_a_503_with_retry_after(client, tmp_path):
    client.app.dependency_overrides[get_app_settings] = lambda: Settings(default_models=[], weights_dir=str(tmp_path))
    try:
        r = client.post("/api/luong/attention", json={"text": TEXT})
        assert r.status_code == 503 and "attnlab prepare" in r.json()["detail"] and r.headers["Retry-After"]
        assert client.get("/api/luong/models").status_code == 503
    finally:
        client.app.dependency_overrides.clear()


def test_the_page_is_served_with_its_examples(client):
    r = client.get("/luong")
    assert r.status_code == 200 and "luong.js" in r.text and 'href="/luong"' in r.text
    for example in luong.EXAMPLES:
        assert not luong.SOURCE_VOCAB.unknown(example)
