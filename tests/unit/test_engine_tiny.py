"""The hooked attention inside a real (tiny, random-weight) BERT: parity, padding, scoping, isolation."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from models.adapters.bert import BertAdapter
from models.effects import attention_tv, hidden_cosine
from models.interventions import Intervention
from tests.float32 import assert_close_f32, attention_terms


@pytest.fixture(scope="module")
def adapter(tiny_bert):
    return BertAdapter("tiny", str(tiny_bert), max_tokens=64, device="cpu")


def test_parity_with_eager_attention(adapter, tiny_bert):
    encoded = adapter.encode("the cat sat on the mat because it was tired .")
    result = adapter.run(encoded)
    eager = AutoModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = eager(**encoded.inputs, output_attentions=True, output_hidden_states=True)
    terms = attention_terms(eager.config, len(encoded.tokens))  # q·k over the head size, softmax over the keys
    assert_close_f32(result.attention, torch.stack([a[0] for a in ref.attentions]), terms, scale=1.0)
    assert torch.allclose(result.hidden_states, torch.stack([h[0] for h in ref.hidden_states]), atol=1e-5)


def test_padding_mask_reaches_the_attention_function(adapter, tiny_bert):
    """A padded batch must give the same attention for the short sentence as running it alone."""
    from models.hooks import RunScope, run_scope

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    batch = tok(["the cat sat", "the dog ran on the rug because it was tired"], padding=True, return_tensors="pt")
    scope = RunScope(layer_of=adapter.layer_of)
    with torch.no_grad(), run_scope(scope):
        adapter.model(**batch)
    n = int(batch["attention_mask"][0].sum())
    padded = scope.attention[0][0]  # (H, T, T)
    assert torch.all(padded[:, :, n:] == 0), "padding keys received attention: the mask function is missing"
    alone = adapter.run(adapter.encode("the cat sat")).attention[0]
    terms = attention_terms(adapter.model.config, padded.shape[-1])  # q·k over the head size, softmax over the keys
    assert_close_f32(padded[:, :n, :n], alone, terms, scale=1.0)


def test_scoped_beta_reruns_later_layers_only(adapter):
    encoded = adapter.encode("the animal did not cross the street because it was tired")
    base = adapter.run(encoded)
    run = adapter.run(encoded, (Intervention("temperature", beta=3.0, layers=(1,), heads=(2,)),))
    tv = attention_tv(run.attention, base.attention)  # (L, H)
    assert float(tv[0].abs().max()) == 0.0  # layer 0 is upstream: unchanged
    assert float(tv[1, 2]) > 1e-3 and float(tv[1, [0, 1, 3]].max()) == 0.0
    cos = hidden_cosine(run.hidden_states, base.hidden_states)
    # embeddings + layer 0 output: cosines of equal states, their dot products summed over the hidden size
    assert_close_f32(cos[:2], torch.ones(2, dtype=cos.dtype), adapter.model.config.hidden_size, scale=1.0)
    assert float(cos[2]) < 1.0  # layer 1's output moved
    assert torch.equal(run.hidden_states[:2], base.hidden_states[:2])
    assert float((run.hidden_states[2] - base.hidden_states[2]).abs().max()) > 1e-4


def test_query_perturbation_moves_later_layers_through_the_residual_stream(adapter):
    encoded = adapter.encode("the cat sat on the mat")
    base = adapter.run(encoded)
    run = adapter.run(encoded, (Intervention("perturb_queries", layers=(0,), tokens=(3,), noise_std=2.0, seed=1),))
    changed_rows = (run.attention[0] - base.attention[0]).abs().amax(dim=(0, 2)) > 0  # (T,)
    assert changed_rows.tolist() == [i == 3 for i in range(len(encoded.tokens))]
    assert float(attention_tv(run.attention, base.attention)[1].max()) > 0  # layer 1 sees it


def test_concurrent_runs_never_see_each_others_interventions(adapter):
    encoded = adapter.encode("the dog ran on the rug")
    plans = {
        "hot": (Intervention("temperature", beta=50.0),),
        "cold": (Intervention("temperature", beta=1e-4),),
        "masked": (Intervention("mask_keys", tokens=(1, 2)),),
        "none": (),
    }
    expected = {name: adapter.run(encoded, ivs).attention for name, ivs in plans.items()}
    failures = []

    def worker(name):
        for _ in range(15):
            got = adapter.run(encoded, plans[name]).attention
            if not torch.equal(got, expected[name]):
                failures.append(name)

    threads = [threading.Thread(target=worker, args=(n,)) for n in plans for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_masked_lm_reports_mask_predictions(tiny_mlm):
    adapter = BertAdapter("tiny-mlm", str(tiny_mlm), device="cpu")
    assert adapter.info.output == "mlm"
    encoded = adapter.encode("the cat [MASK] on the mat")
    before = adapter.run(encoded)
    after = adapter.run(encoded, (Intervention("ablate_heads", layers=(0, 1)),))
    summary = adapter.output_summary(before)
    assert [m["position"] for m in summary["masks"]] == [3]
    assert len(summary["masks"][0]["top"]) == 5
    effect = adapter.output_effect(before, after, encoded)
    assert effect["kind"] == "mlm" and effect["kl"][0] > 0


def test_truncation_is_flagged(adapter):
    encoded = adapter.encode(" ".join(["cat"] * 200))
    assert encoded.truncated and len(encoded.tokens) == 64
    assert not adapter.encode("the cat").truncated


def test_a_run_records_entropy_and_maps_in_place(adapter):
    """The run's P comes from one buffer filled layer by layer; its entropy summary, computed inside the
    attention function, matches −Σ P log P of the returned maps; Ŝ (when recorded) reproduces P."""
    from models.interventions import row_entropy

    encoded = adapter.encode("the animal did not cross the street because it was tired")
    for ivs in [(), (Intervention("mask_keys", tokens=(2,)), Intervention("temperature", beta=0.05, layers=(1,)))]:
        result = adapter.run(encoded, ivs, record_scores=True)
        expected = row_entropy(result.attention.double()).mean(dim=-1)  # (L, H)
        assert torch.allclose(torch.as_tensor(result.derived["entropy"], dtype=torch.float64), expected, atol=1e-5)
        without = adapter.run(encoded, ivs, record_scores=False)
        assert without.scores is None
        terms = attention_terms(adapter.model.config, len(encoded.tokens))  # q·k over the head size, softmax over keys
        assert_close_f32(without.attention, result.attention, terms, scale=1.0)  # β folded into q: another rounding
    beta0 = adapter.info.native_beta
    plain = adapter.run(encoded, (), record_scores=True)
    assert_close_f32(torch.softmax(beta0 * plain.scores, dim=-1), plain.attention, terms, scale=1.0)


def test_scores_come_from_the_recorded_queries_and_keys(adapter):
    """Ŝ is kept as q̂, k̂ (T × d per head) and formed per slice; a key perturbation shows in k̂ only."""
    encoded = adapter.encode("the animal did not cross the street because it was tired")
    plain = adapter.run(encoded, (), record_scores=True)
    n = len(encoded.tokens)
    assert plain.queries.shape == plain.keys.shape == (2, 4, n, adapter.info.head_dim)
    full = plain.scores  # (L, H, T, T)
    # a slice's q̂·k̂ against the full matmul: sums over the head size of products as large as the scores
    expected = full[[1]][:, [2, 0]][:, :, [3, 5]]
    got = plain.scores_slice([1], [2, 0], [3, 5])
    assert_close_f32(got, expected, adapter.info.head_dim, scale=float(full.abs().max()))
    kick = Intervention("perturb_keys", layers=(0,), heads=(1,), tokens=(4,), noise_std=2.0, seed=1)
    perturbed = adapter.run(encoded, (kick,), record_scores=True)
    moved = (perturbed.keys[0, 1] - plain.keys[0, 1]).abs().amax(dim=-1)  # (T,)
    assert float(moved[4]) > 0.1 and float(moved[[t for t in range(n) if t != 4]].max()) == 0.0
    assert torch.equal(perturbed.queries[0], plain.queries[0])
    with pytest.raises(ValueError, match="did not record scores"):
        adapter.run(encoded, (), record_scores=False).scores_slice([0], [0])


def test_a_runs_size_follows_what_it_keeps(adapter):
    """nbytes is measured once and again only when what the run keeps changes: value norms formed from V on a record
    (V dropped), a record built for a window, the maps replaced. Each figure equals the sum over the kept tensors."""
    result = adapter.run(adapter.encode("the cat sat on the mat"), record_scores=True)

    def measured() -> int:  # each piece of memory once: unstacked q̂/k̂ are the records' own tensors
        distinct = {(t.data_ptr(), t.shape, t.stride()): t for t in result._kept_tensors()}
        return sum(t.numel() * t.element_size() for t in distinct.values())

    first = result.nbytes
    assert first == measured() and result.device_nbytes == 0
    record = result.atlas.records[0]
    n_heads, n_keys = record.queries.shape[0], record.keys.shape[1]
    values, grams = torch.randn(n_heads, n_keys, 4), torch.eye(4, dtype=torch.float64).repeat(n_heads, 1, 1)
    record.norms_from = (values, grams)  # as models/head_ops.keep_value_norms leaves them
    assert result.nbytes == measured() == first + values.nbytes + grams.nbytes
    record.value_norms  # noqa: B018  formed now: V and G are dropped, the (H, T) norms kept
    assert result.nbytes == measured() == first + n_heads * n_keys * 4
    result.atlas.record(1)  # a window's LayerRecord replaces the pending one (β and the plan's tensors)
    assert result.nbytes == measured() > first + n_heads * n_keys * 4
    result.attention = result.kept_attention[:, :1].clone()  # the maps replaced (fewer heads)
    assert result.nbytes == measured() < first


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_q_k_and_hidden_states_are_stacked_when_first_read(family, tmp_path_factory):
    """A short run keeps q̂, k̂ and the hidden states per layer, as the forward made them (the atlas records' own q̂/k̂,
    a grouped-query model's k̂ per key/value head), and stacks them only when the whole tensor is read: Ŝ of a few
    heads formed from the parts equals the same slice of the stacks bit for bit, the stacks equal the forward's own
    tensors (k̂ repeated to the query heads), and nbytes counts the shared memory once until a stack is made."""
    from models.adapters.causal_lm import CausalLMAdapter
    from tests.tiny_models import build_text_model

    folder = str(build_text_model(family, tmp_path_factory.mktemp(f"lazy-{family}")))
    adapter = BertAdapter("tiny", folder, device="cpu") if family == "bert" else CausalLMAdapter("tiny", folder, device="cpu")
    result = adapter.run(adapter.encode("the cat sat on the mat because it was tired"), record_scores=True)
    assert all(isinstance(result.parts(name), list) for name in ("queries", "keys", "hidden_states"))
    records = result.atlas.records
    assert all(result.parts("keys")[l] is records[l].keys for l in records)  # not copies
    before = result.nbytes
    layers, heads = [1, 0], [3, 1]
    sliced = result.scores_slice(layers, heads, [2, 0])  # from the parts
    # no layer or no head asked (an export with "layers": [], found by schemathesis): empty, as from the stacks
    n = result.kept_attention.shape[-1]
    assert [tuple(result.scores_slice(l, h).shape) for l, h in (([], []), ([], [1]), ([0], []))] == [
        (0, 0, n, n), (0, 1, n, n), (1, 0, n, n)]
    assert isinstance(result.parts("queries"), list)  # Ŝ of a few heads stacks nothing
    stacked_queries, stacked_keys = result.queries, result.keys  # (L, H, T, d), stacked now
    n_heads = stacked_queries.shape[1]
    assert stacked_keys.shape[1] == n_heads
    assert torch.equal(sliced, result.scores_slice(layers, heads, [2, 0]))  # from the stacks: bit for bit
    for layer, record in records.items():
        n_rep = n_heads // record.keys.shape[0]
        assert (family == "llama") == (n_rep > 1)
        assert torch.equal(stacked_keys[layer], record.keys.repeat_interleave(n_rep, dim=0).float())
        assert torch.equal(stacked_queries[layer], record.queries.float())
    assert result.hidden_states.shape[0] == len(records) + 1
    # the stacks are memory of their own; the parts were the records' (and the forward's) tensors, counted once
    assert result.nbytes >= before + stacked_queries.nbytes + stacked_keys.nbytes
