"""Local response normalisation, in the form of Krizhevsky et al. (2012) or of Caffe.

The paper writes b_i = a_i / (k + alpha * sum_{j in window(i)} a_j^2)^beta, with alpha NOT divided
by the window size n, and k = 2 (so do pylearn2 and the Theano reproduction). Caffe (and so the BVLC
weights) computes b_i = a_i / (k + (alpha / n) * sum a_j^2)^beta with k = 1: ``LRN_FORMS`` names the
two, ``make_lrn`` builds either. torch's ``local_response_norm`` divides alpha by n, so ``LRN`` passes
``coeff * size`` to it (coeff: the factor of the window sum): the result is the chosen formula
computed by the framework's own op.

That op sums the window with ``avg_pool3d``, whose CUDA backward adds with atomics (and raises in
torch's deterministic mode). Under ``torch.use_deterministic_algorithms(True)`` (``train.deterministic``)
the window sum is instead a fixed sequence of shifted slice additions, on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_size(size: int) -> None:
    # An even window has no centre; the paper's max(0, i - n/2) .. min(N-1, i + n/2) then means
    # n + 1 channels while torch sums n, so only odd sizes have one unambiguous meaning.
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size % 2 == 0:
        raise ValueError(f"LRN size must be a positive odd integer, got {size!r}")


class LRN(nn.Module):
    """Cross-channel LRN, paper constants by default (k=2, n=5, alpha=1e-4, beta=0.75).

    divide_by_size: multiply the window sum by alpha / size (Caffe's form) instead of alpha (the paper's).
    """

    def __init__(
        self, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 2.0,
        divide_by_size: bool = False,
    ) -> None:
        super().__init__()
        _check_size(size)
        self.size = size
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.k = float(k)
        self.divide_by_size = bool(divide_by_size)
        self.coeff = self.alpha / size if divide_by_size else self.alpha  # the factor of the window sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            return x / (self.k + self.coeff * channel_window_sum(x * x, self.size)) ** self.beta
        # torch computes k + (alpha' / n) * sum: alpha' = coeff * n gives our denominator.
        return F.local_response_norm(x, self.size, alpha=self.coeff * self.size, beta=self.beta, k=self.k)

    def extra_repr(self) -> str:
        form = "caffe form: alpha divided by size" if self.divide_by_size else "paper form: alpha not divided by size"
        return f"size={self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k} ({form})"


# model.lrn: the paper's (and pylearn2's, and the Theano weights') constants, or Caffe's (the BVLC weights).
LRN_FORMS = ("paper", "caffe")


def make_lrn(form: str = "paper") -> LRN:
    """The LRN of `form` (one of LRN_FORMS), with n=5, alpha=1e-4, beta=0.75."""
    if form == "paper":
        return LRN()
    if form == "caffe":
        return LRN(k=1.0, divide_by_size=True)
    raise ValueError(f"unknown LRN form {form!r}; valid: {', '.join(LRN_FORMS)}")


def channel_window_sum(x: torch.Tensor, size: int) -> torch.Tensor:
    """sum of x over the centred window of `size` channels (zeros beyond the edges), for (N, C, H, W).

    Shifted slices added in a fixed order: forward and backward are plain dense ops, deterministic.
    """
    half = size // 2
    return _window_sum_padded(F.pad(x, (0, 0, 0, 0, half, half)), size, x.shape[1])


def _window_sum_padded(padded: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    """Window sums of the `channels` middle channels of `padded` (size // 2 extra channels each side)."""
    total = padded[:, :channels]
    for i in range(1, size):
        total = total + padded[:, i:i + channels]
    return total


def lrn_with_halo(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, lrn: LRN) -> torch.Tensor:
    """`lrn` of the channels of `x`, a slice of a wider channel axis (a model-parallel column).

    `left` and `right` are the size // 2 channels just before and after the slice (zeros at the
    outer edges), so every window sums what the whole channel axis would give it.
    """
    half = lrn.size // 2
    if left.shape[1] != half or right.shape[1] != half:
        raise ValueError(f"LRN halo must be {half} channels each side, got {left.shape[1]} and {right.shape[1]}")
    squares = torch.cat([left, x, right], dim=1) ** 2
    return x / (lrn.k + lrn.coeff * _window_sum_padded(squares, lrn.size, x.shape[1])) ** lrn.beta


def lrn_reference(
    x: torch.Tensor, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 2.0,
    divide_by_size: bool = False,
) -> torch.Tensor:
    """Literal formula (for tests): explicit, zero-padded, centred channel-window sum.

    ``x`` is (N, C, ...); channel i sums a_j^2 for j from max(0, i - n//2) to min(C-1, i + n//2), times
    alpha (the paper) or alpha / n (`divide_by_size`, Caffe).
    """
    _check_size(size)
    half = size // 2
    squares = (x * x).movedim(1, -1)  # channels last so pad/unfold act on one trailing dim
    padded = F.pad(squares, (half, half))  # zeros stand in for the channels beyond the edges
    window_sum = padded.unfold(-1, size, 1).sum(-1).movedim(-1, 1)
    coeff = alpha / size if divide_by_size else alpha
    return x / (k + coeff * window_sum) ** beta
