"""Luong attention (Luong, Pham & Manning, EMNLP 2015) on a task trained here, beside a tiny Transformer
encoder–decoder trained on the same split (docs/science.md "Luong attention and a Transformer's cross-attention").

The task: date normalisation, character level. "the 3rd of March 2021", "March 3, 2021", "3 March 2021",
"03/03/2021", "Mar 3 2021", "March the 3rd, 2021", "3.3.2021" -> "2021-03-03". The year moves from the end of
the source to the start of the target, and a month name becomes two digits: the alignment reorders and is readable.

The RNN: a GRU encoder read left to right (source states h̄_s) and a GRU decoder of the same width H whose state
h_t scores every source state:

    dot       score(h_t, h̄_s) = h_tᵀ h̄_s
    general   score(h_t, h̄_s) = h_tᵀ W_a h̄_s
    concat    score(h_t, h̄_s) = v_aᵀ tanh(W_a [h_t; h̄_s])
    location  a_t = softmax(W_a h_t)            (over source positions, padded to max_source; no content)

    a_t = softmax_s(β·score + M)   c_t = Σ_s a_t(s) h̄_s   h̃_t = tanh(W_c [c_t; h_t])   p(y_t) = softmax(W_s h̃_t)

M is 0 or −inf: the padding beyond the source and, under an intervention, masked source positions. No input
feeding (Luong's §3.3 option): h_t depends on the previous outputs only, so a teacher-forced pass runs the decoder
GRU over the whole target at once. This module knows nothing about HTTP.
"""
from __future__ import annotations

import calendar
import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SCORES = ("dot", "general", "concat", "location")
FORMAT_VERSION = 1  # bump when the task, the models or the training change: prepared weights are rebuilt
FOLDER = "luong"    # under the weights folder
MODELS_ROOT = Path(__file__).resolve().parent.parent  # the checkout: `python -m models.luong` trains one model
PAD, BOS, EOS = 0, 1, 2
MAX_SOURCE = 32     # characters of a source: the location score's W_a has a row per position up to this
SPECIALS = ("<pad>", "<s>", "</s>")

# ----------------------------------------------------------------------------------------------------
# the task

MONTHS = tuple(calendar.month_name[1:])   # January .. December
MONTHS_SHORT = tuple(calendar.month_abbr[1:])  # Jan .. Dec
FORMATS = (
    "the {ord} of {month} {year}",   # the 3rd of March 2021
    "{month} {day}, {year}",         # March 3, 2021
    "{day} {month} {year}",          # 3 March 2021
    "{dd}/{mm}/{year}",              # 03/03/2021
    "{mon} {day} {year}",            # Mar 3 2021
    "{month} the {ord}, {year}",     # March the 3rd, 2021
    "{day}.{m}.{year}",              # 3.3.2021
)
YEARS = (1950, 2049)
_WORDS = " ".join(MONTHS + MONTHS_SHORT) + " the of st nd rd th"
# Source characters: what the generator can write, capitalised or not. Target: the ISO date's characters.
SOURCE_CHARS = "".join(sorted(set(_WORDS + _WORDS.lower() + "0123456789 ,/.")))
TARGET_CHARS = "0123456789-"
EXAMPLES = ("the 3rd of March 2021", "March 3, 2021", "3 March 2021", "03/03/2021", "Mar 3 2021",
            "July the 21st, 1969", "14.7.1989", "the 31st of december 1999")


def ordinal(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def render(year: int, month: int, day: int, form: int, lower: bool) -> tuple[str, str]:
    """One (source, target) pair: the date written in FORMATS[form] -> "YYYY-MM-DD"."""
    name, short = MONTHS[month - 1], MONTHS_SHORT[month - 1]
    if lower:
        name, short = name.lower(), short.lower()
    source = FORMATS[form].format(ord=ordinal(day), month=name, mon=short, year=year, day=day, dd=f"{day:02d}",
                                  mm=f"{month:02d}", m=month)
    return source, f"{year:04d}-{month:02d}-{day:02d}"


def random_pair(rng: random.Random) -> tuple[str, str]:
    year = rng.randint(*YEARS)
    month = rng.randint(1, 12)
    day = rng.randint(1, calendar.monthrange(year, month)[1])
    return render(year, month, day, rng.randrange(len(FORMATS)), lower=rng.random() < 0.3)


def make_split(seed: int, n_train: int, n_heldout: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training pairs drawn with `seed`, held-out pairs with `seed + 1`, none of whose sources is in training."""
    rng = random.Random(seed)
    train = [random_pair(rng) for _ in range(n_train)]
    seen = {s for s, _ in train}
    rng, heldout = random.Random(seed + 1), []
    while len(heldout) < n_heldout:
        pair = random_pair(rng)
        if pair[0] not in seen:
            seen.add(pair[0])
            heldout.append(pair)
    return train, heldout


class Vocab:
    """Characters <-> ids; 0, 1, 2 are <pad>, <s>, </s>."""

    def __init__(self, chars: str):
        self.itos = list(SPECIALS) + list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def unknown(self, text: str) -> list[str]:
        return sorted({c for c in text if c not in self.stoi})

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(SPECIALS))


SOURCE_VOCAB, TARGET_VOCAB = Vocab(SOURCE_CHARS), Vocab(TARGET_CHARS)


def batch_sources(texts: list[str], max_source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded source ids (B, S) and lengths (B,); S = the longest source."""
    ids = [SOURCE_VOCAB.encode(t)[:max_source] for t in texts]
    S = max(len(i) for i in ids)
    src = torch.full((len(ids), S), PAD, dtype=torch.long)  # (B, S)
    for b, row in enumerate(ids):
        src[b, : len(row)] = torch.tensor(row)
    return src, torch.tensor([len(i) for i in ids])


def batch_targets(targets: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs <s> y (B, T) and outputs y </s> (B, T); every target has the same length."""
    ids = torch.tensor([TARGET_VOCAB.encode(t) for t in targets])         # (B, T-1)
    bos = torch.full((len(targets), 1), BOS)
    eos = torch.full((len(targets), 1), EOS)
    return torch.cat([bos, ids], 1), torch.cat([ids, eos], 1)             # (B, T), (B, T)


# ----------------------------------------------------------------------------------------------------
# the Luong encoder–decoder

@dataclass
class LuongConfig:
    score: str = "general"
    embed: int = 32
    hidden: int = 64          # H: encoder states (directions summed) and decoder states
    concat_hidden: int = 64   # rows of W_a in the concat score
    max_source: int = MAX_SOURCE
    max_target: int = 12      # greedy decoding stops here if </s> has not come

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LuongConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class LuongScore(nn.Module):
    """score(h_t, h̄_s) for every decoder step t and source position s: (B, T, H), (B, S, H) -> (B, T, S)."""

    def __init__(self, cfg: LuongConfig):
        super().__init__()
        self.kind, H = cfg.score, cfg.hidden
        if self.kind == "general":
            self.W_a = nn.Linear(H, H, bias=False)
        elif self.kind == "concat":
            self.W_a = nn.Linear(2 * H, cfg.concat_hidden, bias=False)
            self.v_a = nn.Linear(cfg.concat_hidden, 1, bias=False)
        elif self.kind == "location":
            self.W_a = nn.Linear(H, cfg.max_source, bias=False)

    def forward(self, h: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        if self.kind == "dot":
            return h @ hs.transpose(1, 2)                                   # (B, T, S)
        if self.kind == "general":
            return h @ self.W_a(hs).transpose(1, 2)                         # (B, T, S)
        if self.kind == "location":
            return self.W_a(h)[:, :, : hs.shape[1]]                         # (B, T, S): position only
        H = h.shape[-1]
        W_h, W_s = self.W_a.weight[:, :H], self.W_a.weight[:, H:]           # (Ha, H), (Ha, H): W_a [h; h̄] split
        pre = (h @ W_h.T)[:, :, None, :] + (hs @ W_s.T)[:, None, :, :]      # (B, T, S, Ha)
        return self.v_a(torch.tanh(pre)).squeeze(-1)                        # (B, T, S)


@dataclass
class Alignment:
    """What one teacher-forced or greedy pass shows: per decoder step t and source position s."""
    logits: torch.Tensor    # (B, T, V)
    scores: torch.Tensor    # (B, T, S) raw score(h_t, h̄_s), before β and the masks
    weights: torch.Tensor   # (B, T, S) a_t(s)
    context: torch.Tensor   # (B, T, H) c_t
    states: torch.Tensor    # (B, T, H) h_t


class LuongSeq2Seq(nn.Module):
    def __init__(self, cfg: LuongConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden
        self.src_embed = nn.Embedding(len(SOURCE_VOCAB), cfg.embed, padding_idx=PAD)
        self.encoder = nn.GRU(cfg.embed, H, batch_first=True)
        self.tgt_embed = nn.Embedding(len(TARGET_VOCAB), cfg.embed, padding_idx=PAD)
        self.decoder = nn.GRU(cfg.embed, H, batch_first=True)
        self.score = LuongScore(cfg)
        self.W_c = nn.Linear(2 * H, H, bias=False)
        self.W_s = nn.Linear(H, len(TARGET_VOCAB), bias=False)

    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source ids (B, S) -> states h̄ (B, S, H) and the decoder's first state (1, B, H), the state at each
        source's last character. The encoder runs left to right, as Luong's did, so a state depends on the
        characters up to it only: padding after a source changes none of its states."""
        out, _ = self.encoder(self.src_embed(src))                                    # (B, S, H)
        last = out[torch.arange(src.shape[0]), lengths - 1]                           # (B, H)
        return out, last[None]                                                        # (B, S, H), (1, B, H)

    def attend(self, h: torch.Tensor, hs: torch.Tensor, mask: torch.Tensor, beta: float = 1.0) -> Alignment:
        """Decoder states h (B, T, H) over source states hs (B, S, H); mask (B, S) True = may attend."""
        scores = self.score(h, hs)                                                    # (B, T, S)
        logits_a = (beta * scores).masked_fill(~mask[:, None, :], float("-inf"))      # (B, T, S)
        weights = logits_a.softmax(-1)                                                # (B, T, S) a_t
        context = weights @ hs                                                        # (B, T, H) c_t
        h_tilde = torch.tanh(self.W_c(torch.cat([context, h], -1)))                   # (B, T, H) h̃_t
        return Alignment(self.W_s(h_tilde), scores, weights, context, h)              # logits (B, T, V)

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T, V) for decoder inputs <s> y_1 .. y_{T-1}."""
        hs, h0 = self.encode(src, lengths)
        h, _ = self.decoder(self.tgt_embed(tgt_in), h0)                               # (B, T, H)
        return self.attend(h, hs, source_mask(lengths, src.shape[1])).logits

    def decode_states(self, tgt_in: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        """The decoder's h_t (B, T, H) for given inputs: the states a greedy decode that emitted them went through."""
        return self.decoder(self.tgt_embed(tgt_in), h0)[0]


def source_mask(lengths: torch.Tensor, S: int) -> torch.Tensor:
    return torch.arange(S)[None, :] < lengths[:, None]                                # (B, S)


# ----------------------------------------------------------------------------------------------------
# the tiny Transformer encoder–decoder (Vaswani et al. 2017, post-LN, learned positions), hand-written so
# that its cross-attention is returned per layer and head

@dataclass
class TransformerConfig:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 1          # encoder layers = decoder layers
    ffn: int = 128
    max_source: int = MAX_SOURCE
    max_target: int = 12

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TransformerConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.h, self.d = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) attends over memory (B, S, D); allowed (B, T, S) or broadcastable -> (B, T, D), P (B, h, T, S)."""
        B, T, D = x.shape
        S = memory.shape[1]
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)                       # (B, h, T, d)
        k, v = self.kv(memory).view(B, S, 2, self.h, self.d).permute(2, 0, 3, 1, 4)   # (B, h, S, d) each
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)                         # (B, h, T, S)
        P = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)           # (B, h, T, S)
        y = (P @ v).transpose(1, 2).reshape(B, T, D)                                   # (B, T, D)
        return self.o(y), P


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(cfg.d_model, cfg.ffn), nn.Linear(cfg.ffn, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))                                           # (B, T, D)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn, self.ffn = MultiHeadAttention(cfg), FeedForward(cfg)
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, x, allowed)[0])                                  # (B, S, D)
        return self.ln2(x + self.ffn(x))                                               # (B, S, D)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn, self.cross, self.ffn = MultiHeadAttention(cfg), MultiHeadAttention(cfg), FeedForward(cfg)
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))

    def forward(self, y: torch.Tensor, memory: torch.Tensor, causal: torch.Tensor,
                src_allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.ln1(y + self.self_attn(y, y, causal)[0])                              # (B, T, D)
        attended, P = self.cross(y, memory, src_allowed)                               # (B, T, D), (B, h, T, S)
        y = self.ln2(y + attended)
        return self.ln3(y + self.ffn(y)), P


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.src_embed = nn.Embedding(len(SOURCE_VOCAB), D, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(len(TARGET_VOCAB), D, padding_idx=PAD)
        self.src_pos = nn.Parameter(torch.randn(cfg.max_source, D) * 0.02)            # (S_max, D)
        self.tgt_pos = nn.Parameter(torch.randn(cfg.max_target, D) * 0.02)            # (T_max, D)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.out = nn.Linear(D, len(TARGET_VOCAB))

    def encode(self, src: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S = src.shape[1]
        allowed = source_mask(lengths, S)                                              # (B, S)
        x = self.src_embed(src) + self.src_pos[:S]                                     # (B, S, D)
        for layer in self.encoder:
            x = layer(x, allowed[:, None, :])                                          # (B, S, D)
        return x, allowed

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor,
               allowed: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, T, V) and the cross-attention of every decoder layer [(B, h, T, S)]."""
        T = tgt_in.shape[1]
        y = self.tgt_embed(tgt_in) + self.tgt_pos[:T]                                  # (B, T, D)
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None]                       # (1, T, T)
        cross = []
        for layer in self.decoder:
            y, P = layer(y, memory, causal, allowed[:, None, :])                       # (B, T, D), (B, h, T, S)
            cross.append(P)
        return self.out(y), cross

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, allowed = self.encode(src, lengths)
        return self.decode(tgt_in, memory, allowed)[0]                                 # (B, T, V)


# ----------------------------------------------------------------------------------------------------
# greedy decoding (batched) and accuracy

@torch.no_grad()
def greedy(model: nn.Module, texts: list[str]) -> list[list[int]]:
    """Each text's greedy output ids, </s> included when it came (at most max_target steps)."""
    src, lengths = batch_sources(texts, model.cfg.max_source)
    if isinstance(model, LuongSeq2Seq):
        hs, state = model.encode(src, lengths)
        mask = source_mask(lengths, src.shape[1])
    else:
        memory, allowed = model.encode(src, lengths)
    tokens = torch.full((len(texts), 1), BOS)                                          # (B, 1)
    for _ in range(model.cfg.max_target):
        if isinstance(model, LuongSeq2Seq):  # one GRU step from the previous state: h_t depends on y_<t only
            h, state = model.decoder(model.tgt_embed(tokens[:, -1:]), state)           # (B, 1, H)
            logits = model.attend(h, hs, mask).logits[:, -1]                           # (B, V)
        else:
            logits = model.decode(tokens, memory, allowed)[0][:, -1]                   # (B, V)
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        if (tokens == EOS).any(1).all():
            break
    return [cut_at_eos(row) for row in tokens[:, 1:].tolist()]


def cut_at_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def exact_match(model: nn.Module, pairs: list[tuple[str, str]], batch: int = 500) -> float:
    """The share of sources whose greedy output is exactly the target followed by </s>."""
    right = 0
    for i in range(0, len(pairs), batch):
        chunk = pairs[i: i + batch]
        outputs = greedy(model, [s for s, _ in chunk])
        right += sum(out == TARGET_VOCAB.encode(t) + [EOS] for out, (_, t) in zip(outputs, chunk))
    return right / len(pairs)


def majority_baseline(train: list[tuple[str, str]], heldout: list[tuple[str, str]]) -> float:
    """Exact match of always answering the training split's most frequent target: what a model that ignores its
    input gets at best."""
    counts: dict[str, int] = {}
    for _, t in train:
        counts[t] = counts.get(t, 0) + 1
    top = max(counts, key=counts.get)
    return sum(t == top for _, t in heldout) / len(heldout)


# ----------------------------------------------------------------------------------------------------
# training (at setup: attnlab_prepare.py), saving and loading

@dataclass
class TrainConfig:
    seed: int = 0
    n_train: int = 6000
    n_heldout: int = 1000
    steps: int = 200
    batch: int = 128
    lr: float = 1e-2
    transformer_steps: int = 300
    transformer_lr: float = 5e-3
    lanes: int = 2             # the budget: all five models in <= 60 s on 2 CPU cores, one process per core

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def for_model(self, name: str) -> tuple[int, float]:
        return (self.transformer_steps, self.transformer_lr) if name == "transformer" else (self.steps, self.lr)


class Adam:
    """Adam (Kingma & Ba, ICLR 2015) in a few lines: torch.optim's first optimizer imports torch._dynamo, seconds in
    each training process, longer than the training of a model here."""

    def __init__(self, params, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params = list(params)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.betas, self.eps, self.t = betas, eps, 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            m.mul_(b1).add_(p.grad, alpha=1 - b1)                     # first moment
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)         # second moment
            denom = (v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** self.t))      # bias-corrected step


def train_model(model: nn.Module, train: list[tuple[str, str]], tc: TrainConfig, seed: int) -> list[float]:
    """Adam with a linear warm-up (a tenth of the steps) then a cosine decay of the learning rate, cross-entropy
    under teacher forcing, gradients clipped to norm 1; the losses per step."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    steps, lr = tc.for_model("transformer" if isinstance(model, TinyTransformer) else "luong")
    opt = Adam(model.parameters())
    warmup = max(1, steps // 10)
    model.train()
    losses = []
    for step in range(steps):
        chunk = rng.sample(train, tc.batch)
        src, lengths = batch_sources([s for s, _ in chunk], model.cfg.max_source)
        tgt_in, tgt_out = batch_targets([t for _, t in chunk])
        logits = model(src, lengths, tgt_in)                                          # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        model.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps)))
        losses.append(loss.item())
    return [round(x, 5) for x in losses]


def model_names() -> tuple[str, ...]:
    return ("transformer", *SCORES)  # the longest training first: the lanes end together


def build(name: str, seed: int | None = None) -> nn.Module:
    """A fresh model by name; with a seed, its initial weights are that seed's."""
    if seed is not None:
        torch.manual_seed(seed)
    return TinyTransformer(TransformerConfig()) if name == "transformer" else LuongSeq2Seq(LuongConfig(score=name))


def train_one(name: str, out: Path, tc: TrainConfig) -> dict:
    """Train one model on one thread, write {name}.safetensors and {name}.json into `out`, return its record."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)  # tiny matrices: a second thread only adds its synchronisation; the lanes use the cores
    train, heldout = make_split(tc.seed, tc.n_train, tc.n_heldout)
    started, cpu = time.perf_counter(), time.process_time()
    seed = tc.seed * 100 + model_names().index(name)
    model = build(name, seed)
    losses = train_model(model, train, tc, seed)
    train_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    accuracy = exact_match(model.eval(), heldout)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(json.dumps(model.cfg.to_dict(), indent=1))
    return {"heldout_exact_match": accuracy, "train_s": round(train_s, 2), "train_cpu_s": round(cpu_s, 2),
            "steps": len(losses),
            "parameters": sum(p.numel() for p in model.parameters()), "final_loss": losses[-1],
            "loss_every_20": losses[::20]}


def train_all(out: Path, tc: TrainConfig | None = None, log=print) -> dict:
    """Train the four Luong models and the Transformer on one split, `tc.lanes` processes at a time (one thread
    each), into `out` (safetensors + config JSON each; results.json, written last, with the held-out exact match
    and the seconds each took) and return the results."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    tc = tc or TrainConfig()
    out.mkdir(parents=True, exist_ok=True)

    def run(name: str) -> dict:
        command = [sys.executable, "-m", "models.luong", name, str(out), json.dumps(tc.to_dict())]
        done = subprocess.run(command, capture_output=True, text=True, cwd=MODELS_ROOT)
        if done.returncode:
            raise RuntimeError(f"training the {name} model failed:\n{done.stderr[-2000:]}")
        record = json.loads(done.stdout.strip().splitlines()[-1])
        log(f"luong: {name}: held-out exact match {record['heldout_exact_match']:.3f}, trained in "
            f"{record['train_s']:.1f} s")
        return record

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=tc.lanes) as pool:
        records = dict(zip(model_names(), pool.map(run, model_names())))
    train, heldout = make_split(tc.seed, tc.n_train, tc.n_heldout)
    results = {"format_version": FORMAT_VERSION, "task": task_info(), "training": tc.to_dict(),
               "split": {"train": len(train), "heldout": len(heldout), "train_seed": tc.seed, "heldout_seed": tc.seed + 1},
               "majority_baseline": majority_baseline(train, heldout),
               "models": {name: records[name] for name in (*SCORES, "transformer")},
               "train_s_total": round(time.perf_counter() - started, 2), "threads_per_lane": 1}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def task_info() -> dict:
    return {"name": "date normalisation", "formats": list(FORMATS), "years": list(YEARS), "examples": list(EXAMPLES),
            "source_chars": SOURCE_CHARS, "target_chars": TARGET_CHARS, "tokens": "characters"}


def prepared(folder: Path) -> bool:
    """Whether `folder` holds a finished training of this FORMAT_VERSION (results.json is written last)."""
    try:
        results = json.loads((Path(folder) / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return results.get("format_version") == FORMAT_VERSION and all(
        (Path(folder) / f"{n}.safetensors").is_file() for n in model_names())


def _stamp(folder: str) -> int:
    """results.json's mtime: a new training (written last) is read again, not served from the cache."""
    return (Path(folder) / "results.json").stat().st_mtime_ns


def load_results(folder: str) -> dict:
    return _load_results(str(folder), _stamp(folder))


def load_model(folder: str, name: str) -> nn.Module:
    """One trained model in float64 (the page's numbers are recomputed to 1e-6 from its states)."""
    return _load_model(str(folder), name, _stamp(folder))


@lru_cache(maxsize=4)
def _load_results(folder: str, stamp: int) -> dict:
    return json.loads((Path(folder) / "results.json").read_text())


@lru_cache(maxsize=16)
def _load_model(folder: str, name: str, stamp: int) -> nn.Module:
    from safetensors.torch import load_file

    cfg_data = json.loads((Path(folder) / f"{name}.json").read_text())
    model = (TinyTransformer(TransformerConfig.from_dict(cfg_data)) if name == "transformer"
             else LuongSeq2Seq(LuongConfig.from_dict(cfg_data)))
    model.load_state_dict(load_file(str(Path(folder) / f"{name}.safetensors")))
    return model.double().eval()


if __name__ == "__main__":  # python -m models.luong NAME OUT_FOLDER TRAIN_CONFIG_JSON: one lane's model (train_all)
    import sys

    _name, _out, _tc = sys.argv[1], Path(sys.argv[2]), TrainConfig.from_dict(json.loads(sys.argv[3]))
    print(json.dumps(train_one(_name, _out, _tc)))
