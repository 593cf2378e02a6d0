"""Long images through the API (issue 20: "dinov2-small at 896 px opens with an overview and zooms into windows").

- A tiny random DINOv2 over full_map_tokens_image: every window of every head, from POST /api/runs/{id}/window,
  equals transformers' own eager attention weights to ≤ 1e-6 with masks and β active. The eager model gets them its
  own way: the masked patches through its `attention_mask` (every layer and head), β as the factor β/β₀ on the
  scoped heads' queries (a forward hook on the query projection).
- The real dinov2-small at 896 px (4,097 tokens) with the default settings: admitted (max_image_tokens, the cost
  estimate and the memory budget), an overview whose block-rows sum to 1, received summing to 1, a window equal to the
  query row the response carries, and the image page's first view (one head's overview, every head's query row)
  under 2 MB.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.images import decode_image
from tests.api.test_images_api import build_tiny_vit, png_bytes
from tests.float32 import assert_close_f32, attention_terms

ROOT = Path(__file__).resolve().parents[2]
MASKED = [3, 7, 20]  # patch tokens masked as keys at every layer and head
BETA = {"layer": 1, "head": 1, "beta": 0.2}


def _upload(client, data: bytes) -> str:
    response = client.post("/api/images", files={"file": ("photo.png", data, "image/png")})
    assert response.status_code == 200, response.text
    return response.json()["image_id"]


def _eager_weights(folder: Path, pixel_values: torch.Tensor, n_tokens: int, native_beta: float) -> torch.Tensor:
    """(L, H, T, T) of the eager model with MASKED keys masked and BETA on its head."""
    from transformers import Dinov2Model

    model = Dinov2Model.from_pretrained(folder, attn_implementation="eager").eval()
    heads = model.config.num_attention_heads
    head_dim = model.config.hidden_size // heads

    def scale(module, args, output):  # (1, T, H·d): the scoped head's queries × β/β₀
        out = output.clone().view(*output.shape[:2], heads, head_dim)
        out[:, :, BETA["head"]] *= BETA["beta"] / native_beta
        return out.view(output.shape)

    hook = model.encoder.layer[BETA["layer"]].attention.q_proj.register_forward_hook(scale)
    mask = torch.ones(1, n_tokens, dtype=torch.long)
    mask[0, MASKED] = 0
    try:
        with torch.inference_mode():
            out = model(pixel_values=pixel_values, attention_mask=mask, output_attentions=True, return_dict=True)
    finally:
        hook.remove()
    return torch.stack(out.attentions)[:, 0].float()


def test_long_tiny_dinov2_windows_equal_eager_with_masks_and_beta(tmp_path):
    folder = build_tiny_vit(tmp_path / "dino", kind="dinov2", seed=4)
    settings = Settings(default_models=[], extra_image_models={"tiny-dino": str(folder)}, full_map_tokens_image=8,
                        overview_blocks=5, atlas_block_rows=4, max_response_numbers=200_000)
    with TestClient(create_app(settings)) as client:
        image_id = _upload(client, png_bytes((64, 48), seed=11))
        interventions = [{"op": "temperature", "beta": BETA["beta"], "layers": [BETA["layer"]], "heads": [BETA["head"]]},
                         {"op": "mask_keys", "tokens": MASKED}]
        response = client.post("/api/image/attention", json={"model": "tiny-dino", "image_id": image_id, "image_size": 48,
                                                             "interventions": interventions, "queries": [0]})
        assert response.status_code == 200, response.text
        body = response.json()
        n = len(body["tokens"])
        assert n == 37 and body["overview"] is not None and body["grid"] == [6, 6]
        run = body["run_id"]
        adapter = client.app.state.runtime.adapter("tiny-dino", kind="image")
        encoded = adapter.encode(decode_image(png_bytes((64, 48), seed=11)).image, "x", 48)
        eager = _eager_weights(folder, encoded.inputs["pixel_values"], n, adapter.info.native_beta)  # (L, H, T, T)
        assert float(eager[..., MASKED].abs().max()) == 0.0  # the eager model did mask them
        terms = attention_terms(adapter.model.config, n)  # probabilities to float32 rounding (tests/float32.py)
        for layer in range(eager.shape[0]):
            for head in range(eager.shape[1]):
                window = client.post(f"/api/runs/{run}/window", json={"layer": layer, "head": head, "rows": [0, n],
                                                                       "cols": [0, n], "encoding": "f32"})
                assert window.status_code == 200, window.text
                assert_close_f32(_decode(window.json()["attention"]), eager[layer, head], terms, scale=1.0)
        # β did change its head (against the same head without it): the comparison above can tell
        plain = client.post("/api/image/attention", json={"model": "tiny-dino", "image_id": image_id, "image_size": 48})
        window = client.post(f"/api/runs/{plain.json()['run_id']}/window",
                             json={"layer": BETA["layer"], "head": BETA["head"], "rows": [0, n], "cols": [0, n]})
        assert np.abs(np.array(window.json()["attention"]) - eager[BETA["layer"], BETA["head"]].numpy()).max() > 1e-2


def _weights_ready() -> bool:
    return (ROOT / "weights" / "dinov2-small" / "prepared.json").is_file()


@pytest.mark.slow  # dinov2-small's 4,097-token first view with its rollout, in a server of its own
def test_dinov2_small_at_896_px_opens_with_an_overview():
    if not _weights_ready():
        pytest.fail("weights/dinov2-small is missing: run `make weights`")
    settings = Settings(default_models=[])  # the defaults: max_image_tokens, the cost estimate, max_run_bytes
    with TestClient(create_app(settings)) as client:
        data = (ROOT / "static" / "samples" / "street.jpg").read_bytes()
        response = client.post("/api/images", files={"file": ("street.jpg", data, "image/jpeg")})
        image_id = response.json()["image_id"]
        # what the image page asks at 896 px: the shown head's overview, its query row, f32
        first = client.post("/api/image/attention", json={
            "model": "dinov2-small", "image_id": image_id, "image_size": 896, "layers": [11], "heads": [3],
            "queries": [0], "encoding": "f32"})
        assert first.status_code == 200, first.text
        body = first.json()
        n = len(body["tokens"])
        assert n == 4097 and body["grid"] == [64, 64] and body["attention"] is not None
        overview = body["overview"]
        edges = overview["edges"]
        assert edges[0] == 0 and edges[-1] == n and len(edges) - 1 <= settings.overview_blocks
        maps = _decode(overview["maps"])[0, 0]  # (B, B)
        widths = np.diff(edges)
        assert np.allclose((maps * widths).sum(axis=-1), 1.0, atol=1e-4)  # each block-row of P sums to 1
        received = _decode(body["received"])[0, 0]
        assert received.shape == (n,) and abs(received.sum() - 1) < 1e-4
        assert np.array(body["rollout"]).shape == (64, 64) and np.array(body["mean_distance"]).shape == (12, 6)
        # an exact window of that head: its row 0 is the query row the response carries
        window = client.post(f"/api/runs/{body['run_id']}/window", json={
            "layer": 11, "head": 3, "rows": [0, 32], "cols": [0, n], "encoding": "f32"})
        assert window.status_code == 200, window.text
        rows = _decode(window.json()["attention"])
        assert np.allclose(rows.sum(axis=-1), 1.0, atol=1e-5)
        # the response's row from the forward against the window rebuilt from q̂, k̂: q·k over the head size, softmax
        terms = attention_terms(client.app.state.runtime.adapter("dinov2-small", kind="image").model.config, n)
        assert_close_f32(rows[0], _decode(body["attention"])[0, 0, 0], terms, scale=1.0)
        # the page's first view: this response and every head's query row for the overlay and the grid
        row = client.post(f"/api/runs/{body['run_id']}/row", json={"row": 0, "encoding": "f32"})
        assert row.status_code == 200, row.text
        assert _decode(row.json()["attention"]).shape == (12, 6, n)
        first_view = len(first.content) + len(row.content)
        assert first_view <= 2 * 2**20, first_view
        print(json.dumps({"first_response_bytes": len(first.content), "rows_bytes": len(row.content),
                          "elapsed_s": body["elapsed_s"]}))


def _decode(field) -> np.ndarray:
    if isinstance(field, list):
        return np.array(field)
    return np.frombuffer(base64.b64decode(field["data"]), dtype=np.float32).reshape(field["shape"])
