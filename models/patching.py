"""Activation patching between a clean and a corrupted prompt of the same length (docs/science.md "Patching").

LD = logit(answer) − logit(wrong) at the last position. A patch's effect is (LD_patched − LD_corrupt) /
(LD_clean − LD_corrupt): 0 = no change from the corrupted run, 1 = the clean run's difference fully restored.

- Head scan: for every (layer, head), the corrupted run with that head's output (before W_O, every position)
  taken from the clean run. Batched: the corrupted prompt repeated B times, item b patching one head.
- Residual scan: for every (layer, position), the output of that layer at that position taken from the clean run.
- Attribution patching (Nanda 2023; Syed, Rager & Conmy 2023): the first-order estimate
  effect ≈ Σ_{t, d} (H_clean − H_corrupt) · ∂LD/∂H at the corrupted run, for every head from two forwards and
  one backward.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from models.anatomy import layer_blocks
from models.head_ops import HeadRun, current_sources, head_run
from models.hooks import RunScope, run_scope
from models.interventions import Intervention
from models.lens import capture_residual, residual_stream

Progress = Callable[[int, int], None]  # (items done, items in all); may raise to stop the scan
Guard = Callable[[], contextlib.AbstractContextManager]  # held around each batch's forward (a model lock)


def single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when it is exactly one token (" Paris"), else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def last_logits(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = (),
                head: HeadRun | None = None) -> torch.Tensor:
    """Logits at the last position for a batch of prompts: input_ids (B, T) → (B, V) float32.
    Runs with gradients when the caller enabled them (attribution), else under inference mode."""
    scope = RunScope(layer_of=adapter.layer_of, interventions=interventions, record=False)
    head = head if head is not None else HeadRun(sources=current_sources())
    grad = torch.is_grad_enabled() and head.track_grad
    with (contextlib.nullcontext() if grad else torch.inference_mode()), head_run(head), run_scope(scope):
        ids = input_ids.to(adapter.device)
        out = adapter.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, return_dict=True)
    return out.logits[:, -1].float()  # (B, V)


def logit_difference(logits: torch.Tensor, answer: int, wrong: int) -> torch.Tensor:
    """LD per batch item: logits (B, V) → (B,)."""
    return logits[:, answer] - logits[:, wrong]


@dataclass
class Pair:
    """A clean and a corrupted prompt (same token count) and the two answer tokens."""

    clean: torch.Tensor  # (1, T) input ids
    corrupt: torch.Tensor  # (1, T)
    answer: int
    wrong: int

    def __post_init__(self) -> None:
        if self.clean.shape != self.corrupt.shape:
            raise ValueError(f"clean has {self.clean.shape[1]} tokens and corrupt {self.corrupt.shape[1]}")


def head_outputs(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = ()) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every layer's head outputs for one prompt, one (H, T, d_v) tensor per layer, and the last logits (V,)."""
    record: dict[int, torch.Tensor] = {}
    logits = last_logits(adapter, input_ids, interventions, HeadRun(sources=current_sources(), record=record))
    return [record[l][0].detach() for l in range(len(adapter.layer_of))], logits[0]


def clean_run(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = ()
              ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """head_outputs and, from the same forward, the residual stream after every layer (L, T, D): what patch_heads
    and patch_residual take from a kept clean run."""
    with capture_residual(adapter.model, adapter.layer_of) as captured:
        outputs, logits = head_outputs(adapter, input_ids, interventions)
    residual = torch.stack([captured[l][0].detach() for l in range(len(adapter.layer_of))])  # (L, T, D)
    return outputs, residual, logits


@dataclass
class Baseline:
    clean_outputs: list[torch.Tensor]  # per layer (H, T, d_v): the source of the patches
    ld_clean: float
    ld_corrupt: float
    clean_residual: torch.Tensor | None = None  # (L, T, D) the clean run's residual stream after every layer

    def effect(self, ld: torch.Tensor) -> torch.Tensor:
        """(LD − LD_corrupt) / (LD_clean − LD_corrupt); NaN where the two runs do not differ."""
        span = self.ld_clean - self.ld_corrupt
        return (ld - self.ld_corrupt) / span if span != 0 else torch.full_like(ld, float("nan"))


def baseline(adapter, pair: Pair, interventions: tuple[Intervention, ...] = ()) -> Baseline:
    clean_outputs, clean_residual, clean_logits = clean_run(adapter, pair.clean, interventions)
    corrupt_logits = last_logits(adapter, pair.corrupt, interventions)[0]
    ld = lambda logits: float(logits[pair.answer] - logits[pair.wrong])  # noqa: E731
    return Baseline(clean_outputs, ld(clean_logits), ld(corrupt_logits), clean_residual)


def _batches(total: int, size: int) -> Iterator[range]:
    for start in range(0, total, size):
        yield range(start, min(total, start + size))


def head_scan(adapter, pair: Pair, base: Baseline, interventions: tuple[Intervention, ...] = (), batch: int = 64,
              progress: Progress | None = None, guard: Guard = contextlib.nullcontext) -> torch.Tensor:
    """Effect of patching each head (all positions) from the clean run into the corrupted one: (L, H)."""
    n_layers, n_heads = len(adapter.layer_of), adapter.info.heads
    total = n_layers * n_heads
    lds = torch.empty(total)
    for items in _batches(total, batch):
        chosen = torch.zeros(len(items), n_layers, n_heads, dtype=torch.bool)  # (B, L, H): one head per item
        for b, item in enumerate(items):
            chosen[b, item // n_heads, item % n_heads] = True
        run = HeadRun(sources=current_sources(), batch_heads=chosen, batch_source=base.clean_outputs)
        with guard():
            logits = last_logits(adapter, pair.corrupt.expand(len(items), -1), interventions, run)  # (B, V)
        lds[items.start:items.stop] = logit_difference(logits, pair.answer, pair.wrong).cpu()
        if progress is not None:
            progress(items.stop, total)
    return base.effect(lds).view(n_layers, n_heads)


_residual_patch: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("attnlab_residual_patch", default=None)


@contextlib.contextmanager
def _residual_patching(model: torch.nn.Module, layer_of: dict[int, int], layers: torch.Tensor, positions: torch.Tensor,
                       clean: torch.Tensor) -> Iterator[None]:
    """Within the block, batch item b's layer `layers[b]` output at position `positions[b]` is replaced by the clean
    run's (clean: (L, T, D)). Hooks live only inside the block and act only for this context."""
    plan = (layers, positions, clean)

    def hook_for(layer: int):
        def hook(_module, _args, output):
            if _residual_patch.get() is not plan:
                return None
            items = (layers == layer).nonzero().flatten()  # batch items patching this layer
            if items.numel() == 0:
                return None
            hidden = output[0] if isinstance(output, tuple) else output  # (B, T, D)
            hidden = hidden.clone()
            hidden[items, positions[items]] = clean[layer, positions[items]].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return hook

    handles = [block.register_forward_hook(hook_for(l)) for l, block in enumerate(layer_blocks(model, layer_of))]
    token = _residual_patch.set(plan)
    try:
        yield
    finally:
        _residual_patch.reset(token)
        for handle in handles:
            handle.remove()


def residual_scan(adapter, pair: Pair, base: Baseline, interventions: tuple[Intervention, ...] = (), batch: int = 64,
                  progress: Progress | None = None, guard: Guard = contextlib.nullcontext) -> torch.Tensor:
    """Effect of patching the residual stream after each layer at each position: (L, T)."""
    clean = base.clean_residual
    if clean is None:
        with guard():
            clean = residual_stream(adapter, pair.clean, interventions)  # (L, T, D)
    n_layers, n_tokens = clean.shape[:2]
    total = n_layers * n_tokens
    lds = torch.empty(total)
    for items in _batches(total, batch):
        index = torch.arange(items.start, items.stop)
        layers, positions = index // n_tokens, index % n_tokens  # (B,), (B,)
        with guard(), _residual_patching(adapter.model, adapter.layer_of, layers, positions.to(adapter.device), clean):
            logits = last_logits(adapter, pair.corrupt.expand(len(items), -1), interventions)
        lds[items.start:items.stop] = logit_difference(logits, pair.answer, pair.wrong).cpu()
        if progress is not None:
            progress(items.stop, total)
    return base.effect(lds).view(n_layers, n_tokens)


def _corrupt_gradients(adapter, pair: Pair, interventions: tuple[Intervention, ...]):
    """One forward with gradients and one backward on the corrupted prompt: its head outputs per layer (H, T, d_v),
    ∂LD/∂H per layer (H, T, d_v), and its LD."""
    record: dict[int, torch.Tensor] = {}
    run = HeadRun(sources=current_sources(), record=record, track_grad=True)
    with torch.inference_mode(False), torch.enable_grad():
        logits = last_logits(adapter, pair.corrupt, interventions, run)  # (1, V)
        ld = logit_difference(logits, pair.answer, pair.wrong)[0]
        layers = sorted(run.deltas)
        grads = torch.autograd.grad(ld, [run.deltas[l] for l in layers], allow_unused=True)  # each (1, H, T, d_v)
    grads = [torch.zeros_like(run.deltas[l]) if g is None else g for l, g in zip(layers, grads)]
    return [record[l][0].detach() for l in layers], [g[0] for g in grads], float(ld.detach())


def attribution_scan(adapter, pair: Pair, base: Baseline, interventions: tuple[Intervention, ...] = ()) -> torch.Tensor:
    """First-order estimate of every head's patch effect: Σ_{t,d} (H_clean − H_corrupt) ∂LD/∂H_corrupt, divided by
    LD_clean − LD_corrupt: (L, H). One forward with gradients and one backward on the corrupted prompt (the clean
    run's outputs come from `base`)."""
    corrupt_outputs, grads, _ = _corrupt_gradients(adapter, pair, interventions)
    return _attribution(base, corrupt_outputs, grads)


def _attribution(base: Baseline, corrupt_outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    estimates = []
    for clean, corrupt, grad in zip(base.clean_outputs, corrupt_outputs, grads):
        delta = clean.to(grad.device) - corrupt  # (H, T, d_v)
        estimates.append((delta * grad).sum(dim=(-1, -2)).float().cpu())  # (H,)
    return base.effect(torch.stack(estimates) + base.ld_corrupt)  # (L, H): the estimated LD, as an effect


def attribution_patching(adapter, pair: Pair, interventions: tuple[Intervention, ...] = ()) -> tuple[Baseline, torch.Tensor]:
    """Attribution patching alone: the clean and corrupted prompts in one batched forward with gradients (the clean
    item only records its head outputs), and one backward from the corrupted item's LD. Returns the baseline (LD of
    both runs, the clean outputs) and the (L, H) estimate."""
    record: dict[int, torch.Tensor] = {}
    run = HeadRun(sources=current_sources(), record=record, track_grad=True)
    with torch.inference_mode(False), torch.enable_grad(), capture_residual(adapter.model, adapter.layer_of) as captured:
        logits = last_logits(adapter, torch.cat([pair.clean, pair.corrupt]), interventions, run)  # (2, V)
        ld = logit_difference(logits, pair.answer, pair.wrong)  # (2,): clean, corrupt
        layers = sorted(run.deltas)
        grads = torch.autograd.grad(ld[1], [run.deltas[l] for l in layers], allow_unused=True)  # each (2, H, T, d_v)
    grads = [torch.zeros_like(run.deltas[l]) if g is None else g for l, g in zip(layers, grads)]
    lds = ld.detach().tolist()
    clean_residual = torch.stack([captured[l][0].detach() for l in range(len(adapter.layer_of))])  # (L, T, D)
    base = Baseline([record[l][0].detach() for l in layers], lds[0], lds[1], clean_residual)
    return base, _attribution(base, [record[l][1].detach() for l in layers], [g[1] for g in grads])


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's ρ of two equally shaped tensors (ties get their average rank)."""
    def ranks(x: torch.Tensor) -> torch.Tensor:
        x = x.flatten().double()
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(x.numel(), dtype=torch.float64)
        for value in x.unique():  # average ranks of ties
            same = x == value
            if int(same.sum()) > 1:
                r[same] = r[same].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-30))
