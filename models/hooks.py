"""Plugging the intervened attention into transformers without forking it.

transformers 5 dispatches every BERT/ViT/DINOv2 attention call through `AttentionInterface`; we
register one function under the name "attnlab" and load models with `attn_implementation="attnlab"`.
The function reads the current run from a context variable — set per call by `run_scope` — so two
concurrent requests (threads) never see each other's interventions, and no state is left on modules.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from models import head_ops
from models.atlas import AtlasRecorder, PendingRecord, atlas_attention
from models.interventions import Intervention, LayerCall, LogitExtras, intervened_attention
from models.recording import NOTHING, AttentionRecorder
from models.run_context import current_run
from models.step_rows import StepRows

ATTN_IMPLEMENTATION = "attnlab"


class UnsupportedAttention(RuntimeError):
    """The model's attention does something attnlab cannot reproduce (it is refused at load)."""


@dataclass
class RunScope:
    """Everything one forward pass needs from, and gives back to, the attention function."""

    layer_of: dict[int, int]  # id(attention module) → layer index, built once at load
    interventions: tuple[Intervention, ...] = ()
    record_scores: bool = False
    # False for decoding steps: nothing is kept, the interventions still apply.
    record: bool = True
    # Entropy from the recorded P once after the forward (−Σ P log P over every layer at once) instead of from the
    # logits inside each layer: on a GPU the per-layer form is a dozen tiny kernel launches per layer, which cost
    # more than the arithmetic; on a CPU the per-layer form avoids a log per T × T entry.
    deferred_entropy: bool = False
    # Token position of the first query of this forward: 0, or the KV cache's length during decoding.
    query_offset: int = 0
    attention: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → P (B, H, T_q, T_k)
    # With record_scores: layer → (q̂, k̂), each (B, H, T, d), the queries and keys after perturbation;
    # Ŝ = q̂ k̂ᵀ is formed only for the heads a request asks for (T × d each instead of T × T).
    queries_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → mean row entropy (B, H)
    # layer → query rows with every key masked (B, H, T_q), read once at the end: a check per layer would make
    # the CPU wait for a GPU at every layer
    dead_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # One (L, B, H, T, T) buffer for P, allocated at the first layer and filled in place, so the run's
    # maps are ready at the end without stacking (a copy of L·H·T² floats).
    probs_buffer: torch.Tensor | None = None
    # Long inputs (docs/science.md §10): set, the attention runs in blocks of query rows and keeps q̂/k̂ and per-block
    # summaries instead of P (`attention` stays empty); `records` then holds the atlas's LayerRecords.
    atlas: AtlasRecorder | None = None
    # layer → what rebuilds any window of P (short runs: references to q̂/k̂ and the masks, built into a LayerRecord
    # only when asked for)
    records: dict[int, object] = field(default_factory=dict)
    # A decoding forward (record=False) of a continuation: the last query's row of the asked layers and heads
    # (models/step_rows.py); a long prompt's blockwise layer records are dropped once its row is taken
    rows: StepRows | None = None

    @property
    def layers_recorded(self) -> int:
        return len(self.atlas.records) if self.atlas is not None else len(self.attention)

    def buffer_for(self, layer: int, maps_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """Where layer `layer` writes P; maps_shape: (B, H, T_q, T_k), like: a tensor of the dtype and device."""
        shape = (len(self.layer_of), *maps_shape)
        if self.probs_buffer is None:
            self.probs_buffer = like.new_empty(shape)
        elif self.probs_buffer.shape != shape:  # layers of different shapes: each keeps its own tensor
            return None
        return self.probs_buffer[layer]

    def layer_recorder(self, layer: int, maps_shape: tuple[int, ...], like: torch.Tensor) -> AttentionRecorder:
        """What a recorded layer records (models/recording.py): P into the run's buffer, each head's mean row entropy
        (unless deferred to the end), and q̂/k̂. maps_shape: (B, H, T_q, T_k), like: a tensor of the dtype and device."""
        return AttentionRecorder(pattern=self.buffer_for(layer, maps_shape, like),
                                 entropy=None if self.deferred_entropy else like.new_empty(maps_shape[:2]), qk=[])

    def keep_layer(self, layer: int, recorder: AttentionRecorder, probs: torch.Tensor, dead_rows: torch.Tensor) -> None:
        """A recorded layer's maps, entropy, q̂/k̂ (with record_scores) and dead rows, kept for the run's result."""
        self.attention[layer] = probs.detach()
        if recorder.entropy is not None:
            self.entropy[layer] = recorder.entropy
        if self.record_scores:
            self.queries_keys[layer] = (recorder.qk[0].detach(), recorder.qk[1].detach())
        self.dead_rows[layer] = dead_rows

    def layer_entropy(self, layers: list[int]) -> torch.Tensor:
        """Mean row entropy of each head, batch item 0, for `layers`: (len(layers), H), float64."""
        if not self.deferred_entropy:
            return torch.stack([self.entropy[l][0] for l in layers]).double()
        probs = self.stacked_attention(layers)  # (L, H, T_q, T_k); rows with every key masked are 0 and count as 0
        return (-torch.special.xlogy(probs, probs).sum(dim=-1)).clamp_min_(0.0).mean(dim=-1).double()

    @property
    def warnings(self) -> list[str]:
        if not self.dead_rows:
            return []
        layers = sorted(self.dead_rows)
        # one device → host read for all layers: (L,) rows per layer, then the heads of the layers that have any
        counts = torch.stack([self.dead_rows[l].sum() for l in layers]).tolist()
        out = []
        for layer, count in zip(layers, counts):
            if count:
                heads = sorted({int(h) for h in self.dead_rows[layer].nonzero()[:, 1]})
                out.append(f"layer {layer}: {count} query rows in heads {heads} have every key masked; "
                           "their attention and output are 0")
        return out

    def stacked_attention(self, layers: list[int] | None = None) -> torch.Tensor:
        """P of the first batch item for the given layers (default: all, in order): (L, H, T_q, T_k)."""
        maps, buffer = self.attention, self.probs_buffer
        layers = list(range(len(maps))) if layers is None else layers
        if (
            buffer is not None and layers == list(range(buffer.shape[0]))
            and all(maps[l].data_ptr() == buffer[l].data_ptr() for l in layers)
        ):
            return buffer[:, 0]
        return torch.stack([maps[l][0] for l in layers])


@dataclass
class CallTrace:
    """Set as the current run to learn which modules call the attention function, in call order (the
    load-time probe); the attention itself is computed plainly."""

    modules: list[nn.Module] = field(default_factory=list)


# Called as listener(layer, n_layers) after each attention layer of a run (recorded or not). The server uses it to stop
# a run whose client left within one layer rather than one forward, and to report a long first view's progress; it may
# raise to stop the forward. A context variable, so concurrent requests (threads) each see their own.
_layer_listener: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "attnlab_layer_listener", default=None
)


@contextlib.contextmanager
def on_each_layer(listener: Callable[[int, int], None] | None) -> Iterator[None]:
    token = _layer_listener.set(listener)
    try:
        yield
    finally:
        _layer_listener.reset(token)


def _layer_done(scope: RunScope, module: nn.Module) -> None:
    listener = _layer_listener.get()
    if listener is not None:
        listener(scope.layer_of[id(module)], len(scope.layer_of))


@contextlib.contextmanager
def run_scope(scope: RunScope | CallTrace):
    token = current_run.set(scope)
    try:
        yield scope
    finally:
        current_run.reset(token)


def split_mask(attention_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The model's own mask as (bool 'may attend', finite additive part or None).

    Our registered mask function gives bool masks; a model that builds its own float mask may fold a bias
    into it (0 / large negative, or a position bias): the large negatives block, the rest is added.
    """
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    bias = attention_mask.masked_fill(~allowed, 0.0)
    return allowed, (bias.float() if bool(bias.any()) else None)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, d) → (B, H_kv·n_rep, T, d): query head h reads K/V head h // n_rep (grouped-query attention)."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


def attnlab_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, H, T_q, d)
    key: torch.Tensor,  # (B, H_kv, T_k, d)
    value: torch.Tensor,  # (B, H_kv, T_k, d_v)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,  # Gemma 2's logit soft-capping
    position_bias: torch.Tensor | None = None,  # T5's relative position bias, (1|B, H, T_q, T_k)
    **kwargs,  # transformers' other keywords: dropout (models run in eval mode: none applied), sliding_window, …
) -> tuple[torch.Tensor, torch.Tensor]:
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise UnsupportedAttention("attention sinks (s_aux) are not supported")
    native_beta = scaling if scaling is not None else query.shape[-1] ** -0.5
    n_heads, n_kv_heads = query.shape[1], key.shape[1]
    if n_heads % n_kv_heads:
        raise UnsupportedAttention(f"{n_heads} query heads do not divide into {n_kv_heads} key/value heads")
    # Repeat K/V per query head *before* any perturbation, so a key perturbation scoped to query head h
    # changes head h only, never the other heads that share its K/V head (docs/science.md §9).
    scope = current_run.get()
    if isinstance(scope, RunScope) and scope.record and scope.atlas is not None and query.shape[0] == 1:
        return _long_layer(scope, module, query, key, value, attention_mask, native_beta, softcap, position_bias)
    original_query, original_key, kv_value = query, key, value
    key, value = _repeat_kv(key, n_heads // n_kv_heads), _repeat_kv(value, n_heads // n_kv_heads)  # (B, H, T_k, ·)
    out_dtype = value.dtype
    if query.dtype in (torch.float16, torch.bfloat16):  # softmax in float32, as eager attention does
        query, key = query.float(), key.float()
    allowed, mask_bias = split_mask(attention_mask)
    extras = LogitExtras(
        bias=None if position_bias is None else position_bias.to(query.dtype), softcap=softcap, mask_bias=mask_bias
    )
    if isinstance(scope, CallTrace):
        scope.modules.append(module)
        scope = None
    if scope is None:  # outside a run (e.g. training, or the load-time probe): plain attention, nothing recorded
        output, probs, _, _ = intervened_attention(
            query, key, value, allowed, LayerCall(layer=-1, native_beta=native_beta, extras=extras), recorder=NOTHING
        )
        return output.to(out_dtype).transpose(1, 2).contiguous(), probs
    layer = scope.layer_of[id(module)]
    n_batch, _, n_queries = query.shape[:3]
    call = LayerCall(layer=layer, native_beta=native_beta, interventions=scope.interventions, extras=extras,
                     query_offset=scope.query_offset)
    if not scope.record:
        wants_row = scope.rows is not None and scope.rows.wants(layer)
        # with top_k the row's log-sum-exp is formed from q̂ k̂ᵀ of its last query: the forward hands those over
        recorder = AttentionRecorder(qk=[]) if wants_row and scope.rows.needs_lse else NOTHING
        output, probs, _, _ = intervened_attention(query, key, value, allowed, call, recorder=recorder)
        if wants_row:
            scope.rows.take_probs(layer, probs, recorder.qk, allowed, extras, native_beta, scope.interventions,
                                  scope.query_offset)
        _layer_done(scope, module)
        output = head_ops.at_layer(output, value, layer, scope.interventions, scope.query_offset)  # patches, mean ablation
        return output.to(out_dtype).transpose(1, 2).contiguous(), probs
    recorder = scope.layer_recorder(layer, (n_batch, n_heads, n_queries, key.shape[2]), query)
    output, probs, _, dead_rows = intervened_attention(query, key, value, allowed, call, recorder=recorder)
    if n_batch == 1:  # what rebuilds a window of this layer at another β: references only (models/atlas.py)
        scope.records[layer] = _pending_record(scope, layer, recorder.qk, original_query, original_key, allowed,
                                               native_beta, extras)
    output = head_ops.at_layer(output, value, layer, scope.interventions, scope.query_offset,  # patches, mean ablation
                               kv_value=kv_value)
    scope.keep_layer(layer, recorder, probs, dead_rows)
    _layer_done(scope, module)
    return output.to(out_dtype).transpose(1, 2).contiguous(), probs  # (B, T_q, H, d_v), (B, H, T_q, T_k)


def _long_layer(scope: RunScope, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, native_beta: float, softcap: float | None,
                position_bias: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """A long input's layer: blockwise, keeping q̂/k̂ and summaries in the run's atlas, never P (models/atlas.py).
    query (1, H, T_q, d), key/value (1, H_kv, T_k, ·) → head outputs (1, T_q, H, d_v), no maps."""
    n_heads, n_kv_heads = query.shape[1], key.shape[1]
    allowed, mask_bias = split_mask(attention_mask)
    extras = LogitExtras(bias=None if position_bias is None else position_bias.float(), softcap=softcap,
                         mask_bias=mask_bias)
    call = LayerCall(layer=scope.layer_of[id(module)], native_beta=native_beta, interventions=scope.interventions,
                     extras=extras, query_offset=scope.query_offset)
    output = atlas_attention(scope.atlas, bool(getattr(module, "is_causal", False)), query, key, value, allowed,
                             call)  # (1, H, T_q, d_v) float32
    if scope.rows is not None:  # a continuation's long prompt: its last row, then no record is kept
        layer = scope.layer_of[id(module)]
        if scope.rows.wants(layer):
            scope.rows.take_record(layer, scope.atlas.records[layer])
        del scope.atlas.records[layer]
    _layer_done(scope, module)
    output = head_ops.at_layer(output.to(value.dtype), _repeat_kv(value, n_heads // n_kv_heads),
                               scope.layer_of[id(module)], scope.interventions, scope.query_offset, kv_value=value)
    return output.to(value.dtype).transpose(1, 2).contiguous(), None  # (B, T_q, H, d_v)


def _pending_record(scope: RunScope, layer: int, queries_keys: list, original_query: torch.Tensor,
                    original_key: torch.Tensor, allowed: torch.Tensor | None, native_beta: float,
                    extras: LogitExtras) -> PendingRecord:
    """What rebuilds any window of a short run's layer (batch item 0): references to q̂/k̂ (the perturbed ones where
    the layer perturbs them, as recorded: queries_keys), the masks and the logits' extras."""
    perturbed = {iv.op for iv in scope.interventions if iv.applies_to_layer(layer)}
    return PendingRecord(
        queries=(queries_keys[0] if "perturb_queries" in perturbed else original_query)[0].detach(),
        keys=(queries_keys[1] if "perturb_keys" in perturbed else original_key)[0].detach(),
        allowed=None if allowed is None else allowed[0], native_beta=native_beta,
        extras=LogitExtras(
            bias=None if extras.bias is None else extras.bias[:1], softcap=extras.softcap,
            mask_bias=None if extras.mask_bias is None else extras.mask_bias[:1],
        ),
        interventions=scope.interventions, layer=layer, query_offset=scope.query_offset,
    )


def _materialized_mask(*args, **kwargs):
    """sdpa's bool mask, always materialised: sdpa itself may return None for a plain causal mask and rely on
    its own `is_causal` flag, which our function would read as "no mask" (a decoder seeing the future)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attnlab_attention)
    # bool masks; without a registered mask function padding masks would be dropped
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _materialized_mask)
    return ATTN_IMPLEMENTATION


# transformers' from_pretrained swaps process-wide class attributes while it loads (PreTrainedModel.tie_weights
# becomes a no-op, init functions are patched) and puts them back afterwards. Two loads in two threads at once
# interleave those swaps, and the no-op can stay for good: every later model then loads with untied weights left
# on the meta device ("Cannot copy out of meta tensor"). Seen when a test's server thread loaded a model while the
# next test loaded another. So every load takes this lock, and puts back the real tie_weights if a load elsewhere
# (outside this lock) left the no-op behind.
_LOAD_LOCK = threading.Lock()
_TIE_WEIGHTS = PreTrainedModel.tie_weights
log = logging.getLogger("attnlab")


def load_with_attnlab(model_class, source: str, **kwargs) -> nn.Module:
    """`model_class.from_pretrained(source)` with our attention function, safetensors only (never a pickle).
    A family that builds its attention modules from its own table of implementations (Falcon, BLIP) fails
    here: it is refused with the reason. Loads take turns (see _LOAD_LOCK)."""
    try:
        with _LOAD_LOCK:
            if PreTrainedModel.tie_weights is not _TIE_WEIGHTS:
                log.warning("PreTrainedModel.tie_weights was left patched by a concurrent load; putting it back")
                PreTrainedModel.tie_weights = _TIE_WEIGHTS
            return model_class.from_pretrained(source, attn_implementation=register(), use_safetensors=True, **kwargs)
    except KeyError as exc:
        if ATTN_IMPLEMENTATION not in str(exc):
            raise
        raise UnsupportedAttention(
            f"{source}: computes attention outside transformers' AttentionInterface: not supported "
            f"(the model has no {ATTN_IMPLEMENTATION!r} attention)"
        ) from None
