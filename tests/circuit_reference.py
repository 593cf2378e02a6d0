"""An independent re-computation of one circuit edge's exact score, with forward hooks on plain transformers
modules (eager attention), written apart from models/circuits.py so that the tests compare two implementations.

Grouped-query attention: a `<k>` or `<v>` edge changes the key or value that ONE query head sees. Plain transformers
shares a K/V head's projection between its query heads, so the reference first rewrites the model with one K/V head
per query head (each group's k_proj / v_proj rows repeated, as transformers' repeat_kv repeats them): the same
function, in which a hook on k_proj's output can change one query head's key alone.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM


def ungrouped_model(path: str) -> torch.nn.Module:
    """The model at `path` (float32, eager attention) rewritten with a K/V head per query head."""
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(path)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    state = plain.state_dict()
    if kv != heads:
        repeat = heads // kv
        for name in list(state):
            if ".k_proj." in name or ".v_proj." in name:
                weight = state[name]
                grouped = weight.reshape(kv, -1, *weight.shape[1:])  # (H_kv, d, [D])
                state[name] = grouped.repeat_interleave(repeat, dim=0).reshape(heads * grouped.shape[1], *weight.shape[1:])
        config.num_key_value_heads = heads
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():  # the rewrite must be the same function
        ids = torch.tensor([[1, 5, 9, 12, 7, 3]]) % config.vocab_size
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-4)
    return model


def _layers(model):
    return model.model.layers


def _sandwich(layer) -> bool:
    """Gemma's blocks norm the attention output before adding it, and the MLP's input and output."""
    return hasattr(layer, "pre_feedforward_layernorm")


def _rms_factor(norm, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm (g or 1 + g) as the factor it multiplies x by, (T, D), written out from its definition."""
    gain = (1.0 + norm.weight) if _sandwich_gain(norm) else norm.weight
    return gain * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


def _sandwich_gain(norm) -> bool:
    return type(norm).__name__.startswith("Gemma")


def _parts(model, ids: torch.Tensor) -> dict:
    """Every sender's part in a plain run: "input" (T, D), ("head", l, h) (T, D), ("mlp", l) (T, D). Under a
    sandwich norm a head's part is its output through the attention output's norm at the factor the run had there,
    and the MLP's part is the post-feedforward norm's output."""
    found: dict = {}
    handles = [model.model.embed_tokens.register_forward_hook(
        lambda _m, _a, out: found.__setitem__("input", out[0].detach()))]
    heads = model.config.num_attention_heads
    for l, layer in enumerate(_layers(model)):
        proj = layer.self_attn.o_proj

        def o_output(_m, args, output, l=l, proj=proj, layer=layer):
            z = args[0][0]  # (T, H·d): the heads' outputs, concatenated
            d = z.shape[-1] // heads
            factor = _rms_factor(layer.post_attention_layernorm, output[0]) if _sandwich(layer) else 1.0
            for h in range(heads):
                part = F.linear(z[:, h * d:(h + 1) * d], proj.weight[:, h * d:(h + 1) * d])
                found[("head", l, h)] = (part * factor).detach()
        handles.append(proj.register_forward_hook(o_output))
        mlp_out = layer.post_feedforward_layernorm if _sandwich(layer) else layer.mlp
        handles.append(mlp_out.register_forward_hook(
            lambda _m, _a, out, l=l: found.__setitem__(("mlp", l), out[0].detach())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return found


@contextlib.contextmanager
def _receiver_hook(model, receiver: tuple, delta: torch.Tensor):
    """While open, the receiver reads its input plus `delta` (T, D): ("logits",), ("mlp", l), ("head", l, h, c)."""
    handles = []
    if receiver[0] == "logits":
        handles.append(model.model.norm.register_forward_pre_hook(lambda _m, args: (args[0] + delta, *args[1:])))
    elif receiver[0] == "mlp":
        layer = _layers(model)[receiver[1]]
        norm = layer.pre_feedforward_layernorm if _sandwich(layer) else layer.post_attention_layernorm
        handles.append(norm.register_forward_pre_hook(lambda _m, args: (args[0] + delta, *args[1:])))
    else:
        _, l, h, channel = receiver
        layer = _layers(model)[l]
        heads = model.config.num_attention_heads
        seen = {}

        def layer_input(_m, args, kwargs):
            seen["x"] = args[0] if args else kwargs["hidden_states"]

        def projection_output(module, _args, output):
            d = output.shape[-1] // heads
            other = F.linear(layer.input_layernorm(seen["x"] + delta), module.weight, module.bias)  # not module():
            # that would call this hook again
            output = output.clone()
            output[..., h * d:(h + 1) * d] = other[..., h * d:(h + 1) * d]
            return output
        handles.append(layer.register_forward_pre_hook(layer_input, with_kwargs=True))
        handles.append(getattr(layer.self_attn, f"{channel}_proj").register_forward_hook(projection_output))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def reference_edge_score(model, clean: torch.Tensor, corrupt: torch.Tensor, answer: int, wrong: int,
                         sender, receiver: tuple) -> float:
    """m(clean run, the receiver reading the sender's corrupt part) − m(clean run); m = logit(answer) − logit(wrong)
    at the last position. sender: "input" | ("head", l, h) | ("mlp", l)."""
    clean_parts, corrupt_parts = _parts(model, clean), _parts(model, corrupt)
    delta = corrupt_parts[sender] - clean_parts[sender]  # (T, D)
    with torch.no_grad():
        base = model(clean).logits[0, -1]
        with _receiver_hook(model, receiver, delta):
            patched = model(clean).logits[0, -1]
    return float((patched[answer] - patched[wrong]) - (base[answer] - base[wrong]))


def node_of(name: str):
    """An edge-name node as the reference's key: "input", ("head", l, h), ("mlp", l), ("logits",)."""
    if name == "input":
        return "input"
    if name == "logits":
        return ("logits",)
    if name.startswith("m"):
        return ("mlp", int(name[1:]))
    layer, head = name[1:].split(".h")
    return ("head", int(layer), int(head))


def reference_for_edge(model, clean, corrupt, answer, wrong, edge: str) -> float:
    """reference_edge_score for an edge named as MIB names it (`a3.h2->a7.h1<k>`), parsed here on its own."""
    sender, rest = edge.split("->")
    channel = None
    if rest.endswith(">"):
        rest, channel = rest[:-3], rest[-2]
    receiver = node_of(rest)
    if channel is not None:
        receiver = (*receiver, channel)
    return reference_edge_score(model, clean, corrupt, answer, wrong, node_of(sender), receiver)
