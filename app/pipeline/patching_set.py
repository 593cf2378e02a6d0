"""POST /api/text/patching over a set of prompt pairs (`pairs`, or `template` with `fillers`): each head's mean effect
over the pairs and its spread, the attribution estimates beside it (attribution on the head output, AtP, AtP*) and
how well each ranks the heads against the exact scan (docs/api.md "Patching over a set", docs/science.md).

A set is work of its own kind: the patching route (app/routes/analysis.py) answers a request with `pairs` or `template`
with the job `patching_set_work` builds. Streamed (`Accept: text/event-stream`) it is a job like every scan: accepted with its ETA, progress over every pair's
patched heads, Cancel at the next batch.
"""
from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from app.attention import check_request_limits
from app.interventions import engine_interventions
from app.errors import field_error
from app.admission import check_work_cost
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.lm_inputs import finite_lists, language_model, one_token, prompt_ids
from app.patch_sources import request_sources
from app.runtime import Runtime
from app.schemas import PatchingRequest
from models.head_ops import head_run
from models.patching import Pair
from models.patching_set import ESTIMATES, agreement, mean_and_spread, set_scan


TEMPLATE_RULE = "slots are plain names in braces, e.g. {country}; a literal brace is {{ or }}"


def template_parts(text: str) -> list[tuple[str, str | None]]:
    """The template as (literal text, slot name or None) parts, literal braces unescaped. Only plain {name} slots:
    a format spec ({c:>1000000000} would build a gigabyte), a conversion ({c!r}), attribute or index access
    ({c.x}, {c[0]}) or a positional {} is a 422 on template.text naming the slot. Nothing is formatted here: the
    parser only splits the text (linear in its length)."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # an unmatched brace
        raise field_error(("template", "text"), f"the template does not parse: {exc} ({TEMPLATE_RULE})") from None
    parts = []
    for literal, name, spec, conversion in parsed:
        if name is not None and (spec or conversion is not None or not name.isidentifier()):
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            what = ("a format spec" if spec else "a conversion" if conversion is not None
                    else "no name" if not name else "attribute or index access")
            raise field_error(("template", "text"), f"the slot {shown[:60]} has {what}; {TEMPLATE_RULE}")
        parts.append((literal, name))
    return parts


def expand_template(req: PatchingRequest, max_chars: int) -> list[dict[str, Any]]:
    """The template's pairs: its {slots} filled with each filler's clean and corrupt values. 422 naming the filler
    when a slot is missing or unknown, or when a filled prompt would be over `max_chars` (max_text_chars): its
    length is counted before it is built."""
    template = req.template
    if len(template.text) > max_chars:
        raise field_error(("template", "text"), f"the template has {len(template.text):,} characters; the limit is "
                          f"{max_chars:,} (max_text_chars)")
    parts = template_parts(template.text)
    slots = {name for _, name in parts if name is not None}
    if not slots:
        raise field_error(("template", "text"), "the template has no {slot} to fill")
    literal_chars = sum(len(literal) for literal, _ in parts)
    pairs = []
    for i, filler in enumerate(template.fillers):
        texts = {}
        for side in ("clean", "corrupt"):
            values = getattr(filler, side)
            if set(values) != slots:
                raise field_error(("template", "fillers", i, side), f"fill exactly the slots {sorted(slots)}; "
                                  f"got {sorted(values)[:20]}")
            chars = literal_chars + sum(len(values[name]) for _, name in parts if name is not None)
            if chars > max_chars:
                raise field_error(("template", "fillers", i, side), f"the filled {side} prompt would have {chars:,} "
                                  f"characters; the limit is {max_chars:,} (max_text_chars)")
            texts[side] = "".join(literal + (values[name] if name is not None else "") for literal, name in parts)
        pairs.append({**texts, "answer": filler.answer, "wrong": filler.wrong})
    return pairs


def patching_set_work(runtime: Runtime, req: PatchingRequest) -> Callable[[Callable, RequestContext], dict[str, Any]]:
    """The set form of POST /api/text/patching: every check of `req` done before it returns (4xx naming the field);
    the result is the job app/streams.py respond_steps runs with its progress callback and context."""
    settings = runtime.settings
    if req.pairs is not None and req.template is not None:
        raise field_error(("template",), "give either pairs or template, not both")
    if req.clean is not None or req.corrupt is not None:
        raise field_error(("clean",) if req.clean is not None else ("corrupt",),
                          "a set takes its prompts from pairs or template: leave clean and corrupt out")
    if req.scan != "heads":
        raise field_error(("scan",), "a set is scanned by heads (scan: heads)")
    where = "pairs" if req.pairs is not None else "template"
    # the limits first, before any prompt is built (a set's count, then each prompt's length)
    count = len(req.pairs) if req.pairs is not None else len(req.template.fillers) if req.template else 0
    limit = settings.patching_max_pairs
    if count > limit:
        field = ("pairs",) if where == "pairs" else ("template", "fillers")
        raise HTTPException(413, detail=f"{'.'.join(field)}: {count} pairs; the limit is {limit} "
                            "(patching_max_pairs)")
    check_request_limits(settings, req)
    raw = ([p.model_dump() for p in req.pairs] if req.pairs is not None
           else expand_template(req, settings.max_text_chars))
    adapter = language_model(runtime, req.model)

    def loc(i: int, name: str) -> tuple:
        if where == "pairs":
            return ("pairs", i, name)
        return ("template", "fillers", i, name if name in ("answer", "wrong") else name)

    pairs: list[Pair] = []
    described = []
    for i, item in enumerate(raw):
        for side in ("clean", "corrupt"):
            if len(item[side]) > settings.max_text_chars:
                raise field_error(loc(i, side), f"{side} has {len(item[side]):,} characters; the limit is "
                                  f"{settings.max_text_chars:,} (max_text_chars)")
        clean = _checked_prompt(runtime, adapter, loc(i, "clean"), item["clean"])
        corrupt = _checked_prompt(runtime, adapter, loc(i, "corrupt"), item["corrupt"])
        if clean.shape[1] != corrupt.shape[1]:
            raise field_error(loc(i, "corrupt"), f"pair {i}: clean has {clean.shape[1]} tokens and corrupt "
                              f"{corrupt.shape[1]}: the two prompts must have the same token count")
        texts = {}
        for name in ("answer", "wrong"):
            text = item[name] if item[name] is not None else getattr(req, name)
            if text is None:
                raise field_error(loc(i, name), f"pair {i} has no {name}: give one for the pair or for the whole set")
            texts[name] = text
        try:
            answer, wrong = one_token(adapter, "answer", texts["answer"]), one_token(adapter, "wrong", texts["wrong"])
        except Exception as exc:  # the same message, naming this pair's field
            errors = getattr(exc, "errors", lambda: None)()
            if not errors:
                raise
            name = errors[0]["loc"][-1]
            raise field_error(loc(i, name), f"pair {i}: {errors[0]['msg']}") from None
        if answer == wrong:
            raise field_error(loc(i, "wrong"), f"pair {i}: wrong is the same token as answer")
        pairs.append(Pair(clean, corrupt, answer, wrong))
        described.append({"clean_tokens": [adapter.token_text(int(t)) for t in clean[0]],
                          "corrupt_tokens": [adapter.token_text(int(t)) for t in corrupt[0]],
                          "answer": texts["answer"], "wrong": texts["wrong"], "answer_id": answer, "wrong_id": wrong})
    sources = request_sources(runtime, adapter, req.interventions)
    shortest = min(p.clean.shape[1] for p in pairs)
    with head_run(sources):
        interventions = engine_interventions(req, adapter, shortest)  # token indices valid in every pair
    exact = req.method == "exact"
    info = adapter.info
    shape = model_shape(adapter)
    # per pair: baseline (2 forwards), the estimates (3 forwards and a backward counted as 2), the patched copies
    forwards_per_pair = 7 + (info.layers * info.heads if exact else 0)
    macs = sum(forwards_per_pair * forward_macs(shape, p.clean.shape[1], p.clean.shape[1], len(interventions))
               for p in pairs)

    def job(progress, ctx: RequestContext) -> dict:
        turn = ctx.turns(check_work_cost(adapter, runtime, macs, 1, where, f"a head scan of {len(pairs)} pairs "
                                         f"({forwards_per_pair * len(pairs):,} forwards)", ctx))
        with head_run(sources):
            scans = set_scan(adapter, pairs, interventions, settings.patching_batch_tokens, exact, progress,
                             guard=lambda tokens: runtime.step(tokens, ctx=turn()))
        return set_response(adapter, req, described, scans, exact)

    return job


def _checked_prompt(runtime: Runtime, adapter, where: tuple, text: str):
    """prompt_ids's checks (white space, analysis_max_tokens), its 422 naming this pair's field."""
    try:
        return prompt_ids(runtime, adapter, where[-1], text)
    except Exception as exc:
        errors = getattr(exc, "errors", lambda: None)()
        if not errors:
            raise
        raise field_error(where, f"pair {where[-2]}: {errors[0]['msg']}") from None


def set_response(adapter, req: PatchingRequest, described: list[dict], scans, exact: bool) -> dict[str, Any]:
    for item, scan in zip(described, scans):
        item.update(ld_clean=scan.ld_clean, ld_corrupt=scan.ld_corrupt)
    used = [k for k, scan in enumerate(scans) if scan.defined]
    response: dict[str, Any] = {
        "model": adapter.info.id, "scan": "heads", "method": req.method, "set": True,
        "pairs": described, "n_pairs": len(scans), "pairs_used": used, "top_k": req.top_k,
    }
    warnings = [f"pair {k}: LD_clean equals LD_corrupt: its effect is undefined; left out of the means"
                for k, scan in enumerate(scans) if not scan.defined]
    if not used:
        response["warnings"] = warnings + ["no pair has LD_clean ≠ LD_corrupt: nothing to average"]
        return response
    if warnings:
        response["warnings"] = warnings
    estimates = {}
    for name in ESTIMATES:
        mean, spread = mean_and_spread([scans[k].estimates[name] for k in used])
        estimates[name] = {"mean": finite_lists(mean), "std": finite_lists(spread),
                           "per_pair": [finite_lists(scan.estimates[name]) for scan in scans]}
        if name == "head_output":
            response["attribution"] = estimates[name]["mean"]
    response["estimates"] = estimates
    if exact:
        mean, spread = mean_and_spread([scans[k].effect for k in used])
        response["effect"], response["effect_std"] = finite_lists(mean), finite_lists(spread)
        response["effect_per_pair"] = [finite_lists(scan.effect) for scan in scans]
        means = {name: mean_and_spread([scans[k].estimates[name] for k in used])[0] for name in ESTIMATES}
        response["agreement"] = {name: agreement(mean, means[name], req.top_k) for name in ESTIMATES}
        response["rank_correlation"] = response["agreement"]["head_output"]["spearman"]
    else:  # the estimates alone: `effect` means what a single pair's attribution scan calls `effect`, the
        # attribution estimate on the head output, here its mean over the pairs (AtP and AtP* stay in `estimates`)
        response["effect"] = estimates["head_output"]["mean"]
        response["effect_std"] = estimates["head_output"]["std"]
        response["effect_per_pair"] = estimates["head_output"]["per_pair"]
    return response
