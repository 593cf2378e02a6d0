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


@dataclass
class ProbeReport:
    modules: list[nn.Module]  # attention modules in the order of their first call
    names: dict[int, str]  # id(module) → its dotted name in the model
    parity: float  # max |Δ output| against eager attention
    dtype_parity: float | None = None  # served in float16/bfloat16: max |Δ output| against float32


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
    model.set_attn_implementation("eager")
    try:
        eager_calls, _, eager_outputs = trace_attention_calls(model, forward)
        eager = output_of(eager_outputs).float()
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if eager_calls:  # the switch did not reach every module: the comparison would be with ourselves
        raise UnsupportedAttention("the model cannot switch to eager attention for the parity check")
    if ours.shape != eager.shape:
        raise UnsupportedAttention(f"output shape {tuple(ours.shape)} differs from eager attention's {tuple(eager.shape)}")
    parity = float((ours - eager).abs().max())
    if not parity <= PARITY_TOLERANCE:  # also catches NaN
        raise UnsupportedAttention(
            f"outputs differ from the model's own eager attention by {parity:.3g} (> {PARITY_TOLERANCE:g}): "
            "its attention does something attnlab does not reproduce"
        )
    return ProbeReport(modules=modules, names=names, parity=parity)
