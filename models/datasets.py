"""Offline datasets read from Debian packages (no downloads at run time)."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian: dataset-fashion-mnist
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a numpy array of its stored dtype."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {zero:#x}, type {dtype_code:#x})")
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(split: str, root: Path = FASHION_MNIST_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 (N, 28, 28), labels uint8 (N,)) for split 'train' or 't10k'/'test'."""
    prefix = {"train": "train", "test": "t10k", "t10k": "t10k"}[split]
    images_path = root / f"{prefix}-images-idx3-ubyte.gz"
    if not images_path.exists():
        raise FileNotFoundError(
            f"{images_path} is missing: install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
        )
    images = read_idx(images_path)
    labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
    return images, labels
