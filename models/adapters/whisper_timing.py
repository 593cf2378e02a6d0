"""Whisper's word timing (docs/science.md §11): the alignment heads' cross-attention aligned to time by dynamic time
warping (as OpenAI's whisper/timing.py does it), the rules that place words at pauses after it, and the ranking of
cross heads by how well they follow the speech. Functions of a run's maps and tokens; models/adapters/whisper.py's
WhisperAdapter calls them (and re-exports their names)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

RATE = 16000  # samples per second
POSITION_S = 0.02  # one encoder position (two frames)
MEDIAN_WIDTH = 7  # OpenAI's word-timestamp median filter width (frames of 20 ms)


def word_times(result: Any, encoded: Any, alignment_heads: list[tuple[int, int]],
               token_text: Callable[[int], str]) -> list[dict[str, Any]]:
    """Words of the target with start/end in seconds: the alignment heads' cross-attention aligned to time by DTW
    (as OpenAI's whisper/timing.py does it), then the rules of `refine_word_times` (docs/science.md §11)."""
    labels = encoded.extra["labels"]  # text tokens + EOT
    if len(labels) < 2 or not alignment_heads:
        return []
    n_positions = result.derived["n_positions"]
    cross = result.by_kind["cross"]  # (L, H, N, 1500)
    weights = torch.stack([cross[layer, head] for layer, head in alignment_heads])  # (A, N, 1500)
    weights = weights[:, :, :n_positions].double().numpy()  # (A, N, n)
    matrix = alignment_matrix(weights)[len(encoded.extra["prompt"]) - 1:]  # rows predicting labels[0 …]: (len(labels), n)
    text_indices, time_indices = dtw(-matrix)
    texts = [token_text(t) for t in labels[:-1]]
    units = split_units(texts)  # punctuation apart: its time is not its word's (a "." can span a pause)
    if not units:
        return []
    boundaries = np.pad(np.cumsum([b - a for a, b in units]), (1, 0))  # token index where each unit starts
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] * POSITION_S  # first time each token row is aligned
    timed = [{"text": "".join(texts[a:b]), "tokens": [a, b], "start_s": float(jump_times[boundaries[k]]),
              "end_s": float(jump_times[min(boundaries[k + 1], len(jump_times) - 1)])} for k, (a, b) in enumerate(units)]
    levels = encoded.extra.get("position_db")
    pauses = find_pauses(np.asarray(levels[:n_positions])) if levels is not None else []
    out = []
    for word in refine_word_times(timed, pauses):
        out.append({"word": word["text"].strip(), "start_s": round(word["start_s"], 3),
                    "end_s": round(max(word["end_s"], word["start_s"]), 3), "tokens": word["tokens"]})
    return out


def split_words(tokens: list[int], token_text: Callable[[int], str]) -> tuple[list[str], list[list[int]]]:
    """English words: a token that starts with a space starts a word; punctuation stays with its word."""
    words: list[str] = []
    groups: list[list[int]] = []
    for token in tokens:
        text = token_text(token)
        if not groups or text.startswith(" "):
            words.append(text)
            groups.append([token])
        else:
            words[-1] += text
            groups[-1].append(token)
    return [w.strip() for w in words], groups


def alignment_ranking(result: Any, encoded: Any, alignment_heads: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Every cross head ranked by how well its text rows follow the speech: `monotonicity`, the Spearman
    correlation between a row's place in the text and the time its attention peaks (1 = always forward in time),
    times `focus`, the mean of each row's largest weight (a head that spreads its rows evenly follows nothing)."""
    n_text = len(encoded.extra["labels"]) - 1
    n_positions = result.derived["n_positions"]
    first = len(encoded.extra["prompt"]) - 1  # the row that predicts the first text token
    cross = result.by_kind["cross"][:, :, first:first + n_text, :n_positions]  # (L, H, n_text, n)
    ranking = []
    for layer in range(cross.shape[0]):
        for head in range(cross.shape[1]):
            rows = cross[layer, head]  # (n_text, n)
            peaks = rows.argmax(dim=-1).double().numpy()  # (n_text,)
            monotonicity = spearman(np.arange(peaks.size, dtype=float), peaks) if peaks.size > 2 else 0.0
            focus = float(rows.max(dim=-1).values.mean()) if rows.numel() else 0.0
            ranking.append({"layer": layer, "head": head, "monotonicity": round(monotonicity, 4),
                            "focus": round(focus, 4), "score": round(max(monotonicity, 0.0) * focus, 4),
                            "alignment_head": (layer, head) in alignment_heads})
    return sorted(ranking, key=lambda item: -item["score"])


def alignment_matrix(weights: np.ndarray) -> np.ndarray:
    """OpenAI's word-timing preprocessing: each head's rows standardised over the tokens (per time), a median
    filter of width 7 along time, then the mean over heads. weights: (A, N, n) → (N, n)."""
    from scipy.ndimage import median_filter

    mean = weights.mean(axis=1, keepdims=True)
    std = weights.std(axis=1, keepdims=True)
    standardised = (weights - mean) / np.where(std > 0, std, 1.0)
    filtered = median_filter(standardised, size=(1, 1, MEDIAN_WIDTH), mode="reflect")
    return filtered.mean(axis=0)


# ---- word-timing rules after the DTW -----------------------------------------------------------------------------
# The DTW alone places a word where the alignment heads' rows change, and these heads are coarse: on the bundled
# sample "dawn." ran 2.62–3.72 s across a 0.38 s pause (its "." was aligned inside the silence) and "Attention"
# started 0.46 s after the speech resumed. OpenAI's whisper/timing.py adds rules after its DTW (punctuation timed
# apart, then merged into its word; words at sentence ends bounded to twice the median word duration, capped at
# 0.7 s; its comment notes that a segmentation from voice activity should replace these). Ours, written anew: the
# first two ideas, and the voice-activity one: the clip's own loudness per 20 ms position finds the pauses; no word
# spans one, and speech resuming after a pause starts the next word.
PUNCTUATION = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~“”‘’¿¡。，！？：、")
APPENDED = set("\"'.。,，!！?？:：”)]}、;")  # joins the word before it
SENTENCE_END = set(".。!！?？")
PAUSE_S = 0.16  # a silence this long is a pause (stop closures inside words are shorter, ~50–120 ms)
SILENCE_DB = 35.0  # a position this far below the clip's loud level (its 95th percentile) is silent
SILENCE_FLOOR_DB = -60.0  # …and any position below this level (dBFS) is


def position_levels(samples: np.ndarray) -> list[float]:
    """RMS level in dBFS of each 20 ms encoder position of the clip (the word-timing pause finder's input)."""
    hop = int(round(POSITION_S * RATE))
    n = math.ceil(samples.size / hop) if samples.size else 0
    padded = np.zeros(n * hop, dtype=np.float64)
    padded[:samples.size] = samples
    rms = np.sqrt((padded.reshape(n, hop) ** 2).mean(axis=1))
    return [round(float(v), 2) for v in 20 * np.log10(np.maximum(rms, 1e-6))]


def find_pauses(levels_db: np.ndarray, min_s: float = PAUSE_S) -> list[tuple[float, float]]:
    """(start_s, end_s) of each run of silent positions at least `min_s` long."""
    if levels_db.size == 0:
        return []
    loud = float(np.percentile(levels_db, 95))
    silent = (levels_db < loud - SILENCE_DB) | (levels_db < SILENCE_FLOOR_DB)
    pauses, start = [], None
    for j, quiet in enumerate(list(silent) + [False]):
        if quiet and start is None:
            start = j
        elif not quiet and start is not None:
            if (j - start) * POSITION_S >= min_s - 1e-9:
                pauses.append((start * POSITION_S, j * POSITION_S))
            start = None
    return pauses


def split_units(texts: list[str]) -> list[tuple[int, int]]:
    """Token ranges [a, b) of the timing units: a token starting with a space starts a word, and a token of
    punctuation only is a unit of its own (timed apart, then merged back into its word)."""
    units: list[list[int]] = []
    for k, text in enumerate(texts):
        if not units or text.startswith(" ") or _punctuation(text) or _punctuation("".join(texts[units[-1][0]:k])):
            units.append([k, k + 1])
        else:
            units[-1][1] = k + 1
    return [(a, b) for a, b in units]


def _punctuation(text: str) -> bool:
    stripped = text.strip()
    return bool(stripped) and all(c in PUNCTUATION for c in stripped)


def refine_word_times(units: list[dict[str, Any]], pauses: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """The rules after the DTW (see above). units: [{text, tokens [a, b), start_s, end_s}] in order, punctuation as
    units of its own; returns the words (punctuation merged into them) with their times."""
    units = [dict(u) for u in units]
    durations = np.array([u["end_s"] - u["start_s"] for u in units])
    durations = durations[durations > 0]
    median = min(0.7, float(np.median(durations))) if durations.size else 0.0
    longest = 2 * median
    # a word after a sentence end keeps at most twice the median duration, counted back from its end (the DTW
    # tends to stretch it back over the pause that follows a sentence)
    for k in range(1, len(units)):
        previous = units[k - 1]["text"].strip()
        if longest and previous and previous[-1] in SENTENCE_END and units[k]["end_s"] - units[k]["start_s"] > longest:
            units[k]["start_s"] = units[k]["end_s"] - longest
    # punctuation merged into its word; the word keeps its own times (the punctuation's were only its alignment's)
    words: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # prepended punctuation (" (", " “") waiting for its word
    for u in units:
        stripped = u["text"].strip()
        is_punct = _punctuation(u["text"])
        if is_punct and words and not u["text"].startswith(" ") and all(c in APPENDED for c in stripped):
            words[-1]["text"] += u["text"]
            words[-1]["tokens"] = [words[-1]["tokens"][0], u["tokens"][1]]
        elif is_punct:
            pending.append(u)
        else:
            if pending:
                u["text"] = "".join(p["text"] for p in pending) + u["text"]
                u["tokens"] = [pending[0]["tokens"][0], u["tokens"][1]]
                pending = []
            words.append(u)
    if pending:  # punctuation with no word after it: a word of its own, with its times
        merged = dict(pending[0], text="".join(p["text"] for p in pending), tokens=[pending[0]["tokens"][0], pending[-1]["tokens"][1]])
        merged["end_s"] = pending[-1]["end_s"]
        words.append(merged)
    # pauses: each word is on one side of each pause (the side holding more of it); none spans it, the words
    # before end by its start, and the speech after it starts the first word after it
    for a, b in pauses:
        before = [w for w in words if _side(w, a, b) < 0]
        after = [w for w in words if _side(w, a, b) > 0]
        for w in before:
            w["end_s"] = min(w["end_s"], a)
            w["start_s"] = min(w["start_s"], w["end_s"])
        for w in after:
            w["start_s"] = max(w["start_s"], b)
            w["end_s"] = max(w["end_s"], w["start_s"])
        if after:
            after[0]["start_s"] = b
        if before:
            before[-1]["end_s"] = a
    for k in range(1, len(words)):  # order kept: a word starts no earlier than the one before it
        words[k]["start_s"] = max(words[k]["start_s"], words[k - 1]["start_s"])
        words[k]["end_s"] = max(words[k]["end_s"], words[k]["start_s"])
    return words


def _side(word: dict[str, Any], a: float, b: float) -> int:
    """-1 when a word belongs before the pause [a, b], +1 after: by where more of it lies (outside the pause),
    then by its middle."""
    s, e = word["start_s"], word["end_s"]
    if e <= a:
        return -1
    if s >= b:
        return 1
    ahead, behind = max(0.0, a - s), max(0.0, e - b)
    if ahead != behind:
        return -1 if ahead > behind else 1
    return -1 if (s + e) / 2 < (a + b) / 2 else 1


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonic alignment of rows (text tokens) to columns (time) minimising the summed cost; returns the path as
    (row indices, column indices). Computed along anti-diagonals (every cell of one depends only on the two before)."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0: diagonal step, 1: from the row above, 2: from the left
    for k in range(2, n + m + 1):
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        options = np.stack([total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]])  # (3, cells)
        choice = options.argmin(axis=0)
        total[i, j] = cost[i - 1, j - 1] + options[choice, np.arange(i.size)]
        trace[i, j] = choice
    trace[0, :], trace[:, 0] = 2, 1
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    path = np.array(path[::-1])
    keep = (path[:, 0] >= 0) & (path[:, 1] >= 0)
    return path[keep, 0], path[keep, 1]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (ties share their mean rank); 0 when either side is constant."""
    from scipy.stats import rankdata

    rx, ry = rankdata(x), rankdata(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])
