"""Turning tensors into response fields: compact JSON floats, or base64 float16 on request."""
from __future__ import annotations

import base64

import numpy as np
import torch

SIGNIFICANT_DIGITS = 8  # float32 carries ~7.2; 8 keeps every probability's relative precision


def round_significant(values: np.ndarray, digits: int = SIGNIFICANT_DIGITS) -> np.ndarray:
    """Round to `digits` significant digits so the JSON is short but tiny probabilities keep precision."""
    values = values.astype(np.float64)
    magnitude = np.floor(np.log10(np.abs(values), where=values != 0, out=np.zeros_like(values)))
    factor = 10.0 ** (digits - 1 - magnitude)
    return np.round(values * factor) / factor


def tensor_field(tensor: torch.Tensor, encoding: str = "json") -> object:
    """A nested list of floats, or for encoding 'f16' {"dtype", "shape", "data": base64 little-endian}."""
    array = tensor.detach().cpu().numpy()
    if encoding == "f16":
        return {
            "dtype": "float16",
            "shape": list(array.shape),
            "data": base64.b64encode(array.astype("<f2").tobytes()).decode("ascii"),
        }
    return round_significant(array).tolist()
