"""POST /api/text/export.html: the text page's "Export HTML" button, and anyone with a request body. The same request
as POST /api/text/attention, run the same way (the result cache answers a view the page just drew), with the
scores view-mode β needs; answered as one standalone HTML file (attnlab/export.py): the data inlined, plotly.js
and the page's own view modules bundled, opening offline from file://."""
from __future__ import annotations

import re

import orjson
from fastapi import APIRouter, HTTPException, Query, Request, Response

from app.context import current
from app.lifecycle import ParsedJsonRoute
from app.deps import RuntimeDep, adapter_for
from app.errors import field_error
from app.pipeline.text import text_work
from app.schemas import TextAttentionRequest
from app.streams import wants_events

router = APIRouter(prefix="/api/text", tags=["text"], route_class=ParsedJsonRoute)


@router.post("/export.html", response_class=Response, responses={
    200: {"content": {"text/html": {}}, "description": "one self-contained HTML file (an attachment)"},
    413: {"description": "the maps are over max_response_numbers: name fewer layers or heads"},
})
def export_html(req: TextAttentionRequest, runtime: RuntimeDep, request: Request,
                layer: int | None = Query(None, ge=0, description="the layer shown when the file opens"),
                head: int | None = Query(None, ge=0, description="the head shown when the file opens")) -> Response:
    """The attention of `req` (every layer and head unless `layers`/`heads` name some) as one HTML file that opens
    offline and keeps the view-mode controls: layer, head, view-mode β (from the scores), key masks, colour scale.
    Interventions are applied to the saved maps; effects are not exported (`compare` is ignored)."""
    if wants_events(request):
        raise HTTPException(406, "Accept: the export is one HTML file, not an event stream (send Accept: text/html)")
    # scores for view-mode β: not for value-weighted maps (§12.4), nor (yet) for encoder–decoders, whose file shows
    # the encoder's self-attention at the run's β
    seq2seq = adapter_for(runtime, req.model, "text").info.output == "seq2seq"
    body = req.model_copy(update={
        "include_scores": req.weighting != "value_norm" and not seq2seq,
        "encoding": "f32", "compare": False, "include_base": False, "samples": 1, "thumbnail_size": None,
    })
    # the pipeline's answer (app/pipeline/text.py, as POST /api/text/attention answers), its numpy arrays made
    # plain JSON values for the exporter's json.dumps
    response = orjson.loads(orjson.dumps(text_work(runtime, body)(current()), option=orjson.OPT_SERIALIZE_NUMPY))
    if response.get("attention") is None:
        raise field_error(("text",), f"{len(response.get('tokens', []))} tokens is over full_map_tokens "
                          f"({runtime.settings.full_map_tokens}): a long input has an overview, not full maps to export")
    from attnlab.export import standalone_html  # the client package's exporter (standard library only)

    page = standalone_html(response, request=body.model_dump(mode="json", exclude_none=True), layer=layer, head=head)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"attnlab-{req.model}") + ".html"
    return Response(page, media_type="text/html; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})
