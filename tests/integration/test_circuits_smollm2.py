"""Circuits through attention on the real smollm2-135m (Llama, 30 layers × 9 query heads over 3 K/V heads), on an
IOI pair (docs/science.md "Circuits through attention"):

- exact edge scores equal an independent re-computation with plain forward hooks on transformers
  (tests/circuit_reference.py, the model rewritten with a K/V head per query head) within 1e-4 on the metric, for
  q, k, v, MLP and logits edges;
- patching every incoming edge of a head at once equals patch_heads from the corrupt run;
- faithfulness ends at 0 and 1; every edge is named (123,211 = the count formula);
- EAP against exact on the top 50 EAP edges: Spearman ρ reported (printed), not asserted to be 1.
"""
from __future__ import annotations

import pytest
import torch

from models import circuits as C
from models.circuit_tasks import user_pairs
from models.head_ops import HeadRun
from models.patching import head_outputs, last_logits
from tests.circuit_reference import reference_for_edge, ungrouped_model
from tests.integration.helpers import SMOLLM2, smollm2_adapter

PAIR = {"clean": "When Mary and John went to the store, John gave a drink to",
        "corrupt": "When Mary and John went to the store, Mary gave a drink to", "answer": " Mary", "wrong": " John"}


@pytest.fixture(scope="module")
def lm():
    return smollm2_adapter()


@pytest.fixture(scope="module")
def pair(lm):
    return user_pairs(lm, [PAIR], 128)[0].pair


@pytest.fixture(scope="module")
def engine(lm):
    return C.engine_for(lm)


@pytest.fixture(scope="module")
def eap(engine, pair):
    return C.gradient_scores(engine, [pair], 1)


def test_every_edge_is_named_by_the_count_formula(engine):
    graph = engine.graph
    assert (graph.layers, graph.heads) == (30, 9)
    formula = sum(27 * (1 + 10 * l) + (10 + 10 * l) for l in range(30)) + 301
    assert graph.n_edges == formula == 123_211
    names = graph.all_edge_names()
    assert len(set(names)) == formula and names[0] == "input->a0.h0<q>" and names[-1] == "m29->logits"


EDGES = ["input->a0.h4<q>", "a23.h3->a24.h4<q>", "m0->a23.h3<k>", "a14.h2->a23.h3<k>", "m0->a23.h3<v>",
         "a20.h0->m20", "input->m0", "a23.h3->logits", "m29->logits", "a29.h1->logits"]


def test_exact_scores_equal_an_independent_recomputation(engine, pair):
    reference = ungrouped_model(str(SMOLLM2))
    mine = C.exact_scores(engine, [pair], [engine.graph.parse_edge(e) for e in EDGES])
    theirs = [reference_for_edge(reference, pair.clean, pair.corrupt, pair.answer, pair.wrong, e) for e in EDGES]
    assert sum(abs(t) > 0.1 for t in theirs) >= 3  # several of these edges matter on this pair
    for edge, a, b in zip(EDGES, mine.tolist(), theirs):
        assert abs(a - b) <= 1e-4, (edge, a, b)


@pytest.mark.parametrize("layer,head", [(23, 3), (9, 5)])
def test_every_incoming_edge_of_a_head_at_once_is_patch_heads(lm, engine, pair, layer, head):
    graph = engine.graph
    rows = [graph.receiver_rows(layer).start + c * graph.heads + head for c in range(3)]
    mine = C.patched_metric(engine, pair, [(r, s) for r in rows for s in range(int(graph.prefix()[r]))])
    corrupt_outputs, _ = head_outputs(lm, pair.corrupt)
    chosen = torch.zeros(1, graph.layers, graph.heads, dtype=torch.bool)
    chosen[0, layer, head] = True
    logits = last_logits(lm, pair.clean, (), HeadRun(batch_heads=chosen, batch_source=corrupt_outputs))[0]
    theirs = float(logits[pair.answer] - logits[pair.wrong])
    assert abs(mine - theirs) <= 1e-4, (mine, theirs)


def test_faithfulness_ends_and_eap_against_exact(engine, pair, eap):
    scores, cleans, corrupts = eap
    m_clean = float(C.metric(cleans[0].logits[None], pair)[0])
    m_corrupt = float(C.metric(corrupts[0].logits[None], pair)[0])
    assert m_clean > 0 > m_corrupt  # the model prefers the indirect object, and the swap flips it
    curve = C.faithfulness(engine, [pair], scores, [0.0, 0.05, 1.0], corrupts, m_clean, m_corrupt)
    assert abs(curve[0]["value"]) <= 1e-4 and abs(curve[-1]["value"] - 1) <= 1e-4, curve
    graph = engine.graph
    flat = graph.flat(scores)
    top = flat.abs().topk(50).indices
    edges = [tuple(e) for e in graph.valid().nonzero()[top].tolist()]
    exact = C.exact_scores(engine, [pair], edges, corrupts)
    rho = C.spearman(flat[top], exact)
    print(f"\nIOI pair, smollm2-135m: f(5 %) = {curve[1]['value']:.3f} with {curve[1]['n_edges']} edges; "
          f"Spearman ρ(EAP, exact) over the top 50 EAP edges = {rho:.3f}")
    assert rho is not None and -1 <= rho <= 1
