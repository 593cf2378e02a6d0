"""POST /api/image/export.html and POST /api/audio/export.html: the image and speech pages' "Download standalone HTML"
buttons (issue 31 §3), the same single file as the text page's (attnlab/export.py, app/routes/export.py). The work,
and why the speech file carries ln P / β₀ as its scores, is app/pipeline/export_media.py's: it runs the same work
functions as the image and speech attention routes (no route calls another's handler)."""
from __future__ import annotations

import re

from fastapi import APIRouter, HTTPException, Query, Request, Response

from app.allocator import process_warm_heap
from app.deps import AudioStoreDep, ImageStoreDep, RuntimeDep
from app.lifecycle import ParsedJsonRoute
from app.openmp_teams import plain_work_done
from app.pipeline.audio import AudioAttentionRequest
from app.pipeline.export_media import audio_export, image_export
from app.pipeline.image import ImageAttentionRequest
from app.streams import wants_events

router = APIRouter(tags=["export"], route_class=ParsedJsonRoute)

OPENS_LAYER = Query(None, ge=0, description="the layer shown when the file opens")
OPENS_HEAD = Query(None, ge=0, description="the head shown when the file opens")
ANSWERS = {200: {"content": {"text/html": {}}, "description": "one self-contained HTML file (an attachment)"},
           413: {"description": "the maps are over max_response_numbers: name fewer layers or heads"}}


def _refuse_events(request: Request) -> None:
    if wants_events(request):
        raise HTTPException(406, "Accept: the export is one HTML file, not an event stream (send Accept: text/html)")


def _attachment(page: str, model: str, what: str) -> Response:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"attnlab-{model}-{what}") + ".html"
    return Response(page, media_type="text/html; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _plain_work_done() -> None:
    """What a plain answer's thread does at the end of its work (app/streams.py answered): top up the warm heap, end
    its OpenMP team when another model request is in flight."""
    warm = process_warm_heap()
    if warm is not None:
        warm.reserve()
    plain_work_done()


@router.post("/api/image/export.html", response_class=Response, responses=ANSWERS)
def export_image_html(req: ImageAttentionRequest, runtime: RuntimeDep, store: ImageStoreDep,
                      request: Request, layer: int | None = OPENS_LAYER, head: int | None = OPENS_HEAD) -> Response:
    """The attention of `req` over the image's patches (every layer and head unless `layers`/`heads` name some) as one
    HTML file that opens offline with the view-mode controls: layer, head, view-mode β (from the scores), key masks,
    colour scale. Its tokens are the page's patch labels. Interventions are applied to the saved maps; effects are
    not exported (`compare` is ignored)."""
    _refuse_events(request)
    page = image_export(runtime, store, req, layer, head)
    _plain_work_done()
    return _attachment(page, req.model, "image")


@router.post("/api/audio/export.html", response_class=Response, responses=ANSWERS)
def export_audio_html(req: AudioAttentionRequest, runtime: RuntimeDep, store: AudioStoreDep,
                      request: Request, layer: int | None = OPENS_LAYER, head: int | None = OPENS_HEAD) -> Response:
    """The decoder self-attention of `req` (decoder tokens × decoder tokens, causal; every layer and head unless
    `layers`/`heads` name some) as one HTML file that opens offline with the view-mode controls. Cross-attention is
    not in the file (its map is not square). View-mode β re-normalises P^(β/β₀) per row (scores ln P / β₀; none for
    value-weighted maps). Interventions are applied to the saved maps; effects are not exported."""
    _refuse_events(request)
    page = audio_export(runtime, store, req, layer, head)
    _plain_work_done()
    return _attachment(page, req.model, "decoder")
