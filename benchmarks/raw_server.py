"""The floor under any served view (benchmarks/first_view.py `--floor`): the raw baseline's forward behind the same
uvicorn and HTTP parser as `python -m app.serve`, answering the text page's first-view request with a body of the same
kind and size, and nothing else: no checks, no cache, no run kept, no admission, no middleware.

POST /api/text/attention takes the first view's JSON (text, layers, heads, thumbnail_size) and answers:
- `attention`: the asked head's P, (1, 1, T, T) float32, base64 (as the app's f32 encoding);
- `scores`: the same head's q kᵀ from the layer's query and key projections (the raw forward does not return
  scores), (1, 1, T, T) float32, base64: the app's Ŝ for minilm; for the LM the projections before the rotary
  embedding (the same size and work, not the app's values);
- `thumbnails`: every head's P pooled to size × size (adaptive average pooling), levels 0-255 as uint8, base64;
- `tokens` and `received` (the asked head's mean over queries). Not the app's per-head summaries (entropy, sink
  mass, mean distance: their passes over every head's P are work a floor leaves out);
with a Server-Timing header as the app's: `model` the tokenizer and forward, `app` the endpoint from its body read.

The model is `ATTNLAB_FLOOR_MODEL` (minilm, or the LM's id), loaded as the benchmark's own baseline loads it
(benchmarks/run_all.py RawForward, RawLM), its Linear layers routed as the app routes them on this CPU
(models/cpu_linear.py), so that app − floor is the app's work besides the same forward.

As the app, it reads ATTNLAB_TORCH_THREADS (torch's threads; 0 or unset: torch's default) and ATTNLAB_CPU_LINEAR
(auto | onednn | blas, models/cpu_linear.py): first_view.py `--threads` and `--cpu-linear` set both sides alike, so
that on a loaded machine neither side's start-up timing nor thread count differs from the other's.

    ATTNLAB_FLOOR_MODEL=minilm python -m uvicorn benchmarks.raw_server:app --port 8123
"""
from __future__ import annotations

import json
import os
import time

import orjson
import torch
import torch.nn.functional as F
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.attention import thumbnail_field
from app.encoding import tensor_field
from benchmarks.run_all import LM, RawForward, RawLM
from models.cpu_linear import set_cpu_linear


class Floor:
    def __init__(self, model: str):
        self.raw = RawLM(same_gemm_as_app=True) if model == LM else RawForward(same_gemm_as_app=True)
        self.model = self.raw.model
        self.truncation = {} if model == LM else {"truncation": True, "max_length": 512}
        self.scores_of: dict[str, torch.Tensor] = {}
        self._hook_scores()

    def _hook_scores(self) -> None:
        """Keep layer 0's query and key projections (B, T, D) as the forward makes them: Ŝ = q kᵀ of head 0."""
        layer = self.model.encoder.layer[0].attention.self if hasattr(self.model, "encoder") else \
            self.model.model.layers[0].self_attn
        for name in ("query", "key") if hasattr(layer, "query") else ("q_proj", "k_proj"):
            getattr(layer, name).register_forward_hook(
                lambda _module, _inputs, out, name=name: self.scores_of.__setitem__(name[0], out))

    @torch.inference_mode()
    def view(self, body: dict) -> dict:
        # the baseline's own call (RawForward, RawLM), its token ids kept for the tokens field
        started = time.perf_counter()
        inputs = self.raw.tokenizer(body["text"], return_tensors="pt", **self.truncation)
        out = self.model(**inputs, output_attentions=True)
        forward_s = time.perf_counter() - started
        layer, head = body["layers"][0], body["heads"][0]
        p = out.attentions[layer][:, head][None]  # (1, 1, T, T)
        n_heads = out.attentions[layer].shape[1]
        q = self.scores_of["q"][0].unflatten(-1, (n_heads, -1))[:, head]  # (T, d)
        k = self.scores_of["k"][0]
        n_kv = k.shape[-1] // q.shape[-1]  # a grouped-query model's key heads: query head h reads h // (H / H_kv)
        k = k.unflatten(-1, (n_kv, -1))[:, head // (n_heads // n_kv)]  # (T, d)
        size = body.get("thumbnail_size") or 24
        pooled = torch.cat([F.adaptive_avg_pool2d(a, size) for a in out.attentions])  # (L, H, size, size)
        peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)  # (L, H)
        levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)
        # the app's own field encoders (app/encoding.py, app/attention.py): the same bytes for the same values
        return forward_s, {"tokens": self.raw.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist()),
                           "attention": tensor_field(p, "f32"), "scores": tensor_field((q @ k.T)[None, None], "f32"),
                           "thumbnails": thumbnail_field(levels.numpy(), peak.numpy()),
                           "received": p.mean(dim=2).tolist()}


if int(os.environ.get("ATTNLAB_TORCH_THREADS") or 0) > 0:
    torch.set_num_threads(int(os.environ["ATTNLAB_TORCH_THREADS"]))
set_cpu_linear(os.environ.get("ATTNLAB_CPU_LINEAR", "auto"))  # before the model is routed (same_gemm)
FLOOR = Floor(os.environ.get("ATTNLAB_FLOOR_MODEL", "minilm"))


async def attention(request: Request) -> Response:
    body = json.loads(await request.body())
    started = time.perf_counter()
    forward_s, view = await run_in_threadpool(FLOOR.view, body)  # on a worker thread, as the app's routes run
    response = Response(orjson.dumps(view), media_type="application/json")
    # as the app's Server-Timing: `model` the forward (tokenizer included), `app` the endpoint's whole time
    app_s = time.perf_counter() - started
    response.headers["server-timing"] = f"model;dur={forward_s * 1000:.1f}, app;dur={app_s * 1000:.1f}"
    return response


async def ready(_request: Request) -> Response:
    return Response(b'{"ready": true}', media_type="application/json")


app = Starlette(routes=[Route("/api/text/attention", attention, methods=["POST"]), Route("/api/ready", ready)])
