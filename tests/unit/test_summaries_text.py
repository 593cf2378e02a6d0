"""Mean attention distance for text (SPEC §6): Σ_j P[i,j] |i − j| averaged over query rows, in tokens."""
import torch

from models.summaries import mean_token_distance
from tests.float32 import assert_close_f32


def test_identity_attention_has_zero_distance():
    attention = torch.eye(7).expand(2, 3, 7, 7)  # (L, H, T, T)
    assert mean_token_distance(attention).shape == (2, 3)
    assert torch.allclose(mean_token_distance(attention), torch.zeros(2, 3))


def test_uniform_rows_match_the_closed_form():
    # Mean of |i − j| over all pairs of n positions is (n² − 1) / (3n).
    for n in (2, 5, 16):
        attention = torch.full((1, 1, n, n), 1.0 / n)
        expected = (n * n - 1) / (3 * n)
        assert abs(float(mean_token_distance(attention)[0, 0]) - expected) < 1e-5


def test_previous_token_head_and_each_head_separately():
    n = 6
    previous = torch.zeros(n, n)
    previous[0, 0] = 1.0
    for i in range(1, n):
        previous[i, i - 1] = 1.0  # every query but the first attends one token back
    first = torch.zeros(n, n)
    first[:, 0] = 1.0  # every query attends token 0: distance i
    attention = torch.stack([previous, first]).unsqueeze(0)  # (1, 2, T, T)
    got = mean_token_distance(attention)
    # float32 sums of n·n weighted distances against the exact means, at their scale
    assert_close_f32(got[0, 0], torch.tensor((n - 1) / n), n * n)
    assert_close_f32(got[0, 1], torch.tensor(sum(range(n)) / n), n * n)


def test_all_masked_row_contributes_zero_and_matches_a_direct_loop():
    torch.manual_seed(0)
    attention = torch.softmax(torch.randn(2, 2, 5, 5), dim=-1)
    attention[1, 0, 2] = 0.0  # a row whose keys are all masked
    got = mean_token_distance(attention)
    for layer in range(2):
        for head in range(2):
            p = attention[layer, head]
            direct = sum(float(p[i, j]) * abs(i - j) for i in range(5) for j in range(5)) / 5
            assert abs(float(got[layer, head]) - direct) < 1e-5


def test_long_inputs_keep_float32_summaries_accurate():
    """At 512 tokens the float32 batched sum stays within 1e-4 relative of a float64 reference."""
    torch.manual_seed(1)
    attention = torch.softmax(3 * torch.randn(2, 2, 512, 512), dim=-1)
    positions = torch.arange(512, dtype=torch.float64)
    reference = (attention.double() * (positions[:, None] - positions[None, :]).abs()).sum(-1).mean(-1)
    assert torch.allclose(mean_token_distance(attention).double(), reference, rtol=1e-4)
