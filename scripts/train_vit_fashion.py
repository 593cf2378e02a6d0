"""Train the small `vit-fashion` classifier on Fashion-MNIST (Debian's dataset-fashion-mnist).

The result is a standard transformers `ViTForImageClassification` saved with `save_pretrained`
(safetensors + config with id2label) into models/trained/vit-fashion/, small enough to commit.

    .venv/bin/python scripts/train_vit_fashion.py              # the committed model
    .venv/bin/python scripts/train_vit_fashion.py --epochs 1 --limit 5000 --out /tmp/pilot   # a timed pilot

Seeded; single-threaded by default because the CPU is shared (--threads to change it).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import ViTConfig, ViTForImageClassification

ROOT = Path(__file__).resolve().parents[1]
from models.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist  # noqa: E402

# Fashion-MNIST statistics over the training split (pixels scaled to [0, 1]); stored in
# preprocessor_config.json so that inference normalises exactly like training did.
FASHION_MEAN = 0.2860
FASHION_STD = 0.3530


def build_config(args: argparse.Namespace) -> ViTConfig:
    return ViTConfig(
        image_size=28,
        patch_size=args.patch,
        num_channels=1,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.hidden * args.mlp_ratio,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        qkv_bias=True,
        num_labels=len(FASHION_MNIST_CLASSES),
        id2label={i: name for i, name in enumerate(FASHION_MNIST_CLASSES)},
        label2id={name: i for i, name in enumerate(FASHION_MNIST_CLASSES)},
    )


def to_tensor(images_uint8: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) → normalised float (N, 1, 28, 28)."""
    x = torch.from_numpy(images_uint8.astype(np.float32) / 255.0).unsqueeze(1)  # (N, 1, 28, 28)
    return (x - FASHION_MEAN) / FASHION_STD


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Light augmentation: random horizontal flip and a random shift of up to 2 px (zero-padded
    in raw pixel space, i.e. padded with the normalised value of black)."""
    b = x.shape[0]
    flip = torch.rand(b, generator=generator) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    background = -FASHION_MEAN / FASHION_STD
    padded = F.pad(x, (2, 2, 2, 2), value=background)  # (B, 1, 32, 32)
    dy, dx = torch.randint(0, 5, (2,), generator=generator).tolist()  # one shift per batch: cheap
    return padded[:, :, dy : dy + 28, dx : dx + 28].contiguous()


@torch.inference_mode()
def evaluate(model: ViTForImageClassification, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        logits = model(pixel_values=x[i : i + batch]).logits  # (B, 10)
        correct += (logits.argmax(-1) == y[i : i + batch]).sum().item()
    return correct / len(x)


def save(model: ViTForImageClassification, args: argparse.Namespace, history: list[dict], n_params: int,
         seconds: float) -> None:
    """save_pretrained (safetensors, config with id2label) + the preprocessing and training record."""
    final_accuracy = history[-1]["test_accuracy"]
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    # The image processor config: grayscale 28×28, no resize surprises, training normalisation.
    (args.out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True, "size": {"height": 28, "width": 28},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [FASHION_MEAN], "image_std": [FASHION_STD],
        "do_convert_rgb": False,
    }, indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps({
        "dataset": "Fashion-MNIST (Debian dataset-fashion-mnist), train 60k / test 10k",
        "seed": args.seed, "epochs": args.epochs, "batch": args.batch, "lr": args.lr,
        "weight_decay": args.weight_decay, "augment": not args.no_augment, "threads": args.threads,
        "label_smoothing": args.label_smoothing, "warmup_steps": args.warmup_steps,
        "patch": args.patch, "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "mlp_ratio": args.mlp_ratio,
        "parameters": n_params, "test_accuracy": final_accuracy,
        "init_from": str(args.init_from) if args.init_from else None,
        # the record of the run(s) this one continued, so the whole recipe stays in the model folder
        "previous": _previous_record(args.init_from),
        "train_seconds": round(seconds, 1), "history": history,
        "note": "inputs: white-on-black garments as in Fashion-MNIST (no inversion)",
    }, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "models/trained/vit-fashion")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared: default 1)")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N training images (pilot runs)")
    parser.add_argument("--no-augment", action="store_true")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--save-every-epoch", action="store_true", help="save after every epoch, not only at the end")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start from a saved vit-fashion folder (fine-tuning; the config comes from there)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    train_images, train_labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    if args.limit:
        train_images, train_labels = train_images[: args.limit], train_labels[: args.limit]
    x_train, y_train = to_tensor(train_images), torch.from_numpy(train_labels.astype(np.int64))
    x_test, y_test = to_tensor(test_images), torch.from_numpy(test_labels.astype(np.int64))

    if args.init_from:
        model = ViTForImageClassification.from_pretrained(args.init_from)
        config = model.config
        args.patch, args.hidden, args.layers, args.heads = config.patch_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        args.mlp_ratio = config.intermediate_size // config.hidden_size
    else:
        config = build_config(args)
        model = ViTForImageClassification(config, add_pooling_layer=False) if _accepts_pooling() else ViTForImageClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vit-fashion: {n_params:,} parameters, {(28 // args.patch) ** 2} patches + CLS, "
          f"{args.layers} layers × {args.heads} heads, hidden {args.hidden}; {len(x_train)} train images; "
          f"{args.threads} thread(s)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "position" not in n and "cls_token" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "position" not in n and "cls_token" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.999),
    )
    steps_per_epoch = math.ceil(len(x_train) / args.batch)
    total_steps = steps_per_epoch * args.epochs

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine to zero
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    start = time.time()
    history = []
    step = 0
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stdout,
                   mininterval=5.0, ascii=True)
        running = 0.0
        for i in bar:
            idx = order[i * args.batch : (i + 1) * args.batch]
            xb, yb = x_train[idx], y_train[idx]
            if not args.no_augment:
                xb = augment(xb, generator)
            logits = model(pixel_values=xb).logits  # (B, 10)
            loss = F.cross_entropy(logits, yb, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            running = 0.98 * running + 0.02 * loss.item() if i else loss.item()
            bar.set_postfix(loss=f"{running:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)
        accuracy = evaluate(model, x_test, y_test)
        elapsed = time.time() - start
        history.append({"epoch": epoch + 1, "test_accuracy": accuracy, "elapsed_s": round(elapsed, 1)})
        print(f"epoch {epoch + 1}: test accuracy {accuracy:.4f}  ({elapsed / 60:.1f} min)", flush=True)
        if args.save_every_epoch and epoch + 1 < args.epochs:  # a usable model even if the run is cut short
            save(model, args, history, n_params, elapsed)

    final_accuracy = history[-1]["test_accuracy"]
    save(model, args, history, n_params, time.time() - start)
    print(f"saved to {args.out}: test accuracy {final_accuracy:.4f}, {(time.time() - start) / 60:.1f} min", flush=True)
    return 0


def _previous_record(init_from: Path | None) -> dict | None:
    path = init_from / "training.json" if init_from else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def _accepts_pooling() -> bool:
    import inspect
    return "add_pooling_layer" in inspect.signature(ViTForImageClassification.__init__).parameters


if __name__ == "__main__":
    raise SystemExit(main())
