"""The real whisper-tiny-en (converted from CTranslate2 at setup) through attnlab, on the espeak-ng sample
"Seven curious gulls watched the harbour at dawn. Attention lets every word look at every other word." (6.7 s):
the probe's parity, the transcript, masking 3–7 s in cross-attention, word times, β's meaning, and every upload
format decoding to the same clip."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.adapters.seq2seq import KindScopedIntervention
from models.audio import decode_bytes, decode_path
from models.interventions import Intervention
from tests.float32 import assert_close_f32

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "whisper-tiny-en"
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


@pytest.fixture(scope="module")
def whisper():
    if not (WEIGHTS / "prepared.json").is_file() or not SAMPLE.is_file():
        pytest.fail("weights/whisper-tiny-en or the speech sample is missing: run `make speech weights`")
    from models.adapters.whisper import WhisperAdapter

    torch.set_num_threads(2)
    return WhisperAdapter("whisper-tiny-en", str(WEIGHTS), device="cpu")


@pytest.fixture(scope="module")
def sample():
    return decode_path(SAMPLE)


@pytest.fixture(scope="module")
def plain(whisper, sample):
    encoded = whisper.encode(sample.samples, ("sample",))
    return encoded, whisper.run(encoded)


def test_conversion_was_checked_against_ctranslate2():
    recorded = json.loads((WEIGHTS / "prepared.json").read_text())
    assert recorded["encoder_max_abs_diff"] <= recorded["encoder_tolerance"] <= 1e-3
    assert recorded["logits_max_abs_diff"] <= recorded["logits_tolerance"] <= 5e-4


def test_probe_parity_and_layout(whisper):
    info = whisper.info
    assert info.parity is not None and info.parity <= 1e-4
    assert (info.encoder_layers, info.decoder_layers, info.heads) == (4, 4, 6)
    assert whisper.kind_layers == {"encoder": [0, 1, 2, 3], "decoder": [4, 6, 8, 10], "cross": [5, 7, 9, 11]}


def test_sample_transcript(plain):
    encoded, _ = plain
    text = encoded.extra["text"]
    assert "harbor at dawn." in text and "Attention let" in text and text.endswith("every other word.")
    assert encoded.tokens[:2] == ["<|startoftranscript|>", "<|notimestamps|>"]


def test_teacher_forced_probabilities_follow_the_greedy_choice(whisper, plain):
    encoded, result = plain
    probs = result.output["label_log_probs"].exp()
    assert probs.shape[0] == len(encoded.extra["labels"])
    # the greedy transcript is the argmax at every step (suppressed tokens aside), so each is the most probable
    top = result.output["log_probs"].argmax(dim=-1)
    assert (top == torch.tensor(encoded.extra["labels"])).float().mean() > 0.9
    assert float(probs[-1]) > 0.5  # <|endoftext|> after "word."


def test_cross_attention_rows_and_causal_decoder(plain):
    encoded, result = plain
    n = len(encoded.tokens)
    cross, decoder = result.by_kind["cross"], result.by_kind["decoder"]
    assert cross.shape == (4, 6, n, 1500) and decoder.shape == (4, 6, n, n)
    torch.testing.assert_close(cross.sum(-1), torch.ones(4, 6, n), atol=1e-5, rtol=0)
    assert float(decoder.triu(1).abs().max()) == 0.0


def test_masking_three_to_seven_seconds_removes_the_second_sentence(whisper, plain):
    encoded, _ = plain
    positions = tuple(range(150, 350))  # 3–7 s at 20 ms per encoder position
    ivs = whisper.engine_interventions([KindScopedIntervention(Intervention(op="mask_keys", tokens=positions), "cross")])
    ids, _ = whisper.transcribe(encoded.inputs["input_features"], ivs)
    text = whisper.decode(ids)
    assert "harbor at dawn" in text and "Attention" not in text and "word" not in text, text
    masked = whisper.run(encoded, ivs)
    assert float(masked.by_kind["cross"][..., 150:350].abs().max()) == 0.0
    effect = whisper.output_effect(plain[1], masked, encoded)
    first_attention = encoded.extra["labels"].index(whisper.tokenizer.encode(" Attention", add_special_tokens=False).ids[0])
    assert effect["prob_change"][first_attention] < -0.5  # "Attention" is no longer heard


def test_attention_is_spoken_between_3_and_4_5_seconds(whisper, plain):
    encoded, result = plain
    words = whisper.word_times(result, encoded)
    by_word = {w["word"].strip(".,"): w for w in words}
    assert 3.0 <= by_word["Attention"]["start_s"] <= 4.5
    starts = [w["start_s"] for w in words]
    assert starts == sorted(starts) and words[0]["start_s"] < 0.8 and words[-1]["end_s"] <= 6.7


def test_native_beta_changes_nothing_and_beta_means_q_dot_k(whisper, plain):
    """β = 1/√d (the native value) on every cross head reproduces the plain run; β = 0 makes rows uniform."""
    encoded, result = plain
    native = whisper.engine_interventions([KindScopedIntervention(
        Intervention(op="temperature", beta=whisper.info.native_beta), "cross")])
    same = whisper.run(encoded, native)
    # β applied explicitly against the model's own scaling: q·k over the head size, the softmax over the 1,500 frames
    terms = whisper.info.head_dim + result.by_kind["cross"].shape[-1]
    assert_close_f32(same.by_kind["cross"], result.by_kind["cross"], terms, scale=1.0)
    flat = whisper.engine_interventions([KindScopedIntervention(Intervention(op="temperature", beta=1e-6), "cross", )])
    uniform = whisper.run(encoded, flat).by_kind["cross"]
    torch.testing.assert_close(uniform, torch.full_like(uniform, 1 / 1500), atol=1e-6, rtol=0)


def test_alignment_ranking_puts_openai_alignment_heads_high(whisper, plain):
    encoded, result = plain
    ranking = whisper.alignment_ranking(result, encoded)
    assert len(ranking) == 24
    top_half = ranking[:12]
    assert sum(item["alignment_head"] for item in top_half) >= 5  # of tiny.en's 8
    assert ranking[-1]["score"] < ranking[0]["score"]


@pytest.mark.parametrize("container,codec,rate", [("flac", "flac", 44100), ("mp3", "libmp3lame", 44100),
                                                  ("ogg", "libopus", 48000), ("webm", "libopus", 48000)])
def test_every_upload_format_of_the_sample_decodes_to_the_same_duration(sample, container, codec, rate):
    from tests.unit.test_audio_decode import encode

    pcm = (np.clip(sample.samples, -1, 1) * 32767).astype(np.int16)[None, :]  # (1, n) at 16 kHz
    again = decode_bytes(encode(pcm, 16000, container, codec, out_rate=rate))
    assert abs(again.duration_s - sample.duration_s) <= 0.1
