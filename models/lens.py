"""The logit lens (nostalgebraist 2020): the residual stream after each layer, passed through the model's final norm
and unembedding, read as a next-token distribution at every position (docs/science.md "Logit lens").

Row l is the stream after layer l; the last row is exactly the model's own next-token distribution (the final
norm of the last layer's output is what the head reads).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from models.anatomy import final_norm, layer_blocks
from models.hooks import RunScope, run_scope
from models.interventions import Intervention

# Elements of one chunk of lens logits (rows × vocabulary): the L·T × V logits are never all held at once.
CHUNK_ELEMENTS = 32 * 2**20

_capturing: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attnlab_residual_capture", default=None)


@contextlib.contextmanager
def capture_residual(model: torch.nn.Module, layer_of: dict[int, int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of this context records layer → its block's output (B, T, D).

    The forward hooks live only inside the block and write only for the context that registered them (a
    concurrent forward elsewhere records nothing here)."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer: int):
        def hook(_module, _args, output):
            if _capturing.get() is captured:
                captured[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [block.register_forward_hook(hook_for(l)) for l, block in enumerate(layer_blocks(model, layer_of))]
    token = _capturing.set(captured)
    try:
        yield captured
    finally:
        _capturing.reset(token)
        for handle in handles:
            handle.remove()


def residual_stream(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = ()) -> torch.Tensor:
    """The residual stream after each layer for one prompt: (L, T, D), with the interventions active.
    adapter: a CausalLMAdapter; input_ids: (1, T)."""
    scope = RunScope(layer_of=adapter.layer_of, interventions=interventions, record=False)
    with torch.inference_mode(), capture_residual(adapter.model, adapter.layer_of) as captured, run_scope(scope):
        adapter.model(input_ids=input_ids.to(adapter.device), logits_to_keep=1, return_dict=True)
    return torch.stack([captured[l][0] for l in range(len(adapter.layer_of))])  # (L, T, D)


def lens_logits(adapter, residual: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """The lens logits of a residual stream (L, T, D), in chunks of layers: (layers slice, (l, T, V) float32)."""
    norm = final_norm(adapter.model)
    n_layers, n_tokens, _ = residual.shape
    vocab = adapter.model.get_output_embeddings().weight.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, n_tokens * vocab))
    with torch.inference_mode():
        for start in range(0, n_layers, step):
            chunk = residual[start:start + step]  # (l, T, D)
            normed = norm(chunk) if norm is not None else chunk
            yield slice(start, start + chunk.shape[0]), adapter._logits(normed).float()  # (l, T, V)


@dataclass
class Lens:
    ids: torch.Tensor  # (L, T, k) the top tokens of every layer and position
    probs: torch.Tensor  # (L, T, k) their probabilities


def logit_lens(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = (), top: int = 5) -> Lens:
    """Top-k of the lens distribution at every layer and position. input_ids: (1, T)."""
    residual = residual_stream(adapter, input_ids, interventions)  # (L, T, D)
    ids, probs = [], []
    for _, logits in lens_logits(adapter, residual):
        best = torch.topk(torch.softmax(logits, dim=-1), top, dim=-1)  # (l, T, k)
        ids.append(best.indices.cpu())
        probs.append(best.values.cpu())
    return Lens(ids=torch.cat(ids), probs=torch.cat(probs))
