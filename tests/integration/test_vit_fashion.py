"""The committed vit-fashion classifier: accuracy on a held-out slice of the Fashion-MNIST test split,
through the same preprocessing and adapter the server uses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "trained" / "vit-fashion"
SLICE = slice(8000, 10000)  # 2000 test images (never used for training: the script trains on the train split)


def test_folder_is_a_standard_small_checkpoint():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(MODEL)
    assert config.model_type == "vit" and config.architectures == ["ViTForImageClassification"]
    assert config.id2label[7] == "Sneaker" and config.num_labels == 10
    total = sum(p.stat().st_size for p in MODEL.iterdir())
    assert total < 5 * 1024 * 1024


def test_accuracy_on_held_out_slice():
    from transformers import ViTForImageClassification

    from models.datasets import load_fashion_mnist
    from models.images import PreprocessSpec

    images, labels = load_fashion_mnist("test")
    images, labels = images[SLICE], labels[SLICE]
    model = ViTForImageClassification.from_pretrained(MODEL).eval()
    spec = PreprocessSpec.from_model_folder(MODEL, 28, 1)
    pixels = (torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1) - spec.mean[0]) / spec.std[0]  # (N, 1, 28, 28)
    with torch.inference_mode():
        predicted = torch.cat([model(pixel_values=pixels[i : i + 500]).logits.argmax(-1) for i in range(0, len(pixels), 500)])
    accuracy = float((predicted.numpy() == labels).mean())
    print(f"vit-fashion accuracy on test[8000:10000]: {accuracy:.4f}")
    assert accuracy >= 0.86


def test_adapter_path_predicts_a_sneaker():
    """Upload-style path: PNG decode → preprocess (grayscale, 28 px) → adapter → top-5 labels."""
    from PIL import Image

    from models.adapters.vit import VitAdapter
    from models.images import decode_image

    adapter = VitAdapter("vit-fashion", str(MODEL), device="cpu")
    assert adapter.info.output == "classes" and adapter.channels == 1 and adapter.native_size == 28
    decoded = decode_image((ROOT / "static" / "samples" / "fashion-sneaker.png").read_bytes())
    encoded = adapter.encode(decoded.image, "sample")
    result = adapter.run(encoded)
    predictions = adapter.predictions(result)
    assert predictions[0]["label"] == "Sneaker"
    side = 28 // adapter.patch_size
    assert len(encoded.tokens) == 1 + side * side and encoded.extra["grid"] == (side, side)
    assert encoded.tokens[0] == "CLS" and encoded.tokens[-1] == f"p({side - 1},{side - 1})"
