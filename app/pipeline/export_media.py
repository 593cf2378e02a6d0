"""The work of the image and speech pages' standalone HTML export (POST /api/image/export.html and
/api/audio/export.html, app/routes/export_media.py; issue 31 §3): the same single file as the text page's
(attnlab/export.py). Each runs its page's own attention work (app/pipeline/image.py image_work, app/pipeline/audio.py
audio_work: what the attention routes run, not their handlers) and hands the exporter a response of the embedded
view's shape.

The embedded view (static/js/views/embed.js) draws one square map over one list of tokens:
- images: the patches are the tokens ("CLS", any prefix tokens, then "p(row,col)"), with the scores view-mode β needs;
- speech: the decoder's self-attention over the decoder tokens (causal). Cross-attention (tokens × 1,500 audio
  positions) is not square, and the view does not draw it. The speech work returns no scores, so the file carries
  Ŝ = ln P / β₀, which gives P back under softmax(β₀·Ŝ) (a row's constant cancels in the softmax): view-mode β is
  then P^(β/β₀) re-normalised per row, as softmax(β·Ŝ) of the run's own scores would give."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from app.audiostore import AudioStore
from app.context import current
from app.errors import field_error
from app.imagestore import UploadStore
from app.pipeline.audio import AudioAttentionRequest, audio_work
from app.pipeline.image import ImageAttentionRequest, image_work
from app.runtime import Runtime

# A key the run gave P = 0 (a masked key): a score whose softmax weight is 0 at any β the slider reaches.
MASKED_SCORE = -1e30


def _plain(body: dict[str, Any]) -> dict[str, Any]:
    """The work's answer as its JSON would read back (numpy arrays as lists), the form the exporter writes."""
    return orjson.loads(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))


def image_export(runtime: Runtime, store: UploadStore, req: ImageAttentionRequest, layer: int | None,
                 head: int | None) -> str:
    """The attention of `req` over the image's patches (every layer and head unless `layers`/`heads` name some) as one
    HTML page with the view-mode controls; its tokens are the page's patch labels. 413 naming image_size when the
    image has an overview, not full maps."""
    body = req.model_copy(update={
        "include_scores": req.weighting != "value_norm",  # scores for view-mode β: not for value-weighted maps
        "encoding": "f32", "compare": False, "include_base": False, "samples": 1, "thumbnail_size": None,
        "queries": None,  # the view is the whole square map
    })
    response = _plain(image_work(runtime, store, body)(current()))
    if response.get("attention") is None:
        raise field_error(("image_size",), f"{len(response.get('tokens', []))} tokens is over full_map_tokens_image "
                          f"({runtime.settings.full_map_tokens_image}): a large image has an overview, not full maps "
                          "to export; ask for a smaller image_size")
    from attnlab.export import standalone_html

    rows, cols = response.get("grid") or ["?", "?"]
    title = f"attnlab · {response.get('model', req.model)} · image {req.image_id[:8]} · {rows}×{cols} patches"
    request_fields = body.model_dump(mode="json", exclude_none=True)
    request_fields["text"] = f"image {req.image_id[:8]}, {rows}×{cols} patches: CLS, then p(row,col) row by row"  # its title line
    return standalone_html(response, request=request_fields, title=title, layer=layer, head=head)


def audio_export(runtime: Runtime, store: AudioStore, req: AudioAttentionRequest, layer: int | None,
                 head: int | None) -> str:
    """The decoder self-attention of `req` (decoder tokens × decoder tokens, causal) as one HTML page with the
    view-mode controls; cross-attention is not in it (its map is not square)."""
    body = req.model_copy(update={"kinds": ["decoder"], "encoding": "f32", "compare": False, "encoder_layers": None})
    response = _plain(audio_work(runtime, store, body)(current()))
    view = decoder_view(response, body.interventions)
    from attnlab.export import standalone_html

    transcript = (response.get("transcript") or "").strip()
    title = (f"attnlab · {response.get('model', req.model)} · decoder self-attention · "
             f"“{transcript[:60]}{'…' if len(transcript) > 60 else ''}”")
    request_fields = body.model_dump(mode="json", exclude_none=True)
    request_fields["text"] = f"decoder self-attention (not the cross-attention) of: {transcript}"  # its title line
    return standalone_html(view, request=request_fields, title=title, layer=layer, head=head)


def run_betas(interventions, layers: list[int], heads: list[int], native_beta: float, kind: str = "decoder") -> np.ndarray:
    """The β each returned (layer, head) of attention `kind` ran at: β₀, or the last temperature that covers it (an
    item with kind null covers every kind; layers/heads null every layer/head), as models/interventions.py plans it.
    interventions: the request's items (pydantic models or dicts). → (len(layers), len(heads))"""
    betas = np.full((len(layers), len(heads)), float(native_beta))
    for iv in interventions or ():
        item = iv if isinstance(iv, dict) else iv.model_dump()
        if item.get("op") != "temperature" or item.get("kind") not in (None, kind):
            continue
        for li, layer in enumerate(layers):
            for hi, head in enumerate(heads):
                if item.get("layers") is None or layer in item["layers"]:
                    if item.get("heads") is None or head in item["heads"]:
                        betas[li, hi] = float(item["beta"])
    return betas


def decoder_view(response: dict, interventions=()) -> dict:
    """The speech response as the embedded view's square-map response: the decoder self-attention (L, H, N, N) over
    the decoder tokens, with Ŝ = ln P / β as its scores, β the run's for each head (β₀ unless a temperature on the
    decoder changed it: softmax(β·Ŝ) is then P again, and the slider starts from the map drawn; see the module's
    note; P = 0 → MASKED_SCORE)."""
    decoder = response["attention"]["decoder"]
    P = np.frombuffer(base64.b64decode(decoder["data"]), dtype="<f4").reshape(decoder["shape"])
    beta0 = float(response.get("native_beta") or 1.0)
    layers = response.get("layers") or list(range(P.shape[0]))
    heads = response.get("heads") or list(range(P.shape[1]))
    betas = run_betas(interventions, layers, heads, beta0)[:, :, None, None]  # (L, H, 1, 1)
    with np.errstate(divide="ignore"):
        S = np.where(P > 0, np.log(np.where(P > 0, P, 1.0)) / betas, MASKED_SCORE).astype("<f4")  # (L, H, N, N)
    scores = {**decoder, "data": base64.b64encode(S.tobytes()).decode("ascii")}
    keep = ("model", "tokens", "layers", "heads", "native_beta", "transcript", "weighting", "run_id")
    view = {name: response[name] for name in keep if name in response}
    return {**view, "attention": decoder, "view_kind": "decoder",
            "scores": scores if response.get("weighting", "attention") != "value_norm" else None}
