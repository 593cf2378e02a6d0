"""ViT-family image adapter: ViT, DeiT, DINOv2 (with or without registers), any HF folder or id.

Tokens, in the model's order: "CLS", then "dist" (DeiT's distillation token) or "reg0", "reg1", …
(DINOv2 registers), then the patches row-major, labelled "p(row,col)" from 0.

Output kinds:
- "classes": a *ForImageClassification checkpoint — top-5 predictions; the effect of an intervention
  is the class distribution before/after and KL(before ‖ after).
- "embedding": a backbone (e.g. dinov2-small) — the effect is the cosine of the final CLS embedding
  (after the last LayerNorm) before/after.

Resolution: the model runs at its native size (from preprocessor_config.json, else the config) or at
any multiple of the patch size asked for (e.g. 448 px for DINOv2 → 32×32 patches); position embeddings
are then interpolated (bicubic) by transformers (`interpolate_pos_encoding`; DINOv2 always interpolates).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

from models.adapters.base import AttentionAdapter, AttentionResult, Encoded, ModelInfo, pick_device
from models.effects import cosine, kl_divergence
from models.atlas import AtlasConfig
from models.hooks import load_with_attnlab, run_scope
from models.images import PreprocessSpec, crop_box, preprocess
from models.interventions import Intervention
from models.summaries import patch_centres

TOP_K = 5
SUPPORTED_MODEL_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "clip_vision_model", "siglip_vision_model")
MAX_IMAGE_SIZE = 1036  # 74 × 14 px: a DINOv2 ViT-S at this size has 5477 tokens; beyond that is impractical


def _preprocessor_config(source: str) -> dict[str, Any]:
    path = Path(source) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _native_size(config, preprocessor: dict[str, Any]) -> int:
    """The square size the model is meant to see: the processor's crop (DINOv2: 224), else its
    resize target, else the config's image_size."""
    for key in ("crop_size", "size"):
        size = preprocessor.get(key)
        if isinstance(size, dict) and "height" in size:
            return int(size["height"])
        if isinstance(size, dict) and "shortest_edge" in size and key == "size" and "crop_size" not in preprocessor:
            return int(size["shortest_edge"])
        if isinstance(size, int):
            return size
    image_size = config.image_size
    return int(image_size[0] if isinstance(image_size, (list, tuple)) else image_size)


class VitAdapter(AttentionAdapter):
    def __init__(self, model_id: str, source: str, device: str = "auto", dtype: str = "float32"):
        config = AutoConfig.from_pretrained(source)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {config.model_type!r} is not a ViT-family model {SUPPORTED_MODEL_TYPES}")
        architectures = config.architectures or []
        is_classifier = any("ForImageClassification" in a for a in architectures)
        model_cls = AutoModelForImageClassification if is_classifier else AutoModel
        model = load_with_attnlab(model_cls, source)
        size = int(config.image_size[0] if isinstance(config.image_size, (list, tuple)) else config.image_size)
        probe_inputs = {"pixel_values": torch.randn(1, int(config.num_channels), size, size, generator=torch.Generator().manual_seed(0))}
        report = self._attach_probed(
            model, pick_device(device), probe_inputs, lambda out: out.logits if is_classifier else out.last_hidden_state,
            dtype,
        )
        if len(report.modules) != config.num_hidden_layers:
            raise ValueError(f"found {len(report.modules)} attention modules for {config.num_hidden_layers} layers "
                             f"in {type(model).__name__}")

        patch = config.patch_size
        self.patch_size = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        self.channels = int(config.num_channels)
        self.model_type = config.model_type
        self.config_image_size = int(config.image_size[0] if isinstance(config.image_size, (list, tuple)) else config.image_size)
        preprocessor = _preprocessor_config(source)
        self.native_size = _native_size(config, preprocessor)
        self.preprocess_spec = PreprocessSpec.from_model_folder(source, self.native_size, self.channels)
        self.prefix_labels = self._prefix_labels(config)
        self.labels = (
            [config.id2label[i] for i in range(config.num_labels)] if is_classifier else None
        )
        head_dim = config.hidden_size // config.num_attention_heads
        self.info = ModelInfo(
            id=model_id, kind="image", layers=config.num_hidden_layers, heads=config.num_attention_heads,
            head_dim=head_dim, native_beta=head_dim**-0.5, output="classes" if is_classifier else "embedding",
            source=str(source), image_size=self.native_size, patch_size=self.patch_size, parity=report.parity,
            architecture=type(model).__name__, dtype=dtype, dtype_parity=report.dtype_parity,
        )

    def _prefix_labels(self, config) -> list[str]:
        labels = ["CLS"]
        embeddings = getattr(getattr(self.model, self.model.base_model_prefix, self.model), "embeddings", None)
        if embeddings is not None and getattr(embeddings, "distillation_token", None) is not None:
            labels.append("dist")
        labels += [f"reg{i}" for i in range(int(getattr(config, "num_register_tokens", 0) or 0))]
        return labels

    # ---- input -------------------------------------------------------------------------------------
    def check_image_size(self, image_size: int | None) -> int:
        """The size a request asks for, or the native one; ValueError with the reason when unusable."""
        if image_size is None:
            return self.native_size
        if image_size % self.patch_size or not (self.patch_size <= image_size <= MAX_IMAGE_SIZE):
            raise ValueError(
                f"image_size must be a multiple of the patch size {self.patch_size} between "
                f"{self.patch_size} and {MAX_IMAGE_SIZE}; got {image_size}"
            )
        return image_size

    def encode(self, image: Image.Image, image_id: str, image_size: int | None = None) -> Encoded:
        """An RGB image (any size) → pixel_values (1, C, S, S) and token labels."""
        size = self.check_image_size(image_size)
        spec = PreprocessSpec(size, self.preprocess_spec.mean, self.preprocess_spec.std, self.channels)
        pixel_values = preprocess(image, spec)  # (1, C, S, S)
        rows = cols = size // self.patch_size
        tokens = self.prefix_labels + [f"p({r},{c})" for r in range(rows) for c in range(cols)]
        return Encoded(
            key=("image", image_id, size), tokens=tokens, inputs={"pixel_values": pixel_values},
            extra={"grid": (rows, cols), "prefix_tokens": len(self.prefix_labels), "image_size": size,
                   "crop_box": crop_box(image.width, image.height)},
        )

    # ---- forward -----------------------------------------------------------------------------------
    def summary_macs(self, n_tokens: int) -> float:
        """Multiply-adds of what a request computes besides its forwards (app/costs.py): over full_map_tokens the
        rollout rebuilds every row of every layer from q̂/k̂ (Atlas.cls_rollout): L·H·T²·d for q̂ k̂ᵀ, counted 1.5×
        for its softmax (dinov2-small at 896 px, 2-core CPU: the rollout took 0.47 of the run's time, 0.31 of its
        multiply-adds). Short inputs take the rollout from the kept maps: no product of that size."""
        if n_tokens <= self.full_map_tokens:
            return 0.0
        return 1.5 * self.info.layers * self.info.heads * n_tokens**2 * self.info.head_dim

    def atlas_config_for(self, encoded: Encoded) -> AtlasConfig:
        """Patch centres in pixels for the mean attention distance (CLS and registers have none)."""
        prefix = encoded.extra["prefix_tokens"]
        centres = patch_centres(encoded.extra["grid"], self.info.patch_size)  # (N, 2)
        positions = torch.cat([torch.zeros(prefix, 2, dtype=centres.dtype), centres]).float()  # (T, 2)
        return dataclasses.replace(self.atlas_config, positions=positions, distance_from=prefix)

    @torch.inference_mode()
    def _forward(self, inputs: dict[str, torch.Tensor], interventions: tuple[Intervention, ...], record_scores: bool,
                 encoded: Encoded | None = None):
        n_tokens = len(encoded.tokens) if encoded is not None else 0
        scope = self.new_scope(interventions, record_scores, n_tokens, encoded)
        pixel_values = inputs["pixel_values"].to(self.device, self.dtype)  # (1, C, S, S)
        kwargs: dict[str, Any] = {}
        if self.model_type in ("vit", "deit") and pixel_values.shape[-1] != self.config_image_size:
            kwargs["interpolate_pos_encoding"] = True  # DINOv2 interpolates on its own
        with run_scope(scope):
            outputs = self.model(pixel_values=pixel_values, output_hidden_states=True, return_dict=True, **kwargs)
        if scope.layers_recorded != self.info.layers:
            raise RuntimeError(f"recorded {scope.layers_recorded} attention layers, expected {self.info.layers}")
        return outputs, scope

    @torch.inference_mode()
    def _final_cls(self, outputs) -> torch.Tensor:
        """CLS state after the final LayerNorm (what DINOv2's embedding is). (D,)"""
        last = getattr(outputs, "last_hidden_state", None)
        if last is not None:
            return last[0, 0]
        base = getattr(self.model, self.model.base_model_prefix)
        return base.layernorm(outputs.hidden_states[-1])[0, 0]

    def run(self, encoded: Encoded, interventions: tuple[Intervention, ...] = (), record_scores: bool = False) -> AttentionResult:
        outputs, scope = self._forward(encoded.inputs, interventions, record_scores, encoded)
        output = {"cls": self._final_cls(outputs)}  # (D,)
        if self.info.output == "classes":
            output["logits"] = outputs.logits[0]  # (num_labels,)
        return self._result(encoded, outputs, scope, outputs.hidden_states, output)

    # ---- output and its change ---------------------------------------------------------------------
    def probabilities(self, result: AttentionResult) -> torch.Tensor:
        return torch.softmax(result.output["logits"].double(), dim=-1)  # (num_labels,)

    def predictions(self, result: AttentionResult, k: int = TOP_K) -> list[dict[str, Any]] | None:
        if self.info.output != "classes":
            return None
        probs = self.probabilities(result)
        top = torch.topk(probs, min(k, probs.numel()))
        return [{"label": self.labels[int(i)], "prob": float(p)} for p, i in zip(top.values, top.indices)]

    def output_summary(self, result: AttentionResult, encoded: Encoded | None = None) -> dict[str, Any] | None:
        if self.info.output == "classes":
            return {"kind": "classes", "predictions": self.predictions(result)}
        return None

    def output_effect(self, before: AttentionResult, after: AttentionResult, encoded: Encoded) -> dict[str, Any]:
        cls_cosine = cosine(after.output["cls"], before.output["cls"])
        if self.info.output != "classes":
            return {"kind": "embedding", "cls_cosine": cls_cosine}
        p, q = self.probabilities(before), self.probabilities(after)
        shown = torch.topk(p, min(TOP_K, p.numel())).indices.tolist()
        shown += [i for i in torch.topk(q, min(TOP_K, q.numel())).indices.tolist() if i not in shown]
        return {
            "kind": "classes",
            "before": self.predictions(before),
            "after": self.predictions(after),
            # the union of both top-5s with both probabilities, for side-by-side bars
            "classes": [{"label": self.labels[i], "before": float(p[i]), "after": float(q[i])} for i in shown],
            "kl": kl_divergence(p, q),
            "top1_changed": int(p.argmax()) != int(q.argmax()),
            "cls_cosine": cls_cosine,
        }
