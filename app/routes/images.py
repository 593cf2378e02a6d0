"""Images: uploads (POST /api/images), the model's view of one (GET /api/images/{id}/view),
image attention (POST /api/image/attention) and the page (/image).

Uploads are size-checked before the body is read (Content-Length) and while it streams, decoded in
the thread pool (models/images.py: allowlist, pixel limit before decoding, EXIF, every mode to RGB),
at most `max_concurrent_decodes` at once (DecodeGate in app/uploads.py: one waiting longer than `decode_wait_s` gets 503),
and kept in a bounded LRU; an upload's id is random (app/ids.py: a capability, not a content hash), and
identical content is stored once inside the store; an evicted id answers 404 and the page uploads
the file again. The page's example photos (public files) keep content-hash ids, the same on every replica.
`/view` renders take decode slots too (the same DecodeGate): 40 clients fetching views no longer slow the POSTs. With `redis_url` the uploaded bytes are also written to Redis, shared by every replica
(app/imagestore.py, reached through the ImageStoreDep dependency); Redis unreachable → 503 naming it.
"""
from __future__ import annotations

import io
import math
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse

from app.streams import respond
from app.deps import ImageStoreDep, RuntimeDep
from app.errors import error_response, too_large_response
from app.ids import is_valid_id, new_id
from app.imagestore import RETRY_AFTER_S, StoreItemTooLarge, StoreUnavailable
from app.lifecycle import ParsedJsonRoute
from app.runtime import Runtime
from app.schemas import AttentionResponse
from app.pipeline.image import (
    SAMPLE_IDS, SAMPLES, SAMPLES_DIR, ImageAttentionRequest, image_work, stored_image,
)
from app.templating import templates
from app.uploads import decode_gate, read_upload
from models.images import ImageInputError, decode_image, image_id_for, model_view

router = APIRouter(tags=["image"], route_class=ParsedJsonRoute)

MAX_VIEW_SIZE = 1036


UPLOAD_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary", "description": "PNG, JPEG or WebP"}},
        }}},
    },
    "responses": {
        "200": {"description": "stored", "content": {"application/json": {"schema": {
            "type": "object", "properties": {
                "image_id": {"type": "string"}, "width": {"type": "integer"}, "height": {"type": "integer"},
            }}}}},
        "400": {"description": "empty, truncated or undecodable image, or a malformed multipart body"},
        "403": {"description": "sent by a page of another origin (Sec-Fetch-Site cross-site/same-site, or an Origin "
                               "that is not this server and not in cors_origins)"},
        "408": {"description": "the upload did not arrive within upload_timeout_s"},
        "413": {"description": "over max_upload_bytes or max_image_pixels"},
        "415": {"description": "not PNG, JPEG or WebP, or not multipart/form-data"},
        "422": {"description": "no `file` field, or longer than max_image_aspect_ratio × its shorter side"},
        "503": {"description": "max_concurrent_decodes decodes already running for longer than decode_wait_s, "
                               "or the shared image store (Redis, redis_url) unreachable (Retry-After)"},
    },
}


@router.post("/api/images", openapi_extra=UPLOAD_OPENAPI)
async def upload_image(request: Request, store: ImageStoreDep) -> JSONResponse:
    """Store an image (multipart field `file`) and return its id (random: only who uploaded it knows it) and size (after EXIF
    orientation). ≤ max_upload_bytes (413 before the body is read when Content-Length says so),
    ≤ max_image_pixels (413, checked from the header before decoding), PNG/JPEG/WebP only (415).
    At most max_concurrent_decodes decode at once; one that waits longer than decode_wait_s gets 503."""
    settings = request.app.state.runtime.settings
    limit = settings.max_upload_bytes
    data = await read_upload(request, limit, "max_upload_bytes", "image", store)
    if isinstance(data, JSONResponse):
        return data
    gate = decode_gate(request.app)
    if not await gate.acquire():
        return JSONResponse(
            {"detail": f"server busy: {gate.limit} image decodes already running (max_concurrent_decodes) "
                       f"and none finished within {gate.wait_s:g} s (decode_wait_s); try again in a moment"},
            status_code=503, headers={"Retry-After": str(max(1, math.ceil(gate.wait_s / 4)))},
        )
    try:
        decoded = await run_in_threadpool(decode_image, data, settings.max_image_pixels, settings.max_image_aspect_ratio)
    except ImageInputError as exc:
        return error_response(exc.status, str(exc))
    finally:
        gate.release()
    image_id = new_id()  # never the content hash: an id is a capability (the store deduplicates internally)
    try:  # a Redis round trip (and the LRU's downscale): off the event loop
        await run_in_threadpool(store.put, image_id, data, decoded)
    except StoreUnavailable as exc:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    except StoreItemTooLarge as exc:
        return too_large_response(store.max_item_bytes or limit, f"file: {exc}")
    return JSONResponse({"image_id": image_id, "width": decoded.width, "height": decoded.height,
                         "format": decoded.format, "mode": decoded.source_mode})


@router.get("/api/images/{image_id}/view", response_class=Response,
            responses={200: {"content": {"image/png": {}}}, 404: {"description": "unknown or evicted image_id"},
                       503: {"description": "max_concurrent_decodes renders/decodes busy for decode_wait_s (Retry-After)"}})
async def image_view(request: Request, store: ImageStoreDep, image_id: str,
                     size: int = Query(448, ge=16, le=MAX_VIEW_SIZE)) -> Response:
    """The square the models see (center crop of the shorter side), resized to `size` px, as PNG —
    what the page draws the attention over. A render (resize + PNG encoding, tens of ms for a large upload)
    takes a slot of the decode gate like an upload's decode: many clients fetching views take turns instead of
    taking every worker thread and core from the API."""
    if not is_valid_id(image_id):
        raise HTTPException(404, detail=f"image_id {image_id!r} is not a valid id")
    gate = decode_gate(request.app)
    if not await gate.acquire():
        return JSONResponse(
            {"detail": f"server busy: {gate.limit} image decodes or views already rendering (max_concurrent_decodes) "
                       f"and none finished within {gate.wait_s:g} s (decode_wait_s); try again in a moment"},
            status_code=503, headers={"Retry-After": str(max(1, math.ceil(gate.wait_s / 4)))},
        )
    try:
        png = await run_in_threadpool(_render_view, store, image_id, size)
    finally:
        gate.release()
    return Response(png, media_type="image/png", headers={"Cache-Control": "private, max-age=3600"})


def _render_view(store, image_id: str, size: int) -> bytes:
    item = stored_image(store, image_id)
    buffer = io.BytesIO()
    model_view(item.image, size).save(buffer, "PNG", optimize=False, compress_level=3)
    return buffer.getvalue()


# ---- attention -------------------------------------------------------------------------------------
@router.post("/api/image/attention", responses={
    200: {"model": AttentionResponse}, 404: {"description": "unknown or evicted image_id"},
    413: {"description": "over max_image_tokens (image_size too large) or the response over max_response_numbers"},
    503: {"description": "queue full"}})
def image_attention(req: ImageAttentionRequest, runtime: RuntimeDep, store: ImageStoreDep, request: Request) -> Response:
    """Attention of every requested layer/head for an uploaded image (see POST /api/images).

    Tokens: "CLS", any "dist"/"reg0"… prefix tokens, then patches "p(row,col)" row-major; `grid` is
    [rows, cols] and `prefix_tokens` how many tokens precede the patches. `rollout` is the CLS row of
    the attention rollout over the patches (see /guide#s6), `mean_distance` the mean attention distance per
    layer/head in input pixels, `predictions` the top-5 classes (classifiers). With `compare`,
    `effect.output` holds the class probabilities before/after and their KL (classifiers) or the
    CLS-embedding cosine (backbones). With `Accept: application/octet-stream` the f16/f32 fields come as raw bytes
    after a JSON header (the binary form), with `Accept: text/event-stream` as a job with layer progress.
    """
    return respond(request, image_work(runtime, store, req), "POST /api/image/attention")


# ---- page ------------------------------------------------------------------------------------------


def _sample_config(store) -> list[dict[str, Any]]:
    """The example photos, decoded into the store so the page can draw the first one at once."""
    samples = []
    for sample in SAMPLES:
        path = SAMPLES_DIR / sample["file"]
        if not path.is_file():
            continue
        data = path.read_bytes()
        image_id = SAMPLE_IDS.get(sample["file"]) or image_id_for(data)
        if image_id not in store:
            store.put(image_id, data, decode_image(data), shared=False)
        SAMPLE_IDS[sample["file"]] = image_id
        samples.append({**sample, "url": f"/static/samples/{sample['file']}", "image_id": image_id})
    return samples


@router.get("/image", response_class=HTMLResponse, include_in_schema=False)
def image_page(request: Request, store: ImageStoreDep):
    runtime: Runtime = request.app.state.runtime
    not_ready = runtime.not_ready("image")  # being prepared (`make run`): shown, not chosen
    models = [{"id": i, "default_size": None} for i, s in runtime.specs.items()
              if s.kind == "image" and i not in {m["id"] for m in not_ready}]
    settings = runtime.settings
    config = {
        "models": models,
        "not_ready": not_ready,
        "model": next((m["id"] for m in sorted(models, key=lambda m: m["id"] != "dinov2-small")), "dinov2-small"),
        "samples": _sample_config(store),
        "max_upload_bytes": settings.max_upload_bytes,
        "max_image_pixels": settings.max_image_pixels,
        "max_image_tokens": settings.max_image_tokens,  # the page offers only sizes within it
        "full_map_tokens_image": settings.full_map_tokens_image,  # larger images: one head's overview + windows
        "limits": {"samples": settings.max_samples},  # as on the text page: no more than a request may ask
    }
    return templates.TemplateResponse(request, "image.html", {"config": config, "page": "image"})
