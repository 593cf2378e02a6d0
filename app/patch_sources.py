"""The clean runs that patches take their source from (patch_heads: a run's head outputs; patch_residual: its
residual stream), kept per runtime under random ids by POST /api/text/patching, and the head-output context of a
request that names them (request_sources). Also the interventions some routes refuse."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from fastapi import HTTPException

from app.errors import field_error
from app.ids import new_run_id
from app.runtime import PerRuntime, Runtime
from models.adapters.base import AttentionAdapter
from models.anatomy import layer_blocks
from models.attribution import value_grams
from models.head_ops import HeadRun
from models.ops import OPS


# ---- kept clean runs (patch_heads / patch_residual sources) -----------------------------------------------------
@dataclass
class PatchSource:
    """What a clean run leaves for patches: its head outputs (one (H, T, d_v) tensor per layer, patch_heads) and its
    residual stream after every layer ((L, T, D), patch_residual)."""

    head_outputs: list[torch.Tensor]
    residual: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = self.head_outputs + ([] if self.residual is None else [self.residual])
        return sum(t.numel() * t.element_size() for t in tensors)


class HeadSourceStore:
    """The clean runs that patches take their source from, under random ids, per model: a store of their own (not
    the result cache, whose evictions follow other requests' maps), bounded by `max_bytes` and `max_runs`, least
    recently used out first. An id it evicted is remembered (ids only, a bounded list) so that a request naming it
    is told the run is gone (410) rather than unknown (404)."""

    FORGET_AFTER = 4096  # evicted ids remembered

    def __init__(self, max_bytes: int, max_runs: int = 32):
        self.max_bytes, self.max_runs = max_bytes, max_runs
        self._items: OrderedDict[tuple[str, str], PatchSource] = OrderedDict()
        self._evicted: OrderedDict[tuple[str, str], str] = OrderedDict()  # key → why
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, model: str, source: PatchSource) -> str | None:
        """The new run's id, or None when the run alone is over max_bytes (nothing is kept)."""
        size = source.nbytes
        if size > self.max_bytes:
            return None
        run_id = new_run_id()
        with self._lock:
            self._items[(model, run_id)] = source
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._items) > self.max_runs:
                key, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evicted[key] = ("patch_sources_bytes" if self._bytes + evicted.nbytes > self.max_bytes
                                      else "patch_sources_runs")
                if len(self._evicted) > self.FORGET_AFTER:
                    self._evicted.popitem(last=False)
        return run_id

    def get(self, model: str, run_id: str) -> PatchSource | None:
        with self._lock:
            source = self._items.get((model, run_id))
            if source is not None:
                self._items.move_to_end((model, run_id))
            return source

    def evicted_by(self, model: str, run_id: str) -> str | None:
        """The setting that pushed this run out, or None when it was never kept here (for this model)."""
        with self._lock:
            return self._evicted.get((model, run_id))

    def __len__(self) -> int:
        return len(self._items)


source_store = PerRuntime(lambda runtime: HeadSourceStore(runtime.settings.patch_sources_bytes,
                                                         runtime.settings.patch_sources_runs))


PATCH_OPS = tuple(name for name, op in OPS.items() if op.patch_source)  # ops that read a kept run


def request_sources(runtime: Runtime, adapter: AttentionAdapter, interventions: list, value_norms: bool = False) -> HeadRun:
    """The head-output context of a request: the kept runs its patch items name, the layer blocks to hook for
    patch_residual, and with `value_norms` what a recorded run needs to keep its value norms. A source that is gone
    is a 410 (evicted: run the scan again), one never kept for this model a 404; a token count that differs is
    refused later by engine_interventions (422 naming the field)."""
    store = source_store(runtime)
    model = adapter.info.id
    heads, residual = {}, {}
    for i, item in enumerate(interventions):
        if item.op not in PATCH_OPS:
            continue
        where = f"interventions[{i}].source"
        kept = store.get(model, item.source)
        if kept is None:
            why = store.evicted_by(model, item.source)
            if why is not None:
                raise HTTPException(410, detail=f"{where}: run {item.source!r} is no longer kept (evicted from the patch "
                                    f"sources, {why}={getattr(runtime.settings, why):,}): run POST /api/text/patching "
                                    "again for a new clean_run_id")
            raise HTTPException(404, detail=f"{where}: no kept run {item.source!r} for model {model}: {item.op} takes the "
                                "clean_run_id of POST /api/text/patching with the same model")
        if OPS[item.op].patch_source == "heads":
            heads[item.source] = kept.head_outputs
        else:
            if item.heads is not None:
                raise field_error(("interventions", i, "heads"), "patch_residual patches the residual stream (every head "
                                  "at once): heads must be null; name the positions in `tokens`")
            if kept.residual is None:
                raise HTTPException(404, detail=f"{where}: run {item.source!r} kept no residual stream")
            residual[item.source] = kept.residual
    run = HeadRun(sources=heads, residual_sources=residual)
    if residual:
        run.blocks = layer_blocks(adapter.model, adapter.layer_of)
    if value_norms:
        run.value_grams = value_grams(adapter)
    return run


# ---- interventions a route refuses --------------------------------------------------------
def refuse_for_seq2seq(req) -> None:
    for i, item in enumerate(req.interventions):
        if item.op in PATCH_OPS:
            raise field_error(("interventions", i, "op"), f"{item.op} is not offered for encoder–decoder models")


def refuse_for_generate(req) -> None:
    """A continuation feeds one new token per step (KV cache): what an op cannot do there (mean ablation: a head's
    mean over the positions is not at hand) is refused rather than silently applied to one position."""
    for i, item in enumerate(req.interventions):
        refusal = OPS[item.op].continuation_refusal(item)
        if refusal is not None:
            raise field_error(("interventions", i, refusal[0]), refusal[1])
