"""models/luong.py and models/luong_lab.py: the date task, the four Luong scores against their formulas (Luong, Pham &
Manning 2015), greedy decoding, the interventions, and the models `attnlab prepare` trained (weights/luong/)."""
from __future__ import annotations

import collections

import pytest
import torch

from models import luong, luong_lab
from tests.luong_weights import scores_by_hand, trained_folder, write_untrained

TEXTS = ["the 3rd of March 2021", "3.3.2021", "December 31, 1999"]


def test_each_form_writes_the_date_and_the_target_is_iso():
    sources = {luong.render(2021, 3, 3, form, lower=False) for form in range(len(luong.FORMATS))}
    assert {s for s, _ in sources} == {"the 3rd of March 2021", "March 3, 2021", "3 March 2021", "03/03/2021",
                                       "Mar 3 2021", "March the 3rd, 2021", "3.3.2021"}
    assert {t for _, t in sources} == {"2021-03-03"}
    assert [luong.ordinal(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st"]
    assert luong.render(1969, 7, 21, 0, lower=True) == ("the 21st of july 1969", "1969-07-21")


def test_the_split_is_seeded_and_the_heldout_dates_are_unseen():
    train, heldout = luong.make_split(5, 400, 100)
    assert (train, heldout) == luong.make_split(5, 400, 100)
    assert luong.make_split(6, 400, 100)[0] != train
    assert not {s for s, _ in train} & {s for s, _ in heldout}
    for source, target in train + heldout:
        assert not luong.SOURCE_VOCAB.unknown(source) and len(source) <= luong.MAX_SOURCE
        assert luong.TARGET_VOCAB.decode(luong.TARGET_VOCAB.encode(target)) == target and len(target) == 10


@pytest.mark.parametrize("score", luong.SCORES)
def test_attend_is_the_softmax_of_the_score_then_the_context_and_output(score):
    torch.manual_seed(1)
    model = luong.LuongSeq2Seq(luong.LuongConfig(score=score)).double().eval()
    src, lengths = luong.batch_sources(TEXTS, luong.MAX_SOURCE)
    hs, h0 = model.encode(src, lengths)
    h = model.decode_states(torch.randint(3, len(luong.TARGET_VOCAB), (len(TEXTS), 6)), h0)
    allowed = luong.source_mask(lengths, src.shape[1])
    allowed[0, 4] = False
    beta = 0.7
    out = model.attend(h, hs, allowed, beta)
    raw = scores_by_hand(model, h, hs)
    logits = torch.where(allowed[:, None, :], beta * raw, torch.tensor(float("-inf"), dtype=raw.dtype))
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    weights = weights / weights.sum(-1, keepdim=True)
    assert (out.scores - raw).abs().max() < 1e-12
    assert (out.weights - weights).abs().max() < 1e-12
    assert out.weights[0, :, 4].abs().max() == 0 and out.weights[1, :, lengths[1]:].abs().max() == 0
    context = torch.einsum("bts,bsh->bth", weights, hs)
    h_tilde = torch.tanh(torch.cat([context, h], -1) @ model.W_c.weight.T)
    assert (out.context - context).abs().max() < 1e-12
    assert (out.logits - h_tilde @ model.W_s.weight.T).abs().max() < 1e-12


def test_a_sources_states_do_not_depend_on_the_padding_after_it():
    torch.manual_seed(2)
    model = luong.LuongSeq2Seq(luong.LuongConfig(score="dot")).double().eval()
    alone = model.encode(*luong.batch_sources(["3.3.2021"], luong.MAX_SOURCE))
    padded = model.encode(*luong.batch_sources(["3.3.2021", "the 23rd of September 2021"], luong.MAX_SOURCE))
    assert (alone[0][0] - padded[0][0, :8]).abs().max() < 1e-12
    assert (alone[1][0, 0] - padded[1][0, 0]).abs().max() < 1e-12


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    return write_untrained(tmp_path_factory.mktemp("luong-untrained"))


@pytest.mark.parametrize("score", luong.SCORES)
def test_the_views_step_by_step_decode_is_the_batched_greedy_decode(untrained, score):
    for text in TEXTS:
        view = luong_lab.attention_view(untrained, score, text)
        ids = luong.greedy(luong.load_model(str(untrained), score), [text])[0]
        assert view["output"]["tokens"] == [luong.TARGET_VOCAB.itos[i] for i in ids]
        assert len(view["alignment"]) == len(ids) and len(view["alignment"][0]) == len(text)


def test_beta_zero_attends_uniformly_over_the_unmasked_positions(untrained):
    view = luong_lab.attention_view(untrained, "general", "3 March 2021", luong_lab.Interventions(0.0, (1, 2)))
    free = len("3 March 2021") - 2
    for row in view["alignment"]:
        assert row[1] == row[2] == 0
        assert max(abs(p - 1 / free) for s, p in enumerate(row) if s not in (1, 2)) < 1e-12
    assert view["effect"] is not None and all(kl >= 0 for kl in view["effect"]["kl"])


def test_noise_is_seeded_and_only_on_the_chosen_positions():
    hs = torch.zeros(1, 5, 4, dtype=torch.float64)
    a = luong_lab.perturbed_states(hs, luong_lab.Perturbation(0.5, seed=3, positions=(1, 3)))
    assert torch.equal(a, luong_lab.perturbed_states(hs, luong_lab.Perturbation(0.5, seed=3, positions=(1, 3))))
    assert not torch.equal(a, luong_lab.perturbed_states(hs, luong_lab.Perturbation(0.5, seed=4, positions=(1, 3))))
    assert a[0, [0, 2, 4]].abs().max() == 0 and a[0, [1, 3]].abs().min() > 0
    every = luong_lab.perturbed_states(hs, luong_lab.Perturbation(2.0, seed=3))
    assert torch.allclose(every[0, [1, 3]], 4 * a[0, [1, 3]])  # the same draw, σ times


@pytest.mark.parametrize("text, ivs, field", [
    ("the 3rd of MARCH 2021", luong_lab.Interventions(), "text"),
    ("3.3.2021", luong_lab.Interventions(mask=tuple(range(8))), "mask"),
    ("3.3.2021", luong_lab.Interventions(mask=(8,)), "mask"),
    ("3.3.2021", luong_lab.Interventions(perturb=luong_lab.Perturbation(1.0, 0, (0, 9))), "perturb"),
])
def test_bad_input_names_its_field(untrained, text, ivs, field):
    with pytest.raises(luong_lab.LuongInputError) as err:
        luong_lab.attention_view(untrained, "dot", text, ivs)
    assert err.value.field == field


def test_training_is_seeded_and_lowers_the_loss():
    train, _ = luong.make_split(0, 500, 10)
    tc = luong.TrainConfig(steps=12, batch=32)
    runs = []
    for _ in range(2):
        model = luong.build("general", seed=7)
        runs.append((luong.train_model(model, train, tc, seed=7), model.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert runs[0][0][-1] < runs[0][0][0]


def per_position_baseline(train, heldout) -> float:
    """Exact match of answering each character position's commonest training character (input ignored)."""
    guess = "".join(collections.Counter(t[i] for _, t in train).most_common(1)[0][0] for i in range(10))
    return sum(t == guess for _, t in heldout) / len(heldout)


def test_every_model_prepared_here_is_trained_and_beats_the_input_blind_baselines():
    folder = trained_folder()
    results = luong.load_results(str(folder))
    split = results["split"]
    assert split["heldout_seed"] != split["train_seed"]
    train, heldout = luong.make_split(split["train_seed"], split["train"], split["heldout"])
    commonest = collections.Counter(t for _, t in train).most_common(1)[0][0]
    baseline = max(sum(t == commonest for _, t in heldout) / len(heldout), per_position_baseline(train, heldout))
    assert set(results["models"]) == {*luong.SCORES, "transformer"}
    for name, info in results["models"].items():
        model = luong.load_model(str(folder), name)
        right = sum(out == luong.TARGET_VOCAB.encode(t) + [luong.EOS]
                    for out, (_, t) in zip(luong.greedy(model, [s for s, _ in heldout]), heldout))
        # measured in float32 at training, float64 here: a borderline step may go the other way
        assert right / len(heldout) == pytest.approx(info["heldout_exact_match"], abs=0.01), name
        assert right / len(heldout) > baseline + 0.2, (name, right / len(heldout), baseline)
        assert info["train_s"] > 0 and info["steps"] > 0
