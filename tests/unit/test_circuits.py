"""Circuits through attention (models/circuits.py, docs/science.md "Circuits through attention") on tiny random
grouped-query decoders (Llama and Qwen2, 4 query heads over 2 K/V heads, Qwen2 with q/k/v biases moved off zero;
Gemma 3, 4 query heads over 1 K/V head, with q/k norms, sandwich norms and a sliding window shorter than the prompt):

- each exact edge score equals an independent re-computation with plain forward hooks on transformers
  (tests/circuit_reference.py) within 1e-4 on the metric, for q, k, v, MLP and logits edges;
- patching every incoming edge of a head at once equals patch_heads of that head from the corrupt run;
- faithfulness is 0 with nothing kept and 1 with everything; every edge is named, once, by the count formula;
- EAP-IG with one step is EAP; the pruned circuit's edges all lie on a path from input to logits.
"""
from __future__ import annotations

import pytest
import torch

from models import circuits as C
from models.head_ops import HeadRun
from models.patching import Pair, head_outputs, last_logits
from models.registry import build_registry
from tests.circuit_reference import reference_for_edge, ungrouped_model
from tests.tiny_models import build_text_model

CLEAN, CORRUPT = "the cat sat on the mat because it was tired", "the dog ran on the rug because it was small"


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def tiny(request, tmp_path_factory):
    family = request.param
    folder = build_text_model(family, tmp_path_factory.mktemp(family))
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases (Qwen2's q/k/v) and norm gains off their init, so they count
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    spec = build_registry(weights_dir="/nonexistent", extra={f"tiny-{family}": str(folder)})[f"tiny-{family}"]
    adapter = spec.load("cpu")
    tokens = adapter.tokenizer
    clean, corrupt = (torch.tensor([tokens.convert_tokens_to_ids(t.split())]) for t in (CLEAN, CORRUPT))
    assert clean.shape == corrupt.shape and int(clean.min()) > 4  # every word is in the vocabulary
    pair = Pair(clean, corrupt, tokens.convert_tokens_to_ids("mat"), tokens.convert_tokens_to_ids("rug"))
    return family, adapter, pair, ungrouped_model(str(folder))


EDGES = ["input->a0.h1<q>", "input->a0.h3<k>", "input->a0.h2<v>", "a0.h0->a1.h1<q>", "a0.h1->a1.h2<k>",
         "a0.h3->a1.h3<k>", "m0->a1.h0<v>", "a0.h2->m0", "input->m1", "a1.h3->m1", "m0->logits", "a1.h2->logits",
         "input->logits", "m1->logits"]


def test_exact_scores_equal_an_independent_recomputation(tiny):
    _, adapter, pair, reference = tiny
    engine = C.engine_for(adapter)
    graph = engine.graph
    mine = C.exact_scores(engine, [pair], [graph.parse_edge(e) for e in EDGES])
    theirs = [reference_for_edge(reference, pair.clean, pair.corrupt, pair.answer, pair.wrong, e) for e in EDGES]
    assert any(abs(t) > 1e-3 for t in theirs)  # the edges do move the metric
    for edge, a, b in zip(EDGES, mine.tolist(), theirs):
        assert abs(a - b) <= 1e-4, (edge, a, b)


@pytest.mark.parametrize("layer,head", [(0, 1), (1, 2)])
def test_every_incoming_edge_of_a_head_at_once_is_patch_heads(tiny, layer, head):
    _, adapter, pair, _ = tiny
    engine = C.engine_for(adapter)
    graph = engine.graph
    rows = [graph.receiver_rows(layer).start + c * graph.heads + head for c in range(3)]
    edges = [(r, s) for r in rows for s in range(int(graph.prefix()[r]))]
    mine = C.patched_metric(engine, pair, edges)
    corrupt_outputs, _ = head_outputs(adapter, pair.corrupt)
    chosen = torch.zeros(1, graph.layers, graph.heads, dtype=torch.bool)
    chosen[0, layer, head] = True
    logits = last_logits(adapter, pair.clean, (), HeadRun(batch_heads=chosen, batch_source=corrupt_outputs))[0]
    theirs = float(logits[pair.answer] - logits[pair.wrong])
    clean = float(C.metric(engine.forward(pair.clean)[0], pair)[0])
    assert abs(theirs - clean) > 1e-4  # the patch changes something
    assert abs(mine - theirs) <= 1e-4, (mine, theirs)


def test_every_edge_is_named_once_by_the_count_formula(tiny):
    _, adapter, _, _ = tiny
    graph = C.engine_for(adapter).graph
    L, H = graph.layers, graph.heads
    formula = sum(3 * H * (1 + l * (H + 1)) + (1 + l * (H + 1) + H) for l in range(L)) + 1 + L * (H + 1)
    names = graph.all_edge_names()
    assert len(names) == len(set(names)) == graph.n_edges == formula
    assert {"input->a0.h0<q>", "a0.h3->a1.h1<k>", "a0.h0->m0", "m1->logits", "input->logits"} <= set(names)
    for k, name in enumerate(names):
        r, s = graph.parse_edge(name)
        assert graph.edge_names([(r, s)]) == [name]
    for bad in ("a1.h0->a0.h1<q>", "a0.h0->a0.h1<q>", "m0->a0.h0<k>", "a0.h9->m0", "input->m0<q>", "m0->a1.h0",
                "x->y"):
        with pytest.raises(ValueError):
            graph.parse_edge(bad)


def test_faithfulness_is_0_with_nothing_and_1_with_everything(tiny):
    _, adapter, pair, _ = tiny
    engine = C.engine_for(adapter)
    scores, cleans, corrupts = C.gradient_scores(engine, [pair], 1)
    m_clean = float(C.metric(cleans[0].logits[None], pair)[0])
    m_corrupt = float(C.metric(corrupts[0].logits[None], pair)[0])
    curve = C.faithfulness(engine, [pair], scores, [0.0, 0.3, 1.0], corrupts, m_clean, m_corrupt)
    assert curve[0]["n_edges"] == 0 and curve[-1]["n_edges"] == engine.graph.n_edges
    assert abs(curve[0]["value"]) <= 1e-4 and abs(curve[-1]["value"] - 1) <= 1e-4, curve
    cpr, cmd = C.areas(curve)
    assert 0 <= cmd <= 2 and cpr is not None


def test_eap_ig_with_one_step_is_eap_and_more_steps_differ(tiny):
    _, adapter, pair, _ = tiny
    engine = C.engine_for(adapter)
    eap, _, _ = C.gradient_scores(engine, [pair], 1)
    again, _, _ = C.gradient_scores(engine, [pair], 1)
    ig, _, _ = C.gradient_scores(engine, [pair], 4)
    assert torch.equal(eap, again)
    assert not torch.allclose(eap, ig)
    assert bool((eap[~engine.graph.valid()] == 0).all())


def test_eap_matches_a_finite_difference_of_the_exact_score(tiny):
    """EAP is the first-order term: on a tenth of the corrupt−clean difference the exact change is ≈ 0.1 × EAP."""
    _, adapter, pair, _ = tiny
    engine = C.engine_for(adapter)
    eap, cleans, corrupts = C.gradient_scores(engine, [pair], 1)
    clean, corrupt = cleans[0], corrupts[0]
    near = C.Record(clean.parts + 0.001 * (corrupt.parts - clean.parts), corrupt.attn_in, corrupt.mlp_in,
                    corrupt.final, corrupt.logits)
    for edge in ("input->a0.h1<q>", "a0.h1->a1.h2<k>", "m0->a1.h0<v>", "a0.h2->m0", "m0->logits"):
        r, s = engine.graph.parse_edge(edge)
        moved = C.patched_metric(engine, pair, [(r, s)], near) - float(C.metric(clean.logits[None], pair)[0])
        assert abs(moved / 0.001 - float(eap[r, s])) <= 2e-2 * max(1.0, abs(float(eap[r, s]))), edge


def test_pruned_circuits_are_paths_from_input_to_logits():
    graph = C.Graph(3, 2)
    keep = torch.zeros(graph.n_receivers, graph.n_senders, dtype=torch.bool)
    on_path = [graph.parse_edge(e) for e in ("input->a0.h1<k>", "a0.h1->m1", "m1->logits")]
    dangling = [graph.parse_edge(e) for e in ("a1.h0->a2.h0<q>", "input->m0")]  # a1.h0 unread; m0 read by nobody
    for r, s in on_path + dangling:
        keep[r, s] = True
    pruned = C.prune(graph, keep)
    assert sorted(pruned.nonzero().tolist()) == sorted([list(e) for e in on_path])


@pytest.mark.parametrize("edge", ["a0.h1->a1.h2<k>", "input->a1.h0<q>", "m0->a1.h3<v>", "a0.h2->m0"])
def test_edge_why_agrees_with_the_exact_score_and_the_attention(tiny, edge):
    from models.circuit_edge import edge_why
    _, adapter, pair, _ = tiny
    engine = C.engine_for(adapter)
    why = edge_why(engine, pair, edge)
    exact = C.exact_scores(engine, [pair], [engine.graph.parse_edge(edge)])
    assert abs(why["score"] - float(exact[0])) <= 1e-5
    if edge.endswith(("<q>", "<k>")):
        before, after = torch.tensor(why["row_before"]), torch.tensor(why["row_after"])
        assert abs(float(before.sum()) - 1) < 1e-4 and abs(float(after.sum()) - 1) < 1e-4
        assert why["key"] == int((after - before).abs().argmax())
        assert why["part"] == {"input": "embed", "m0": "L0.mlp"}.get(why["sender"], "L0.H1")
        side = "key" if edge.endswith("<k>") else "query"
        assert why["part_share"][side] is not None
        assert abs(why["qk"]["sum"] - why["qk"]["score"]) <= 1e-4 * max(1.0, abs(why["qk"]["score"]))
    elif edge.endswith("<v>"):
        assert len(why["writes"]["before"]) == len(why["writes"]["after"]) == 10
    else:
        assert why["row_before"] is None and why["writes"] is None
