"""A run's maps as a response shows them, with the job's weighting applied before any is read: P itself, or with
weighting "value_norm" the value-weighted maps ‖P[i,j]·v_j W_O^h‖ normalised per row (models/attribution.py,
docs/science.md). One object per kind of run answers the slices, received, thumbnails and overview:

- `ShortMaps`: a short run (P kept whole): P's slices join the first view's one device → host read (their device
  tensors), the value-weighted ones are formed from P and the run's value norms;
- `LongMaps`: a long run (an atlas: q̂/k̂ and summaries): the overview, received and query rows, value-weighted ones
  rebuilt from q̂/k̂ block by block (once per cached run, its cost counted by the job);
- `KindMaps`: an encoder–decoder's kinds (encoder, decoder, cross), short or long;
- `SpeechMaps`: Whisper's cross and decoder maps and its encoder overview.
"""
from __future__ import annotations

from typing import Any

import torch
from fastapi import HTTPException

from app.attention import pooling_matrix, thumbnail_field, thumbnail_levels, thumbnails
from app.encoding import tensor_field
from app.lifecycle import after_layer, check_cancelled
from app.pipeline.job import AttentionJob
from models.adapters.base import AttentionResult
from models.adapters.seq2seq import KINDS
from models.adapters.whisper import encoder_overview
from models.atlas import full_rows
from models.attribution import (
    kept_value_norms, layer_value_norms, run_value_norms, value_weighted, value_weighted_overview, value_weighted_rows,
)


def as_index(values: list[int]) -> slice | list[int]:
    """Indices that run in steps of one as a slice: the selection is then a view and one copy, not two index kernels
    and, on a GPU, each index list's own copy to the device."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return values


def run_norms(job: AttentionJob, result: AttentionResult, interventions: tuple) -> torch.Tensor:
    """(L, H, T) ‖v_j W_O^h‖ of a run: those it kept on its records, else (a run made before the norms were kept,
    or a batch) from a forward of its own that records V, once per cached result."""
    kept = kept_value_norms(result.atlas)
    if kept is not None:
        return kept

    def compute() -> torch.Tensor:
        if result.is_long:  # a long run without its norms cannot be re-run whole here (its P would not fit)
            raise HTTPException(409, detail="this long run kept no value norms: run the input again")
        check_cancelled(job.ctx)
        with job.runtime.admitted(ctx=job.ctx):
            return run_value_norms(job.adapter, job.encoded, interventions)
    return result.summary("value_norms", compute)  # (L, H, T)


def value_thumbnails(attention: torch.Tensor, norms: torch.Tensor, size: int) -> dict:
    """The thumbnails of the value-weighted maps, a layer at a time: attention (L, H, T, T), norms (L, H, T); never
    a second L·H·T² tensor beside the run's P."""
    n_tokens = attention.shape[-1]
    pool = pooling_matrix(n_tokens, size).to(attention.device) if n_tokens > size else None  # (t, T)
    pooled = []
    for layer in range(attention.shape[0]):
        weighted = value_weighted(attention[layer], norms[layer].to(attention.device))  # (H, T, T)
        pooled.append(weighted if pool is None else pool @ weighted @ pool.T)  # (H, t, t)
    return thumbnails(torch.stack(pooled), size)  # already ≤ size: thumbnails only encodes


class ShortMaps:
    """A short run's maps (P kept whole on the run's device). `device_parts()` are the tensors that join the first
    view's one read (P's slices, received and thumbnail levels; Ŝ's slices, never weighted); `fields(host)` the
    response's map fields from that read, the value-weighted ones formed here."""

    def __init__(self, job: AttentionJob, result: AttentionResult, base: AttentionResult | None):
        self.job, self.result, self.base = job, result, base
        self.rows = slice(None) if job.requested_queries is None else job.queries
        self.thumbnail_key = f"thumbnails{job.req.thumbnail_size}"

    def device_parts(self) -> dict[str, torch.Tensor]:
        job, req, result = self.job, self.job.req, self.result
        layer_index, head_index = as_index(job.layers), as_index(job.heads)
        parts: dict[str, torch.Tensor] = {}
        if req.include_scores:
            parts["scores"] = result.scores_slice(job.layers, job.heads, self.rows)  # (l, h, q, T)
        if job.value_weighted:
            return parts
        kept = result.kept_attention  # (L, H, T, T) on the run's device
        # (l, h, T, T): one copy kernel when the indices run in steps of one
        selected = kept[layer_index][:, head_index].contiguous()
        parts["attention"] = selected if job.requested_queries is None else selected[:, :, self.rows]  # (l, h, q, T)
        parts["received"] = selected.mean(dim=2)  # (l, h, T): the attention each key gets, averaged over queries
        if self.base is not None and req.include_base:
            parts["base_attention"] = self.base.kept_attention[layer_index][:, head_index][:, :, self.rows]  # (l, h, q, T)
        if req.thumbnail_size and self.thumbnail_key not in result.derived:  # (L, H, t, t) levels and each head's max
            parts["thumbnail_levels"], parts["thumbnail_max"] = thumbnail_levels(kept, req.thumbnail_size)
        return parts

    def fields(self, host: dict[str, Any]) -> dict[str, Any]:
        """attention, scores, base_attention, received, thumbnails; `host` is the one read of device_parts() (a
        thumbnail read there is kept with the run as its derived field)."""
        req, result = self.job.req, self.result
        if "thumbnail_levels" in host:
            result.derived[self.thumbnail_key] = thumbnail_field(host["thumbnail_levels"], host["thumbnail_max"])

        def field(name: str) -> object:
            return tensor_field(torch.from_numpy(host[name]), req.encoding) if name in host else None

        out = {"attention": field("attention"), "scores": field("scores"), "base_attention": field("base_attention"),
               "received": field("received"),
               "thumbnails": result.derived[self.thumbnail_key] if req.thumbnail_size and not self.job.value_weighted
               else None}
        if self.job.value_weighted:
            out.update(self._value_weighted())
        return out

    def _value_weighted(self) -> dict[str, Any]:
        job, req, result = self.job, self.job.req, self.result
        layers, heads = job.layers, job.heads
        norms = run_norms(job, result, job.interventions)  # (L, H, T)
        out: dict[str, Any] = {}
        if job.requested_queries is None:
            maps = value_weighted(result.attention[layers][:, heads], norms[layers][:, heads])  # (l, h, T, T)
            out["attention"] = tensor_field(maps, req.encoding)
            out["received"] = tensor_field(maps.mean(dim=2), req.encoding)  # (l, h, T)
        else:  # query rows (the image page): only those rows (each renormalised on its own), received once per run
            rows = job.queries
            # the rows first: indexing all of P by layers/heads would copy every layer's T × T maps
            picked = value_weighted(result.attention[:, :, rows][layers][:, heads], norms[layers][:, heads])  # (l, h, q, T)
            out["attention"] = tensor_field(picked, req.encoding)
            received = result.summary("value_received", lambda: torch.stack([  # (L, H, T), a layer at a time
                value_weighted(result.attention[l], norms[l].to(result.attention.device)).mean(dim=1)
                for l in range(result.attention.shape[0])]).cpu())
            out["received"] = tensor_field(received[layers][:, heads], req.encoding)
        if req.thumbnail_size:
            out["thumbnails"] = result.summary(f"value_thumbnails{req.thumbnail_size}",
                                               lambda: value_thumbnails(result.attention, norms, req.thumbnail_size))
        if self.base is not None and req.include_base:
            base = self.base
            out["base_attention"] = tensor_field(value_weighted(base.attention[layers][:, heads],
                                                                run_norms(job, base, ())[layers][:, heads]), req.encoding)
        return out


class LongMaps:
    """A long run's maps (over full_map_tokens: an atlas, no P): the overview (B × B block means), received, the
    thumbnails and any requested query rows over every key; with value weighting those of the value-weighted maps,
    rebuilt from q̂/k̂ and the kept norms (models/attribution.value_weighted_overview, once per cached run)."""

    def __init__(self, job: AttentionJob, result: AttentionResult, base: AttentionResult | None):
        self.job, self.result, self.base = job, result, base

    def fields(self) -> dict[str, Any]:
        """attention (query rows or None), overview, base_overview, received, thumbnails."""
        if self.job.value_weighted:
            return self._value_weighted()
        job, req, atlas, base = self.job, self.job.req, self.result.atlas, self.base
        layers, heads = job.layers, job.heads
        attention = None
        if job.requested_queries is not None:  # the rows asked for, each normalised over all keys, rebuilt from q̂/k̂
            rows = [torch.stack([full_rows(atlas.record(l), heads, q, q + 1)[:, 0] for q in job.queries], dim=1)
                    for l in layers]
            attention = tensor_field(torch.stack(rows).cpu(), req.encoding)  # (l, h, q, T)
        return {
            "attention": attention,
            "overview": {"edges": atlas.row_edges(), "col_edges": atlas.col_edges(),
                         "maps": tensor_field(atlas.overview(layers, heads), req.encoding)},  # (l, h, B, B)
            # the run without the interventions on the same blocks (same tokens): the page shows the overview of
            # P̂ − P (a block mean is linear in P)
            "base_overview": (tensor_field(base.atlas.overview(layers, heads), req.encoding)  # (l, h, B, B)
                              if base is not None and base.atlas is not None else None),
            "received": tensor_field(atlas.received(layers, heads), req.encoding),  # (l, h, T)
            "thumbnails": self.result.summary(f"thumbnails{req.thumbnail_size}",
                                              lambda: atlas.thumbnails(req.thumbnail_size)) if req.thumbnail_size else None,
        }

    def _value_weighted(self) -> dict[str, Any]:
        job, req, result = self.job, self.job.req, self.result
        layers, heads = job.layers, job.heads
        atlas = result.atlas
        if kept_value_norms(atlas) is None:
            raise HTTPException(409, detail="this long run kept no value norms: run the input again")

        def overview() -> tuple[torch.Tensor, torch.Tensor]:
            job.check_extra()  # every run was cached: the overview alone (app/costs.py)
            check_cancelled(job.ctx)
            with job.runtime.admitted(ctx=job.ctx):  # the attention's arithmetic once more: it takes its turn like a run
                every = sorted(atlas.records)
                parts = []
                for i, layer in enumerate(every):  # a layer at a time: progress and Cancel as in a model run
                    parts.append(value_weighted_overview(atlas, atlas.config.block_rows, [layer]))
                    after_layer(i, len(every), job.ctx)
                return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (L, H, nR, nC), (L, H, T)
        sums, received = result.summary("value_overview", overview)  # (L, H, nR, nC), (L, H, T)
        row_sizes = torch.tensor(atlas.row_edges()).diff().float()
        col_sizes = torch.tensor(atlas.col_edges()).diff().float()
        means = sums[layers][:, heads] / (row_sizes[:, None] * col_sizes[None, :])  # (l, h, nR, nC)
        attention = None
        if job.requested_queries is not None:
            rows = [torch.stack([value_weighted_rows(atlas.record(l), heads, q, q + 1)[:, 0] for q in job.queries], dim=1)
                    for l in layers]  # each (h, q, T)
            attention = tensor_field(torch.stack(rows).cpu(), req.encoding)
        return {
            "attention": attention,
            "overview": {"edges": atlas.row_edges(), "col_edges": atlas.col_edges(),
                         "maps": tensor_field(means, req.encoding)},
            "base_overview": None,  # P's: the base run's value-weighted overview is not formed (windows take minus)
            "received": tensor_field(received[layers][:, heads], req.encoding),
            "thumbnails": result.summary(f"value_thumbnails{req.thumbnail_size}",
                                         lambda: atlas.thumbnails(req.thumbnail_size, sums)) if req.thumbnail_size else None,
        }


class KindMaps:
    """An encoder–decoder's maps per kind (encoder M × M, decoder N × N, cross N × M): a short run's slices of P (and
    of the base run's), a long run's overview and received; value-weighted, encoder and cross keys by the source
    tokens' values and the decoder's by the target's."""

    def __init__(self, job: AttentionJob, result: AttentionResult, base: AttentionResult | None):
        self.job, self.result, self.base = job, result, base

    def norms(self, run: AttentionResult, kind: str) -> torch.Tensor:
        norms = layer_value_norms(run.atlas, self.job.adapter.kind_layers[kind])  # (L_kind, H, T_k)
        if norms is None:
            raise HTTPException(409, detail="this run kept no value norms: run the input again")
        return norms

    def slices(self, run: AttentionResult) -> dict[str, Any]:
        """Every kind's maps of the requested layers/heads, (l, h, ·, ·) each."""
        job = self.job
        layers, heads = job.layers, job.heads
        if job.value_weighted:
            return {kind: tensor_field(value_weighted(run.by_kind[kind][layers][:, heads],
                                                      self.norms(run, kind)[layers][:, heads]), job.req.encoding)
                    for kind in KINDS}
        return {kind: tensor_field(maps[layers][:, heads], job.req.encoding) for kind, maps in run.by_kind.items()}

    def overview(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """A long run's (overview, received) per kind."""
        job, atlas, adapter = self.job, self.result.atlas, self.job.adapter
        layers, heads, encoding = job.layers, job.heads, job.req.encoding
        overview, received = {}, {}
        for kind in KINDS:
            part = adapter.kind_overview(atlas, kind, layers, heads)
            if not job.value_weighted:
                overview[kind] = {**part, "maps": tensor_field(part["maps"], encoding)}  # (l, h, nR, nC)
                received[kind] = tensor_field(adapter.kind_received(atlas, kind, layers, heads), encoding)
                continue

            def compute(kind=kind) -> tuple[torch.Tensor, torch.Tensor]:
                self.norms(self.result, kind)
                job.check_extra()  # every run was cached: the overviews alone (app/costs.py)
                check_cancelled(job.ctx)
                with job.runtime.admitted(ctx=job.ctx):  # the attention's arithmetic once more: it takes its turn like a run
                    return value_weighted_overview(atlas, atlas.config.block_rows, adapter.kind_layers[kind])
            sums, kind_received = self.result.summary(f"value_overview_{kind}", compute)  # (L_k, H, nR, nC), (L_k, H, T_k)
            first = adapter.kind_layers[kind][0]
            rows = torch.tensor(atlas.row_edges(first)).diff().float()
            cols = torch.tensor(atlas.col_edges(first)).diff().float()
            means = sums[layers][:, heads] / (rows[:, None] * cols[None, :])  # (l, h, nR, nC)
            overview[kind] = {**part, "maps": tensor_field(means, encoding)}
            received[kind] = tensor_field(kind_received[layers][:, heads], encoding)
        return overview, received


class SpeechMaps:
    """Whisper's maps: cross [l][h][N][1500] (keys: encoder positions of 20 ms) and decoder [l][h][N][N] of the
    requested kinds, and the encoder's self-attention as a pooled overview; value-weighted, cross keys by what each
    frame's value adds and the encoder overview pooled from the value-weighted encoder maps."""

    def __init__(self, job: AttentionJob, result: AttentionResult):
        self.job, self.result = job, result

    def norms(self, kind: str) -> torch.Tensor:
        """‖v_j W_O^h‖ of one kind's layers, (L_kind, H, T_k): cross keys are the 1,500 encoder positions."""
        norms = layer_value_norms(self.result.atlas, self.job.adapter.kind_layers[kind])
        if norms is None:  # a run made without them (none of this route's): the same input again keeps them
            raise HTTPException(409, detail="this run kept no value norms: run the clip again")
        return norms

    def attention(self, n_positions: int) -> dict[str, Any]:
        job, req, result = self.job, self.job.req, self.result
        layers, heads = job.layers, job.heads
        attention: dict[str, Any] = {}
        for kind in ("cross", "decoder"):
            maps = result.by_kind[kind][layers][:, heads] if kind in req.kinds else None  # (l, h, N, ·)
            if maps is not None and job.value_weighted:
                maps = value_weighted(maps, self.norms(kind)[layers][:, heads])
            attention[kind] = None if maps is None else tensor_field(maps, req.encoding)
        attention["encoder"] = None
        if "encoder" in req.kinds:
            overview = (self._value_encoder_overview() if job.value_weighted
                        else result.output["encoder_overview"][job.encoder_layers])[:, heads]  # (l, h, B, B)
            attention["encoder"] = {"overview": tensor_field(overview, req.encoding), "layers": job.encoder_layers,
                                    "block_positions": result.derived["overview_block"], "positions": n_positions}
        return attention

    def _value_encoder_overview(self) -> torch.Tensor:
        """The encoder overview of the value-weighted encoder maps of the requested encoder layers, (l, H, B, B) on
        the blocks of the P overview: each layer's 1,500 rows rebuilt from its kept q̂/k̂ (the run keeps no encoder P),
        weighted by the frames' value norms and pooled (models/adapters/whisper.encoder_overview); once per cached
        run and layer (the page shows one), taking its turn like a run."""
        job, result = self.job, self.result
        self.norms("encoder")
        n_positions = result.derived["n_positions"]

        def pooled(layer: int) -> torch.Tensor:
            record = result.atlas.record(job.adapter.kind_layers["encoder"][layer])
            heads = []
            check_cancelled(job.ctx)
            with job.runtime.admitted(ctx=job.ctx):
                for head in range(record.n_heads):  # a head at a time: one 1,500² map held, not H of them
                    rows = value_weighted_rows(record, [head], 0, record.queries.shape[1])  # (1, 1500, 1500)
                    heads.append(encoder_overview(rows[None], n_positions)[0][0, 0])  # (B, B)
            return torch.stack(heads)  # (H, B, B)
        return torch.stack([result.summary(f"value_encoder_overview{l}", lambda l=l: pooled(l))
                            for l in job.encoder_layers])
