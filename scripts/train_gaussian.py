"""Train the Gaussian-attention encoder (models/gaussian.py) and record its centers after every epoch.

    .venv/bin/python scripts/train_gaussian.py            # the committed run (Fashion-MNIST, defaults below)
    .venv/bin/python scripts/train_gaussian.py --dataset cifar10 --cifar-dir ~/cifar-10-batches-py --cordonnier

Writes to --out: history.json (epoch 0 = the initial centers, then one entry per epoch with centers,
widths, test accuracy and train loss), model.safetensors (final weights) and config.json.
Seeded: the same command gives the same run (single thread; data order from a seeded generator).
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from models.datasets import load_fashion_mnist  # noqa: E402
from models.gaussian import GaussianConfig, GaussianEncoder, param_count  # noqa: E402


def load_cifar10(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR-10 python-pickle batches (data_batch_1..5, test_batch) -> uint8 (N, 3, 32, 32), labels."""
    def read(name: str):
        with open(folder / name, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        return np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"])
    parts = [read(f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = read("test_batch")
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), x_test, y_test)


@torch.no_grad()
def evaluate(model: GaussianEncoder, x: torch.Tensor, y: torch.Tensor, batch: int = 250) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch].float() / 255.0)          # (b, classes)
        correct += int((logits.argmax(-1) == y[i:i + batch]).sum())
    return correct / len(x)


def snapshot(model: GaussianEncoder, epoch: int, accuracy: float, train_loss: float | None,
             seconds: float) -> dict:
    return {"epoch": epoch, "accuracy": accuracy, "train_loss": train_loss,
            "elapsed_s": round(seconds, 1), "layers": model.centers_and_alphas()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["fashion-mnist", "cifar10"], default="fashion-mnist")
    p.add_argument("--cifar-dir", type=Path, help="folder with CIFAR-10 python batches (data_batch_1.., test_batch)")
    p.add_argument("--cordonnier", action="store_true", help="6 layers, 9 heads, hidden 400 (Cordonnier et al.)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--hidden", type=int, help="override the hidden width")
    p.add_argument("--ffn-hidden", type=int, help="override the feed-forward width")
    p.add_argument("--gelu", choices=["exact", "tanh"], default="exact")
    p.add_argument("--position-embedding", action=argparse.BooleanOptionalAction, default=True,
                   help="add a learned absolute embedding per token (the heads stay content-free)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--center-lr-mult", type=float, default=1.0, help="learning-rate multiplier of centers/widths")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--no-flip", action="store_true", help="no random horizontal flips")
    p.add_argument("--train-subset", type=int, default=30000,
                   help="use only the first N training images (0 = all 60,000); 30,000 kept a 10-epoch run "
                        "within ~35 minutes on a shared core")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU is shared)")
    p.add_argument("--out", type=Path, default=Path("models/trained/gaussian-fashion"))
    p.add_argument("--model-id", default="gaussian-fashion")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (its config, final weights and history) for --epochs more epochs, "
                        "with a new warm-up + cosine schedule from --lr; the history keeps counting epochs")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_order = torch.Generator().manual_seed(args.seed)

    if args.dataset == "fashion-mnist":
        x_train, y_train = load_fashion_mnist("train")
        x_test, y_test = load_fashion_mnist("test")
        x_train, x_test = x_train[:, None], x_test[:, None]  # (N, 1, 28, 28)
        cfg_kwargs = dict(image_size=28, in_channels=1)
    else:
        if args.cifar_dir is None:
            p.error("--dataset cifar10 needs --cifar-dir")
        x_train, y_train, x_test, y_test = load_cifar10(args.cifar_dir)
        cfg_kwargs = dict(image_size=32, in_channels=3, pixel_mean=0.4734, pixel_std=0.2516)
    for name, value in (("n_layers", args.layers), ("hidden", args.hidden), ("ffn_hidden", args.ffn_hidden)):
        if value is not None:
            cfg_kwargs[name] = value
    cfg_kwargs["gelu"] = args.gelu
    cfg_kwargs["position_embedding"] = args.position_embedding
    cfg = GaussianConfig.cordonnier(**cfg_kwargs) if args.cordonnier else GaussianConfig(**cfg_kwargs)

    if args.train_subset:
        x_train, y_train = x_train[:args.train_subset], y_train[:args.train_subset]
    x_train_t = torch.from_numpy(np.array(x_train))                        # (N, C, S, S) uint8
    y_train_t = torch.from_numpy(np.asarray(y_train, dtype=np.int64))     # (N,)
    x_test_t = torch.from_numpy(np.array(x_test))
    y_test_t = torch.from_numpy(np.asarray(y_test, dtype=np.int64))

    previous = None
    if args.resume:
        from safetensors.torch import load_file

        cfg = GaussianConfig.from_dict(json.loads((args.out / "config.json").read_text()))
        previous = json.loads((args.out / "history.json").read_text())
    model = GaussianEncoder(cfg)
    if previous is not None:
        model.load_state_dict(load_file(str(args.out / "model.safetensors")))
    print(f"config {cfg.to_dict()}\nparameters {param_count(model):,}  train {len(x_train_t)}  test {len(x_test_t)}",
          flush=True)

    position_params = [p_ for n, p_ in model.named_parameters() if n.endswith(("centers", "alpha_raw"))]
    other_params = [p_ for n, p_ in model.named_parameters() if not n.endswith(("centers", "alpha_raw"))]
    optimizer = torch.optim.AdamW([
        {"params": other_params, "weight_decay": args.weight_decay},
        {"params": position_params, "weight_decay": 0.0, "lr": args.lr * args.center_lr_mult},
    ], lr=args.lr)
    steps_per_epoch = (len(x_train_t) + args.batch_size - 1) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    warmup = min(args.warmup, total_steps // 10)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    def set_lr(step: int) -> None:  # linear warm-up, then cosine to 0
        scale = step / max(1, warmup) if step < warmup else 0.5 * (1 + np.cos(np.pi * (step - warmup) / max(1, total_steps - warmup)))
        for g, base in zip(optimizer.param_groups, base_lrs):
            g["lr"] = base * scale

    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    first_epoch = 1
    if previous is not None:  # continue the same run: same history, epochs keep counting, a new data order
        history = previous
        first_epoch = history["epochs"][-1]["epoch"] + 1
        data_order.manual_seed(args.seed + first_epoch)
        history.setdefault("continued", []).append(
            {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "cifar_dir"}
            | {"from_epoch": first_epoch, "previous_wall_time_s": history.get("wall_time_s")})
        start -= history.get("wall_time_s") or 0.0
    else:
        history = {"model": args.model_id, "dataset": args.dataset, "config": cfg.to_dict(),
                   "parameters": param_count(model),
                   "training": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "cifar_dir"},
                   "epochs": [snapshot(model, 0, evaluate(model, x_test_t, y_test_t), None, 0.0)]}
        print(f"epoch 0 test accuracy {history['epochs'][0]['accuracy']:.4f}", flush=True)

    step = 0
    for epoch in range(first_epoch, first_epoch + args.epochs):
        model.train()
        order = torch.randperm(len(x_train_t), generator=data_order)
        flips = torch.rand(len(x_train_t), generator=data_order) < (0.0 if args.no_flip else 0.5)
        loss_sum, seen = 0.0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch}/{first_epoch + args.epochs - 1}", mininterval=10, file=sys.stdout)
        for i in bar:
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            images = x_train_t[idx].float() / 255.0                                  # (b, C, S, S)
            images = torch.where(flips[idx][:, None, None, None], images.flip(-1), images)
            labels = y_train_t[idx]                                                  # (b,)
            set_lr(step)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
            if i % 50 == 0:
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}")
        accuracy = evaluate(model, x_test_t, y_test_t)
        history["epochs"].append(snapshot(model, epoch, accuracy, loss_sum / seen, time.time() - start))
        print(f"epoch {epoch} train loss {loss_sum / seen:.4f} test accuracy {accuracy:.4f} "
              f"elapsed {time.time() - start:.0f}s", flush=True)
        # write after every epoch so an interrupted run still leaves a consistent history + weights
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "model.safetensors"))
        (args.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        history["wall_time_s"] = round(time.time() - start, 1)
        (args.out / "history.json").write_text(json.dumps(history, indent=1))

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    history["wall_time_s"] = round(time.time() - start, 1)
    (args.out / "history.json").write_text(json.dumps(history, indent=1))
    print(f"done in {history['wall_time_s']:.0f}s, final test accuracy {history['epochs'][-1]['accuracy']:.4f}")


if __name__ == "__main__":
    main()
