"""A faithfulness check for attributions (docs/science.md "Faithfulness"): rank the keys of one query row by an
attribution method, mask each method's top-k keys in every layer, and measure how much the model's output moves.
The method whose top keys move it more is the more faithful one for this input.

Methods (each a score per key of row i):
- "attention": P[i, j] averaged over every layer and head (or one layer's heads, or one head);
- "value_norm": the value-weighted maps (models/attribution.py) averaged the same way;
- "rollout": row i of R = Ã_L ⋯ Ã_1 (Abnar & Zuidema 2020, models/summaries.py);
- "grad_attention": Chefer, Gur & Wolf 2021: Ā_l = mean_h (∇_{P_l} f ⊙ P_l)⁺, R = Π_l (I + Ā_l) accumulated from
  the first layer, row i; f is the output being explained (log p(answer) for decoder LMs).
"""
from __future__ import annotations

from typing import Any

import torch

from models.adapters.base import AttentionAdapter, Encoded
from models.attribution import run_value_norms, value_weighted
from models.effects import cosine, kl_divergence
from models.head_ops import HeadRun, head_run
from models.hooks import RunScope, run_scope
from models.interventions import Intervention
from models.summaries import attention_rollout

METHODS = ("attention", "value_norm", "rollout", "grad_attention")


def _target(adapter: AttentionAdapter, outputs, encoded: Encoded, position: int, answer: int | None,
            reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scalar f whose attribution grad_attention explains, from a forward with gradients."""
    kind = adapter.info.output
    if kind == "next_token":
        logits = adapter._logits(outputs.hidden_states[-1][0, position])  # (V,)
        return torch.log_softmax(logits.float(), dim=-1)[answer]
    if kind == "mlm":
        logits = outputs.logits[0, position].float()  # (V,)
        return torch.log_softmax(logits, dim=-1)[int(reference["mlm_logits"][position].argmax())]
    last = outputs.hidden_states[-1][0]  # (T, D)
    if kind == "similarity":  # the pooled state's component along the original embedding (cosine has no slope there)
        mask = encoded.inputs["attention_mask"][0].to(last.device, last.dtype).unsqueeze(-1)  # (T, 1)
        pooled = (last * mask).sum(0) / mask.sum()
        return pooled @ reference["embedding"].to(pooled.device, pooled.dtype)
    return last[0] @ reference["cls"].to(last.device, last.dtype)


def attention_gradients(adapter: AttentionAdapter, encoded: Encoded, position: int, answer: int | None,
                        reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """∂f/∂P for every layer (L, H, T, T), from ∂f/∂H (a zero leaf added to each head output) and V:
    H = P V, so ∂f/∂P[i, j] = ∂f/∂H[i] · v_j."""
    values: dict[int, torch.Tensor] = {}
    run = HeadRun(values=values, track_grad=True)
    scope = RunScope(layer_of=adapter.layer_of, record=False)
    with torch.inference_mode(False), torch.enable_grad(), head_run(run), run_scope(scope):
        outputs = adapter.model(**adapter.model_inputs(encoded.inputs), output_hidden_states=True, return_dict=True)
        target = _target(adapter, outputs, encoded, position, answer, reference)
        layers = sorted(run.deltas)
        grads = torch.autograd.grad(target, [run.deltas[l] for l in layers], allow_unused=True)
    out = []
    for l, grad in zip(layers, grads):
        grad = torch.zeros_like(run.deltas[l]) if grad is None else grad  # (1, H, T, d_v)
        out.append((grad[0] @ values[l][0].detach().transpose(-1, -2)).float().cpu())  # (H, T, T)
    return torch.stack(out)


def chefer_relevance(attention: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """R = (I + Ā_L) ⋯ (I + Ā_1) with Ā_l = mean_h (∇P_l ⊙ P_l)⁺ (Chefer et al. 2021, self-attention rule).
    attention, gradients: (L, H, T, T) → (T, T)."""
    n_tokens = attention.shape[-1]
    relevance = torch.eye(n_tokens, dtype=torch.float64)
    for probs, grad in zip(attention.double(), gradients.double()):
        mixed = (grad * probs).clamp_min(0).mean(dim=0)  # (T, T)
        relevance = relevance + mixed @ relevance
    return relevance.float()


def _scoped_row(maps: torch.Tensor, position: int, layer: int | None, head: int | None) -> torch.Tensor:
    """Row `position` of maps (L, H, T, T) averaged over every layer and head, or over one layer's heads, or of
    one head: (T,)."""
    rows = maps[:, :, position]  # (L, H, T)
    if layer is None:
        return rows.mean(dim=(0, 1))
    return rows[layer].mean(dim=0) if head is None else rows[layer, head]


def key_scores(adapter: AttentionAdapter, encoded: Encoded, result, position: int, methods: list[str],
               answer: int | None, layer: int | None = None, head: int | None = None) -> dict[str, torch.Tensor]:
    """Each method's score for every key of row `position`: name → (T,). `layer`/`head` scope the attention and
    value_norm methods (None: the mean over every layer and head)."""
    scores = {}
    attention = result.attention  # (L, H, T, T)
    if "attention" in methods:
        scores["attention"] = _scoped_row(attention, position, layer, head)
    if "value_norm" in methods:
        weighted = value_weighted(attention, run_value_norms(adapter, encoded))  # (L, H, T, T)
        scores["value_norm"] = _scoped_row(weighted, position, layer, head)
    if "rollout" in methods:
        scores["rollout"] = attention_rollout(attention)[position]
    if "grad_attention" in methods:
        gradients = attention_gradients(adapter, encoded, position, answer, result.output)
        scores["grad_attention"] = chefer_relevance(attention, gradients)[position]
    return scores


def ranked_keys(score: torch.Tensor, position: int, causal: bool) -> list[int]:
    """Keys by decreasing score (the query's visible keys only: j ≤ position for a decoder); ties by position."""
    keys = list(range(position + 1)) if causal else list(range(score.numel()))
    return sorted(keys, key=lambda j: (-float(score[j]), j))


def _output_change(adapter: AttentionAdapter, before, after, position: int, answer: int | None) -> dict[str, float]:
    kind = adapter.info.output
    if kind == "next_token":
        p, q = adapter.distribution(before, position), adapter.distribution(after, position)
        return {"kl": kl_divergence(p, q), "p_drop": float(p[answer] - q[answer])}
    if kind == "mlm":
        p = torch.softmax(before.output["mlm_logits"][position].double(), -1)
        q = torch.softmax(after.output["mlm_logits"][position].double(), -1)
        top = int(p.argmax())
        return {"kl": kl_divergence(p, q), "p_drop": float(p[top] - q[top])}
    name = "embedding" if kind == "similarity" else "cls"
    return {"change": 1.0 - cosine(after.output[name], before.output[name])}


def faithfulness(adapter: AttentionAdapter, encoded: Encoded, position: int, ks: list[int], methods: list[str],
                 answer: int | None = None, layer: int | None = None, head: int | None = None) -> dict[str, Any]:
    """For each method: its ranked keys and, per k, the output change with its top-k keys masked in every layer
    (null where k leaves the row no key). Decoder LMs: `kl` of the next-token distribution at `position` and
    `p_drop` of p(answer) (default: the top token); masked LMs the same at `position`; embeddings 1 − cosine."""
    base = adapter.run(encoded)
    causal = adapter.info.output == "next_token"
    if causal and answer is None:
        answer = int(adapter.distribution(base, position).argmax())
    visible = position + 1 if causal else len(encoded.tokens)
    out: dict[str, Any] = {}
    for name, score in key_scores(adapter, encoded, base, position, methods, answer, layer, head).items():
        keys = ranked_keys(score, position, causal)
        changes: dict[str, list] = {}
        for k in ks:
            change = None
            if k < visible:
                masked = adapter.run(encoded, (Intervention("mask_keys", tokens=tuple(keys[:k])),))
                change = _output_change(adapter, base, masked, position, answer)
            for field in ("kl", "p_drop") if adapter.info.output in ("next_token", "mlm") else ("change",):
                changes.setdefault(field, []).append(None if change is None else change[field])
        out[name] = {"keys": keys, "scores": [float(score[j]) for j in keys], **changes}
    response: dict[str, Any] = {"k": ks, "methods": out}
    if causal:
        response["answer"] = {"id": answer, "token": adapter.token_text(answer),
                              "prob": float(adapter.distribution(base, position)[answer])}
    return response
