"""Long inputs: an atlas of a run instead of all of P (docs/science.md §10).

A run over T tokens has L·H maps of T² numbers; at 4,096 tokens smollm2-135m's would take 18 GB. Instead the
attention function computes softmax over blocks of query rows and keeps, per layer:

- a `LayerRecord`: q̂ and k̂ after every perturbation and RoPE (k̂ per K/V head under GQA unless a key perturbation
  made the copies differ), the per-head β, the key masks, the causal flags and the model's own mask and extras:
  everything that rebuilds any window of P exactly (`window`, `full_rows`);
- `LayerSummary`: what views show at any length, taken from each block on the device and the block dropped:
  the pooled overview (≤ B × B blocks of P's mean), row entropy, mean attention distance, `received[j]`.

Memory during a run is then O(L·H·T·d + block·T) instead of O(L·H·T²); nothing is read back to the host
inside the forward.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch

from models.interventions import (
    Intervention, LayerCall, LogitExtras, perturb_vectors, plan_layer,
)


@dataclass(frozen=True)
class AtlasConfig:
    """How a run is recorded blockwise; `positions` (T, p) give each token's coordinates for the mean attention
    distance (None: the token index), tokens before `distance_from` (CLS, registers) have none."""

    block_rows: int = 128
    overview_blocks: int = 128
    thumbnail_size: int = 24
    positions: torch.Tensor | None = None
    distance_from: int = 0


@dataclass
class LayerRecord:
    """What rebuilds any window of one layer's P: P = softmax(z(β, q̂, k̂, extras) + M) row-wise."""

    queries: torch.Tensor  # (H, T_q, d) q̂
    keys: torch.Tensor  # (H_k, T_k, d) k̂; query head h reads key head h // (H / H_k)
    native_beta: float
    beta: torch.Tensor  # (H,) float32
    key_mask: torch.Tensor | None  # (H, T_k) bool, True = masked by an intervention
    causal_heads: torch.Tensor | None  # (H,) bool, heads under a `causal` intervention
    allowed: torch.Tensor | None  # (1|H, T_q, T_k) bool, the model's own mask (None: only `model_causal`, or none)
    model_causal: bool  # the model masks every key after the query's own position
    extras: LogitExtras  # bias/mask_bias sliced to batch item 0: (1|H, T_q, T_k)
    query_offset: int = 0
    # (H, T_k) ‖v_j W_O^h‖ per head and key, when the run kept them (models/head_ops.py): a value-weighted window
    # is P[i, j]·n_j renormalised per row (models/attribution.py)
    value_norms: torch.Tensor | None = None

    @property
    def n_heads(self) -> int:
        return self.queries.shape[0]

    @property
    def n_rep(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.queries, self.keys, self.beta, self.key_mask, self.causal_heads, self.allowed,
                 self.extras.bias, self.extras.mask_bias, self.value_norms]
        return [t for t in parts if t is not None]


@dataclass
class LayerSummary:
    entropy: torch.Tensor  # (H,) mean row entropy
    distance: torch.Tensor  # (H,) mean attention distance
    received: torch.Tensor  # (H, T_k) Σ_i P[i, j] / T_q
    overview_sums: torch.Tensor  # (H, nR, nC) Σ of P over each block's cells
    dead_rows: torch.Tensor  # (H, T_q) bool


def edges(n: int, blocks: int) -> list[int]:
    """Block boundaries in tokens: blocks of equal width ⌈n / blocks⌉ (the last one shorter)."""
    width = max(1, -(-n // blocks))
    return list(range(0, n, width)) + [n]


def _logits(queries: torch.Tensor, keys: torch.Tensor, beta: torch.Tensor, native_beta: float,
            extras: LogitExtras) -> torch.Tensor:
    """z for a block: queries (H, r, d), keys (H_k, c, d), β (H,), extras already sliced to (1|H, r, c).

    The same arithmetic as interventions.attention_logits, grouped: query heads sharing a K/V head are stacked
    into one (n_rep·r × d) matrix, so K is never repeated. → (H, r, c) float32."""
    n_heads, rows, dim = queries.shape
    n_kv, cols = keys.shape[0], keys.shape[1]
    queries, keys = queries.float(), keys.float()
    keys_t = keys.transpose(-1, -2)  # (H_k, d, c)
    if extras.empty:
        scaled = (queries * beta[:, None, None]).reshape(n_kv, -1, dim)  # (H_k, n_rep·r, d)
        return torch.matmul(scaled, keys_t).view(n_heads, rows, cols)
    logits = extras.native_logits(torch.matmul((queries * native_beta).reshape(n_kv, -1, dim), keys_t).view(n_heads, rows, cols))
    return logits * (beta / native_beta)[:, None, None]


def _slice_extras(extras: LogitExtras, rows: slice, cols: slice, heads: slice | list[int] = slice(None)) -> LogitExtras:
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[:, :, rows, cols] if t.dim() == 4 else t[:, rows, cols]  # (1|H, r, c)
        t = t[0] if t.dim() == 4 else t
        return t if t.shape[0] == 1 else t[heads]
    return LogitExtras(bias=cut(extras.bias), softcap=extras.softcap, mask_bias=cut(extras.mask_bias))


def _blocked(record: LayerRecord, r0: int, r1: int, c0: int, c1: int,
             heads: slice | list[int] = slice(None)) -> torch.Tensor | None:
    """Which cells of rows [r0, r1) × keys [c0, c1) are masked, (1|h, r, c) bool; None = none."""
    device = record.queries.device
    blocked = None
    if record.key_mask is not None:
        blocked = record.key_mask[heads][:, None, c0:c1]  # (h, 1, c)
    need_future = record.model_causal and c1 > r0 + record.query_offset + 1
    if record.causal_heads is not None or need_future:
        rows = torch.arange(r0, r1, device=device)[:, None] + record.query_offset
        future = torch.arange(c0, c1, device=device)[None, :] > rows  # (r, c)
        if need_future and record.allowed is None:
            blocked = future[None] if blocked is None else blocked | future
        if record.causal_heads is not None:
            by_head = record.causal_heads[heads][:, None, None] & future  # (h, r, c)
            blocked = by_head if blocked is None else blocked | by_head
    if record.allowed is not None:
        allowed = record.allowed[:, r0:r1, c0:c1]
        allowed = allowed if allowed.shape[0] == 1 else allowed[heads]
        blocked = ~allowed if blocked is None else blocked | ~allowed
    return blocked


def _row_logits(record: LayerRecord, heads: list[int], r0: int, r1: int,
                beta: float | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """z of rows [r0, r1) over the keys those rows may see, masked cells −∞: (z (h, r, c) float32, the mask
    (1|h, r, c) or None, c). A causal model's keys after the last row are left out (c < T_k): they are all masked."""
    n_keys = record.keys.shape[1]
    cols = min(n_keys, r1 + record.query_offset) if record.model_causal else n_keys
    rep = record.n_rep
    queries = record.queries[heads, r0:r1]  # (h, r, d)
    if rep == 1:
        keys = record.keys[heads, :cols]
    else:
        keys = record.keys[[h // rep for h in heads], :cols]  # (h, c, d): one K/V head per query head here
    b = record.beta[heads] if beta is None else torch.full((len(heads),), float(beta), device=record.beta.device)
    z = _logits(queries, keys, b, record.native_beta, _slice_extras(record.extras, slice(r0, r1), slice(0, cols), heads))
    blocked = _blocked(record, r0, r1, 0, cols, heads)
    if blocked is not None:
        z = z.masked_fill(blocked, float("-inf"))
    return z, blocked, cols


def row_logits(record: LayerRecord, heads: list[int], r0: int, r1: int,
               beta: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """z of rows [r0, r1) over their keys, masked cells −∞ (see _row_logits): for callers outside this module (the
    log-sum-exp a continuation's top-k rows carry, models/step_rows.py)."""
    return _row_logits(record, heads, r0, r1, beta)


@torch.inference_mode()
def full_row_entropy(record: LayerRecord, heads: list[int], r0: int, r1: int, beta: float | None = None,
                     block: int = 128) -> torch.Tensor:
    """H_i = −Σ_j P_ij log P_ij of rows [r0, r1), each over ALL its keys (nats), at `beta` when given, from q̂ k̂ᵀ:
    H_i = lse_i − Σ_j P_ij z_ij with lse_i the row's log-sum-exp. Blocks of `block` rows, so memory is
    O(h·block·T_k) whatever r1 − r0 is. A row with every key masked has entropy 0. → (h, r) float32"""
    out = []
    for b0 in range(r0, r1, block):
        b1 = min(r1, b0 + block)
        z, blocked, _ = _row_logits(record, heads, b0, b1, beta)  # (h, b, c)
        top = z.amax(dim=-1, keepdim=True)  # (h, b, 1): −∞ for a row with every key masked
        live = torch.isfinite(top[..., 0])
        # shifted by the row's max: lse and Σ p·z are then O(1) and their difference keeps its float32 digits
        z = z - torch.where(torch.isfinite(top), top, 0.0)
        lse = torch.logsumexp(z, dim=-1)  # (h, b)
        probs = torch.exp(z - torch.where(live, lse, 0.0)[..., None])  # (h, b, c): exp(−∞) = 0 at masked cells
        finite_z = z if blocked is None else z.masked_fill(blocked, 0.0)  # p = 0 there: Σ p·z over allowed keys
        entropy = torch.where(live, lse - _row_dot(probs, finite_z), torch.zeros_like(lse)).clamp_min_(0.0)
        out.append(entropy)
        del z, probs, finite_z
    return torch.cat(out, dim=1)


@torch.inference_mode()
def full_rows(record: LayerRecord, heads: list[int], r0: int, r1: int, beta: float | None = None) -> torch.Tensor:
    """P[r0:r1, :] of the given heads, normalised over the whole row; with `beta`, at that β instead of the
    run's (view mode: no model re-run). Rows with every key masked are 0. → (h, r, T_k) float32"""
    n_keys = record.keys.shape[1]
    z, blocked, cols = _row_logits(record, heads, r0, r1, beta)
    probs = torch.softmax(z, dim=-1)
    if blocked is not None:
        probs = probs.nan_to_num_(0.0)  # a row with every key masked: all 0, never NaN
    if cols < n_keys:
        probs = torch.nn.functional.pad(probs, (0, n_keys - cols))  # keys after the row: exactly 0
    return probs


def window(record: LayerRecord, head: int, rows: tuple[int, int], cols: tuple[int, int],
           beta: float | None = None) -> torch.Tensor:
    """P[r0:r1, c0:c1] of one head, exactly the run's (each row normalised over all T_k keys). → (r, c)"""
    return full_rows(record, [head], rows[0], rows[1], beta)[0, :, cols[0]:cols[1]]


@torch.inference_mode()
def scores_window(record: LayerRecord, head: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Ŝ[r0:r1, c0:c1] = q̂ k̂ᵀ of one head (unscaled, before β, masks and softmax). → (r, c)"""
    queries = record.queries[head, rows[0]:rows[1]].float()
    keys = record.keys[head // record.n_rep, cols[0]:cols[1]].float()
    return queries @ keys.T


@dataclass
class AtlasRecorder:
    """Collects each layer's record and summaries during one forward (set on the RunScope)."""

    config: AtlasConfig
    records: dict[int, LayerRecord] = field(default_factory=dict)
    summaries: dict[int, LayerSummary] = field(default_factory=dict)
    # id → verdict, once per distinct mask tensor: "causal" (exactly the causal triangle), "subset" (within it)
    _mask_kind: dict[int, str] = field(default_factory=dict)

    def mask_kind(self, allowed: torch.Tensor) -> str:
        """On a CPU, whether the model's own mask is exactly causal (then only the diagonal block is masked and
        nothing is kept) or within the causal triangle; on a GPU nothing is read back: "unknown"."""
        key = allowed.data_ptr()
        if key not in self._mask_kind:
            if allowed.device.type != "cpu":
                self._mask_kind[key] = "unknown"
            else:
                square = allowed.reshape(-1, *allowed.shape[-2:])  # (n, T_q, T_k)
                rows, cols = square.shape[-2:]
                tril = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)
                if bool((square == tril).all()):
                    self._mask_kind[key] = "causal"
                elif not bool((square & ~tril).any()):
                    self._mask_kind[key] = "subset"
                else:
                    self._mask_kind[key] = "other"
        return self._mask_kind[key]


def _planned(q: torch.Tensor, k: torch.Tensor, call: LayerCall) -> tuple:
    """The layer's plan applied to its inputs: q (H, T_q, d) and k (H_kv, T_k, d) perturbed where asked (a key
    perturbation gives every query head its own copy of K), and the (H,) β, key mask, causal heads and ablated heads
    on the device (None where nothing is asked)."""
    layer, native_beta, device = call.layer, call.native_beta, q.device
    n_heads, n_kv, n_keys = q.shape[0], k.shape[0], k.shape[1]
    plan = plan_layer(call.interventions, layer, n_heads, n_keys, native_beta) if any(
        iv.applies_to_layer(layer) for iv in call.interventions) else None
    if plan is not None and plan.key_perturbations:
        # a key perturbation scoped to one query head: that head gets its own copy of K (docs/science.md §9)
        k = k.repeat_interleave(n_heads // n_kv, dim=0).float()[None]  # (1, H, T_k, d)
        for iv in plan.key_perturbations:
            k = perturb_vectors(k, iv, layer)
        k = k[0]
    if plan is not None and plan.query_perturbations:
        q = q.float()[None]
        for iv in plan.query_perturbations:
            q = perturb_vectors(q, iv, layer, offset=call.query_offset)
        q = q[0]
    # (H,) β; without interventions made on the device: a copy from the host would make the CPU wait for the GPU
    beta = (plan.beta.to(device, torch.float32) if plan is not None
            else torch.full((n_heads,), float(native_beta), device=device, dtype=torch.float32))
    key_mask = plan.key_mask.to(device) if plan is not None and bool(plan.key_mask.any()) else None
    causal_heads = plan.causal.to(device) if plan is not None and bool(plan.causal.any()) else None
    ablate = plan.ablate.to(device) if plan is not None and bool(plan.ablate.any()) else None
    return q, k, beta, key_mask, causal_heads, ablate


def _block_softmax(z: torch.Tensor, record: "LayerRecord", span: tuple[int, int, int], pure_causal: bool,
                   dead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's logits z (H, r, c) for rows r0:r1 over keys 0:cols (span), masked in place: the row maxima and
    their keys (H, r), P (H, r, c), and z with 0 where P is 0 (for Σ p·z over the allowed keys); rows with every key
    masked are set in `dead` (H, T_q)."""
    r0, r1, cols = span
    query_offset = record.query_offset
    if pure_causal:
        # only the diagonal square has masked cells: keys before the block's first row are all allowed
        diagonal = z[:, :, r0 + query_offset:cols]  # (H, r, r)
        future = torch.ones(r1 - r0, cols - r0 - query_offset, dtype=torch.bool, device=z.device).triu(1)
        diagonal.masked_fill_(future, float("-inf"))
        top, top_index = z.max(dim=-1)  # (H, r)
        probs = torch.softmax(z, dim=-1)  # (H, r, c)
        diagonal.masked_fill_(future, 0.0)  # p = 0 there: Σ p·z over the allowed keys
        return top, top_index, probs, z
    blocked = _blocked(record, r0, r1, 0, cols)
    if blocked is not None:
        z.masked_fill_(blocked, float("-inf"))
    top, top_index = z.max(dim=-1)  # (H, r): −∞ for a row with every key masked
    probs = torch.softmax(z, dim=-1)  # (H, r, c)
    if blocked is None:
        return top, top_index, probs, z
    row_dead = torch.isneginf(top)  # (H, r)
    probs.masked_fill_(row_dead[..., None], 0.0)
    dead[:, r0:r1] = row_dead
    return top, top_index, probs, z.masked_fill_(blocked, 0.0)  # p = 0 there: Σ p·z over the allowed keys


def atlas_attention(
    recorder: AtlasRecorder,
    module_causal: bool,
    query: torch.Tensor,  # (1, H, T_q, d)
    key: torch.Tensor,  # (1, H_kv, T_k, d)
    value: torch.Tensor,  # (1, H_kv, T_k, d_v)
    allowed: torch.Tensor | None,  # bool (1, 1|H, T_q, T_k)
    call: LayerCall,
) -> torch.Tensor:
    """One layer's attention computed in blocks of query rows, recording the layer's record and summaries.
    Returns the head outputs P V: (1, H, T_q, d_v) in float32 (the caller casts)."""
    cfg = recorder.config
    layer, native_beta, extras, query_offset = call.layer, call.native_beta, call.extras, call.query_offset
    _, n_heads, n_queries, _ = query.shape
    n_kv, n_keys = key.shape[1], key.shape[2]
    device = query.device
    q, k, beta, key_mask, causal_heads, ablate = _planned(query[0], key[0], call)
    v = value[0]  # (H_kv, T_k, d_v)

    model_causal = module_causal and n_keys == n_queries + query_offset
    kind = recorder.mask_kind(allowed) if allowed is not None else "none"
    if allowed is not None and kind == "other":
        model_causal = False  # the mask lets some query see the future (it is not a causal model's)
    keep_mask = None if allowed is None or (model_causal and kind == "causal") else allowed[0]  # (1|H, T_q, T_k)
    record = LayerRecord(
        queries=q, keys=k, native_beta=native_beta, beta=beta, key_mask=key_mask, causal_heads=causal_heads,
        allowed=keep_mask, model_causal=model_causal,
        extras=LogitExtras(
            bias=None if extras.bias is None else extras.bias[:1], softcap=extras.softcap,
            mask_bias=None if extras.mask_bias is None else extras.mask_bias[:1],
        ),
        query_offset=query_offset,
    )
    recorder.records[layer] = record
    # the common decoder case: nothing but the causal triangle is masked, so only each block's diagonal square is
    pure_causal = model_causal and keep_mask is None and key_mask is None and causal_heads is None

    row_edges, col_edges = edges(n_queries, cfg.overview_blocks), edges(n_keys, cfg.overview_blocks)
    row_width, col_width = row_edges[1] - row_edges[0], col_edges[1] - col_edges[0]
    block = max(row_width, cfg.block_rows // row_width * row_width)  # block rows align with overview rows
    out = torch.empty(n_heads, n_queries, v.shape[-1], device=device, dtype=torch.float32)  # (H, T_q, d_v)
    entropy_sum = torch.zeros(n_heads, device=device, dtype=torch.float64)
    distance_sum = torch.zeros(n_heads, device=device, dtype=torch.float64)
    received = torch.zeros(n_heads, n_keys, device=device, dtype=torch.float32)  # (H, T_k)
    overview = torch.zeros(n_heads, len(row_edges) - 1, len(col_edges) - 1, device=device)  # (H, nR, nC)
    dead = torch.zeros(n_heads, n_queries, dtype=torch.bool, device=device)
    values = v if v.shape[0] == k.shape[0] else v.repeat_interleave(n_heads // n_kv, dim=0)  # (H_k, T_k, d_v)
    values = values.float()
    positions = cfg.positions.to(device) if cfg.positions is not None else None
    token_index = torch.arange(n_keys, device=device, dtype=torch.float32)  # (T_k,)
    for r0 in range(0, n_queries, block):
        r1 = min(n_queries, r0 + block)
        cols = min(n_keys, r1 + query_offset) if model_causal else n_keys  # keys after the block's last row: masked
        z = _logits(q[:, r0:r1], k[:, :cols], beta, native_beta, _slice_extras(record.extras, slice(r0, r1), slice(0, cols)))
        top, top_index, probs, finite_z = _block_softmax(z, record, (r0, r1, cols), pure_causal, dead)
        # H_i = lse_i − Σ_j p_ij z_ij with lse_i = max_j z_ij − log p_i,argmax (one log per row, not per entry)
        top_prob = probs.gather(-1, top_index[..., None])[..., 0]  # (H, r)
        row_entropy = torch.where(top_prob > 0, top - torch.log(top_prob) - _row_dot(probs, finite_z),
                                  torch.zeros_like(top)).clamp_min_(0.0)
        entropy_sum += row_entropy.sum(dim=-1, dtype=torch.float64)
        distance_sum += _distance_rows(probs, r0, r1, cols, model_causal, positions, cfg.distance_from,
                                       token_index, query_offset).sum(dim=-1, dtype=torch.float64)
        # the head outputs: query heads sharing a K/V head stacked into one product, K/V never repeated
        out[:, r0:r1] = torch.matmul(probs.reshape(values.shape[0], -1, cols), values[:, :cols]).view(n_heads, r1 - r0, -1)
        # pooled: rows first (within the block, aligned with the overview's rows), then columns by pad + reshape
        # (a 0/1 matrix product: summing the middle axis of a (H, nr, w, c) view is several times slower on a CPU)
        by_rows = torch.matmul(_row_pooling(r0, r1, row_width, device), probs)  # (H, nr, c)
        received[:, :cols] += by_rows.sum(dim=1)
        padded_cols = -(-cols // col_width) * col_width
        pooled = torch.nn.functional.pad(by_rows, (0, padded_cols - cols)).view(
            n_heads, by_rows.shape[1], padded_cols // col_width, col_width).sum(dim=-1)  # (H, nr, nc)
        first = r0 // row_width
        overview[:, first:first + pooled.shape[1], :pooled.shape[2]] += pooled
        del z, probs, by_rows, finite_z
    if ablate is not None:
        out.masked_fill_(ablate[:, None, None], 0.0)
    n_distance_rows = max(1, n_queries - cfg.distance_from) if positions is not None else n_queries
    recorder.summaries[layer] = LayerSummary(
        entropy=(entropy_sum / n_queries).float(), distance=(distance_sum / n_distance_rows).float(),
        received=received / n_queries, overview_sums=overview, dead_rows=dead,
    )
    return out[None]  # (1, H, T_q, d_v)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a[h, i, j] b[h, i, j] → (H, r) as a batched product (linalg.vecdot would allocate a · b whole)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1))[..., 0, 0]


def _row_pooling(r0: int, r1: int, width: int, device: torch.device) -> torch.Tensor:
    """(nr, r) 0/1: row a sums the block's rows that fall in overview row a (blocks start on overview rows)."""
    rows = torch.arange(r1 - r0, device=device)
    groups = -(-(r1 - r0) // width)
    return (rows[None, :] // width == torch.arange(groups, device=device)[:, None]).float()


def _distance_rows(probs: torch.Tensor, r0: int, r1: int, cols: int, model_causal: bool,
                   positions: torch.Tensor | None, distance_from: int, token_index: torch.Tensor,
                   query_offset: int) -> torch.Tensor:
    """Σ_j P[i, j]·dist(i, j) for the block's rows, (H, r). Text: dist = |i − j| tokens (for a causal model
    every key is at or before the row, so it is i − Σ_j P j, one product); images: ‖pos_i − pos_j‖ over the
    patches only (rows and keys before `distance_from` count 0)."""
    rows = torch.arange(r0, r1, device=probs.device, dtype=torch.float32) + query_offset  # (r,)
    if positions is None:
        if model_causal:
            return (rows[None, :] - torch.matmul(probs, token_index[:cols])) * (probs.sum(-1) > 0)
        distance = (rows[:, None] - token_index[None, :cols]).abs()  # (r, c)
        return _row_dot(probs, distance.expand_as(probs))
    pos = positions.float()
    distance = torch.cdist(pos[r0:r1], pos[:cols])  # (r, c)
    distance[:, :distance_from] = 0.0
    distance[: max(0, min(r1, distance_from) - r0)] = 0.0
    return _row_dot(probs, distance.expand_as(probs))


@dataclass
class Atlas:
    """A run's atlas, kept on the device it ran on: the per-layer records and summaries."""

    records: dict[int, "LayerRecord | PendingRecord"]
    summaries: dict[int, LayerSummary]  # empty for a short run (its P is kept whole)
    config: AtlasConfig

    @property
    def n_layers(self) -> int:
        return len(self.records)

    def record(self, layer: int) -> LayerRecord:
        record = self.records[layer]
        if isinstance(record, PendingRecord):
            record = self.records[layer] = record.build()
        return record

    def row_edges(self, layer: int = 0) -> list[int]:
        return edges(self.records[layer].queries.shape[1], self.config.overview_blocks)

    def col_edges(self, layer: int = 0) -> list[int]:
        return edges(self.records[layer].keys.shape[1], self.config.overview_blocks)

    def overview(self, layers: list[int], heads: list[int]) -> torch.Tensor:
        """Mean of P over each block's cells, (l, h, nR, nC), on the host."""
        rows = torch.tensor(self.row_edges(layers[0])).diff().float()
        cols = torch.tensor(self.col_edges(layers[0])).diff().float()
        sums = torch.stack([self.summaries[l].overview_sums[heads] for l in layers]).cpu()
        return sums / (rows[:, None] * cols[None, :])

    def entropy(self) -> torch.Tensor:
        return torch.stack([self.summaries[l].entropy for l in sorted(self.summaries)]).cpu()  # (L, H)

    def mean_distance(self) -> torch.Tensor:
        return torch.stack([self.summaries[l].distance for l in sorted(self.summaries)]).cpu()  # (L, H)

    def sink_mass(self) -> torch.Tensor:
        """Each head's mean P[i, 0] over rows: `received` of the first key (Σ_i P[i, 0] / T_q). (L, H) on the host"""
        return torch.stack([self.summaries[l].received[:, 0] for l in sorted(self.summaries)]).cpu()

    def received(self, layers: list[int], heads: list[int]) -> torch.Tensor:
        return torch.stack([self.summaries[l].received[heads] for l in layers]).cpu()  # (l, h, T_k)

    def thumbnails(self, size: int, sums: torch.Tensor | None = None) -> dict:
        """Every head's map pooled to size × size bins whose edges are overview block edges: each bin the mean of P
        over its cells (exact, from the block sums). Same encoding as the short-input thumbnails. `sums` (L, H, nR,
        nC): block sums of another map on the same edges (the value-weighted one) instead of P's."""
        if sums is None:
            sums = torch.stack([self.summaries[l].overview_sums for l in sorted(self.summaries)])
        sums = sums.cpu().double()  # (L, H, nR, nC)
        rows, cols = torch.tensor(self.row_edges()).diff().double(), torch.tensor(self.col_edges()).diff().double()
        row_group, col_group = _grouping(len(rows), size), _grouping(len(cols), size)  # (t, nR), (t, nC)
        pooled = (row_group @ sums @ col_group.T) / ((row_group @ rows)[:, None] * (col_group @ cols)[None, :])
        peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)
        levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)
        return {"dtype": "uint8", "shape": list(levels.shape), "max": peak.float().tolist(),
                "data": base64.b64encode(levels.numpy().tobytes()).decode("ascii")}

    def dead_rows_warnings(self) -> list[str]:
        layers = sorted(self.summaries)
        counts = torch.stack([self.summaries[l].dead_rows.sum() for l in layers]).tolist()  # one read for all layers
        out = []
        for layer, count in zip(layers, counts):
            if count:
                heads = sorted({int(h) for h in self.summaries[layer].dead_rows.nonzero()[:, 0]})
                out.append(f"layer {layer}: {count} query rows in heads {heads} have every key masked; "
                           "their attention and output are 0")
        return out

    def row(self, row: int, layers: list[int], heads: list[int], beta: float | None = None) -> torch.Tensor:
        """P[row, :] of every given layer and head: (l, h, T_k) on the host."""
        return torch.stack([full_rows(self.record(l), heads, row, row + 1, beta)[:, 0] for l in layers]).cpu()

    @torch.inference_mode()
    def cls_rollout(self, prefix_tokens: int, grid: tuple[int, int], block: int = 512) -> torch.Tensor:
        """The CLS row of the attention rollout (summaries.cls_rollout_map) from the records: e₀ᵀ Ã_L ⋯ Ã_1 built from
        the left, each Ã_l = ½ mean_h(P_l) + ½ I (rows renormalised) applied block by block of rows rebuilt from
        q̂/k̂, so no T × T map is held. (rows, cols) on the host."""
        layers = sorted(self.records)
        first = self.record(layers[0])
        n_tokens = first.queries.shape[1]
        device = first.queries.device
        row = torch.zeros(n_tokens, dtype=torch.float64, device=device)
        row[0] = 1.0  # e₀ᵀ
        for layer in reversed(layers):
            record = self.record(layer)
            heads = list(range(record.n_heads))
            new = torch.zeros_like(row)
            for r0 in range(0, n_tokens, block):
                r1 = min(n_tokens, r0 + block)
                mean_p = full_rows(record, heads, r0, r1).double().mean(dim=0)  # (r, T)
                sums = 0.5 * mean_p.sum(dim=-1) + 0.5  # (r,) the row sums of ½ mean_h P + ½ I
                weights = row[r0:r1] / sums.clamp_min(1e-12)
                new += 0.5 * weights @ mean_p
                new[r0:r1] += 0.5 * weights
            row = new
        return row[prefix_tokens:].reshape(*grid).float().cpu()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the atlas keeps, each once (a mask shared by every layer counts once)."""
        seen: set[int] = set()
        kept = []
        tensors = [t for r in self.records.values() for t in r.tensors()]
        tensors += [t for s in self.summaries.values() for t in (s.received, s.overview_sums, s.dead_rows)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                kept.append(t)
        return kept


def _grouping(n: int, size: int) -> torch.Tensor:
    """(size', n) 0/1 matrix putting n blocks into min(size, n) contiguous groups."""
    groups = min(size, n)
    matrix = torch.zeros(groups, n, dtype=torch.float64)
    for g in range(groups):
        matrix[g, (g * n) // groups:((g + 1) * n) // groups] = 1.0
    return matrix


def run_bytes(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, n_queries: int, n_keys: int,
              overview_blocks: int = 128, block_rows: int = 128) -> int:
    """What an atlas run keeps (float32): q̂, k̂, received, the overview; plus one block's temporaries."""
    overview = min(overview_blocks, n_queries) * min(overview_blocks, n_keys)
    kept = n_layers * (n_heads * n_queries * head_dim + n_kv_heads * n_keys * head_dim + 2 * n_heads * n_keys
                       + n_heads * overview)  # 2 · H · T_k: received and the value norms
    block = 4 * n_heads * block_rows * n_keys  # z, P and their companions of one block
    return 4 * (kept + block) + n_queries * n_keys  # + the model's own bool mask, once


__all__ = ["Atlas", "AtlasConfig", "AtlasRecorder", "LayerRecord", "atlas_attention", "window", "full_rows",
           "full_row_entropy", "scores_window", "edges", "run_bytes"]


def value_norms_from_gram(values: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """‖v_j W_O^h‖ = √(v_j G_h v_jᵀ) per head and key: values (H, T_k, d_v) or, for grouped-query attention, one per
    K/V head (H_kv, T_k, d_v: query head h reads K/V head h // (H / H_kv)), gram (H, d_v, d_v) float64 → (H, T_k)
    float32. Float64 because v G vᵀ sums terms of both signs (a small norm would lose its digits in float32)."""
    v = values.double()  # (H or H_kv, T_k, d_v)
    if v.shape[0] != gram.shape[0]:
        v = v.repeat_interleave(gram.shape[0] // v.shape[0], dim=0)  # (H, T_k, d_v)
    squared = (torch.matmul(v, gram.to(v.device)) * v).sum(dim=-1)  # (H, T_k)
    return squared.clamp_min_(0.0).sqrt_().float()


@dataclass
class PendingRecord:
    """A short run's layer, as references to tensors the forward computed anyway; turned into a LayerRecord only
    when a window at another β is asked for (so short runs pay nothing for it)."""

    queries: torch.Tensor  # (H, T_q, d) q̂
    keys: torch.Tensor  # (H_k, T_k, d) k̂
    allowed: torch.Tensor | None  # (1|H, T_q, T_k)
    extras: LogitExtras
    native_beta: float
    interventions: tuple[Intervention, ...]
    layer: int
    query_offset: int = 0
    # (V (H_kv, T_k, d_v): one per K/V head, G (H, d_v, d_v) float64) when the run keeps value norms: references to
    # what the forward had (a grouped-query model's V before its copies per query head: 3 heads, not 9, of smollm2-135m),
    # the norms formed from them when first asked for, so a run that never shows a value-weighted map pays nothing
    # (on a GPU the per-layer float64 work was ~5 ms of a 27 ms run at 128 tokens: launches, not arithmetic)
    norms_from: tuple[torch.Tensor, torch.Tensor] | None = None
    _norms: torch.Tensor | None = field(default=None, repr=False)

    @property
    def value_norms(self) -> torch.Tensor | None:
        """(H, T_k) float32 ‖v_j W_O^h‖, as LayerRecord.value_norms; None when the run kept none."""
        if self._norms is None and self.norms_from is not None:
            self._norms = value_norms_from_gram(*self.norms_from)
            self.norms_from = None  # V is no longer held
        return self._norms

    def build(self) -> LayerRecord:
        n_heads, n_keys = self.queries.shape[0], self.keys.shape[1]
        plan = plan_layer(self.interventions, self.layer, n_heads, n_keys, self.native_beta)
        device = self.queries.device
        return LayerRecord(
            queries=self.queries, keys=self.keys, native_beta=self.native_beta,
            beta=plan.beta.to(device, torch.float32),
            key_mask=plan.key_mask.to(device) if bool(plan.key_mask.any()) else None,
            causal_heads=plan.causal.to(device) if bool(plan.causal.any()) else None,
            allowed=self.allowed, model_causal=False, extras=self.extras, query_offset=self.query_offset,
            value_norms=self.value_norms,
        )

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.queries, self.keys, self.allowed, self.extras.bias, self.extras.mask_bias, self._norms,
                 *(self.norms_from or ())]
        return [t for t in parts if t is not None]
