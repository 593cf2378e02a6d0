"""The optional whisper-base (multilingual; prepared by `attnlab prepare --model whisper-base`, not by default): the
check against CTranslate2 recorded at setup, the probe, language detection, transcription and translation of the
espeak-ng sample, and the prompt each task uses. Skipped, saying so, where it was not prepared (CI need not
download it); the joining of its two parts is tested in tests/unit/test_whisper_ctranslate2.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.audio import decode_path

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "whisper-base"
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"

pytestmark = pytest.mark.skipif(
    not (WEIGHTS / "prepared.json").is_file() or not SAMPLE.is_file(),
    reason="whisper-base is not prepared here (optional: `make whisper-base`), or the speech sample is missing",
)


@pytest.fixture(scope="module")
def base():
    from models.adapters.whisper import WhisperAdapter

    torch.set_num_threads(2)
    return WhisperAdapter("whisper-base", str(WEIGHTS), device="cpu")


@pytest.fixture(scope="module")
def sample():
    return decode_path(SAMPLE).samples


def test_conversion_was_checked_against_ctranslate2_for_both_tasks():
    recorded = json.loads((WEIGHTS / "prepared.json").read_text())
    assert recorded["multilingual"] is True and len(recorded["part_sha256"]) == 2
    assert recorded["encoder_max_abs_diff"] <= recorded["encoder_tolerance"] <= 1e-3
    assert recorded["logits_max_abs_diff"] <= recorded["logits_tolerance"] <= 5e-4
    assert "50358" in recorded["checked_with"] and "50359" in recorded["checked_with"]  # translate and transcribe


def test_probe_parity_layout_and_languages(base):
    info = base.info
    assert info.parity is not None and info.parity <= 1e-4
    assert (info.encoder_layers, info.decoder_layers, info.heads) == (6, 6, 8)
    assert info.multilingual and info.tasks == ["transcribe", "translate"] and len(info.languages) == 99
    assert {"en", "de", "fr", "zh"} <= set(info.languages)
    assert base.eot == 50257 and base.tokens.sot == 50258


def test_detects_english_and_transcribes(base, sample):
    encoded = base.encode(sample, ("sample",))
    assert encoded.extra["language"] == "en" and encoded.extra["language_prob"] > 0.5
    assert encoded.extra["prompt"] == [50258, 50259, 50359, 50363]
    assert encoded.tokens[:4] == ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    text = encoded.extra["text"].lower()
    assert "harbo" in text and "dawn" in text and "every other word" in text, text
    result = base.run(encoded)
    n = len(encoded.tokens)
    assert tuple(result.by_kind["cross"].shape) == (6, 8, n, 1500)
    words = base.word_times(result, encoded)
    attention = [w for w in words if w["word"].lower().startswith("attention")]
    assert attention and 2.5 <= attention[0]["start_s"] <= 4.5, words


def test_translate_prompt_and_a_named_language(base, sample):
    """task "translate" puts <|translate|> in the prompt; an English clip translated into English stays English."""
    encoded = base.encode(sample, ("sample",), language="en", task="translate")
    assert encoded.extra["prompt"] == [50258, 50259, 50358, 50363] and encoded.extra["language_prob"] is None
    assert "dawn" in encoded.extra["text"].lower()
    german = base.encode(sample, ("sample",), language="de", task="transcribe")
    assert german.extra["prompt"][1] == 50261 and german.tokens[1] == "<|de|>"
