"""LRN: layers.LRN (its own autograd function) must equal the paper's formula computed literally, and torch's
own local_response_norm forward and backward; a model-parallel column's LRN (with halos) the whole one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layers import LRN, lrn_reference, lrn_with_halo, make_lrn


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs().clamp_min(1e-300)).max().item()


def _random(channels: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Scaled so alpha * sum(a^2) is O(0.1-1): the normaliser then really depends on the window.
    return 30.0 * torch.randn(2, channels, 3, 4, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5, 6, 7, 16, 96])
def test_lrn_matches_literal_formula(channels: int) -> None:
    x = _random(channels)
    assert _max_rel_err(LRN()(x), lrn_reference(x)) < 1e-10


@pytest.mark.parametrize("size,alpha,beta,k", [(3, 1e-2, 0.5, 1.0), (1, 1e-3, 1.0, 0.5), (7, 1e-4, 0.75, 2.0)])
def test_lrn_matches_literal_formula_other_constants(size: int, alpha: float, beta: float, k: float) -> None:
    x = _random(9, seed=1)
    got = LRN(size, alpha, beta, k)(x)
    assert _max_rel_err(got, lrn_reference(x, size, alpha, beta, k)) < 1e-10


def test_lrn_hand_computed() -> None:
    x = torch.arange(1.0, 8.0, dtype=torch.float64).view(1, 7, 1, 1)  # channels hold 1..7
    # Paper defaults k=2, alpha=1e-4, beta=0.75, window n=5 centred, cut at the edges.
    expected = {
        0: 1 / (2 + 1e-4 * (1 + 4 + 9)) ** 0.75,  # channels 0..2
        3: 4 / (2 + 1e-4 * (4 + 9 + 16 + 25 + 36)) ** 0.75,  # channels 1..5
        6: 7 / (2 + 1e-4 * (25 + 36 + 49)) ** 0.75,  # channels 4..6
    }
    for out in (LRN()(x), lrn_reference(x)):
        for c, value in expected.items():
            assert math.isclose(out[0, c, 0, 0].item(), value, rel_tol=1e-12)


def test_torch_alpha_convention_differs() -> None:
    """torch divides alpha by n: passing the paper's 1e-4 unchanged gives another function."""
    x = _random(16)
    reference = lrn_reference(x)
    unscaled = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)(x)
    scaled = nn.LocalResponseNorm(5, alpha=5e-4, beta=0.75, k=2.0)(x)
    assert _max_rel_err(unscaled, reference) > 1e-3
    assert _max_rel_err(scaled, reference) < 1e-10


def test_lrn_channels_last_and_float32() -> None:
    x = _random(8).float()
    expected = LRN()(x)
    got = LRN()(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(expected.double(), lrn_reference(x.double()), rtol=1e-5, atol=1e-5)


def test_lrn_gradient() -> None:
    x = _random(6)[:1, :, :2, :2].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(LRN(), (x,))


def test_lrn_repr_shows_paper_constants() -> None:
    text = repr(LRN())
    for part in ("size=5", "alpha=0.0001", "beta=0.75", "k=2.0"):
        assert part in text


@pytest.mark.parametrize("size", [0, 2, 4, -1])
def test_lrn_rejects_bad_size(size: int) -> None:
    with pytest.raises(ValueError, match="size"):
        LRN(size)
    with pytest.raises(ValueError, match="size"):
        lrn_reference(torch.ones(1, 3, 1, 1), size)


@pytest.mark.parametrize("form", ["paper", "caffe"])
@pytest.mark.parametrize("shape", [(2, 7, 5), (3, 9, 4, 5), (2, 6, 3, 2, 2), (1, 1, 3, 3)])
def test_lrn_forward_and_backward_equal_torchs_own_op(form: str, shape: tuple) -> None:
    """An independent implementation (torch's avg_pool3d window, differentiated by autograd), float64,
    N-d inputs, one random upstream gradient."""
    lrn = make_lrn(form)
    gen = torch.Generator().manual_seed(len(shape))
    x = (30.0 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    g = torch.randn(*shape, generator=gen, dtype=torch.float64)
    ours = lrn(x)
    (dx_ours,) = torch.autograd.grad(ours, x, g)
    theirs = F.local_response_norm(x, lrn.size, alpha=lrn.coeff * lrn.size, beta=lrn.beta, k=lrn.k)
    (dx_theirs,) = torch.autograd.grad(theirs, x, g)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    torch.testing.assert_close(dx_ours, dx_theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("at", [(0, 3), (2, 5), (5, 9), (0, 9)])
def test_a_columns_lrn_with_its_halos_is_the_whole_ones_slice_and_gradients_reach_the_halos(at) -> None:
    """lrn_with_halo on channels a..b of a 9-channel axis, its neighbours (zeros past the edges) as halos:
    the output is that slice of the whole axis's LRN, and the gradient of every input (the slice and
    both halos) is the whole one's (each halo channel gets what the column's windows ask of it)."""
    a, b = at
    lrn = make_lrn("caffe")
    gen = torch.Generator().manual_seed(a * 10 + b)
    whole = (150.0 * torch.randn(2, 9, 3, 2, generator=gen, dtype=torch.float64)).requires_grad_(True)
    g = torch.randn(2, b - a, 3, 2, generator=gen, dtype=torch.float64)
    padded = F.pad(whole, (0, 0, 0, 0, 2, 2))  # whole's channel c is padded's c + 2
    column = lrn_with_halo(padded[:, a + 2:b + 2], padded[:, a:a + 2], padded[:, b + 2:b + 4], lrn)
    want = lrn(whole)[:, a:b]
    torch.testing.assert_close(column, want, rtol=1e-12, atol=0)
    (d_column,) = torch.autograd.grad(column, whole, g)
    (d_want,) = torch.autograd.grad(want, whole, g)
    torch.testing.assert_close(d_column, d_want, rtol=1e-10, atol=1e-14)
    x, left, right = (t.detach().clone().requires_grad_(True)
                      for t in (padded[:, a + 2:b + 2], padded[:, a:a + 2], padded[:, b + 2:b + 4]))
    assert torch.autograd.gradcheck(lambda *t: lrn_with_halo(*t, lrn), (x, left, right))


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_input_is_normalised_in_float32_and_its_gradient_is_bf16(autocast: bool) -> None:
    """A bf16 window sum of squares would lose the small terms: the layer computes in float32 (as torch's
    own op gives under bf16 autocast) and hands back a bf16 gradient for its bf16 input."""
    x = _random(8).float().bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = LRN()(x)
    assert y.dtype == torch.float32
    exact = x.detach().double().requires_grad_(True)
    want = lrn_reference(exact)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    want.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), exact.grad, rtol=1e-2, atol=1e-4)  # bf16's 8 bits


def test_caffe_form_divides_alpha_by_the_window_hand_computed() -> None:
    """k = 1 and alpha / n (Caffe): channel 3 of 1..7 by hand, the layer and the literal formula alike."""
    x = torch.arange(1.0, 8.0, dtype=torch.float64).view(1, 7, 1, 1)
    want = 4 / (1 + 1e-4 / 5 * (4 + 9 + 16 + 25 + 36)) ** 0.75
    for out in (make_lrn("caffe")(x), LRN(k=1.0, divide_by_size=True)(x), lrn_reference(x, k=1.0, divide_by_size=True)):
        assert math.isclose(out[0, 3, 0, 0].item(), want, rel_tol=1e-12)


def test_the_forms_by_name_and_their_words() -> None:
    assert repr(make_lrn()).endswith("k=2.0 (paper form: alpha not divided by size))")
    assert repr(make_lrn("caffe")).endswith("k=1.0 (caffe form: alpha divided by size))")
    with pytest.raises(ValueError, match=r"unknown LRN form 'pylearn2'; valid: paper, caffe"):
        make_lrn("pylearn2")


@pytest.mark.parametrize("size", [3.0, True])
def test_lrn_refuses_a_size_that_is_not_an_int(size) -> None:
    with pytest.raises(ValueError, match="positive odd integer"):
        LRN(size)


def test_a_halo_of_the_wrong_width_on_one_side_is_refused_naming_both() -> None:
    x = torch.ones(1, 3, 2, 2)
    with pytest.raises(ValueError, match="LRN halo must be 2 channels each side, got 2 and 1"):
        lrn_with_halo(x, torch.ones(1, 2, 2, 2), torch.ones(1, 1, 2, 2), LRN())
    with pytest.raises(ValueError, match="got 3 and 2"):
        lrn_with_halo(x, torch.ones(1, 3, 2, 2), torch.ones(1, 2, 2, 2), LRN())
