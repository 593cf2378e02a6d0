"""Value-weighted attention on speech (issue 22 §3, "wherever P is"): POST /api/audio/attention takes `weighting` on the
real whisper-tiny-en. The cross rows are weighted by what each 20 ms encoder frame's value adds to the head's output,
‖v_j W_O^h‖ with v_j the encoder output through the cross-attention's v_proj and W_O its out_proj — checked here
against that computation done directly with the model's own modules; the decoder map and the encoder overview are
value-weighted too, and the kept run's windows of every kind take the weighting and agree with the response."""
from __future__ import annotations

import numpy as np
import torch

from models.audio import decode_bytes
from tests.api.test_audio_api import SAMPLE, audio_client, sample_id  # noqa: F401  (fixtures)

BODY = {"layers": [1], "heads": [2], "encoder_layers": [1], "kinds": ["cross", "decoder", "encoder"]}


def _direct_cross(adapter, features: torch.Tensor, layer: int, head: int, probs: np.ndarray) -> np.ndarray:
    """P[i, j]·‖v_j W_O^h‖ renormalised per row, with v_j = encoder output → encoder_attn.v_proj, computed here from
    the modules (no encoder intervention in these runs, so the plain encoder's output is the run's)."""
    model = adapter.model
    with torch.inference_mode():
        hidden = model.model.encoder(features.to(adapter.device)).last_hidden_state[0]  # (1500, D)
        attention = model.model.decoder.layers[layer].encoder_attn
        head_dim = attention.head_dim
        v = attention.v_proj(hidden).double()[:, head * head_dim:(head + 1) * head_dim]  # (1500, d)
        w_o = attention.out_proj.weight.double()[:, head * head_dim:(head + 1) * head_dim]  # (D, d)
        norms = torch.linalg.vector_norm(v @ w_o.T, dim=-1).cpu().numpy()  # (1500,)
    weighted = probs * norms[None, :]
    return weighted / weighted.sum(axis=-1, keepdims=True)


def test_value_norm_cross_rows_weight_each_frame_by_its_value(audio_client, sample_id):  # noqa: F811
    plain = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **BODY})
    weighted = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **BODY, "weighting": "value_norm"})
    assert plain.status_code == 200 and weighted.status_code == 200, weighted.text
    p, body = plain.json(), weighted.json()
    assert body["weighting"] == "value_norm" and p["weighting"] == "attention"
    cross, cross_p = np.array(body["attention"]["cross"]), np.array(p["attention"]["cross"])  # (1, 1, N, 1500)
    assert cross.shape == cross_p.shape and np.allclose(cross.sum(-1), 1, atol=1e-5)
    assert np.abs(cross - cross_p).max() > 1e-3
    adapter = audio_client.app.state.runtime.adapter("whisper-tiny-en", kind="audio")
    samples = decode_bytes(SAMPLE.read_bytes()).samples  # the clip the sample id names, as the server decodes it
    expected = _direct_cross(adapter, adapter._features(samples), 1, 2, cross_p[0, 0].astype(np.float64))
    assert np.abs(cross[0, 0] - expected).max() <= 1e-4
    decoder, decoder_p = np.array(body["attention"]["decoder"]), np.array(p["attention"]["decoder"])
    assert np.allclose(decoder.sum(-1), 1, atol=1e-5) and np.abs(decoder - decoder_p).max() > 1e-3
    enc, enc_p = np.array(body["attention"]["encoder"]["overview"]), np.array(p["attention"]["encoder"]["overview"])
    assert enc.shape == enc_p.shape and np.abs(enc - enc_p).max() > 1e-4
    # the transcript, words and alignment are P's, unchanged
    assert body["transcript"] == p["transcript"] and body["words"] == p["words"] and body["alignment"] == p["alignment"]
    # with a cross mask (frames 100–149) and β on the cross heads: the masked frames get 0, and the rows are still
    # the intervened P times the same frame norms (cross masks and β leave the encoder, so its values, unchanged)
    ivs = [{"op": "mask_keys", "kind": "cross", "tokens": list(range(100, 150))},
           {"op": "temperature", "kind": "cross", "beta": 0.5}]
    p_iv = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **BODY, "kinds": ["cross"],
                                                           "interventions": ivs}).json()
    vw_iv = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **BODY, "kinds": ["cross"],
                                                            "interventions": ivs, "weighting": "value_norm"}).json()
    cross_p_iv, cross_iv = np.array(p_iv["attention"]["cross"]), np.array(vw_iv["attention"]["cross"])
    assert np.abs(cross_p_iv - cross_p).max() > 1e-3 and float(np.abs(cross_iv[..., 100:150]).max()) == 0.0
    expected_iv = _direct_cross(adapter, adapter._features(samples), 1, 2, cross_p_iv[0, 0].astype(np.float64))
    assert np.abs(cross_iv[0, 0] - expected_iv).max() <= 1e-4
    bad = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, "weighting": "norm"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "weighting"


def test_value_norm_windows_of_the_kept_speech_run(audio_client, sample_id):  # noqa: F811
    body = audio_client.post("/api/audio/attention", json={"audio_id": sample_id, **BODY, "weighting": "value_norm"}).json()
    run_id = body["run_id"]
    cross = audio_client.post(f"/api/runs/{run_id}/window", json={
        "layer": 1, "head": 2, "kind": "cross", "rows": [0, 6], "cols": [0, 1500], "weighting": "value_norm"})
    assert cross.status_code == 200, cross.text
    got, shown = np.array(cross.json()["attention"]), np.array(body["attention"]["cross"])[0, 0, :6]
    assert np.array_equal(got, shown)  # the kept cross maps weighted by the kept norms: the response's numbers
    # the encoder's 1,500² map is not kept: its window is rebuilt from q̂/k̂ and weighted by the kept frame norms, and
    # agrees with the value-weighted overview's block
    encoder = audio_client.post(f"/api/runs/{run_id}/window", json={
        "layer": 1, "head": 2, "kind": "encoder", "rows": [40, 60], "cols": [0, 1500], "weighting": "value_norm"})
    assert encoder.status_code == 200, encoder.text
    rows = np.array(encoder.json()["attention"])  # (20, 1500)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-5)
    block = body["attention"]["encoder"]["block_positions"]
    overview = np.array(body["attention"]["encoder"]["overview"])[0, 0]
    np.testing.assert_allclose(rows[:block, 100:100 + block].mean(), overview[40 // block, 100 // block], rtol=1e-4)
