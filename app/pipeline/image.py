"""An image attention request's work (POST /api/image/attention, and the image page's standalone HTML export in
app/pipeline/export_media.py): the stored image (an upload, or one of the page's example photos), the settings' limits
and the image size checked, the input encoded (kept in the runtime's cache), the job built (app/pipeline/job.py) and
the fields the image page shows besides the shared ones. Both routes call `image_work`; neither calls the other."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from pydantic import Field

from app.attention import check_request_limits
from app.context import RequestContext
from app.deps import adapter_for
from app.errors import field_error
from app.ids import ID_PATTERN
from app.imagestore import RETRY_AFTER_S, StoreUnavailable, UploadStore
from app.lifecycle import check_cancelled
from app.pipeline.job import PageInput, build_job
from app.pipeline.views import answer
from app.runtime import Runtime
from app.schemas import WEIGHTING_DESCRIPTION, AttentionRequestBase, IndexList, Weighting
from models.adapters.base import AttentionResult, Encoded
from models.images import StoredImage, decode_image, image_id_for
from models.summaries import cls_rollout_map, mean_attention_distance

ROOT = Path(__file__).resolve().parents[2]

SAMPLES_DIR = ROOT / "static" / "samples"

# The page's example photos (static/samples, see LICENSE.md there) and which model each suits.
SAMPLES = [
    {"name": "Street scene", "file": "street.jpg", "model": "dinov2-small"},
    {"name": "Fruit bowl", "file": "fruit.jpg", "model": "dinov2-small"},
    {"name": "Sneaker (Fashion-MNIST)", "file": "fashion-sneaker.png", "model": "vit-fashion"},
]

SAMPLE_IDS: dict[str, str] = {}  # an example photo's file → its content-hash id


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


def image_work(runtime: Runtime, store: UploadStore, req: ImageAttentionRequest) -> Callable[[RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field, 404 an unknown image, 413 over
    max_image_tokens); calling the result with the request's context runs the work and gives the response dict."""
    check_request_limits(runtime.settings, req)  # the settings' limits, as on every route: before any work
    item = stored_image(store, req.image_id)
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
    job = build_job(runtime, adapter, encoded, req, PageInput(fields=image_fields(adapter, encoded, req, item)))
    return lambda ctx: answer(job, ctx)


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


def image_tokens(adapter, size: int) -> int:
    """Tokens of a size × size input: (size / patch)² patches + the prefix tokens (CLS, …)."""
    return (size // adapter.info.patch_size) ** 2 + len(adapter.prefix_labels)


def max_image_size(adapter, max_tokens: int) -> int:
    """The largest image_size (a multiple of the patch size) within max_tokens on this model."""
    side = math.isqrt(max(0, max_tokens - len(adapter.prefix_labels)))
    return max(1, side) * adapter.info.patch_size


def stored_image(store: UploadStore, image_id: str) -> StoredImage:
    try:
        item = store.get(image_id)
    except StoreUnavailable as exc:
        raise HTTPException(503, detail=str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    if item is None:
        item = sample_image(store, image_id)  # the page's photos: every replica has them in static/
    if item is None:
        raise HTTPException(404, detail=f"image_id {image_id!r} is not held by the server (evicted or never uploaded): upload the image again")
    return item


def sample_image(store, image_id: str) -> StoredImage | None:
    """An example photo by id, decoded from static/samples into this replica's store (never into Redis)."""
    for sample in SAMPLES:
        path = SAMPLES_DIR / sample["file"]
        if not path.is_file():
            continue
        if sample["file"] not in SAMPLE_IDS:
            SAMPLE_IDS[sample["file"]] = image_id_for(path.read_bytes())
        if SAMPLE_IDS[sample["file"]] == image_id:
            data = path.read_bytes()
            return store.put(image_id, data, decode_image(data), shared=False)
    return None
