"""The Luong models for tests: the ones `attnlab prepare` trained into weights/luong/ (make test prepares them), and a
folder of untrained ones in the same layout for tests that need no training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models import luong

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "weights" / luong.FOLDER


def trained_folder() -> Path:
    if not luong.prepared(TRAINED):
        pytest.fail(f"{TRAINED} holds no finished training: run `attnlab prepare --model luong` (make test does)")
    return TRAINED


def write_untrained(folder: Path, seed: int = 0) -> Path:
    """Random-weight models of every name and a results.json of the same shape (accuracies 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    models = {}
    for name in luong.model_names():
        model = luong.build(name)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / f"{name}.safetensors"))
        (folder / f"{name}.json").write_text(json.dumps(model.cfg.to_dict()))
        models[name] = {"heldout_exact_match": 0.0, "train_s": 0.0, "parameters": sum(p.numel() for p in model.parameters())}
    results = {"format_version": luong.FORMAT_VERSION, "task": luong.task_info(), "training": {"untrained": True},
               "split": {"train": 0, "heldout": 0}, "majority_baseline": 0.0, "models": models, "train_s_total": 0.0}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def scores_by_hand(model: luong.LuongSeq2Seq, h: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
    """score(h_t, h̄_s) (B, T, S) from each score's formula and the model's weight matrices."""
    kind, S = model.cfg.score, hs.shape[1]
    if kind == "dot":
        return torch.einsum("btd,bsd->bts", h, hs)
    W = model.score.W_a.weight
    if kind == "general":
        return torch.einsum("btd,de,bse->bts", h, W, hs)
    if kind == "location":
        return torch.einsum("btd,pd->btp", h, W)[:, :, :S]
    B, T, H = h.shape
    pairs = torch.cat([h[:, :, None, :].expand(B, T, S, H), hs[:, None, :, :].expand(B, T, S, H)], -1)  # (B, T, S, 2H)
    return torch.einsum("a,btsa->bts", model.score.v_a.weight[0], torch.tanh(torch.einsum("ak,btsk->btsa", W, pairs)))
