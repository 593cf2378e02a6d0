"""What the /luong page shows for one input: a Luong model's alignment, context vectors and greedy output, under
the lab's interventions on the alignment (β on the scores, masked source positions, Gaussian noise on the source
states h̄_s) with their effect on the output, and the tiny Transformer's cross-attention per layer and head for the
same input (docs/science.md "Luong attention and a Transformer's cross-attention"). No HTTP here: bad input raises
LuongInputError naming the request field.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from models import luong
from models.luong import BOS, EOS, SOURCE_VOCAB, TARGET_VOCAB, LuongSeq2Seq, TinyTransformer


class LuongInputError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Perturbation:
    sigma: float
    seed: int = 0
    positions: tuple[int, ...] | None = None  # None: every source position


@dataclass(frozen=True)
class Interventions:
    beta: float = 1.0
    mask: tuple[int, ...] = ()
    perturb: Perturbation | None = None

    @property
    def any(self) -> bool:
        return self.beta != 1.0 or bool(self.mask) or (self.perturb is not None and self.perturb.sigma > 0)


@dataclass
class Decoded:
    ids: list[int]              # greedy outputs, </s> included when it came
    probs: torch.Tensor         # (T, V) p(y_t | y_<t, x)
    alignment: luong.Alignment  # batch of one: weights, scores (1, T, S), context (1, T, H)


def check_input(text: str, ivs: Interventions, max_source: int) -> None:
    unknown = SOURCE_VOCAB.unknown(text)
    if unknown:
        raise LuongInputError("text", f"characters outside the model's vocabulary: {''.join(unknown)!r}; it reads "
                                      f"{luong.SOURCE_CHARS!r}")
    if not text or len(text) > max_source:
        raise LuongInputError("text", f"the text must have 1 to {max_source} characters, not {len(text)}")
    S = len(text)
    for field, positions in (("mask", ivs.mask), ("perturb", (ivs.perturb.positions or ()) if ivs.perturb else ())):
        outside = [p for p in positions if not 0 <= p < S]
        if outside:
            raise LuongInputError(field, f"source positions {outside} are outside the text's {S} characters (0..{S - 1})")
    if len(set(ivs.mask)) >= S:
        raise LuongInputError("mask", "every source position is masked: the softmax would have nothing to attend to")


def perturbed_states(hs: torch.Tensor, perturb: Perturbation | None) -> torch.Tensor:
    """h̄_s + σ ε with ε ~ N(0, I) drawn from `seed`, at the chosen positions (all when none are chosen)."""
    if perturb is None or perturb.sigma == 0:
        return hs
    gen = torch.Generator().manual_seed(perturb.seed)
    noise = torch.randn(hs.shape, generator=gen, dtype=torch.float64).to(hs.dtype)   # (1, S, H)
    if perturb.positions is not None:
        keep = torch.zeros(hs.shape[1], dtype=torch.bool)
        keep[list(perturb.positions)] = True
        noise = noise * keep[None, :, None]
    return hs + perturb.sigma * noise


def greedy_decode(model: LuongSeq2Seq, hs: torch.Tensor, h0: torch.Tensor, allowed: torch.Tensor,
                  beta: float) -> Decoded:
    """One step at a time: h_t = GRU(h_{t-1}, y_{t-1}), then the alignment over hs; argmax until </s>."""
    token, state, steps = torch.tensor([[BOS]]), h0, []
    for _ in range(model.cfg.max_target):
        h, state = model.decoder(model.tgt_embed(token), state)                         # (1, 1, H)
        step = model.attend(h, hs, allowed, beta)                                       # logits (1, 1, V)
        steps.append(step)
        token = step.logits[:, -1].argmax(-1, keepdim=True)                             # (1, 1)
        if int(token) == EOS:
            break
    alignment = luong.Alignment(*(torch.cat([getattr(s, f) for s in steps], 1) for f in
                                  ("logits", "scores", "weights", "context", "states")))
    ids = alignment.logits[0].argmax(-1).tolist()
    return Decoded(ids, alignment.logits[0].softmax(-1), alignment)


def forced(model: LuongSeq2Seq, ids: list[int], hs: torch.Tensor, h0: torch.Tensor, allowed: torch.Tensor,
           beta: float) -> torch.Tensor:
    """p(y_t | y_<t) (T, V) along the given outputs (teacher forcing)."""
    tgt_in = torch.tensor([[BOS] + ids[:-1]])                                          # (1, T)
    h = model.decode_states(tgt_in, h0)                                                 # (1, T, H)
    return model.attend(h, hs, allowed, beta).logits[0].softmax(-1)                     # (T, V)


def output_view(ids: list[int], probs: torch.Tensor) -> dict:
    chosen = [float(probs[t, i]) for t, i in enumerate(ids)]
    return {"tokens": [TARGET_VOCAB.itos[i] for i in ids], "text": TARGET_VOCAB.decode(ids), "probs": chosen}


def alignment_view(decoded: Decoded) -> dict:
    a = decoded.alignment
    raw = a.scores[0]                                                                   # (T, S)
    return {"alignment": a.weights[0].tolist(), "scores": raw.tolist(),
            "context": a.context[0].tolist(), "context_norms": a.context[0].norm(dim=-1).tolist()}


def effect_view(model: LuongSeq2Seq, base: Decoded, after: Decoded, parts: tuple) -> dict:
    """The intervened run against the plain one: outputs, and along the plain output (same prefixes, so only the
    intervention differs) the intervened probability of each plain token and KL(p_plain ‖ p_intervened) per step."""
    hs_after, h0, allowed, beta = parts
    p_after = forced(model, base.ids, hs_after, h0, allowed, beta)                     # (T, V)
    p_base = base.probs                                                                 # (T, V)
    kl = (p_base * (p_base.clamp_min(1e-300).log() - p_after.clamp_min(1e-300).log())).sum(-1)  # (T,)
    return {
        "baseline": {"output": output_view(base.ids, base.probs), **alignment_view(base)},
        "changed": base.ids != after.ids,
        "kl": kl.clamp_min(0).tolist(),
        "kl_mean": float(kl.clamp_min(0).mean()),
        "prob_of_baseline_token": [float(p_after[t, i]) for t, i in enumerate(base.ids)],
    }


@torch.no_grad()
def transformer_view(model: TinyTransformer, text: str) -> dict:
    """The Transformer's greedy output for `text` and its cross-attention [layers][heads][steps][source] along it."""
    ids = luong.greedy(model, [text])[0]
    src, lengths = luong.batch_sources([text], model.cfg.max_source)
    memory, allowed = model.encode(src, lengths)
    logits, cross = model.decode(torch.tensor([[BOS] + ids[:-1]]), memory, allowed)    # (1, T, V), [(1, h, T, S)]
    return {"output": output_view(ids, logits[0].softmax(-1)),
            "cross_attention": [P[0].tolist() for P in cross],
            "layers": model.cfg.n_layers, "heads": model.cfg.n_heads}


@torch.no_grad()
def attention_view(folder: str | Path, score: str, text: str, ivs: Interventions = Interventions()) -> dict:
    """Everything the page draws for one input; the alignment and output are the intervened run's when there are
    interventions, and `effect` compares it with the plain run."""
    folder = str(folder)
    model: LuongSeq2Seq = luong.load_model(folder, score)
    check_input(text, ivs, model.cfg.max_source)
    src, lengths = luong.batch_sources([text], model.cfg.max_source)
    hs, h0 = model.encode(src, lengths)                                                 # (1, S, H), (1, 1, H)
    allowed = torch.ones(1, len(text), dtype=torch.bool)
    allowed[0, list(ivs.mask)] = False
    hs_after = perturbed_states(hs, ivs.perturb)
    after = greedy_decode(model, hs_after, h0, allowed, ivs.beta)
    results = luong.load_results(folder)
    view = {
        "score": score, "text": text, "source_tokens": list(text),
        "beta": ivs.beta, "mask": sorted(set(ivs.mask)),
        "perturb": None if ivs.perturb is None else {"sigma": ivs.perturb.sigma, "seed": ivs.perturb.seed,
                                                      "positions": ivs.perturb.positions and list(ivs.perturb.positions)},
        "heldout_exact_match": results["models"][score]["heldout_exact_match"],
        "output": output_view(after.ids, after.probs), **alignment_view(after),
        "effect": None,
    }
    if ivs.any:
        base = greedy_decode(model, hs, h0, torch.ones_like(allowed), 1.0)
        view["effect"] = effect_view(model, base, after, (hs_after, h0, allowed, ivs.beta))
    view["transformer"] = {**transformer_view(luong.load_model(folder, "transformer"), text),
                           "heldout_exact_match": results["models"]["transformer"]["heldout_exact_match"]}
    return view


def models_view(folder: str | Path) -> dict:
    """The trained models with their held-out exact match, the task, the split and the training's seconds."""
    results = luong.load_results(str(folder))
    models = [{"name": name, "kind": "transformer" if name == "transformer" else "luong", **info}
              for name, info in results["models"].items()]
    return {"models": models, "task": results["task"], "split": results["split"], "training": results["training"],
            "majority_baseline": results["majority_baseline"], "train_s_total": results["train_s_total"]}
