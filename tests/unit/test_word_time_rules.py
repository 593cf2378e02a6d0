"""The rules after the word-timing DTW (models/adapters/whisper.py, docs/science.md §11) on units whose answer is known."""
from __future__ import annotations

import numpy as np

from models.adapters.whisper import find_pauses, position_levels, refine_word_times, split_units


def unit(text, a, b, start, end):
    return {"text": text, "tokens": [a, b], "start_s": start, "end_s": end}


def test_punctuation_is_a_unit_of_its_own():
    assert split_units([" at", " dawn", ".", " Att", "ention", " (", "see", ")"]) == [
        (0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8)]


def test_a_word_never_spans_a_pause_and_speech_after_it_starts_the_next_word():
    # "dawn" aligned 2.62–3.28 s, its "." inside the 2.88–3.26 s pause, "Attention" late at 3.72 s
    units = [unit(" at", 0, 1, 2.28, 2.62), unit(" dawn", 1, 2, 2.62, 3.28), unit(".", 2, 3, 3.28, 3.72),
             unit(" Attention", 3, 4, 3.72, 3.78), unit(" let", 4, 5, 3.78, 4.18)]
    words = refine_word_times(units, [(2.88, 3.26)])
    assert [w["text"].strip() for w in words] == ["at", "dawn.", "Attention", "let"]
    assert words[1]["tokens"] == [1, 3]  # the "." merged into its word
    assert words[1]["end_s"] == 2.88 and words[2]["start_s"] == 3.26 and words[2]["end_s"] == 3.78


def test_a_word_after_a_sentence_end_is_bounded():
    units = [unit(" one", 0, 1, 0.0, 0.3), unit(".", 1, 2, 0.3, 0.3), unit(" two", 2, 3, 0.3, 2.3),
             unit(" three", 3, 4, 2.3, 2.6)]
    words = refine_word_times(units, [])
    median = np.median([0.3, 2.0, 0.3])  # non-zero durations
    assert abs(words[1]["start_s"] - (2.3 - 2 * median)) < 1e-9 and words[1]["end_s"] == 2.3


def test_pauses_from_levels():
    rate = 16000
    tone = 0.3 * np.sin(np.arange(rate) * 2 * np.pi * 220 / rate)
    clip = np.concatenate([tone, np.zeros(int(0.3 * rate)), tone, np.zeros(int(0.1 * rate)), tone]).astype(np.float32)
    pauses = find_pauses(np.array(position_levels(clip)))
    assert pauses == [(1.0, 1.3)]  # the 0.1 s gap is no pause
