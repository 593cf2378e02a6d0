"""Where the pieces of a loaded model are, found from the attention modules the load-time probe numbered: each
layer's block (for the residual stream), each layer's output projection W_O, and the final norm (the lens)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def attention_modules(model: nn.Module, layer_of: dict[int, int]) -> list[nn.Module]:
    """The modules that call the attention function, in layer order."""
    found = {layer_of[id(m)]: m for m in model.modules() if id(m) in layer_of}
    return [found[l] for l in range(len(layer_of))]


def _parents(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    parents = {}
    for module in model.modules():
        for name, child in module.named_children():
            parents[id(child)] = (module, name)
    return parents


def layer_blocks(model: nn.Module, layer_of: dict[int, int]) -> list[nn.Module]:
    """Each layer's block: the nearest ancestor of its attention module that is an item of a ModuleList
    (LlamaDecoderLayer, GPT2Block, BertLayer, …). Its output is the residual stream after that layer."""
    parents = _parents(model)
    blocks = []
    for module in attention_modules(model, layer_of):
        current = module
        while id(current) in parents:
            parent, _ = parents[id(current)]
            if isinstance(parent, nn.ModuleList):
                blocks.append(current)
                break
            current = parent
        else:
            raise ValueError(f"no layer block (ModuleList item) above {type(module).__name__}")
    return blocks


def output_projections(model: nn.Module, layer_of: dict[int, int], n_heads: int | Sequence[int],
                       head_dim: int | Sequence[int]) -> list[torch.Tensor]:
    """W_O of every layer as (H, d_v, D): head h's output (d_v,) times W_O[h] is its share of the layer's output.
    n_heads / head_dim: one for every layer, or one per layer (encoder–decoders whose kinds differ in heads).

    The projection is the attention module's own (o_proj, out_proj, c_proj, o, or a name its family declares:
    models/families/) or, in BERT/ViT, the sibling `output.dense` of the self-attention module."""
    from models.families import output_projection_names

    names = ("o_proj", "out_proj", "c_proj", "o", "dense", *output_projection_names())
    parents = _parents(model)
    modules = attention_modules(model, layer_of)
    heads_of = [n_heads] * len(modules) if isinstance(n_heads, int) else list(n_heads)
    dims_of = [head_dim] * len(modules) if isinstance(head_dim, int) else list(head_dim)
    out = []
    for module, n_heads, head_dim in zip(modules, heads_of, dims_of):
        width = n_heads * head_dim
        candidates = [getattr(module, name, None) for name in names]
        if id(module) in parents:
            sibling_output = getattr(parents[id(module)][0], "output", None)
            candidates.append(getattr(sibling_output, "dense", None))
        for proj in candidates:
            weight = getattr(proj, "weight", None)
            if weight is None or weight.dim() != 2:
                continue
            matrix = weight.T if isinstance(proj, nn.Linear) else weight  # (H·d_v, D); GPT-2's Conv1D is stored so
            if matrix.shape[0] == width:
                out.append(matrix.detach().reshape(n_heads, head_dim, -1))  # (H, d_v, D)
                break
        else:
            raise ValueError(f"no output projection of width {width} found for {type(module).__name__}")
    return out


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm applied to the last layer's output before the unembedding (None: the model has none)."""
    base = getattr(model, "base_model", model)
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        module = getattr(base, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
