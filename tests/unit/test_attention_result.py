"""AttentionResult is one plain dataclass (issue 54): its fields are declared in its body, nothing is patched onto the
class after it and nothing writes into its __dict__; the fields formed later (P's host view, the stacks of per-layer
parts, the warnings) go through its own methods, and the dataclass machinery (constructor, fields, replace) sees the
same fields the runs pass."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from models.adapters.base import AttentionResult

BASE = Path(__file__).resolve().parents[2] / "models" / "adapters" / "base.py"
FIELDS = ["tokens", "attention", "hidden_states", "output", "queries", "keys", "warnings", "derived", "by_kind",
          "atlas", "run_id", "model_id"]


def test_nothing_is_patched_onto_the_class_nor_written_into_its_dict():
    source = BASE.read_text(encoding="utf-8")
    assert "__dict__" not in source
    assert re.search(r"^AttentionResult\.\w+\s*=", source, re.M) is None


def test_its_fields_are_the_constructors_and_replace_keeps_the_parts():
    assert [f.name for f in dataclasses.fields(AttentionResult)] == FIELDS
    parts = [torch.randn(3, 2), torch.randn(3, 2)]
    result = AttentionResult(tokens=["a", "b", "c"], attention=torch.rand(1, 1, 3, 3), hidden_states=parts, output={})
    assert result.parts("hidden_states") is parts and result.warnings == [] and result.queries is None
    copy = dataclasses.replace(result, derived={"x": 1})
    assert copy.kept_attention is result.kept_attention and copy.derived == {"x": 1}
    stacked = result.hidden_states  # (L+1, T, D), stacked once and kept so
    assert torch.equal(stacked, torch.stack(parts)) and result.parts("hidden_states") is stacked
    result.warnings.append("kept")
    assert result.warnings == ["kept"] and AttentionResult(["a"], None, None, {}).warnings == []
