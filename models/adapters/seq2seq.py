"""Encoder–decoder models (BART, Marian, mBART, T5, …): three kinds of attention (docs/science.md §9, seed 004 §2.3).

- "encoder": encoder self-attention over the M source tokens (bidirectional), M × M;
- "decoder": decoder self-attention over the N target tokens (causal), N × N;
- "cross":   decoder queries × encoder keys, N × M (Q from the target, K and V from the source).

The engine numbers every attention module in call order (encoder layers, then the decoder's self and cross
modules interleaved); this adapter keeps the kind and the layer within the kind of each, translates the
interventions' (kind, layers) scopes into those global numbers, and splits the recorded maps by kind.

Output "seq2seq": the decoded target with the probability of each target token given the source and the
target before it (teacher forcing), before and after the interventions. Without a target the model's own
greedy output (no interventions) is used.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from models.adapters.base import AttentionAdapter, AttentionResult, Encoded, ModelInfo, encode_now, pick_device
from models.effects import kl_divergence
from models.atlas import Atlas
from models.hooks import load_with_attnlab
from models.interventions import Intervention

KINDS = ("encoder", "decoder", "cross")
_CROSS = re.compile(r"encoder_attn|EncDecAttention|crossattention", re.IGNORECASE)
PROBE_SOURCE = "the cat sat on the mat because it was tired"


def kind_of(module_name: str) -> str:
    if _CROSS.search(module_name):
        return "cross"
    return "decoder" if "decoder" in module_name.split(".")[:2] or module_name.startswith("decoder") else "encoder"


@dataclasses.dataclass(frozen=True)
class KindScopedIntervention:
    """An intervention with the attention kind it targets (None = every kind); layers count within the kind."""

    intervention: Intervention
    kind: str | None = None


class Seq2SeqAdapter(AttentionAdapter):
    def __init__(self, model_id: str, source: str, max_tokens: int = 512, device: str = "auto",
                 max_new_tokens: int = 64, source_label: str | None = None, dtype: str = "float32"):
        config = AutoConfig.from_pretrained(source)
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        model = load_with_attnlab(AutoModelForSeq2SeqLM, source)
        start = config.decoder_start_token_id
        if start is None:
            raise ValueError(f"{source}: the config has no decoder_start_token_id")
        self.decoder_start = int(start)
        source_ids = self.tokenizer(PROBE_SOURCE, return_tensors="pt")["input_ids"]  # (1, M)
        probe_inputs = {"input_ids": source_ids, "decoder_input_ids": torch.cat([torch.tensor([[start]]), source_ids[:, :5]], 1)}
        report = self._attach_probed(model, pick_device(device), probe_inputs, lambda out: out.logits, dtype)
        # global engine layer → (kind, layer within the kind), in call order
        self.kind_layers: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for index, module in enumerate(report.modules):
            self.kind_layers[kind_of(report.names[id(module)])].append(index)
        missing = [kind for kind in KINDS if not self.kind_layers[kind]]
        if missing:
            raise ValueError(f"{source}: found no {', '.join(missing)} attention modules")
        self.max_tokens = min(max_tokens, getattr(config, "max_position_embeddings", None) or max_tokens)
        self.max_new_tokens = max_new_tokens
        n_heads = _first(config, "encoder_attention_heads", "num_heads", "num_attention_heads")
        d_model = _first(config, "d_model", "hidden_size")
        head_dim = getattr(config, "d_kv", None) or d_model // n_heads
        native_beta = float(getattr(report.modules[0], "scaling", head_dim**-0.5))
        self.info = ModelInfo(
            id=model_id, kind="text", layers=len(self.kind_layers["encoder"]), heads=n_heads, head_dim=head_dim,
            native_beta=native_beta, output="seq2seq", source=source_label or Path(source).name,
            max_tokens=self.max_tokens, parity=report.parity, max_new_tokens=max_new_tokens,
            architecture=type(model).__name__, decoder_layers=len(self.kind_layers["decoder"]), dtype=dtype,
            dtype_parity=report.dtype_parity,
            decoder_heads=_first(config, "decoder_attention_heads", "num_heads", "num_attention_heads"),
        )

    def layers_of(self, kind: str) -> int:
        return len(self.kind_layers[kind])

    # ---- input -------------------------------------------------------------------------------------
    def encode_request(self, request: Any, cached=encode_now) -> Encoded:
        """The source `text` and the `target` (None: the model's own greedy output, generated once per source)."""
        return cached(("seq2seq", request.text, request.target), lambda: self.encode(request.text, request.target))

    def untruncated_tokens(self, request: Any) -> int:
        return len(self.tokenizer(request.text, verbose=False)["input_ids"])  # the source's

    @torch.inference_mode()
    def encode(self, text: str, target: str | None = None) -> Encoded:
        source = self.tokenizer(text, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        truncated = len(self.tokenizer(text)["input_ids"]) > self.max_tokens
        if target is None:  # the model's own greedy output, without interventions
            generated = self.model.generate(
                input_ids=source["input_ids"].to(self.device), attention_mask=source["attention_mask"].to(self.device),
                max_new_tokens=self.max_new_tokens, do_sample=False, num_beams=1,
            )[0].tolist()
            labels = generated[1:] if generated[0] == self.decoder_start else generated
        else:
            labels = self.tokenizer(text_target=target, truncation=True, max_length=self.max_tokens)["input_ids"]
        labels = labels[: self.max_tokens] or [self.tokenizer.eos_token_id or 0]
        decoder_inputs = [self.decoder_start] + labels[:-1]  # teacher forcing: position t predicts labels[t]
        return Encoded(
            key=("seq2seq", text, target, self.max_tokens),
            tokens=self.tokenizer.convert_ids_to_tokens(source["input_ids"][0].tolist()),
            inputs={"input_ids": source["input_ids"], "attention_mask": source["attention_mask"],
                    "decoder_input_ids": torch.tensor([decoder_inputs])},
            truncated=truncated,
            extra={"target_tokens": self.tokenizer.convert_ids_to_tokens(decoder_inputs),
                   "labels": labels, "label_tokens": self.tokenizer.convert_ids_to_tokens(labels)},
        )

    def engine_interventions(self, scoped: list[KindScopedIntervention]) -> tuple[Intervention, ...]:
        """Translate (kind, layers within the kind) scopes into the engine's global layer numbers."""
        result = []
        for item in scoped:
            iv = item.intervention
            kinds = KINDS if item.kind is None else (item.kind,)
            layers = tuple(
                self.kind_layers[kind][l] for kind in kinds
                for l in (range(self.layers_of(kind)) if iv.layers is None else iv.layers) if l < self.layers_of(kind)
            )
            result.append(dataclasses.replace(iv, layers=layers))
        return tuple(result)

    # ---- forward -----------------------------------------------------------------------------------
    def new_scope(self, interventions: tuple[Intervention, ...], record_scores: bool,
                  n_tokens: int = 0, encoded: Encoded | None = None):
        """Long when the source or the target is over full_map_tokens: every kind then runs blockwise (its cross
        attention is N × M, so a long source makes it long too) and the run keeps an atlas (docs/science.md §10)."""
        if encoded is not None:
            n_tokens = max(n_tokens, len(encoded.tokens), len(encoded.extra.get("target_tokens", ())))
        return super().new_scope(interventions, record_scores, n_tokens, encoded)

    def run(self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False) -> AttentionResult:
        outputs, scope = self._forward(encoded.inputs, interventions, record_scores, encoded)
        logits = outputs.logits[0].double().cpu()  # (N, V)
        log_probs = torch.log_softmax(logits, dim=-1)
        labels = torch.tensor(encoded.extra["labels"])
        output = {"label_log_probs": log_probs.gather(1, labels[:, None])[:, 0], "probs": log_probs.exp().float()}
        if scope.atlas is not None:  # a long input: no P of any kind; the atlas stays on the device it ran on
            atlas = Atlas(scope.atlas.records, scope.atlas.summaries, scope.atlas.config)
            entropy = {kind: torch.stack([atlas.summaries[g].entropy for g in self.kind_layers[kind]]).double().cpu().tolist()
                       for kind in KINDS}  # (L_kind, H_kind): kinds may differ in heads
            # (L_dec + 1, N, D) in float16, as for other long runs: only the effects' hidden cosine reads it
            hidden = torch.stack([h[0].half() for h in outputs.decoder_hidden_states]).cpu()
            return AttentionResult(
                tokens=encoded.tokens, attention=None, hidden_states=hidden, output=output,
                warnings=atlas.dead_rows_warnings(), derived={"entropy": entropy}, atlas=atlas,
            )
        by_kind = {kind: scope.stacked_attention(self.kind_layers[kind]).float().cpu() for kind in KINDS}  # (L, H, ·, ·)
        entropy = {
            kind: scope.layer_entropy(self.kind_layers[kind]).tolist() for kind in KINDS
        }
        hidden = torch.stack([h[0] for h in outputs.decoder_hidden_states]).float().cpu()  # (L_dec + 1, N, D)
        return AttentionResult(
            tokens=encoded.tokens, attention=by_kind["encoder"], hidden_states=hidden, output=output,
            warnings=list(scope.warnings), derived={"entropy": entropy}, by_kind=by_kind,
            atlas=Atlas(dict(scope.records), {}, self.atlas_config) if len(scope.records) == len(self.layer_of) else None,
        )

    def kind_overview(self, atlas: Atlas, kind: str, layers: list[int], heads: list[int]) -> dict[str, Any]:
        """A long run's overview of one kind: block edges of its queries and keys, and (l, h, nR, nC) means of P."""
        first = self.kind_layers[kind][0]
        return {"edges": atlas.row_edges(first), "col_edges": atlas.col_edges(first),
                "maps": atlas.overview([self.kind_layers[kind][l] for l in layers], heads)}

    def kind_received(self, atlas: Atlas, kind: str, layers: list[int], heads: list[int]) -> torch.Tensor:
        """received[j] of one kind's layers × heads: (l, h, T_k), each summing to 1 over the keys."""
        return atlas.received([self.kind_layers[kind][l] for l in layers], heads)

    # ---- output and its change ---------------------------------------------------------------------
    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any]:
        assert encoded is not None
        return {
            "kind": "seq2seq", "target_tokens": encoded.extra["label_tokens"],
            "probs": result.output["label_log_probs"].exp().tolist(),
            "text": self.tokenizer.decode(encoded.extra["labels"], skip_special_tokens=True),
        }

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        p, q = before.output["probs"], after.output["probs"]  # (N, V)
        return {
            "kind": "seq2seq",
            "probs_before": before.output["label_log_probs"].exp().tolist(),
            "probs_after": after.output["label_log_probs"].exp().tolist(),
            "kl": [kl_divergence(p[t], q[t]) for t in range(p.shape[0])],
        }


def _first(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError(f"config has none of {names}")
