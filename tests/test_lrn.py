"""LRN: the fast framework-op module must equal the paper's formula, computed literally."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from layers import LRN, lrn_reference


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
