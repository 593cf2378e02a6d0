"""The attention-as-convolution theorem (SPEC §7), numerically: models/conv_theorem.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import conv_theorem as ct


def dense_mhsa(images, weight, bias, alpha, dilation, padding):
    """The theorem's layer written the slow, obvious way: a full (T, T) softmax per head over the
    (optionally zero-padded) token grid. Checks the separable fast path."""
    C_out, C_in, K, _ = weight.shape
    n, m = images.shape[-2:]
    w = dilation * (K // 2) if padding == "zeros" else 0
    tokens = F.pad(images, (w, w, w, w)).double()                     # (C_in, R, Q)
    R, Q = tokens.shape[-2:]
    rr, cc = torch.meshgrid(torch.arange(R), torch.arange(Q), indexing="ij")
    pos = torch.stack([rr.reshape(-1), cc.reshape(-1)], -1).double()  # (T, 2)
    shift = pos[None, :, :] - pos[:, None, :]                         # (T, T, 2) k - q
    Z = tokens.reshape(C_in, -1).T                                    # (T, C_in)
    out = torch.zeros(R * Q, C_out, dtype=torch.float64)
    half = K // 2
    for i in range(K):
        for j in range(K):
            mu = torch.tensor([dilation * (i - half), dilation * (j - half)], dtype=torch.float64)
            P = torch.softmax(-alpha * ((shift - mu) ** 2).sum(-1), dim=-1)  # (T, T)
            out += P @ Z @ weight[:, :, i, j].double().T
    out = (out + bias.double()).T.reshape(C_out, R, Q)
    return out[:, w:w + n, w:w + m]


@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("dilation", [1, 2])
def test_padded_layer_equals_same_convolution_at_large_alpha(kernel_size, dilation):
    for alpha in (1e3, 1e6):
        result = ct.conv_equivalence(kernel_size, dilation, "zeros", alpha, image_size=12, channels_in=3,
                                     channels_out=4, seed=kernel_size + dilation)
        assert result.max_abs_error < 1e-5, (kernel_size, dilation, alpha, result.max_abs_error)
        assert result.interior_max_abs_error < 1e-5
        assert torch.isfinite(result.mhsa).all()
        # the comparison is not trivially zero: the convolution output is O(1)
        assert float(result.conv.abs().max()) > 0.5


@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("dilation", [1, 2])
def test_without_padding_only_the_interior_matches(kernel_size, dilation):
    result = ct.conv_equivalence(kernel_size, dilation, "none", 1e4, image_size=12, seed=3)
    assert result.interior_max_abs_error < 1e-5
    assert result.max_abs_error > 0.1, "border heads should attend to the wrong pixel without zero tokens"
    # and the mismatch is exactly on the border ring of width d*floor(K/2)
    diff = (result.mhsa - result.conv).abs().amax(0)                     # (n, n)
    mask = ct.interior_mask((12, 12), kernel_size, dilation)
    assert float(diff[~mask].max()) > 0.1
    assert float(diff[mask].max()) < 1e-5


@pytest.mark.parametrize("kernel_size,dilation", [(3, 1), (5, 2)])
def test_error_falls_as_alpha_grows(kernel_size, dilation):
    result = ct.conv_equivalence(kernel_size, dilation, "zeros", 50.0, image_size=10, seed=1)
    alphas = np.array([a for a, _ in result.error_by_alpha])
    errors = np.array([e for _, e in result.error_by_alpha])
    assert alphas.min() <= 1 and alphas.max() >= 100 and np.all(np.diff(alphas) > 0)
    # non-increasing up to round-off once the error reaches the float64 floor
    assert np.all(np.diff(errors) <= 1e-12 + 1e-9 * errors[:-1]), errors
    err_at = lambda a: errors[np.argmin(np.abs(np.log(alphas / a)))]
    assert err_at(1.0) > 0.1
    assert err_at(100.0) < 1e-10
    # roughly e^-alpha between alpha 10 and 20 (two nearest-neighbour leaks of weight e^-alpha)
    e10 = ct.compare(*ct.random_problem(kernel_size, 3, 4, 10, 1), 10.0, dilation).max_abs_error
    e20 = ct.compare(*ct.random_problem(kernel_size, 3, 4, 10, 1), 20.0, dilation).max_abs_error
    assert 1e-6 < e20 / e10 < 1e-2


@pytest.mark.parametrize("kernel_size,dilation,padding", [(3, 1, "zeros"), (3, 2, "none"), (5, 1, "none"), (2, 1, "zeros")])
@pytest.mark.parametrize("alpha", [0.3, 2.0, 40.0])
def test_separable_fast_path_equals_dense_softmax(kernel_size, dilation, padding, alpha):
    images, weight, bias = ct.random_problem(kernel_size, 2, 3, 7, seed=5)
    fast = ct.mhsa_from_kernel(images, weight, bias, alpha, dilation, padding)
    slow = dense_mhsa(images, weight, bias, alpha, dilation, padding)
    assert torch.allclose(fast, slow, atol=1e-12), float((fast - slow).abs().max())


@pytest.mark.parametrize("kernel_size,dilation", [(1, 1), (3, 1), (3, 2), (5, 1), (7, 2)])
def test_same_conv_is_torch_zero_padded_conv(kernel_size, dilation):
    images, weight, bias = ct.random_problem(kernel_size, 3, 2, 16, seed=0)
    ours = ct.same_conv(images, weight, bias, dilation)
    ref = F.conv2d(images[None], weight, bias, padding=dilation * (kernel_size // 2), dilation=dilation)[0]
    assert ours.shape == (2, 16, 16)
    assert torch.allclose(ours, ref)


@pytest.mark.parametrize("kernel_size", [2, 4])
def test_even_kernels_use_the_asymmetric_shift_set(kernel_size):
    assert ct.kernel_shifts(kernel_size)[0] == (-(kernel_size // 2),) * 2
    assert ct.kernel_shifts(kernel_size)[-1] == ((kernel_size - 1) // 2,) * 2
    result = ct.conv_equivalence(kernel_size, 1, "zeros", 1e3, image_size=9, seed=2)
    assert result.max_abs_error < 1e-5


def test_stable_at_huge_alpha_and_large_images():
    result = ct.conv_equivalence(7, 3, "zeros", 1e6, image_size=40, channels_in=2, channels_out=2, seed=9)
    assert np.isfinite(result.max_abs_error) and result.max_abs_error < 1e-5
    assert all(np.isfinite(e) for _, e in result.error_by_alpha)


def test_dilation_must_fit_and_padding_is_checked():
    with pytest.raises(ValueError, match="does not fit"):
        ct.conv_equivalence(5, 4, "zeros", 10.0, image_size=8)
    images, weight, bias = ct.random_problem(3, 1, 1, 5, seed=0)
    with pytest.raises(ValueError, match="padding"):
        ct.mhsa_from_kernel(images, weight, bias, 10.0, 1, "reflect")
