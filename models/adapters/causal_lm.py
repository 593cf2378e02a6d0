"""Decoder language models (GPT-2, Llama, Qwen2, Mistral, Gemma 2, SmolLM2, …): next-token predictions and
greedy continuations, with the interventions active at every step (docs/science.md §9).

Output "next_token": the distribution p(· | tokens ≤ i) at a chosen position i (the last by default), its
top-k, and with a comparison KL(before ‖ after), the change of the before-top token's probability and the
ranks of each side's top tokens on the other side.

Kept per run, on the run's device: the final hidden states (T × D) and the logits of the last position, as the
forward computed them (logits_to_keep=1). The last position's panel is the softmax of those logits; another
position's logits are formed on demand with the model's own head (T × V would be 100 MB at 512 tokens for a 49k
vocabulary; the probe at load checks that the head reproduces the model's logits). Softmax and top-k run on the
device; the panel is then read to the host once: the top-k (probabilities and ids, 2 × k numbers), with the rest of
a first view's response in its one copy (output_parts, app/pipeline/views.py short_response).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from models.adapters.base import (AttentionAdapter, AttentionResult, Encoded, ModelInfo, OutputParts, RequestFieldError,
                                  encode_now, pick_device)
from models.effects import kl_divergence
from models.hooks import RunScope, UnsupportedAttention, load_with_attnlab, run_scope
from models.gguf import read_prepared
from models.probe import layer_facts, window_probe_length
from models.interventions import Intervention
from models.atlas import AtlasRecorder
from models.step_rows import RowRequest, StepRows

TOP_K = 10
PROBE_TEXT = "The capital of France is Paris, and the capital of Italy is"


@dataclasses.dataclass
class Step:
    """One new token of a continuation."""

    token: str
    id: int
    prob: float
    # the row of the query that produced this token, for the asked layers and heads (models/step_rows.py): {"rows":
    # (l, h, T_k)} or with top_k {"indices", "values": (l, h, k), "lse": (l, h)}; None when none was asked
    attention: dict | None = None


class CausalLMAdapter(AttentionAdapter):
    def __init__(self, model_id: str, source: str, max_tokens: int = 512, device: str = "auto",
                 max_new_tokens: int = 64, source_label: str | None = None, dtype: str = "float32"):
        config = AutoConfig.from_pretrained(source)
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        model = load_with_attnlab(AutoModelForCausalLM, source, dtype=torch.float32)
        probe_inputs = dict(self.tokenizer(PROBE_TEXT, return_tensors="pt"))
        probe_inputs.pop("token_type_ids", None)
        report = self._attach_probed(model, pick_device(device), probe_inputs, lambda out: out.logits, dtype,
                                     long_inputs=self.window_probe_inputs(config))
        self._check_head_reproduces_logits(probe_inputs)
        facts = layer_facts(config)
        prepared = read_prepared(source)  # prepared weights (models/gguf.py): licence and what they are
        self.config = config
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        first = report.modules[0]
        native_beta = float(getattr(first, "scaling", head_dim**-0.5))
        self.max_tokens = min(max_tokens, getattr(config, "max_position_embeddings", max_tokens) or max_tokens)
        self.max_new_tokens = max_new_tokens
        self.info = ModelInfo(
            id=model_id, kind="text", layers=len(report.modules), heads=n_heads, head_dim=head_dim,
            native_beta=native_beta, output="next_token", source=source_label or Path(source).name,
            max_tokens=self.max_tokens, kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            parity=report.parity, chat=bool(getattr(self.tokenizer, "chat_template", None)),
            max_new_tokens=max_new_tokens, architecture=type(model).__name__, dtype=dtype,
            dtype_parity=report.dtype_parity, model_type=config.model_type, origin=prepared.get("source"), licence=prepared.get("licence"),
            upstream=prepared.get("upstream"), **facts,
        )
        self.eos_ids = self._eos_ids()

    def window_probe_inputs(self, config) -> dict[str, torch.Tensor] | None:
        """The probe's second input for a model with sliding-window or chunked layers: the probe text repeated past
        the window (models/probe.py window_probe_length); None for other models."""
        length = window_probe_length(config)
        if length is None:
            return None
        ids = self.tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"]  # (1, t)
        body = self.tokenizer(" " + PROBE_TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
        repeats = -(-max(0, length - ids.shape[1]) // max(1, body.shape[1]))
        ids = torch.cat([ids, body.repeat(1, repeats)], dim=1)[:, :length]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    # ---- load-time checks ----------------------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's head on final hidden states: (..., D) → (..., V), with Gemma 2's final soft-cap."""
        logits = self.model.get_output_embeddings()(hidden.to(self.device, self.dtype))
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def _check_head_reproduces_logits(self, inputs: dict[str, torch.Tensor]) -> None:
        outputs = self.model(**self.model_inputs(inputs), output_hidden_states=True)
        error = float((self._logits(outputs.hidden_states[-1]) - outputs.logits).abs().max())
        if not error <= 1e-4:
            raise UnsupportedAttention(
                f"the output head applied to the last hidden state differs from the logits by {error:.3g}"
            )

    def _eos_ids(self) -> set[int]:
        ids = set()
        for value in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---- input -------------------------------------------------------------------------------------
    def prompt_ids(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            if not self.info.chat:
                raise ValueError(f"model {self.info.id} has no chat template")
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def token_text(self, token_id: int) -> str:
        """A token as the text it adds (" Paris"), not its vocabulary spelling ("ĠParis")."""
        return self.tokenizer.decode([token_id])

    def encode(self, text: str, chat: bool = False) -> Encoded:
        ids = self.prompt_ids(text, chat)
        truncated = len(ids) > self.max_tokens
        ids = ids[: self.max_tokens]
        input_ids = torch.tensor([ids])  # (1, T)
        return Encoded(
            key=("lm", text, chat, self.max_tokens), tokens=[self.token_text(i) for i in ids],
            inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, truncated=truncated,
            extra={"position": len(ids) - 1},
        )

    def encode_ids(self, ids: list[int]) -> Encoded:
        """Token ids as this model's input (a finished continuation: prompt + generated ids), named by its ids."""
        input_ids = torch.tensor([ids])  # (1, T)
        return Encoded(key=("lm_ids", tuple(ids)), tokens=[self.token_text(i) for i in ids],
                       inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                       extra={"position": len(ids) - 1})

    def encode_request(self, request: Any, cached=encode_now) -> Encoded:
        """The prompt `text` (a user turn with `chat`), kept per prompt; then the query `position` whose next token is
        shown (a request without one, such as a continuation's: the last)."""
        def encode() -> Encoded:
            try:
                return self.encode(request.text, request.chat)
            except ValueError as exc:  # no chat template
                raise RequestFieldError("chat", str(exc)) from None

        encoded = cached(("lm", request.text, request.chat), encode)
        position = getattr(request, "position", None)
        if position is not None and position >= len(encoded.tokens):
            raise RequestFieldError("position", f"position {position} is past the last token ({len(encoded.tokens) - 1})")
        return self.at_position(encoded, position)

    def untruncated_tokens(self, request: Any) -> int:
        return len(self.prompt_ids(request.text, request.chat))

    @staticmethod
    def at_position(encoded: Encoded, position: int | None) -> Encoded:
        """The same input (same cache key) with the query position whose prediction is shown."""
        last = len(encoded.tokens) - 1
        return dataclasses.replace(encoded, extra={**encoded.extra, "position": last if position is None else position})

    # ---- forward -----------------------------------------------------------------------------------
    def run(self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False) -> AttentionResult:
        # the forward computes the logits of the last position only; other positions' come from the head on demand
        outputs, scope = self._forward({**encoded.inputs, "logits_to_keep": 1}, interventions, record_scores, encoded)
        hidden_states = outputs.hidden_states  # L+1 × (1, T, D); the last is the final norm's output
        output = {"final_hidden": hidden_states[-1][0], "last_logits": outputs.logits[0, -1]}  # (T, D), (V,)
        return self._result(encoded, outputs, scope, hidden_states, output, output_on_device=True)

    def position_logits(self, result: AttentionResult, position: int) -> torch.Tensor:
        """The model's logits after tokens ≤ position, on the run's device: (V,). The last position's are the forward's
        own; another position's, the head applied to that position's final hidden state."""
        if position == len(result.tokens) - 1 and "last_logits" in result.output:
            return result.output["last_logits"]
        with torch.inference_mode():
            return self._logits(result.output["final_hidden"][position])

    def device_distribution(self, result: AttentionResult, position: int) -> torch.Tensor:
        """p(· | tokens ≤ position), float64, on the run's device: (V,)"""
        with torch.inference_mode():
            return torch.softmax(self.position_logits(result, position).double(), dim=-1)

    def distribution(self, result: AttentionResult, position: int) -> torch.Tensor:
        """p(· | tokens ≤ position), float64, on the host: (V,)"""
        return self.device_distribution(result, position).cpu()

    def _top_parts(self, probs: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
        """The top k of a distribution on its device as one (2, k) float64 tensor: probabilities, then ids (exact in
        float64), so that they are read in one copy."""
        with torch.inference_mode():
            top = torch.topk(probs, min(k, probs.numel()))
            return torch.stack([top.values, top.indices.double()])  # (2, k)

    def _top_items(self, top: Any) -> list[dict[str, Any]]:
        """The (2, k) top-k of _top_parts, on the host, as the panel's items."""
        return [{"token": self.token_text(int(i)), "id": int(i), "prob": float(p)} for p, i in zip(top[0], top[1])]

    def output_parts(self, result: AttentionResult, encoded: Encoded | None = None) -> OutputParts:
        position = (encoded.extra["position"] if encoded is not None else len(result.tokens) - 1)
        top = self._top_parts(self.device_distribution(result, position))  # (2, k) on the run's device

        def build(host: dict[str, Any]) -> dict[str, Any]:
            return {"kind": "next_token", "position": position, "top": self._top_items(host["top"])}

        return OutputParts({"top": top}, build)

    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any]:
        parts = self.output_parts(result, encoded)
        return parts.build({name: t.cpu().numpy() for name, t in parts.tensors.items()})  # one read: the top-k

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        position = encoded.extra["position"]
        # both distributions in one read; KL, ranks and the top-k on the host as before
        p, q = torch.stack([self.device_distribution(before, position), self.device_distribution(after, position)]).cpu()
        top_before, top_after = self._top_items(self._top_parts(p)), self._top_items(self._top_parts(q))
        for item in top_before:
            item["rank_after"] = rank_of(q, item["id"])
        for item in top_after:
            item["rank_before"] = rank_of(p, item["id"])
        first = top_before[0]["id"]
        return {
            "kind": "next_token", "position": position, "kl": kl_divergence(p, q),
            "prob_change": float(q[first] - p[first]), "top_before": top_before, "top_after": top_after,
        }

    # ---- continuation --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _next_logits(self, ids: torch.Tensor, cache: DynamicCache | None, n_done: int,
                     interventions: tuple[Intervention, ...], rows: StepRows | None = None) -> torch.Tensor:
        """Logits after `ids` (1, T); with a cache only the tokens from position n_done on are fed. (V,)
        A forward over more than full_map_tokens new tokens (a long prompt) runs blockwise (models/atlas.py), so no
        T × T map is formed; `rows` receives the last query's row of the asked layers."""
        new = ids[:, n_done:] if cache is not None else ids
        long = new.shape[1] > self.full_map_tokens
        scope = RunScope(layer_of=self.layer_of, interventions=interventions, record=long, query_offset=n_done,
                         rows=rows, atlas=AtlasRecorder(self.atlas_config) if long else None)
        if cache is None:
            scope.query_offset = 0
        with run_scope(scope):
            outputs = self.model(
                input_ids=new.to(self.device), past_key_values=cache, use_cache=cache is not None, logits_to_keep=1,
                return_dict=True,
            )
        return outputs.logits[0, -1]

    def continuation(
        self, prompt: list[int], interventions: tuple[Intervention, ...], max_new_tokens: int, use_cache: bool = True,
        rows: RowRequest | None = None,
    ) -> Iterator[Step]:
        """Greedy decoding with the interventions active at every step: token positions keep their masks and
        their ε as the sequence grows (docs/science.md §9). Yields one Step per new token; stops at end of sequence.
        Each step is a separate forward, so a caller may stop between steps (a closed connection). With `rows`, each
        Step carries the attention row of the query that produced its token (models/step_rows.py)."""
        ids = torch.tensor([prompt])  # (1, T)
        cache = DynamicCache() if use_cache else None
        n_done = 0
        for _ in range(max_new_tokens):
            step_rows = StepRows(rows, self.info.layers, self.info.heads)
            logits = self._next_logits(ids, cache, n_done, interventions, step_rows)  # (V,)
            n_done = ids.shape[1]
            probs = torch.softmax(logits.double(), dim=-1)
            token = int(probs.argmax())
            yield Step(self.token_text(token), token, float(probs[token]), step_rows.result())
            if token in self.eos_ids:
                return
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def rank_of(probs: torch.Tensor, token_id: int) -> int:
    """0-based rank of a token in a distribution (how many tokens are more probable)."""
    return int((probs > probs[token_id]).sum())
