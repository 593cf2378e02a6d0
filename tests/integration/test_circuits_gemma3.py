"""Circuits through attention on the real gemma3-270m (18 layers × 4 query heads over 1 K/V head, q/k norms,
sandwich norms, local and global layers), on the README's capital pair: exact edge scores equal the independent
re-computation with hooks on plain transformers (tests/circuit_reference.py) within 1e-4 on the metric for q, k, v,
MLP and logits edges; patching every incoming edge of a head equals patch_heads; faithfulness ends at 0 and 1."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import circuits as C
from models.circuit_tasks import task_pairs
from models.head_ops import HeadRun
from models.patching import head_outputs, last_logits
from models.registry import build_registry
from tests.circuit_reference import reference_for_edge, ungrouped_model

WEIGHTS = Path(__file__).resolve().parents[2] / "weights"
pytestmark = [
    pytest.mark.skipif(not (WEIGHTS / "gemma3-270m" / "prepared.json").is_file(),
                       reason="gemma3-270m is not prepared here: run `make weights` (attnlab prepare)"),
    pytest.mark.slow,  # gemma3-270m loaded twice (the lab's and the plain reference), 1.1 GB float32 each
]


@pytest.fixture(scope="module")
def lm():
    return build_registry(weights_dir=WEIGHTS)["gemma3-270m"].load("cpu")


@pytest.fixture(scope="module")
def pair(lm):
    return task_pairs(lm, "capital", 1, 0)[0].pair  # The capital of France is → " Paris" against Italy's " Rome"


EDGES = ["input->a0.h1<q>", "input->a3.h2<k>", "m2->a9.h0<v>", "a5.h3->a11.h1<k>", "a7.h0->m7", "m0->m4",
         "a16.h2->logits", "m17->logits"]


def test_every_edge_is_named_and_exact_scores_equal_an_independent_recomputation(lm, pair):
    engine = C.engine_for(lm)
    graph = engine.graph
    assert (graph.layers, graph.heads) == (18, 4)
    assert graph.n_edges == sum(12 * (1 + 5 * l) + (5 + 5 * l) for l in range(18)) + 1 + 18 * 5
    mine = C.exact_scores(engine, [pair], [graph.parse_edge(e) for e in EDGES])
    reference = ungrouped_model(str(WEIGHTS / "gemma3-270m"))
    theirs = [reference_for_edge(reference, pair.clean, pair.corrupt, pair.answer, pair.wrong, e) for e in EDGES]
    assert sum(abs(t) > 1e-2 for t in theirs) >= 3
    for edge, a, b in zip(EDGES, mine.tolist(), theirs):
        assert abs(a - b) <= 1e-4, (edge, a, b)


def test_patch_heads_and_faithfulness_ends(lm, pair):
    engine = C.engine_for(lm)
    graph = engine.graph
    layer, head = 11, 1
    rows = [graph.receiver_rows(layer).start + c * graph.heads + head for c in range(3)]
    mine = C.patched_metric(engine, pair, [(r, s) for r in rows for s in range(int(graph.prefix()[r]))])
    corrupt_outputs, _ = head_outputs(lm, pair.corrupt)
    chosen = torch.zeros(1, graph.layers, graph.heads, dtype=torch.bool)
    chosen[0, layer, head] = True
    logits = last_logits(lm, pair.clean, (), HeadRun(batch_heads=chosen, batch_source=corrupt_outputs))[0]
    assert abs(mine - float(logits[pair.answer] - logits[pair.wrong])) <= 1e-4
    scores, cleans, corrupts = C.gradient_scores(engine, [pair], 1)
    m_clean = float(C.metric(cleans[0].logits[None], pair)[0])
    m_corrupt = float(C.metric(corrupts[0].logits[None], pair)[0])
    curve = C.faithfulness(engine, [pair], scores, [0.0, 1.0], corrupts, m_clean, m_corrupt)
    assert abs(curve[0]["value"]) <= 1e-4 and abs(curve[1]["value"] - 1) <= 1e-4
