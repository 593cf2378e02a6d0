"""Images: uploads (POST /api/images), the model's view of one (GET /api/images/{id}/view),
image attention (POST /api/image/attention) and the page (/image).

Uploads are size-checked before the body is read (Content-Length) and while it streams, decoded in
the thread pool (models/images.py: allowlist, pixel limit before decoding, EXIF, every mode to RGB),
at most `max_concurrent_decodes` at once (DecodeGate: one waiting longer than `decode_wait_s` gets 503),
and kept in a bounded LRU; an upload's id is random (app/ids.py: a capability, not a content hash), and
identical content is stored once inside the store; an evicted id answers 404 and the page uploads
the file again. The page's example photos (public files) keep content-hash ids, the same on every replica.
`/view` renders take decode slots too (the same DecodeGate): 40 clients fetching views no longer slow the POSTs. With `redis_url` the uploaded bytes are also written to Redis, shared by every replica
(app/imagestore.py, reached through the ImageStoreDep dependency); Redis unreachable → 503 naming it.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import Field
from starlette.datastructures import UploadFile

from app.pipeline import answer, plain_job
from app.attention import check_request_limits
from app.streams import answered
from app.deps import ImageStoreDep, RuntimeDep, adapter_for
from app.errors import error_response, field_error, too_large_response
from app.ids import ID_PATTERN, is_valid_id, new_id
from app.origin import cross_origin_refusal
from app.imagestore import RETRY_AFTER_S, StoreItemTooLarge, StoreUnavailable
from app.context import current
from app.lifecycle import ParsedJsonRoute, check_cancelled
from app.runtime import Runtime
from app.schemas import WEIGHTING_DESCRIPTION, AttentionRequestBase, AttentionResponse, IndexList, Weighting
from app.templating import templates
from models.adapters.base import AttentionResult, Encoded
from models.images import (
    ImageInputError,
    StoredImage,
    decode_image,
    image_id_for,
    model_view,
)
from models.summaries import cls_rollout_map, mean_attention_distance

router = APIRouter(tags=["image"], route_class=ParsedJsonRoute)

ROOT = Path(__file__).resolve().parents[2]
SAMPLES_DIR = ROOT / "static" / "samples"
MULTIPART_SLACK = 64 * 1024  # boundaries and part headers around the file; the file itself is checked exactly
MAX_VIEW_SIZE = 1036
# The page's example photos (static/samples, see LICENSE.md there) and which model each suits.
SAMPLES = [
    {"name": "Street scene", "file": "street.jpg", "model": "dinov2-small"},
    {"name": "Fruit bowl", "file": "fruit.jpg", "model": "dinov2-small"},
    {"name": "Sneaker (Fashion-MNIST)", "file": "fashion-sneaker.png", "model": "vit-fashion"},
]

class DecodeGate:
    """At most `limit` image decodes at once: a decode holds the whole bitmap (and a copy or two while it
    converts), so a burst of large uploads is made to take turns instead of adding up to gigabytes.
    A request that gets no slot within `wait_s` is refused (503 + Retry-After) rather than left hanging.
    One per app, used on its event loop (see `decode_gate`)."""

    def __init__(self, limit: int, wait_s: float):
        self.limit, self.wait_s = limit, wait_s
        self._semaphore = anyio.Semaphore(limit)

    @property
    def in_use(self) -> int:
        return self.limit - self._semaphore.value

    async def acquire(self) -> bool:
        """Take a slot, waiting at most `wait_s`; False when none came free in time."""
        try:
            self._semaphore.acquire_nowait()  # a free slot is taken even when wait_s is 0
            return True
        except anyio.WouldBlock:
            pass
        with anyio.move_on_after(self.wait_s):
            await self._semaphore.acquire()
            return True
        return False

    def release(self) -> None:
        self._semaphore.release()


def decode_gate(app) -> DecodeGate:
    """The app's gate, built from its settings on first use (on the event loop: no lock needed)."""
    gate = getattr(app.state, "decode_gate", None)
    if gate is None:
        settings = app.state.runtime.settings
        gate = app.state.decode_gate = DecodeGate(settings.max_concurrent_decodes, settings.decode_wait_s)
    return gate


async def read_upload(request: Request, limit: int, setting: str, what: str, store=None) -> bytes | JSONResponse:
    """The bytes of an upload's multipart field `file` (the image and speech uploads), or the refusal to answer:
    403 a browser's cross-origin upload (app/origin.py); 415 not multipart; 400 a bad Content-Length; 413 over
    `limit` (the setting named), before the body is read when Content-Length says so, else counted as it comes
    (chunked uploads have none), and over the shared store's per-item limit; 422 no `file` field holding `what`."""
    refusal = cross_origin_refusal(request.headers, request.app.state.runtime.settings.cors_origins)
    if refusal is not None:  # a page on another origin making its visitor's browser upload (app/origin.py)
        return JSONResponse({"detail": refusal}, status_code=403)
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        return error_response(415, f"send multipart/form-data with the {what} in the field 'file' (got {content_type or 'no content type'!r})")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            return error_response(400, "invalid Content-Length header", "content-length")
        if int(declared) > limit + MULTIPART_SLACK:
            return too_large_response(limit, setting=setting)  # refused before a byte of the body is read
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit + MULTIPART_SLACK:
            return too_large_response(limit, setting=setting)
    form = await _replayed(request, bytes(body)).form(max_files=1, max_fields=8)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            return error_response(422, f"missing the multipart field 'file' holding the {what}")
        data = await upload.read()
    finally:
        await form.close()
    if len(data) > limit:
        return too_large_response(limit, setting=setting)
    if store is not None and store.max_item_bytes is not None and len(data) > store.max_item_bytes:
        return too_large_response(store.max_item_bytes, f"file: the upload is larger than the shared store's limit of "
                                                f"{store.max_item_bytes:,} bytes per item (redis_max_item_bytes)")
    return data


def _replayed(request: Request, body: bytes) -> Request:
    """The same request with its (already read and counted) body to be read again, for Starlette's form parser:
    a new Request over the same scope whose receive hands over `body` once (no write into a Request's fields)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:  # read past the end: as a server says once the body is over and the client leaves
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


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


def _stored(store: ImageStoreDep, image_id: str) -> StoredImage:
    try:
        item = store.get(image_id)
    except StoreUnavailable as exc:
        raise HTTPException(503, detail=str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    if item is None:
        item = _sample_image(store, image_id)  # the page's photos: every replica has them in static/
    if item is None:
        raise HTTPException(404, detail=f"image_id {image_id!r} is not held by the server (evicted or never uploaded): upload the image again")
    return item


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
    item = _stored(store, image_id)
    buffer = io.BytesIO()
    model_view(item.image, size).save(buffer, "PNG", optimize=False, compress_level=3)
    return buffer.getvalue()


# ---- attention -------------------------------------------------------------------------------------
class ImageAttentionRequest(AttentionRequestBase):
    model: str = "dinov2-small"
    image_id: str = Field(pattern=ID_PATTERN.pattern, description="from POST /api/images")
    image_size: int | None = Field(
        None, ge=1, le=4096,
        description="model input size in px (a multiple of the patch size; null = the model's native size, "
        "e.g. 224 for dinov2-small; 448 gives 32×32 patches through position-embedding interpolation)",
    )
    queries: IndexList | None = Field(
        None, description="query rows of `attention`/`scores` to return (null = all rows): [L][H][len(queries)][T]",
    )
    weighting: Weighting = Field("attention", description=WEIGHTING_DESCRIPTION + "; `rollout` and `mean_distance` "
                                 "stay those of P")


def image_fields(adapter, encoded: Encoded, req: ImageAttentionRequest, item: StoredImage):
    """What the image page shows besides the shared fields: geometry, rollout, distance in px, predictions."""
    info = adapter.info
    grid = encoded.extra["grid"]
    prefix = encoded.extra["prefix_tokens"]

    def fields(result: AttentionResult) -> dict[str, Any]:
        return {
            "image_id": req.image_id,
            "image_size": encoded.extra["image_size"],
            "patch_size": info.patch_size,
            "grid": list(grid),
            "prefix_tokens": prefix,
            "crop_box": list(encoded.extra["crop_box"]),  # in the stored image's pixels (see `stored_size`)
            "stored_size": [item.image.width, item.image.height],
            "rollout": result.summary("rollout", lambda: (
                result.atlas.cls_rollout(prefix, grid) if result.is_long else cls_rollout_map(result.attention, prefix, grid)
            ).tolist()),
            "mean_distance": result.summary(  # (L, H) in input pixels; a long input's taken during its run
                "mean_distance", lambda: result.atlas.mean_distance().tolist() if result.is_long
                else mean_attention_distance(result.attention, prefix, grid, info.patch_size).tolist()
            ),
            "predictions": adapter.predictions(result) if hasattr(adapter, "predictions") else None,
        }

    return fields


@router.post("/api/image/attention", responses={
    200: {"model": AttentionResponse}, 404: {"description": "unknown or evicted image_id"},
    413: {"description": "over max_image_tokens (image_size too large) or the response over max_response_numbers"},
    503: {"description": "queue full"}})
def image_attention(req: ImageAttentionRequest, runtime: RuntimeDep, store: ImageStoreDep) -> Response:
    """Attention of every requested layer/head for an uploaded image (see POST /api/images).

    Tokens: "CLS", any "dist"/"reg0"… prefix tokens, then patches "p(row,col)" row-major; `grid` is
    [rows, cols] and `prefix_tokens` how many tokens precede the patches. `rollout` is the CLS row of
    the attention rollout over the patches (see /guide#s6), `mean_distance` the mean attention distance per
    layer/head in input pixels, `predictions` the top-5 classes (classifiers). With `compare`,
    `effect.output` holds the class probabilities before/after and their KL (classifiers) or the
    CLS-embedding cosine (backbones).
    """
    check_request_limits(runtime.settings, req)  # the settings' limits, as on every route: before any work
    item = _stored(store, req.image_id)
    try:
        adapter = adapter_for(runtime, req.model, "image")
    except (OSError, ValueError) as exc:  # weights not prepared on this machine
        raise HTTPException(503, detail=f"model {req.model!r} is not available here: {exc}") from None
    try:
        size = adapter.check_image_size(req.image_size)
    except ValueError as exc:
        raise field_error(("image_size",), str(exc)) from None
    tokens = image_tokens(adapter, size)
    cap = runtime.settings.max_image_tokens
    if tokens > cap:  # before any work: attention costs T² per head and layer in time and memory
        raise HTTPException(413, detail=(
            f"image_size={size} gives {tokens:,} tokens on {req.model} ({size // adapter.info.patch_size}² patches "
            f"+ {len(adapter.prefix_labels)}); the limit is max_image_tokens={cap:,}: ask for a smaller image_size "
            f"(at most {max_image_size(adapter, cap)} px on this model)"))
    check_cancelled()
    encoded = runtime.encode(adapter, ("image", req.image_id, size), lambda: adapter.encode(item.image, req.image_id, size))
    # value norms kept with the run (its windows/rows can be value-weighted later); weighting "value_norm" weights the
    # maps, thumbnails and received (app/pipeline, as for text)
    job = plain_job(runtime, adapter, encoded, req, image_fields(adapter, encoded, req, item))
    return answered(answer(job, current()))  # the edge: the request's context (app/context.py)


def image_tokens(adapter, size: int) -> int:
    """Tokens of a size × size input: (size / patch)² patches + the prefix tokens (CLS, …)."""
    return (size // adapter.info.patch_size) ** 2 + len(adapter.prefix_labels)


def max_image_size(adapter, max_tokens: int) -> int:
    """The largest image_size (a multiple of the patch size) within max_tokens on this model."""
    side = math.isqrt(max(0, max_tokens - len(adapter.prefix_labels)))
    return max(1, side) * adapter.info.patch_size


# ---- page ------------------------------------------------------------------------------------------
_sample_ids: dict[str, str] = {}


def _sample_image(store, image_id: str) -> StoredImage | None:
    """An example photo by id, decoded from static/samples into this replica's store (never into Redis)."""
    for sample in SAMPLES:
        path = SAMPLES_DIR / sample["file"]
        if not path.is_file():
            continue
        if sample["file"] not in _sample_ids:
            _sample_ids[sample["file"]] = image_id_for(path.read_bytes())
        if _sample_ids[sample["file"]] == image_id:
            data = path.read_bytes()
            return store.put(image_id, data, decode_image(data), shared=False)
    return None


def _sample_config(store) -> list[dict[str, Any]]:
    """The example photos, decoded into the store so the page can draw the first one at once."""
    samples = []
    for sample in SAMPLES:
        path = SAMPLES_DIR / sample["file"]
        if not path.is_file():
            continue
        data = path.read_bytes()
        image_id = _sample_ids.get(sample["file"]) or image_id_for(data)
        if image_id not in store:
            store.put(image_id, data, decode_image(data), shared=False)
        _sample_ids[sample["file"]] = image_id
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
