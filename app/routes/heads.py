"""Head kinds: POST /api/text/head_scores (docs/api.md "Head kinds", docs/science.md "Head kinds").

The work (checks, probes, runs and the answers' cache) is app/pipeline/head_scores.py's; this route answers it, with
`Accept: text/event-stream` as a job with one progress step per probe.
"""
from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.deps import RuntimeDep
from app.lifecycle import ParsedJsonRoute
from app.pipeline.head_scores import HeadScoresRequest, head_scores_work
from app.streams import respond_steps

router = APIRouter(prefix="/api/text", tags=["text"], route_class=ParsedJsonRoute)
_WHAT = "POST /api/text/head_scores"


@router.post("/head_scores", responses={
    200: {"description": "scores, labels and probe (JSON), or with Accept: text/event-stream progress events then them"},
    413: {"description": "over the request's time limit"}, 422: {"description": "a field is wrong"},
    503: {"description": "queue full"}})
def head_scores(req: HeadScoresRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Which heads are of which kind (see /guide and docs/science.md "Head kinds"), for a decoder language model.

    `scores` {name: [L][H]}: previous_token, induction, duplicate_token, sink (each the mean share of a row's attention
    on its targets), retrieval (built-in probes only: the share of greedy generation steps copying a needle back whose
    top-attended key is the copied token's source) and mean_distance (tokens); a score no row of the input applies
    to is null. `labels` [L][H]: the kind among previous_token, induction, duplicate_token and sink that the
    head scores highest at over its threshold (`probe.thresholds`), else null. `retrieval_heads` (built-in probes):
    the heads over the retrieval threshold (`probe.needle.threshold`, 0.1), highest first, beside their labels. `locality` [L][H]: "local" or "global" for
    a model with sliding-window layers, else null. `probe`: how the input was made (seed, lengths, ids, thresholds).
    """
    return respond_steps(request, head_scores_work(runtime, req), _WHAT)
