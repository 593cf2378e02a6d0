"""Thumbnails of every head: pooling as two matrix products must equal adaptive average pooling."""
import base64

import pytest
import torch

from app.attention import pooling_matrix, thumbnails
from tests.float32 import assert_close_f32


@pytest.mark.parametrize("n", [25, 128, 130, 512])
def test_pooling_matrix_equals_adaptive_avg_pool(n):
    torch.manual_seed(n)
    maps = torch.rand(2, 3, n, n)
    pool = pooling_matrix(n, 24)
    expected = torch.nn.functional.adaptive_avg_pool2d(maps.reshape(6, 1, n, n), 24).reshape(2, 3, 24, 24)
    window = n // 24 + 2  # an adaptive pooling window spans at most ⌈n/24⌉ + 1 rows (and columns)
    assert_close_f32(pool @ maps @ pool.T, expected, window * window)  # means of a window's cells, at their scale
    assert torch.allclose(pool.sum(dim=1), torch.ones(24))


def test_thumbnail_levels_are_relative_to_each_heads_peak():
    maps = torch.zeros(1, 2, 48, 48)
    maps[0, 0, :24, :24] = 1.0  # the top-left quarter: pooled to the top-left 12×12 block
    maps[0, 1] = 0.5
    out = thumbnails(maps, 24)
    levels = torch.frombuffer(bytearray(base64.b64decode(out["data"])), dtype=torch.uint8).reshape(out["shape"])
    assert out["shape"] == [1, 2, 24, 24]
    assert out["max"] == [[1.0, 0.5]]
    assert int(levels[0, 0, :12, :12].min()) == 255 and int(levels[0, 0, 12:].max()) == 0
    assert int(levels[0, 1].min()) == 255
