"""Circuits through attention: a graph of edges between heads and MLPs, scored over prompt pairs (docs/science.md
"Circuits through attention").

Nodes are `input` (the token embeddings), each query head `a{l}.h{h}`, each MLP `m{l}` and `logits`. Every node's
output is a part of the residual stream (a head: its z through its slice of W_O, no bias; an MLP: its output), so
the input a later node reads is the sum of the parts before it. An edge A→B is "A's part, as B reads it"; a head
reads the stream three times, for its query, key and value, so it receives `<q>`, `<k>` and `<v>` edges. Under
grouped-query attention each query head computes its own copy of its group's key and value, so a `<k>`/`<v>` edge
changes only what that one query head sees (MIB counts a K/V head's edges once per query head; Mueller et al. 2025).

The engine runs the decoder itself from the model's own modules (embedding, norms, projections, RoPE, MLPs, final
norm and head), with one residual-stream input per receiver and channel: each receiver's input is recomputed
through its own norm, so patching an edge is exact, not linearised. The forward is checked against the model's own
logits when an engine is first built for a model.

- exact score of A→B: m(the clean run with B reading A's corrupt-run part instead of its clean one; everything after
  B recomputed) − m(clean run). m = logit(answer) − logit(wrong) at the last position, mean over the pairs.
- eap (Syed, Rager & Conmy 2023): (a_A,corrupt − a_A,clean) · ∂m/∂(B's input) at the clean run, every edge from one
  clean forward with a gradient per receiver and channel, and one corrupt forward, per pair.
- eap_ig (Hanna, Pezzelle & Belinkov 2024): the same difference times the gradient averaged over `steps` runs
  whose input embeddings lie on the straight line from the corrupt prompt's to the clean one's, at α = k/steps,
  k = 1 … steps (the clean end included, so one step is EAP).
- faithfulness of a circuit C: every edge outside C reads its sender's corrupt-run part (all of a receiver's edges at
  once), f(C) = (m(C) − m(∅)) / (m(all) − m(∅)).

o_proj's bias (Llama and Qwen2 have none; a model with one adds it after every layer's heads) and any other
constant is the same in every run: it belongs to no edge. Qwen2's q/k/v biases are inside the head's own reading.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from models.adapters.base import RequestFieldError
from models.anatomy import attention_modules, final_norm, layer_blocks
from models.patching import Pair

Progress = Callable[[int, int], None]
Guard = Callable[[], contextlib.AbstractContextManager]
DEFAULT_BUDGETS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
CHANNELS = ("q", "k", "v")
# the engine's own forward must give the model's logits within this (relative to their scale)
PARITY_TOLERANCE = 1e-4


class CircuitUnsupported(RequestFieldError):
    """The model is not a pre-norm decoder of a shape the engine runs (named `model`)."""

    def __init__(self, message: str):
        super().__init__("model", message)


# ---- the graph ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Graph:
    """Senders: `input`, then per layer its H heads and its MLP. Receivers: per layer the q, k and v of each head
    (3H) and the MLP, then `logits`. A receiver reads a prefix of the senders: a head of layer l everything before
    layer l, the MLP of layer l also layer l's heads, logits everything."""

    layers: int
    heads: int

    @property
    def n_senders(self) -> int:
        return 1 + self.layers * (self.heads + 1)

    @property
    def n_receivers(self) -> int:
        return self.layers * (3 * self.heads + 1) + 1

    def layer_start(self, layer: int) -> int:
        """The first sender index of `layer` (its head 0)."""
        return 1 + layer * (self.heads + 1)

    def receiver_rows(self, layer: int) -> range:
        base = layer * (3 * self.heads + 1)
        return range(base, base + 3 * self.heads + 1)

    @property
    def logits_row(self) -> int:
        return self.layers * (3 * self.heads + 1)

    def prefix(self) -> torch.Tensor:
        """(R,) how many senders each receiver reads."""
        out = torch.empty(self.n_receivers, dtype=torch.long)
        for l in range(self.layers):
            rows = self.receiver_rows(l)
            out[rows.start:rows.start + 3 * self.heads] = self.layer_start(l)
            out[rows.stop - 1] = self.layer_start(l) + self.heads
        out[self.logits_row] = self.n_senders
        return out

    def valid(self) -> torch.Tensor:
        """(R, S) bool: which (receiver, sender) pairs are edges."""
        return torch.arange(self.n_senders)[None, :] < self.prefix()[:, None]

    @property
    def n_edges(self) -> int:
        """Σ over receivers of the senders each reads: 3H·Σ_l (1 + l(H+1)) + Σ_l (1 + l(H+1) + H) + 1 + L(H+1)."""
        return int(self.prefix().sum())

    def node_names(self) -> list[str]:
        names = ["input"]
        for l in range(self.layers):
            names += [f"a{l}.h{h}" for h in range(self.heads)] + [f"m{l}"]
        return names + ["logits"]

    def sender_name(self, s: int) -> str:
        if s == 0:
            return "input"
        layer, k = divmod(s - 1, self.heads + 1)
        return f"m{layer}" if k == self.heads else f"a{layer}.h{k}"

    def receiver_name(self, r: int) -> str:
        if r == self.logits_row:
            return "logits"
        layer, k = divmod(r, 3 * self.heads + 1)
        if k == 3 * self.heads:
            return f"m{layer}"
        channel, head = divmod(k, self.heads)
        return f"a{layer}.h{head}<{CHANNELS[channel]}>"

    def receiver_node(self, r: int) -> int:
        """The node a receiver belongs to, as a sender index (logits: n_senders)."""
        if r == self.logits_row:
            return self.n_senders
        layer, k = divmod(r, 3 * self.heads + 1)
        return self.layer_start(layer) + (self.heads if k == 3 * self.heads else k % self.heads)

    def edge_names(self, pairs: Iterable[tuple[int, int]]) -> list[str]:
        return [f"{self.sender_name(s)}->{self.receiver_name(r)}" for r, s in pairs]

    def all_edge_names(self) -> list[str]:
        """Every edge, in the flat order of `flat` (receiver-major)."""
        return self.edge_names(self.valid().nonzero().tolist())

    def parse_edge(self, name: str) -> tuple[int, int]:
        """`a3.h2->a7.h1<k>` → (receiver, sender); ValueError when it is not an edge of this model."""
        match = _EDGE.fullmatch(name)
        if match is None:
            raise ValueError(f"{name[:80]!r} is not an edge name (e.g. 'input->a0.h0<q>', 'a3.h2->a7.h1<k>', "
                             "'a0.h0->m0', 'm1->logits')")
        sender, receiver, channel = match.group(1), match.group(2), match.group(3)
        s = self._sender_index(sender, name)
        r = self._receiver_index(receiver, channel, name)
        if s >= int(self.prefix()[r]):
            raise ValueError(f"{name}: {receiver} does not read {sender} (a node reads only the nodes before it)")
        return r, s

    def _sender_index(self, sender: str, name: str) -> int:
        if sender == "input":
            return 0
        layer, head = _node_numbers(sender)
        if layer >= self.layers or (head is not None and head >= self.heads):
            raise ValueError(f"{name}: the model has no node {sender} ({self.layers} layers × {self.heads} heads)")
        return self.layer_start(layer) + (self.heads if head is None else head)

    def _receiver_index(self, receiver: str, channel: str | None, name: str) -> int:
        if receiver == "logits":
            if channel:
                raise ValueError(f"{name}: logits have no <{channel}> input")
            return self.logits_row
        layer, head = _node_numbers(receiver)
        if layer >= self.layers or (head is not None and head >= self.heads):
            raise ValueError(f"{name}: the model has no node {receiver} ({self.layers} layers × {self.heads} heads)")
        base = self.receiver_rows(layer).start
        if head is None:
            if channel:
                raise ValueError(f"{name}: an MLP has one input, no <{channel}>")
            return base + 3 * self.heads
        if not channel:
            raise ValueError(f"{name}: a head's edge names its input: <q>, <k> or <v>")
        return base + CHANNELS.index(channel) * self.heads + head

    def flat(self, matrix: torch.Tensor) -> torch.Tensor:
        """(R, S) → (E,) the edges' entries, receiver-major."""
        return matrix[self.valid()]


_EDGE = re.compile(r"(input|a\d{1,4}\.h\d{1,4}|m\d{1,4})->(logits|a\d{1,4}\.h\d{1,4}|m\d{1,4})(?:<([qkv])>)?")


def _node_numbers(node: str) -> tuple[int, int | None]:
    if node.startswith("m"):
        return int(node[1:]), None
    layer, head = node[1:].split(".h")
    return int(layer), int(head)


# ---- the model's pieces ------------------------------------------------------------------------------------------
@dataclass
class Layer:
    input_norm: nn.Module
    post_norm: nn.Module  # the norm the MLP reads through (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    mlp: nn.Module
    attention: nn.Module
    wq: torch.Tensor  # (H, D, d)
    wk: torch.Tensor  # (H, D, d): each query head's copy of its K/V group's columns
    wv: torch.Tensor  # (H, D, d)
    bq: torch.Tensor | None  # (H, 1, d)
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor  # (H, d, D)
    bo: torch.Tensor | None  # (D,)
    scaling: float
    window: int | None  # a sliding window, when the layer has one
    kind: str = "full_attention"  # the layer type (Gemma 3's local and global layers have their own RoPE)
    q_norm: nn.Module | None = None  # Gemma 3, Qwen3: a norm on each head's q and k before RoPE
    k_norm: nn.Module | None = None
    attn_out_norm: nn.Module | None = None  # Gemma's sandwich norms: on the attention output and the MLP output
    mlp_out_norm: nn.Module | None = None


def _head_weights(linear: nn.Linear, n_heads: int, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A q/k/v projection as one (D, d) matrix per query head (K/V heads repeated over their group)."""
    weight = linear.weight.detach()  # (H_x·d, D)
    per_head = weight.reshape(n_heads, -1, weight.shape[1]).transpose(1, 2)[group]  # (H, D, d)
    bias = None
    if linear.bias is not None:
        bias = linear.bias.detach().reshape(n_heads, 1, -1)[group]  # (H, 1, d)
    return per_head, bias


def _layers(model: nn.Module, layer_of: dict[int, int], info) -> list[Layer]:
    n_heads, head_dim = info.heads, info.head_dim
    n_kv = info.kv_heads or n_heads
    group = torch.arange(n_heads) // (n_heads // n_kv)  # the K/V head each query head reads
    windows = _windows(model.config, len(layer_of))
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * len(layer_of)
    out = []
    for l, (block, attention) in enumerate(zip(layer_blocks(model, layer_of), attention_modules(model, layer_of))):
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attention, n)]
        missing += [n for n in ("input_layernorm", "post_attention_layernorm", "mlp") if not hasattr(block, n)]
        sandwich = hasattr(block, "pre_feedforward_layernorm")
        if missing or (sandwich and attention.o_proj.bias is not None):
            raise CircuitUnsupported(
                f"{type(block).__name__}: circuits run pre-norm decoders with Llama's block (input norm, separate "
                "q/k/v/o projections, a norm before the MLP): Llama, SmolLM2, Qwen2, Mistral, Gemma 3. "
                + (f"Missing: {', '.join(missing)}" if missing else "A sandwich norm after an o_proj bias is not run"))
        wq, bq = _head_weights(attention.q_proj, n_heads, torch.arange(n_heads))
        wk, bk = _head_weights(attention.k_proj, n_kv, group)
        wv, bv = _head_weights(attention.v_proj, n_kv, group)
        wo = attention.o_proj.weight.detach().T.reshape(n_heads, head_dim, -1)  # (H, d, D)
        bo = attention.o_proj.bias.detach() if attention.o_proj.bias is not None else None
        layer = Layer(block.input_layernorm, block.post_attention_layernorm, block.mlp, attention, wq, wk, wv,
                      bq, bk, bv, wo, bo, float(getattr(attention, "scaling", head_dim ** -0.5)), windows[l], kinds[l],
                      getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
        if sandwich:
            layer.post_norm, layer.attn_out_norm = block.pre_feedforward_layernorm, block.post_attention_layernorm
            layer.mlp_out_norm = block.post_feedforward_layernorm
        out.append(layer)
    return out


def _windows(config, n_layers: int) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return [window if window and kind == "sliding_attention" else None for kind in kinds]


def _norm_scale(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm's factor at x (..., D): norm(v) = factor ⊙ v for v = x, with the gain read by applying the norm to
    ones (Llama's g, Gemma's 1 + g; as models/qk_attribution.py freezes a norm). → (..., D)"""
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    gain = norm(ones) * (1.0 + eps) ** 0.5  # rms(ones) = 1
    return gain * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# ---- one run -----------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One prompt's run (batch of one), detached: every sender's part and what each kind of receiver read."""

    parts: torch.Tensor  # (S, T, D)
    attn_in: torch.Tensor  # (L, T, D) the stream entering each layer (what its heads read)
    mlp_in: torch.Tensor  # (L, T, D) the stream entering each MLP
    final: torch.Tensor  # (T, D) what the logits read
    logits: torch.Tensor  # (V,) at the last position

    def receiver_input(self, graph: Graph, rows: range, layer: int) -> torch.Tensor:
        """(len(rows), T, D): what these receivers of `layer` read in this run."""
        heads = self.attn_in[layer].expand(3 * graph.heads, -1, -1)
        return torch.cat([heads, self.mlp_in[layer][None]])[: len(rows)]


@dataclass
class Plan:
    """What one batched forward changes. `edits`: (item, receiver, sender): that item's receiver reads the sender's
    corrupt part instead of its own run's. `keep`: (B, R, S) bool, dense: each receiver reads the kept senders from
    its own run and every other sender from the corrupt run. `grad`: a zero leaf per receiver input, whose gradient
    is ∂m/∂(that input). `watch`: (layer, head) whose attention, z and output to keep. `embeds`: (B, T, D) input
    embeddings to use instead of the ids' (EAP-IG's interpolation)."""

    corrupt: Record | None = None
    edits: Sequence[tuple[int, int, int]] = ()
    keep: torch.Tensor | None = None
    grad: bool = False
    watch: tuple[int, int] | None = None
    embeds: torch.Tensor | None = None
    # per layer the heads' (B, 3H, T, D) and the MLP's (B, 1, T, D), then the logits' (B, 1, T, D)
    leaves: list[torch.Tensor] = field(default_factory=list)
    watched: dict[str, torch.Tensor] = field(default_factory=dict)


class Engine:
    """The decoder run from its modules, with an input per receiver. Build with `engine_for(adapter)`."""

    def __init__(self, adapter):
        model = adapter.model
        self.adapter = adapter
        self.model = model
        self.graph = Graph(adapter.info.layers, adapter.info.heads)
        self.layers = _layers(model, adapter.layer_of, adapter.info)
        base = getattr(model, "model", None)
        self.rotary = getattr(base, "rotary_emb", None)
        self.norm = final_norm(model)
        self.head = model.get_output_embeddings()
        self.embedding = model.get_input_embeddings()
        config = model.config
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            raise CircuitUnsupported("soft-capped logits (Gemma 2) are not run by the circuit engine yet")
        if self.rotary is None or self.norm is None:
            raise CircuitUnsupported(f"{type(model).__name__}: no rotary embedding or final norm found")
        self._rope_by_kind = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.dtype = self.layers[0].wq.dtype
        self.device = self.layers[0].wq.device

    # -- the forward --
    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids.to(self.device))  # (B, T, D)

    def forward(self, ids: torch.Tensor, plan: Plan | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids (B, T) → last-position logits (B, V) float32 and every sender's part [(B, T, D)] in sender order."""
        plan = plan or Plan()
        with torch.set_grad_enabled(plan.grad and torch.is_grad_enabled()):
            return self._forward(ids, plan)

    def _forward(self, ids: torch.Tensor, plan: Plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n_items, n_tokens = ids.shape
        x = plan.embeds if plan.embeds is not None else self.embeddings(ids)  # (B, T, D)
        positions = torch.arange(n_tokens, device=self.device)[None].expand(n_items, -1)
        ropes = self._ropes(x, positions)  # layer kind → (cos, sin), each (B, T, d)
        parts = [x]
        dense = plan.keep is not None
        for l, layer in enumerate(self.layers):
            rows = self.graph.receiver_rows(l)
            head_in = self._inputs(plan, parts, x, range(rows.start, rows.stop - 1), l)  # (B, 3H, T, D)
            outputs = self._heads(layer, head_in, *ropes[layer.kind], plan, l)  # (B, H, T, D)
            if layer.attn_out_norm is not None:  # each head's part: its output through the norm at this run's scale
                outputs = outputs * _norm_scale(layer.attn_out_norm, outputs.sum(dim=1))[:, None]
            parts += list(outputs.unbind(1))
            mid = x + outputs.sum(dim=1) + (layer.bo if layer.bo is not None else 0)
            mlp_in = self._inputs(plan, parts, mid, range(rows.stop - 1, rows.stop), l)[:, 0]  # (B, T, D)
            mlp_out = layer.mlp(layer.post_norm(mlp_in))
            if layer.mlp_out_norm is not None:
                mlp_out = layer.mlp_out_norm(mlp_out)
            parts.append(mlp_out)
            x = mid + mlp_out if not dense else x  # the natural stream (a dense plan reads the corrupt one)
        row = self.graph.logits_row
        final = self._inputs(plan, parts, x, range(row, row + 1), self.graph.layers)[:, 0]  # (B, T, D)
        logits = self.head(self.norm(final[:, -1:]))[:, 0].float()  # (B, V)
        return logits, parts

    def _inputs(self, plan: Plan, parts: list[torch.Tensor], stream: torch.Tensor, rows: range,
                layer: int) -> torch.Tensor:
        """What the receivers `rows` read, (B, len(rows), T, D). Natural: the stream (plus edits and grad leaves);
        dense: the corrupt run's input plus the kept senders' (own − corrupt) parts."""
        n_rows = len(rows)
        if plan.keep is not None:
            corrupt = plan.corrupt
            if rows.start == self.graph.logits_row:
                base = corrupt.final[None, None]
            else:
                which = rows.start - self.graph.receiver_rows(layer).start
                base = corrupt.receiver_input(self.graph, range(which + n_rows), layer)[which:][None]
            prefix = len(parts)
            diff = self._differences(plan, parts)  # (B, S, T, D), filled up to prefix
            keep = plan.keep[:, rows.start:rows.stop, :prefix].to(diff.dtype)  # (B, n, P)
            mixed = torch.bmm(keep, diff[:, :prefix].flatten(2))  # (B, n, T·D)
            return base + mixed.view(*mixed.shape[:2], *diff.shape[2:])
        inputs = stream[:, None].expand(-1, n_rows, -1, -1)
        edits = [(b, r - rows.start, s) for b, r, s in plan.edits if rows.start <= r < rows.stop]
        if edits:
            inputs = inputs.clone()
            for b, r, s in edits:
                inputs[b, r] = inputs[b, r] + plan.corrupt.parts[s].to(inputs.dtype) - parts[s][b]
        if plan.grad:
            leaf = torch.zeros_like(inputs, requires_grad=True)
            plan.leaves.append(leaf)
            inputs = inputs + leaf
        return inputs

    def _ropes(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        kinds = {layer.kind for layer in self.layers}
        if self._rope_by_kind:  # Gemma 3: local and global layers rotate with their own base
            return {kind: self.rotary(x, positions, kind) for kind in kinds}
        cos_sin = self.rotary(x, positions)
        return {kind: cos_sin for kind in kinds}

    def _differences(self, plan: Plan, parts: list[torch.Tensor]) -> torch.Tensor:
        """own − corrupt part of every sender computed so far, kept in one (B, S, T, D) buffer filled as they come."""
        buffer = plan.watched.get("_diff")
        if buffer is None:
            first = parts[0]
            buffer = torch.empty(first.shape[0], self.graph.n_senders, *first.shape[1:], dtype=first.dtype,
                                 device=first.device)
            plan.watched["_diff"] = buffer
            plan.watched["_filled"] = torch.zeros(1, dtype=torch.long)
        filled = int(plan.watched["_filled"])
        if filled < len(parts):
            fresh = torch.stack(parts[filled:], dim=1)  # (B, n, T, D)
            buffer[:, filled:len(parts)] = fresh - plan.corrupt.parts[filled:len(parts)][None]
            plan.watched["_filled"][0] = len(parts)
        return buffer

    def _heads(self, layer: Layer, inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Plan,
               index: int) -> torch.Tensor:
        """Each head from its own q, k and v inputs (B, 3H, T, D) → its part of the stream (B, H, T, D)."""
        n_heads = self.graph.heads
        normed = layer.input_norm(inputs)
        xq, xk, xv = normed[:, :n_heads], normed[:, n_heads:2 * n_heads], normed[:, 2 * n_heads:]  # (B, H, T, D)
        q = torch.einsum("bhtD,hDd->bhtd", xq, layer.wq) + (layer.bq if layer.bq is not None else 0)
        k = torch.einsum("bhtD,hDd->bhtd", xk, layer.wk) + (layer.bk if layer.bk is not None else 0)
        v = torch.einsum("bhtD,hDd->bhtd", xv, layer.wv) + (layer.bv if layer.bv is not None else 0)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        c, s = cos[:, None], sin[:, None]  # (B, 1, T, d)
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        scores = (q @ k.transpose(-1, -2)).float() * layer.scaling  # (B, H, T, T)
        n_tokens = scores.shape[-1]
        i = torch.arange(n_tokens, device=scores.device)
        allowed = i[None, :] <= i[:, None]
        if layer.window is not None:
            allowed &= i[:, None] - i[None, :] < layer.window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(v.dtype)
        z = probs @ v  # (B, H, T, d)
        out = torch.einsum("bhtd,hdD->bhtD", z, layer.wo)  # (B, H, T, D)
        if plan.watch is not None and plan.watch[0] == index:
            head = plan.watch[1]
            plan.watched.update(probs=probs[:, head].detach(), out=out[:, head].detach())
        return out

    # -- records --
    @torch.inference_mode()
    def record(self, ids: torch.Tensor, embeds: torch.Tensor | None = None) -> Record:
        """One prompt (1, T) run plainly, kept for later patches."""
        logits, parts = self.forward(ids, Plan(embeds=embeds))
        stacked = torch.stack([p[0] for p in parts])  # (S, T, D)
        graph = self.graph
        attn_in, mlp_in = [], []
        x = stacked[0]
        for l in range(graph.layers):
            start = graph.layer_start(l)
            attn_in.append(x)
            mid = x + stacked[start:start + graph.heads].sum(0) + (self.layers[l].bo if self.layers[l].bo is not None else 0)
            mlp_in.append(mid)
            x = mid + stacked[start + graph.heads]
        return Record(stacked, torch.stack(attn_in), torch.stack(mlp_in), x, logits[0])


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(adapter) -> Engine:
    """The adapter's engine, built (and checked against the model's own logits) once."""
    engine = _ENGINES.get(adapter)
    if engine is None:
        engine = Engine(adapter)
        check_parity(engine)
        _ENGINES[adapter] = engine
    return engine


@torch.inference_mode()
def check_parity(engine: Engine) -> float:
    """The engine's logits against the model's own plain forward on a short prompt; CircuitUnsupported if apart."""
    tokenizer = engine.adapter.tokenizer
    ids = torch.tensor([tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]])
    mine, _ = engine.forward(ids)
    theirs = engine.model(input_ids=ids.to(engine.device), logits_to_keep=1).logits[:, -1].float()
    gap = float((mine - theirs).abs().max())
    scale = float(theirs.abs().max())
    if not gap <= PARITY_TOLERANCE * max(scale, 1.0) * 10:
        raise CircuitUnsupported(f"the circuit engine's forward differs from the model's logits by {gap:.3g}: this "
                                 "model's blocks do something the engine does not run")
    return gap


def metric(logits: torch.Tensor, pair: Pair) -> torch.Tensor:
    """m per item: logit(answer) − logit(wrong), (B, V) → (B,)."""
    return logits[:, pair.answer] - logits[:, pair.wrong]


# ---- scores --------------------------------------------------------------------------------------------------------
def _gradient_scores(engine: Engine, pair: Pair, clean: Record, corrupt: Record, steps: int) -> torch.Tensor:
    """(R, S) Σ_{t,d} (corrupt − clean part) · mean_k ∂m/∂(receiver input) at the run whose embeddings are
    corrupt + (k/steps)(clean − corrupt), k = 1 … steps (steps = 1: the clean run itself, EAP)."""
    graph = engine.graph
    alphas = torch.arange(1, steps + 1, dtype=clean.parts.dtype, device=clean.parts.device) / steps
    embeds = corrupt.parts[0][None] + alphas[:, None, None] * (clean.parts[0] - corrupt.parts[0])[None]  # (k, T, D)
    plan = Plan(grad=True, embeds=embeds)
    with torch.inference_mode(False), torch.enable_grad():
        logits, _ = engine.forward(pair.clean.expand(steps, -1), plan)
        grads = torch.autograd.grad(metric(logits, pair).sum(), plan.leaves)
    diff = (corrupt.parts - clean.parts).flatten(1)  # (S, T·D)
    prefix = graph.prefix()
    scores = torch.zeros(graph.n_receivers, graph.n_senders, dtype=torch.float64)
    start = 0
    for grad in grads:  # the leaves in receiver order
        rows = range(start, start + grad.shape[1])
        start = rows.stop
        g = grad.sum(0).flatten(1) / steps  # (n, T·D)
        p = int(prefix[rows.stop - 1])
        block = (g @ diff[:p].T).double().cpu()  # (n, p): the scores live on the host
        mask = torch.arange(p)[None] < prefix[rows.start:rows.stop, None]
        scores[rows.start:rows.stop, :p] = torch.where(mask, block, 0.0)
    return scores


def gradient_scores(engine: Engine, pairs: Sequence[Pair], steps: int = 1, progress: Progress | None = None,
                    guard: Guard = contextlib.nullcontext) -> tuple[torch.Tensor, list[Record], list[Record]]:
    """EAP (steps = 1) or EAP-IG scores (R, S) float64, mean over the pairs, and each pair's clean and corrupt
    records."""
    total = torch.zeros(engine.graph.n_receivers, engine.graph.n_senders, dtype=torch.float64)
    cleans, corrupts = [], []
    for k, pair in enumerate(pairs):
        with guard():
            clean, corrupt = engine.record(pair.clean), engine.record(pair.corrupt)
            total += _gradient_scores(engine, pair, clean, corrupt, steps)
        cleans.append(clean)
        corrupts.append(corrupt)
        if progress is not None:
            progress(k + 1, len(pairs))
    return total / len(pairs), cleans, corrupts


@torch.inference_mode()
def exact_scores(engine: Engine, pairs: Sequence[Pair], edges: Sequence[tuple[int, int]],
                 corrupts: Sequence[Record] | None = None, batch: int = 32, progress: Progress | None = None,
                 guard: Guard = contextlib.nullcontext) -> torch.Tensor:
    """Exact scores of `edges` [(receiver, sender)], mean over the pairs: (E,) float64."""
    out = torch.zeros(len(edges), dtype=torch.float64)
    total, done = len(pairs) * len(edges), 0
    for k, pair in enumerate(pairs):
        with guard():
            corrupt = corrupts[k] if corrupts is not None else engine.record(pair.corrupt)
            m_clean = float(metric(engine.forward(pair.clean)[0], pair)[0])
        for start in range(0, len(edges), batch):
            chunk = edges[start:start + batch]
            plan = Plan(corrupt=corrupt, edits=[(b, r, s) for b, (r, s) in enumerate(chunk)])
            with guard():
                logits, _ = engine.forward(pair.clean.expand(len(chunk), -1), plan)
            out[start:start + len(chunk)] += (metric(logits, pair).double().cpu() - m_clean)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return out / len(pairs)


@torch.inference_mode()
def patched_metric(engine: Engine, pair: Pair, edits: Sequence[tuple[int, int]], corrupt: Record | None = None) -> float:
    """m of the clean run with every edge in `edits` [(receiver, sender)] read from the corrupt run, all at once."""
    corrupt = corrupt if corrupt is not None else engine.record(pair.corrupt)
    plan = Plan(corrupt=corrupt, edits=[(0, r, s) for r, s in edits])
    return float(metric(engine.forward(pair.clean, plan)[0], pair)[0])


# ---- circuits and faithfulness -------------------------------------------------------------------------------------
def top_edges(graph: Graph, scores: torch.Tensor, count: int) -> torch.Tensor:
    """(R, S) bool: the `count` edges of largest |score| (ties broken by order)."""
    flat = graph.flat(scores.abs())
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    if count > 0:
        chosen[torch.topk(flat, min(count, flat.numel())).indices] = True
    keep = torch.zeros(graph.n_receivers, graph.n_senders, dtype=torch.bool)
    keep[graph.valid()] = chosen
    return keep


def prune(graph: Graph, keep: torch.Tensor) -> torch.Tensor:
    """Only the kept edges on a path from `input` to `logits` through kept edges: (R, S) bool."""
    n = graph.n_senders
    owner = torch.tensor([graph.receiver_node(r) for r in range(graph.n_receivers)])  # (R,)
    reached = torch.zeros(n + 1, dtype=torch.bool)
    reached[0] = True
    for node in range(1, n + 1):  # senders are in topological order; logits last
        rows = owner == node
        reached[node] = bool((keep[rows] & reached[None, :n]).any())
    reaches = torch.zeros(n + 1, dtype=torch.bool)
    reaches[n] = True
    for node in range(n, -1, -1):
        if node < n:
            readers = keep[:, node] & reaches[owner]
            reaches[node] = bool(readers.any())
    return keep & reached[None, :n] & reaches[owner][:, None]


@torch.inference_mode()
def circuit_metric(engine: Engine, pair: Pair, corrupt: Record, keeps: torch.Tensor) -> torch.Tensor:
    """m of the run where each receiver reads the kept senders from this run and all others from the corrupt run,
    one item per mask: keeps (B, R, S) → (B,)."""
    plan = Plan(corrupt=corrupt, keep=keeps.to(engine.device))
    logits, _ = engine.forward(pair.clean.expand(keeps.shape[0], -1), plan)
    return metric(logits, pair).double().cpu()


def faithfulness(engine: Engine, pairs: Sequence[Pair], scores: torch.Tensor, budgets: Sequence[float],
                 corrupts: Sequence[Record], m_clean: float, m_corrupt: float, progress: Progress | None = None,
                 guard: Guard = contextlib.nullcontext) -> list[dict]:
    """f(C_b) for each budget b: C_b the top round(b·|E|) edges by |score| pruned to paths input → logits."""
    graph = engine.graph
    keeps = torch.stack([prune(graph, top_edges(graph, scores, round(b * graph.n_edges))) for b in budgets])
    values = torch.zeros(len(budgets), dtype=torch.float64)
    for k, (pair, corrupt) in enumerate(zip(pairs, corrupts)):
        with guard():
            values += circuit_metric(engine, pair, corrupt, keeps)
        if progress is not None:
            progress(k + 1, len(pairs))
    values /= len(pairs)
    span = m_clean - m_corrupt
    return [{"budget": float(b), "n_edges": int(keep.sum()),
             "value": float((v - m_corrupt) / span) if span != 0 else None}
            for b, keep, v in zip(budgets, keeps, values)]


def areas(curve: list[dict]) -> tuple[float | None, float | None]:
    """MIB's CPR (area under f over the budget) and CMD (area under |1 − f|), trapezoids over the budgets given."""
    points = sorted((p["budget"], p["value"]) for p in curve if p["value"] is not None)
    if len(points) < 2:
        return None, None
    cpr = cmd = 0.0
    for (b0, f0), (b1, f1) in zip(points, points[1:]):
        cpr += (b1 - b0) * (f0 + f1) / 2
        cmd += (b1 - b0) * (abs(1 - f0) + abs(1 - f1)) / 2
    return cpr, cmd


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    from models.patching import rank_correlation
    if a.numel() < 2:
        return None
    value = rank_correlation(a, b)
    return None if math.isnan(value) else value
