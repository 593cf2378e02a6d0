"""Word times of the real whisper-tiny-en against the pauses of espeak-ng speech (issue 28, item 6): clips spoken
by espeak-ng, joined with silences of known length; an energy detector written here (10 ms frames, independent of
the adapter's own) finds the pauses. A word that follows a pause of ≥ 200 ms starts within 0.15 s after the pause
ends, and no word spans a pause."""
from __future__ import annotations

import io
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from models.audio import decode_bytes, decode_path

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "weights" / "whisper-tiny-en"
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"

# (sentences, the silences inserted between them in seconds)
CLIPS = [
    (["The little boat drifted across the quiet lake.", "Nobody on the shore noticed it."], [0.5]),
    (["Morning light filled the valley slowly.", "Birds began to sing", "and the farmers walked out."], [0.3, 0.6]),
    (["Open the window please.", "It is far too warm in here today."], [0.8]),
]


@pytest.fixture(scope="module")
def whisper():
    if not (WEIGHTS / "prepared.json").is_file() or not SAMPLE.is_file():
        pytest.fail("weights/whisper-tiny-en or the speech sample is missing: run `make speech weights`")
    from models.adapters.whisper import WhisperAdapter

    torch.set_num_threads(2)
    return WhisperAdapter("whisper-tiny-en", str(WEIGHTS), device="cpu")


def espeak(text: str, tmp: Path) -> tuple[np.ndarray, int]:
    path = tmp / "say.wav"
    subprocess.run([shutil.which("espeak-ng") or "espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    with wave.open(str(path)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16), w.getframerate()


def joined_clip(sentences: list[str], gaps: list[float], tmp: Path) -> bytes:
    """The sentences spoken one by one and joined with `gaps` seconds of digital silence, as 16-bit WAV bytes."""
    parts, rate = [], None
    for k, sentence in enumerate(sentences):
        samples, rate = espeak(sentence, tmp)
        parts.append(samples)
        if k < len(gaps):
            parts.append(np.zeros(int(gaps[k] * rate), dtype=np.int16))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.concatenate(parts).tobytes())
    return buffer.getvalue()


def pauses_of(samples: np.ndarray, rate: int = 16000, min_s: float = 0.2) -> list[tuple[float, float]]:
    """Pauses by energy: runs of 10 ms frames whose RMS is under 2 % of the loudest frame's, ≥ min_s long."""
    hop = rate // 100
    n = samples.size // hop
    rms = np.sqrt((samples[: n * hop].astype(np.float64).reshape(n, hop) ** 2).mean(axis=1))
    silent = rms < max(1e-4, 0.02 * rms.max())
    pauses, start = [], None
    for i, quiet in enumerate(list(silent) + [False]):
        if quiet and start is None:
            start = i
        elif not quiet and start is not None:
            if (i - start) / 100 >= min_s:
                pauses.append((start / 100, i / 100))
            start = None
    return pauses


def check_words_against_pauses(words: list[dict], pauses: list[tuple[float, float]], duration: float) -> list[str]:
    problems = []
    for a, b in pauses:
        for w in words:  # none spans it: at most 0.1 s of a word inside a pause (20 ms positions, detector edges)
            inside = min(w["end_s"], b) - max(w["start_s"], a)
            if inside > 0.1:
                problems.append(f"{w['word']!r} {w['start_s']}–{w['end_s']} s spans the pause {a:.2f}–{b:.2f} s")
        if b >= duration - 0.05:
            continue  # the clip's trailing silence: no word follows it
        following = next((w for w in words if w["end_s"] > b), None)  # the first word with speech after the pause
        if following is None:
            problems.append(f"no word after the pause {a:.2f}–{b:.2f} s")
        elif not b - 0.1 <= following["start_s"] <= b + 0.15:
            problems.append(f"{following['word']!r} starts at {following['start_s']} s, the pause {a:.2f}–{b:.2f} s ends at {b:.2f} s")
    return problems


def test_sample_words_start_after_its_pause(whisper):
    """The bundled sample: "dawn." ran 2.62–3.72 s across the 2.88–3.26 s pause and "Attention" started at 3.72 s."""
    audio = decode_path(SAMPLE)
    encoded = whisper.encode(audio.samples, ("sample",))
    words = whisper.word_times(whisper.run(encoded), encoded)
    pauses = pauses_of(audio.samples)
    assert any(b - a >= 0.3 and 2.5 < a < 3.5 for a, b in pauses), pauses  # the sentence pause is there
    assert check_words_against_pauses(words, pauses, audio.duration_s) == []
    by_word = {w["word"]: w for w in words}
    assert by_word["dawn."]["end_s"] <= 2.95 and 3.2 <= by_word["Attention"]["start_s"] <= 3.41
    assert [w["start_s"] for w in words] == sorted(w["start_s"] for w in words)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
@pytest.mark.parametrize("sentences,gaps", CLIPS, ids=["one-pause", "two-pauses", "long-pause"])
def test_words_follow_inserted_pauses(whisper, tmp_path, sentences, gaps):
    audio = decode_bytes(joined_clip(sentences, gaps, tmp_path))
    encoded = whisper.encode(audio.samples, ("clip",) + tuple(sentences))
    words = whisper.word_times(whisper.run(encoded), encoded)
    pauses = pauses_of(audio.samples)
    inner = [(a, b) for a, b in pauses if b < audio.duration_s - 0.05 and a > 0.05]
    assert len(inner) >= len(gaps), (pauses, gaps)  # every inserted silence is found (espeak adds its own too)
    assert check_words_against_pauses(words, pauses, audio.duration_s) == [], (encoded.extra["text"], words, pauses)
    assert all(w["end_s"] >= w["start_s"] for w in words)
    assert [w["start_s"] for w in words] == sorted(w["start_s"] for w in words)
