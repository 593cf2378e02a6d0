"""The work of POST /api/text/patching for one prompt pair (app/routes/analysis.py; a set of pairs is
app/pipeline/patching_set.py's): the request checked (prompts of one token count, answer and wrong one token each,
the method the scan allows, the interventions), then the job that runs the baseline, the scan one batch of patched
copies at a time (each batch a turn of the model lock) and the attribution estimate beside an exact head scan, and
keeps the clean run's head outputs for `patch_heads` (app/patch_sources.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.admission import check_work_cost
from app.attention import check_request_limits
from app.context import RequestContext
from app.costs import WorkClock, forward_macs, model_shape
from app.errors import field_error
from app.interventions import engine_interventions
from app.lifecycle import check_cancelled
from app.lm_inputs import finite_lists, language_model, one_token, prompt_ids
from app.patch_sources import PatchSource, request_sources, source_store
from app.runtime import Runtime
from app.schemas import PatchingRequest
from models.head_ops import head_run
from models.patching import (
    Pair, attribution_patching, attribution_scan, baseline, head_scan, rank_correlation, residual_scan,
)

PROGRESS_STEPS = 8  # a scan's batches at least (fewer when it has fewer copies)


def patching_work(runtime: Runtime, req: PatchingRequest) -> Callable[[Callable, RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field); the result is the job app/streams.py
    respond_steps runs with its progress callback and context."""
    check_request_limits(runtime.settings, req)  # the settings' limits, as on every route: before any work
    for name in ("clean", "corrupt", "answer", "wrong"):
        if getattr(req, name) is None:
            raise field_error((name,), f"{name} is required (or give `pairs` or `template` for a set of pairs)")
    adapter = language_model(runtime, req.model)
    clean, corrupt = prompt_ids(runtime, adapter, "clean", req.clean), prompt_ids(runtime, adapter, "corrupt", req.corrupt)
    if clean.shape[1] != corrupt.shape[1]:
        raise field_error(("corrupt",), f"clean has {clean.shape[1]} tokens and corrupt {corrupt.shape[1]}: the two "
                          "prompts must have the same token count")
    answer, wrong = one_token(adapter, "answer", req.answer), one_token(adapter, "wrong", req.wrong)
    if answer == wrong:
        raise field_error(("wrong",), "wrong is the same token as answer")
    if req.method == "attribution" and req.scan != "heads":
        raise field_error(("method",), "attribution patching is offered for the head scan (scan: heads)")
    sources = request_sources(runtime, adapter, req.interventions)
    with head_run(sources):
        interventions = engine_interventions(req, adapter, clean.shape[1])
    pair = Pair(clean, corrupt, answer, wrong)
    n_tokens = clean.shape[1]
    copies, scanned = _scan_copies(adapter, req, n_tokens)
    # patched copies per forward: about patching_batch_tokens tokens, and at least PROGRESS_STEPS batches, so that the
    # page's bar moves (one batch of every copy reported its only progress at the scan's end)
    batch = max(1, min(runtime.settings.patching_batch_tokens // n_tokens, -(-copies // PROGRESS_STEPS)))

    def job(progress, ctx: RequestContext) -> dict:
        # the whole scan's model time, before any forward: 413 naming `scan` over the limit (a plain request's
        # request_timeout_s, a job's job_timeout_s); a job is accepted here with its ETA
        macs = copies * forward_macs(model_shape(adapter), n_tokens, n_tokens, len(interventions))
        turn = ctx.turns(check_work_cost(adapter, runtime, macs, 1, "scan",
                                         f"{scanned} ({copies:,} forwards over {n_tokens} tokens)", ctx))
        clock = WorkClock(adapter, runtime.measures)  # the scan's model time, learnt from as one run (app/costs.py)
        with head_run(sources):
            attribution = None
            with clock.step(runtime.step(n_tokens, ctx=turn())):
                if req.method == "attribution":  # 2 forwards and 1 backward in all
                    base, attribution = attribution_patching(adapter, pair, interventions)
                else:
                    base = baseline(adapter, pair, interventions)
            response: dict[str, Any] = {
                "model": adapter.info.id, "clean_tokens": [adapter.token_text(int(i)) for i in clean[0]],
                "corrupt_tokens": [adapter.token_text(int(i)) for i in corrupt[0]],
                "answer_id": answer, "wrong_id": wrong, "ld_clean": base.ld_clean, "ld_corrupt": base.ld_corrupt,
                "scan": req.scan, "method": req.method,
            }
            if base.ld_clean == base.ld_corrupt:
                response["warnings"] = ["LD_clean equals LD_corrupt: the effect is undefined (null)"]
            if req.scan == "heads" and req.method == "exact":
                effect = head_scan(adapter, pair, base, interventions, batch, progress,
                                   guard=lambda: clock.step(runtime.step(n_tokens * batch, ctx=turn())))
            elif req.scan == "residual":
                effect = residual_scan(adapter, pair, base, interventions, batch, progress,
                                       guard=lambda: clock.step(runtime.step(n_tokens * batch, ctx=turn())))
            else:
                effect = None
            if effect is None:  # attribution alone
                effect = attribution
                progress(1, 1)
            elif req.scan == "heads":  # the estimate beside the exact scan, and how well they agree
                check_cancelled(ctx)
                with clock.step(runtime.step(n_tokens, ctx=turn())):
                    attribution = attribution_scan(adapter, pair, base, interventions)
                response["attribution"] = finite_lists(attribution)
                response["rank_correlation"] = rank_correlation(effect, attribution)
            clock.observe(macs)
            response["effect"] = finite_lists(effect)
            response["clean_run_id"] = source_store(runtime).put(
                adapter.info.id, PatchSource(base.clean_outputs, base.clean_residual))
        return response

    return job


def _scan_copies(adapter, req, n_tokens: int) -> tuple[int, str]:
    """Forwards a patching request makes (a backward counted as two), and what they are, for its cost check: the clean
    and corrupted runs, then one patched copy per head (scan heads) or per layer and position (scan residual), and the
    attribution estimate's forward and backward beside an exact head scan."""
    info = adapter.info
    if req.method == "attribution":
        return 4, "attribution patching"
    if req.scan == "heads":
        return 2 + info.layers * info.heads + 3, f"a head scan of {info.layers} × {info.heads} heads"
    return 2 + info.layers * n_tokens, f"a residual scan of {info.layers} layers × {n_tokens} positions"
