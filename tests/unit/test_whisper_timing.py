"""Word-timing and overview helpers of models/adapters/whisper.py on matrices whose answers are known."""
from __future__ import annotations

import numpy as np
import torch

from models.adapters.whisper import alignment_matrix, dtw, encoder_overview, spearman
from tests.float32 import assert_close_f32


def test_dtw_follows_a_staircase():
    """Three tokens spoken over columns 0–3, 4–6, 7–9: the cheapest monotonic path enters each row at its start."""
    cost = np.ones((3, 10))
    for row, (start, end) in enumerate([(0, 4), (4, 7), (7, 10)]):
        cost[row, start:end] = 0.0
    rows, cols = dtw(cost)
    assert rows[0] == 0 and cols[0] == 0 and rows[-1] == 2 and cols[-1] == 9
    assert np.all(np.diff(rows) >= 0) and np.all(np.diff(cols) >= 0)  # monotonic
    first_col = {int(r): int(cols[rows == r].min()) for r in range(3)}
    assert first_col == {0: 0, 1: 4, 2: 7}
    assert cost[rows, cols].sum() == 0.0


def test_alignment_matrix_standardises_and_filters():
    rng = np.random.default_rng(0)
    weights = rng.random((2, 5, 40))
    weights[:, :, 20] = 50.0  # a one-column spike is removed by the width-7 median filter
    matrix = alignment_matrix(weights)
    assert matrix.shape == (5, 40)
    assert np.abs(matrix[:, 20]).max() < 3.0


def test_encoder_overview_blocks_are_means_and_rows_sum_to_one():
    torch.manual_seed(0)
    maps = torch.softmax(torch.randn(2, 3, 400, 400), dim=-1)  # (L, H, T, T); only the first 333 are the clip
    n_positions = 333
    clip = maps[:, :, :n_positions, :n_positions]
    overview, block = encoder_overview(maps, n_positions, blocks=50)
    assert block == 7 and overview.shape == (2, 3, 48, 48)
    assert_close_f32(overview[1, 2, 3, 5], clip[1, 2, 21:28, 35:42].mean(), 7 * 7)  # a mean of 7×7 cells at its scale
    # the last block is narrower (333 = 47 · 7 + 4) and still a mean over its own cells
    assert_close_f32(overview[0, 0, -1, -1], clip[0, 0, 329:, 329:].mean(), 4 * 4)
    widths = torch.tensor([7.0] * 47 + [4.0])
    # Σ_b value·width over a block row = the mean row sum over the clip's keys (< 1: the padding keys are left out)
    row_sums = (overview * widths).sum(-1)
    assert_close_f32(row_sums[0, 0, 0], clip[0, 0, :7].sum(-1).mean(), n_positions, scale=1.0)  # row sums over 333 keys


def test_spearman():
    x = np.arange(10.0)
    assert abs(spearman(x, x**3) - 1.0) < 1e-12
    assert abs(spearman(x, -x) + 1.0) < 1e-12
    assert spearman(x, np.ones(10)) == 0.0
