"""Whisper (speech → text), an encoder–decoder whose cross-attention looks over time (docs/science.md §speech).

- The encoder reads an 80-bin log-mel spectrogram of a 30 s window (3,000 frames of 10 ms; shorter clips are padded
  with silence, as Whisper was trained); two convolutions halve it to 1,500 encoder positions of 20 ms.
- The decoder writes text tokens after the prompt <|startoftranscript|><|notimestamps|> (tiny.en is English-only:
  no language or task token); a multilingual model (whisper-base) gets <|startoftranscript|><|lang|><|task|>
  <|notimestamps|>, the language detected from the clip when none is asked for, the task "transcribe" or "translate"
  (into English). Its cross-attention rows are N × 1,500: a text token's look over time.

Kinds and layers as in models/adapters/seq2seq.py ("encoder", "decoder", "cross"; layers count within the kind;
KindScopedIntervention). Whisper's attention scales its queries by 1/√d *before* the attention function (which it
calls with scaling 1.0); the engine sees q/√d, so a requested β is passed on as β·√d and a query perturbation's σ as
σ/√d: the shown β keeps the meaning of docs/science.md §2 (β₀ = 1/√d on the raw q·k).

Runs:
- `encode`: the log-mel features and the greedy transcript without interventions (the teacher-forcing target);
- `run`: the encoder (its maps pooled into an overview, never kept whole: 1,500² per head), then the decoder
  teacher-forced on the target, with the interventions; keeps cross (N × 1,500) and decoder (N × N) maps and each
  target token's probability;
- `transcribe`: greedy decoding with the interventions active at every step (KV cache);
- `word_times`: word start/end from the alignment heads (median filter + dynamic time warping over the normalised
  cross-attention, as OpenAI's whisper/timing.py does it; the heads are tiny.en's from OpenAI's published table).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import EncoderDecoderCache, DynamicCache, WhisperFeatureExtractor, WhisperForConditionalGeneration

from models.adapters.base import AttentionAdapter, AttentionResult, Encoded, ModelInfo, pick_device
from models.adapters.seq2seq import KINDS, KindScopedIntervention, Seq2SeqAdapter, kind_of
from models.effects import kl_divergence
from models.hooks import RunScope, load_with_attnlab, run_scope
from models.atlas import Atlas
from models.interventions import Intervention
from models.adapters.whisper_timing import (  # noqa: F401  (word timing's names, also imported from here)
    MEDIAN_WIDTH, POSITION_S, RATE, alignment_matrix, alignment_ranking, dtw, find_pauses, position_levels,
    refine_word_times, spearman, split_units, split_words, word_times,
)
from models.ops import OPS

FRAME_S = 0.01  # one log-mel frame
WINDOW_S = 30.0
OVERVIEW_BLOCKS = 250  # the encoder self-attention overview: at most this many blocks a side


@dataclasses.dataclass
class AudioModelInfo(ModelInfo):
    """ModelInfo plus the speech fields of GET /api/models (`layers`/`heads` are the decoder's)."""

    encoder_layers: int | None = None
    frame_s: float | None = None
    max_audio_s: float | None = None
    alignment_heads: list | None = None
    multilingual: bool = False
    tasks: list | None = None  # ["transcribe"] or ["transcribe", "translate"]
    languages: list | None = None  # language codes a multilingual model accepts ("en", "de", …); None: English only


def probe_waveform(seconds: float = 4.0) -> np.ndarray:
    """A fixed chirp with noise: the load-time probe's input (no file needed)."""
    t = np.arange(int(seconds * RATE)) / RATE
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 60 * t) * t) * (np.sin(2 * np.pi * 1.5 * t) > 0)
    return (chirp + 0.02 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)


class WhisperAdapter(AttentionAdapter):
    def __init__(self, model_id: str, source: str, device: str = "auto", dtype: str = "float32",
                 max_new_tokens: int = 224, max_audio_s: float = WINDOW_S, source_label: str | None = None):
        from tokenizers import Tokenizer

        folder = Path(source)
        if not (folder / "model.safetensors").is_file():
            command = "attnlab prepare" if model_id == "whisper-tiny-en" else f"make {model_id}` or `attnlab prepare --model {model_id}"
            raise ValueError(f"{model_id} is not prepared on this server (run `{command}`)")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.extractor = WhisperFeatureExtractor.from_pretrained(folder)
        ct2_config = json.loads((folder / "ctranslate2_config.json").read_text())
        self.suppress = sorted(set(ct2_config.get("suppress_ids", [])))  # never generated (Whisper's suppress_tokens)
        self.suppress_begin = sorted(set(ct2_config.get("suppress_ids_begin", [])))  # not as the first token
        self.alignment_heads = [tuple(pair) for pair in ct2_config.get("alignment_heads", [])]  # (decoder layer, head)
        model = load_with_attnlab(WhisperForConditionalGeneration, str(folder), dtype=torch.float32)
        config = model.config
        from models.whisper_front import whisper_tokens

        self.tokens = whisper_tokens(folder / "tokenizer.json", config.vocab_size, ct2_config.get("lang_ids"))
        self.eot = self.tokens.eot
        self.multilingual = self.tokens.multilingual
        self.prompt = self.tokens.prompt()  # the probe's (and English transcription's)
        # never generated: the special tokens after <|endoftext|> (start, languages, tasks, timestamps)
        self.suppress = sorted(set(self.suppress) | set(range(self.eot + 1, config.vocab_size)))
        features = self._features(probe_waveform())
        probe_inputs = {"input_features": features, "decoder_input_ids": torch.tensor([self.prompt + [1770, 13]])}
        report = self._attach_probed(model, pick_device(device), probe_inputs, lambda out: out.logits, dtype)
        self.kind_layers: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for index, module in enumerate(report.modules):
            self.kind_layers[kind_of(report.names[id(module)])].append(index)
        # the encoder runs alone (its own scope): its layers are the first ones called, 0 … L_enc − 1
        if self.kind_layers["encoder"] != list(range(len(self.kind_layers["encoder"]))):
            raise ValueError(f"{source}: encoder attention is not called first")
        self.encoder_layer_of = {i: l for i, l in self.layer_of.items() if l in self.kind_layers["encoder"]}
        head_dim = config.d_model // config.decoder_attention_heads
        self.query_scale = float(report.modules[0].scaling)  # 1/√d, applied to q before the attention function
        self.max_new_tokens = max_new_tokens
        self.max_audio_s = max_audio_s
        self.info = AudioModelInfo(
            id=model_id, kind="audio", layers=config.decoder_layers, heads=config.decoder_attention_heads,
            head_dim=head_dim, native_beta=self.query_scale, output="transcript", source=source_label or folder.name,
            parity=report.parity, max_new_tokens=max_new_tokens, architecture=type(model).__name__,
            decoder_layers=config.decoder_layers, decoder_heads=config.decoder_attention_heads, dtype=dtype,
            dtype_parity=report.dtype_parity, encoder_layers=config.encoder_layers, frame_s=POSITION_S,
            max_audio_s=max_audio_s, max_tokens=config.max_target_positions,
            alignment_heads=[list(pair) for pair in self.alignment_heads], multilingual=self.multilingual,
            tasks=["transcribe", "translate"] if self.multilingual else ["transcribe"],
            languages=sorted(self.tokens.languages) if self.multilingual else None,
        )

    # ---- input -------------------------------------------------------------------------------------
    def _features(self, samples: np.ndarray) -> torch.Tensor:
        """(1, 80, 3000) log-mel of the clip padded with silence to 30 s (what the model sees)."""
        features = self.extractor(samples, sampling_rate=RATE, return_tensors="np").input_features
        return torch.from_numpy(features.astype(np.float32))

    def spectrogram(self, samples: np.ndarray) -> np.ndarray:
        """The log-mel the model sees, up to the clip's end: (80, F), F = frames of 10 ms."""
        frames = min(3000, math.ceil(samples.size / (FRAME_S * RATE)))
        return self._features(samples)[0, :, :frames].numpy()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.eot], skip_special_tokens=True).strip()

    @torch.inference_mode()
    def detect_language(self, features: torch.Tensor, encoder_hidden: torch.Tensor | None = None) -> tuple[str, float]:
        """A multilingual model's language for the clip, as Whisper finds it: one decoder step after
        <|startoftranscript|>, the most probable language token (softmax over the language tokens only).
        `encoder_hidden`: the encoder's output without interventions, when the caller has it."""
        if encoder_hidden is None:
            encoder_hidden, _ = self._encoder(features, (), False)
        with run_scope(self._scope((), False)):
            logits = self.model(encoder_outputs=(encoder_hidden,), return_dict=True,
                                decoder_input_ids=torch.tensor([[self.tokens.sot]], device=self.device)).logits[0, -1]
        codes = list(self.tokens.languages)
        probs = torch.softmax(logits[[self.tokens.languages[c] for c in codes]].double().cpu(), dim=-1)  # (n_languages,)
        best = int(probs.argmax())
        return codes[best], float(probs[best])

    def encode(self, samples: np.ndarray, key: tuple, target: str | None = None, language: str | None = None,
               task: str = "transcribe") -> Encoded:
        """The clip's features and the decoder input: the prompt then the target's tokens (the greedy transcript
        without interventions when `target` is None). Labels: the target tokens then <|endoftext|>. A multilingual
        model's prompt names `language` (detected from the clip when None) and `task`."""
        features = self._features(samples)
        language_prob = None
        plain = None  # the encoder's output without interventions: once for detection and transcription
        if (self.multilingual and language is None) or target is None:
            plain, _ = self._encoder(features, (), False)
        if self.multilingual and language is None:
            language, language_prob = self.detect_language(features, plain)
        prompt = self.tokens.prompt(language, task)
        if target is None:
            labels = self.transcribe(features, (), prompt=prompt, encoder_hidden=plain)[0]
        else:
            labels = self.tokenizer.encode(" " + target.strip(), add_special_tokens=False).ids[: self.max_new_tokens]
        labels = [t for t in labels if t != self.eot] + [self.eot]
        decoder_inputs = prompt + labels[:-1]  # teacher forcing: input position p predicts decoder_inputs[p + 1]
        return Encoded(
            key=key + (target, language, task), tokens=[self.token_text(t) for t in decoder_inputs],
            inputs={"input_features": features, "decoder_input_ids": torch.tensor([decoder_inputs])},
            extra={"labels": labels, "n_samples": int(samples.size), "text": self.decode(labels), "prompt": prompt,
                   "position_db": position_levels(samples),
                   "language": language if self.multilingual else "en", "language_prob": language_prob, "task": task},
        )

    # ---- interventions -----------------------------------------------------------------------------
    def layers_of(self, kind: str) -> int:
        return len(self.kind_layers[kind])

    def engine_interventions(self, scoped: list[KindScopedIntervention]) -> tuple[Intervention, ...]:
        """Seq2SeqAdapter's mapping of (kind, layers within the kind) onto the engine's layers, then β and query noise
        onto Whisper's pre-scaled queries: the engine's β multiplies q/√d (so β/β₀ passes on), and ε on q/√d is ε/√d
        (α q + ε, then scaled, is α (q/√d) + ε/√d)."""
        return tuple(OPS[iv.op].for_whisper(iv, self.query_scale)
                     for iv in Seq2SeqAdapter.engine_interventions(self, scoped))

    def _decoder_layers(self) -> set[int]:
        return set(self.kind_layers["decoder"])

    def _for_length(self, interventions: tuple[Intervention, ...], n_keys: int) -> tuple[Intervention, ...]:
        """Decoder self-attention masks name target positions; while decoding, keys past the current length are
        not there yet, so those entries wait for their step (cross/encoder keys are always all there)."""
        decoder = self._decoder_layers()
        now = (OPS[iv.op].for_keys_so_far(iv, n_keys, decoder) for iv in interventions)
        return tuple(iv for iv in now if iv is not None)

    # ---- forward -----------------------------------------------------------------------------------
    def _scope(self, interventions: tuple[Intervention, ...], record: bool, layer_of: dict[int, int] | None = None,
               query_offset: int = 0) -> RunScope:
        return RunScope(layer_of=layer_of or self.layer_of, interventions=interventions, record=record,
                        deferred_entropy=self.deferred_entropy, query_offset=query_offset)

    @torch.inference_mode()
    def _encoder(self, features: torch.Tensor, interventions: tuple[Intervention, ...], record: bool):
        encoder_ivs = tuple(iv for iv in interventions if iv.layers is None or set(iv.layers) & set(self.kind_layers["encoder"]))
        scope = self._scope(encoder_ivs, record, self.encoder_layer_of)
        # no per-layer entropy inside the forward (a third pass over 1,500² logits per head); the page does not
        # show it, and layer_entropy() can still form it from the recorded P
        scope.deferred_entropy = True
        with run_scope(scope):
            hidden = self.model.model.encoder(self.model_inputs({"x": features})["x"]).last_hidden_state  # (1, 1500, D)
        return hidden, scope

    def run(self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False) -> AttentionResult:
        with torch.inference_mode():
            encoder_hidden, encoder_scope = self._encoder(encoded.inputs["input_features"], interventions, True)
            n_positions = min(1500, math.ceil(encoded.extra["n_samples"] / (POSITION_S * RATE)))
            overview, block = encoder_overview(encoder_scope.stacked_attention(self.kind_layers["encoder"]), n_positions)
            warnings = list(encoder_scope.warnings)
            encoder_records = dict(encoder_scope.records)  # q̂/k̂ references: rebuild any encoder window later
            del encoder_scope  # the 1,500² maps go now
            ids = encoded.inputs["decoder_input_ids"]
            scope = self._scope(self._for_length(interventions, ids.shape[1]), True)
            with run_scope(scope):
                outputs = self.model(encoder_outputs=(encoder_hidden,), decoder_input_ids=ids.to(self.device),
                                     output_hidden_states=True, return_dict=True)
        by_kind = {kind: scope.stacked_attention(self.kind_layers[kind]).float().cpu() for kind in ("decoder", "cross")}
        entropy = {kind: scope.layer_entropy(self.kind_layers[kind]).tolist() for kind in ("decoder", "cross")}
        # row p predicts decoder input p + 1: the rows from the prompt's last token on predict the labels
        first = len(encoded.extra["prompt"]) - 1
        log_probs = torch.log_softmax(outputs.logits[0, first:].double().cpu(), dim=-1)  # (n_labels, V)
        labels = torch.tensor(encoded.extra["labels"])  # (n_labels,)
        hidden = torch.stack([h[0] for h in outputs.decoder_hidden_states]).float().cpu()  # (L_dec + 1, N, D)
        return AttentionResult(
            tokens=encoded.tokens, attention=by_kind["decoder"], hidden_states=hidden,
            output={"label_log_probs": log_probs.gather(1, labels[:, None])[:, 0], "log_probs": log_probs.float(),
                    "encoder_overview": overview},
            warnings=warnings + list(scope.warnings),
            derived={"entropy": entropy, "overview_block": block, "n_positions": n_positions}, by_kind=by_kind,
            # every layer's q̂/k̂ (and β, masks) as the run had them: POST /api/runs/{run_id}/window rebuilds any window
            # of any kind, the encoder's 1,500 × 1,500 included (docs/science.md §10)
            atlas=Atlas({**encoder_records, **scope.records}, {}, self.atlas_config)
            if len(encoder_records) + len(scope.records) == len(self.layer_of) else None,
        )

    # ---- greedy decoding with the interventions ----------------------------------------------------
    @torch.inference_mode()
    def transcribe(self, features: torch.Tensor, interventions: tuple[Intervention, ...],
                   max_new_tokens: int | None = None, on_token=None, prompt: list[int] | None = None,
                   encoder_hidden: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
        """Greedy tokens (without the prompt, ending with <|endoftext|> unless cut by max_new_tokens) and their
        probabilities, the interventions active at every step; the encoder runs once, the decoder with a KV cache.
        Whisper's suppressed tokens are never chosen (and blank/EOT not first), as `generate` does."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if encoder_hidden is None:  # (given: the caller's run of the encoder with these interventions)
            encoder_hidden, _ = self._encoder(features, interventions, False)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        ids = list(self.prompt if prompt is None else prompt)
        new_ids: list[int] = []
        probs: list[float] = []
        suppress = torch.tensor(self.suppress, dtype=torch.long)
        suppress_begin = torch.tensor(self.suppress_begin, dtype=torch.long)
        n_done = 0
        for step in range(limit):
            scope = self._scope(self._for_length(interventions, len(ids)), False, query_offset=n_done)
            with run_scope(scope):
                outputs = self.model(encoder_outputs=(encoder_hidden,), decoder_input_ids=torch.tensor([ids[n_done:]], device=self.device),
                                     past_key_values=cache, use_cache=True, return_dict=True)
            n_done = len(ids)
            logits = outputs.logits[0, -1].double().cpu()  # (V,)
            logits[suppress] = -math.inf
            if step == 0:
                logits[suppress_begin] = -math.inf
            p = torch.softmax(logits, dim=-1)
            token = int(p.argmax())
            new_ids.append(token)
            probs.append(float(p[token]))
            if on_token is not None:
                on_token(token, float(p[token]))
            if token == self.eot:
                break
            ids.append(token)
        return new_ids, probs

    # ---- outputs -----------------------------------------------------------------------------------
    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any]:
        assert encoded is not None
        labels = encoded.extra["labels"]
        probs = result.output["label_log_probs"].exp().tolist()
        return {"kind": "transcript", "text": encoded.extra["text"],
                "tokens": [{"token": self.token_text(t), "id": t, "prob": p} for t, p in zip(labels, probs)]}

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        p, q = before.output["log_probs"].double().exp(), after.output["log_probs"].double().exp()  # (N, V)
        kl = [kl_divergence(p[t], q[t]) for t in range(p.shape[0])]
        before_p = before.output["label_log_probs"].exp()
        after_p = after.output["label_log_probs"].exp()
        return {"prob_change": (after_p - before_p).tolist(), "probs_before": before_p.tolist(),
                "probs_after": after_p.tolist(), "kl": kl, "kl_mean": float(np.mean(kl)) if kl else 0.0}

    # ---- word times and alignment (models/adapters/whisper_timing.py) ------------------------------
    def word_times(self, result: AttentionResult, encoded: Encoded) -> list[dict[str, Any]]:
        """Words of the target with start/end in seconds, from the alignment heads (docs/science.md §11)."""
        return word_times(result, encoded, self.alignment_heads, self.token_text)

    def split_words(self, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
        return split_words(tokens, self.token_text)

    def alignment_ranking(self, result: AttentionResult, encoded: Encoded) -> list[dict[str, Any]]:
        """Every cross head ranked by how well its text rows follow the speech (whisper_timing.alignment_ranking)."""
        return alignment_ranking(result, encoded, self.alignment_heads)

def encoder_overview(maps: torch.Tensor, n_positions: int, blocks: int = OVERVIEW_BLOCKS) -> tuple[torch.Tensor, int]:
    """The encoder's self-attention over the clip's positions pooled to blocks (docs/science.md §10's overview):
    each block the mean of P over its cells. maps: (L, H, 1500, 1500) → ((L, H, B, B), block width in positions).
    Rows are the clip's positions; keys beyond the clip (the silence padding) are left out of the blocks."""
    block = max(1, math.ceil(n_positions / blocks))
    n = math.ceil(n_positions / block) * block
    clip = maps[:, :, :n_positions, :n_positions].float()  # (L, H, n_pos, n_pos)
    padded = torch.nn.functional.pad(clip, (0, n - n_positions, 0, n - n_positions))  # (L, H, n, n)
    L, H = padded.shape[:2]
    sums = padded.reshape(L, H, n // block, block, n // block, block).sum(dim=(3, 5))  # (L, H, B, B)
    widths = torch.full((n // block,), float(block))
    widths[-1] = n_positions - block * (n // block - 1)
    return (sums / (widths[:, None] * widths[None, :])).cpu(), block
