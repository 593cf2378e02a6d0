"""The load-time probe: proof that attnlab sees every attention call of a model, and computes it faithfully.

A model is served only when one forward pass shows that
(a) every attention module that ran called our function (transformers' AttentionInterface), and
(b) with no interventions its outputs equal those of the model's own eager attention to within a tolerance
    (docs/science.md §9: max |Δ logits| ≤ 1e-4 in float32).
Otherwise it is refused with the reason. The probe also yields the attention modules in call order, which is
how layers are numbered (modules carry no reliable layer index: ViT's have none, encoder–decoders have three
kinds).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from models.hooks import ATTN_IMPLEMENTATION, CallTrace, UnsupportedAttention, run_scope

PARITY_TOLERANCE = 1e-4


def layer_facts(config) -> dict:
    """`layer_types` ("sliding" | "full" | "chunked" per layer) and `sliding_window` (tokens, or None) of a decoder
    config: what GET /api/models reports, and what sizes the probe's long input (window_probe_length)."""
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    window = getattr(config, "sliding_window", None)
    raw = getattr(config, "layer_types", None)
    if raw:
        types = ["sliding" if t.startswith("sliding") else "chunked" if t.startswith("chunked") else "full" for t in raw]
    elif window and getattr(config, "use_sliding_window", True) is not False:
        types = ["sliding"] * n_layers  # Mistral-style: one window for every layer
    else:
        types = ["full"] * n_layers
    if "sliding" not in types:
        window = None
    return {"layer_types": types, "sliding_window": int(window) if window else None}


def window_probe_length(config) -> int | None:
    """Tokens of the second probe input of a model with sliding-window or chunked layers: longer than the window
    (or chunk) by a margin, so its band is exercised and a mismatch there refused; None for a model without them
    (its one short probe covers everything it does). Capped by the model's context."""
    facts = layer_facts(config)
    spans = [facts["sliding_window"]] if facts["sliding_window"] else []
    if "chunked" in facts["layer_types"] and getattr(config, "attention_chunk_size", None):
        spans.append(int(config.attention_chunk_size))
    if not spans:
        return None
    length = max(spans) + max(8, max(spans) // 32)
    context = getattr(config, "max_position_embeddings", None)
    return min(length, int(context)) if context else length


@dataclass
class ProbeReport:
    modules: list[nn.Module]  # attention modules in the order of their first call
    names: dict[int, str]  # id(module) → its dotted name in the model
    parity: float  # max |Δ output| against eager attention
    dtype_parity: float | None = None  # served in float16/bfloat16: max |Δ output| against float32
    long_tokens: int | None = None  # the second, longer-than-the-window probe input's length (windowed models)


def attention_leaves(model: nn.Module) -> dict[int, str]:
    """id → name of the innermost modules whose class name ends in "Attention" (BertSelfAttention,
    LlamaAttention, T5Attention, …; not BertAttention, which holds a BertSelfAttention)."""
    named = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    leaves = {}
    for name, module in named:
        inner = [m for m in module.modules() if m is not module and type(m).__name__.endswith("Attention")]
        if not inner:
            leaves[id(module)] = name
    return leaves


@torch.inference_mode()
def trace_attention_calls(model: nn.Module, forward: Callable[[], object]) -> tuple[list[nn.Module], set[int], object]:
    """Run `forward()` once; return (modules that called our function, in first-call order; ids of the
    attention leaves that ran; the outputs)."""
    leaves = attention_leaves(model)
    ran: set[int] = set()
    handles = [
        m.register_forward_pre_hook(lambda module, args: ran.add(id(module)))
        for m in model.modules() if id(m) in leaves
    ]
    trace = CallTrace()
    try:
        with run_scope(trace):
            outputs = forward()
    finally:
        for handle in handles:
            handle.remove()
    ordered = list({id(m): m for m in trace.modules}.values())  # dicts keep insertion order: first calls
    return ordered, ran, outputs


def max_abs_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 64) -> float:
    """max |a − b| (NaN when either holds one), a few rows at a time: a decoder's logits over the long probe input
    (gemma3-270m: 528 tokens × 262,144) are 0.55 GB each, and the whole difference and its absolute value were two
    more such tensors at load time, on top of the memory budget."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])  # (N, V)
    worst = 0.0
    for start in range(0, a.shape[0], rows):
        chunk = float((a[start:start + rows] - b[start:start + rows]).abs().max())
        if chunk != chunk:  # NaN: keep it, so the caller's bound refuses the model
            return chunk
        worst = max(worst, chunk)
    return worst


def probe(model: nn.Module, forward: Callable[[], object], output_of: Callable[[object], torch.Tensor]) -> ProbeReport:
    """Check (a) and (b) above on `forward()` (a closure running the model on a small input); raise
    UnsupportedAttention naming the reason, else return the modules in call order and the parity figure."""
    names = {id(m): n for n, m in model.named_modules()}
    modules, ran, outputs = trace_attention_calls(model, forward)
    callers = {id(m) for m in modules}
    outside = sorted(names[i] for i in ran - callers)
    if outside or not modules:
        which = ", ".join(outside[:3]) + (" …" if len(outside) > 3 else "") if outside else type(model).__name__
        raise UnsupportedAttention(
            f"{which}: computes attention outside transformers' AttentionInterface: not supported"
        )
    ours = output_of(outputs).float()
    del outputs  # the rest of the forward's output (a decoder's cache) is not compared
    model.set_attn_implementation("eager")
    try:
        eager_calls, _, eager_outputs = trace_attention_calls(model, forward)
        eager = output_of(eager_outputs).float()
        del eager_outputs
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if eager_calls:  # the switch did not reach every module: the comparison would be with ourselves
        raise UnsupportedAttention("the model cannot switch to eager attention for the parity check")
    if ours.shape != eager.shape:
        raise UnsupportedAttention(f"output shape {tuple(ours.shape)} differs from eager attention's {tuple(eager.shape)}")
    parity = max_abs_difference(ours, eager)
    if not parity <= PARITY_TOLERANCE:  # also catches NaN
        raise UnsupportedAttention(
            f"outputs differ from the model's own eager attention by {parity:.3g} (> {PARITY_TOLERANCE:g}): "
            "its attention does something attnlab does not reproduce"
        )
    return ProbeReport(modules=modules, names=names, parity=parity)
