"""The notebook's view of a circuit (POST /api/text/circuit, docs/api.md "Circuits through attention"): the server's
numbers as they came, with the circuit at a budget computed from them the way the server's faithfulness curve keeps
edges (top by |score|, then only edges on a path from input to logits)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from attnlab._types import LabLike

_NAME = re.compile(r"^(.+)->([^<]+)(?:<[qkv]>)?$")


class CircuitResult:
    """`.edges` {name: score}, `.in_graph` {name: bool} at the request's `budget`, `.faithfulness` [{budget, n_edges,
    value}], `.cpr`, `.cmd`, `.metric` {clean, corrupt}, `.nodes`; `.circuit(budget)` the edges kept at a budget,
    `.edge(name)` why one edge matters (POST /api/text/circuit/edge on the first pair), `.to_json(path)`."""

    def __init__(self, data: dict[str, Any], request: dict[str, Any], lab: "LabLike"):
        self.data, self.request, self._lab = data, request, lab
        self.edges: dict[str, float] = {name: item["score"] for name, item in data["edges"].items()}
        self.in_graph: dict[str, bool] = {name: bool(item.get("in_graph")) for name, item in data["edges"].items()}
        self.faithfulness: list[dict[str, Any]] = data["faithfulness"]
        self.cpr, self.cmd = data.get("cpr"), data.get("cmd")
        self.metric: dict[str, float] = data["metric"]
        self.nodes: list[str] = data["nodes"]
        self.n_edges: int = data["n_edges"]
        self.method: str = data["method"]

    def __repr__(self) -> str:
        return (f"CircuitResult({self.data['model']}, {self.method}, {self.data['pairs']} pairs, "
                f"{len(self.edges):,} of {self.n_edges:,} edges listed, CPR={self.cpr})")

    def circuit(self, budget: float) -> dict[str, float]:
        """The edges of the circuit at `budget` (a fraction of all edges): the top round(budget × n_edges) by |score|
        among the listed ones, pruned to edges on a path from input to logits. {name: score}."""
        if not 0 <= budget <= 1:
            raise ValueError(f"budget {budget} is not a fraction in [0, 1]")
        count = round(budget * self.n_edges)
        if count > len(self.edges):
            raise ValueError(f"a budget of {budget} needs the top {count:,} edges; this result lists "
                             f"{len(self.edges):,} (ask with top=None or a larger top)")
        ranked = sorted(self.edges, key=lambda name: -abs(self.edges[name]))[:count]
        return {name: self.edges[name] for name in _on_paths(ranked)}

    def edge(self, name: str, pair: int = 0, query: int | None = None) -> dict[str, Any]:
        """Why one edge matters on one of the pairs (the server's answer as it came)."""
        prompt = self.data["prompts"][pair]
        body = {"model": self.data["model"], "edge": name, "query": query,
                "pair": {k: prompt[k] for k in ("clean", "corrupt", "answer", "wrong")}}
        return self._lab._json("POST", "/api/text/circuit/edge", body)

    def to_json(self, path: str | Path) -> Path:
        """Edge name → {score, in_graph}, with the curve and the request: what the page exports."""
        path = Path(path)
        keep = {k: v for k, v in self.data.items() if k not in ("nodes",)}
        path.write_text(json.dumps({**keep, "request": self.request}, indent=1))
        return path


def _reached(start: str, steps: list[tuple[str, str]]) -> set[str]:
    """The nodes reached from `start` along the (from, to) steps, start included."""
    reached, changed = {start}, True
    while changed:
        changed = False
        for here, there in steps:
            if here in reached and there not in reached:
                reached.add(there)
                changed = True
    return reached


def _on_paths(names: list[str]) -> list[str]:
    """The edges (by name) that lie on a path from `input` to `logits` through the given edges."""
    split = []
    for name in names:
        match = _NAME.match(name)
        split.append((name, match.group(1), match.group(2)))
    reached = _reached("input", [(sender, receiver) for _, sender, receiver in split])
    reaches = _reached("logits", [(receiver, sender) for _, sender, receiver in split])
    return [name for name, sender, receiver in split if sender in reached and receiver in reaches]
