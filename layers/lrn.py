"""Local response normalisation, in the form of Krizhevsky et al. (2012) or of Caffe.

The paper writes b_i = a_i / (k + alpha * sum_{j in window(i)} a_j^2)^beta, with alpha NOT divided
by the window size n, and k = 2 (so do pylearn2 and the Theano reproduction). Caffe (and so the BVLC
weights) computes b_i = a_i / (k + (alpha / n) * sum a_j^2)^beta with k = 1: ``LRN_FORMS`` names the
two, ``make_lrn`` builds either (``coeff``: the factor of the window sum).

One autograd function computes both, on every device, in every mode: the window sum is a fixed sequence
of shifted slice additions (no atomics: deterministic, so ``train.deterministic`` needs no other path),
s^-beta is exp(-beta log s) (torch's pow with a fractional exponent costs twice as much on the CPU), and
the backward is the closed form (Caffe's): dx_j = g_j s_j^-beta - 2 coeff beta x_j sum_{i in window(j)}
g_i b_i / s_i. torch's ``local_response_norm`` sums with ``avg_pool3d`` and lets autograd differentiate
it: measured side by side (``scripts/benchmark.py lrn``), this is faster forward and backward. A
model-parallel column's LRN (``lrn_with_halo``) is the same function given its neighbours' channels.
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
        return _WindowLRN.apply(x, None, None, self.size, self.coeff, self.beta, self.k)

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
    """sum of x over the centred window of `size` channels (zeros beyond the edges), for (N, C, ...).

    Shifted slices added in a fixed order: plain dense ops, deterministic.
    """
    return _window_sum_padded(_pad_channels(x, size // 2), size, x.shape[1])


def _window_sum_padded(padded: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    """Window sums of the `channels` middle channels of `padded` (size // 2 extra channels each side)."""
    total = padded[:, :channels].clone()
    for i in range(1, size):
        total += padded[:, i:i + channels]
    return total


def lrn_with_halo(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, lrn: LRN) -> torch.Tensor:
    """`lrn` of the channels of `x`, a slice of a wider channel axis (a model-parallel column).

    `left` and `right` are the size // 2 channels just before and after the slice (zeros at the
    outer edges), so every window sums what the whole channel axis would give it; they get gradients.
    """
    half = lrn.size // 2
    if left.shape[1] != half or right.shape[1] != half:
        raise ValueError(f"LRN halo must be {half} channels each side, got {left.shape[1]} and {right.shape[1]}")
    return _WindowLRN.apply(x, left, right, lrn.size, lrn.coeff, lrn.beta, lrn.k)


class _WindowLRN(torch.autograd.Function):
    """b = x s^-beta, s = k + coeff * (window sum of the squares), over the channels of `x` (N, C, ...)
    with `left` and `right` (size // 2 channels each, or None for zeros) beyond its edges.

    Computed in float32 at least: under bf16 autocast a bf16 window sum of squares would lose the small
    terms (torch's own op gives float32 there too); autograd casts the gradients to their inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, left, right, size: int, coeff: float, beta: float, k: float):
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        if left is None:
            wide = _pad_channels(xf, size // 2)
        else:
            wide = torch.cat([left, xf, right], dim=1)  # cat promotes the halos to xf's dtype
        s = _window_sum_padded(wide * wide, size, x.shape[1]).mul_(coeff).add_(k)
        scale = s.log().mul_(-beta).exp_()  # s^-beta
        ctx.save_for_backward(xf, wide if left is not None else None, s, scale)
        ctx.size, ctx.coeff, ctx.beta = size, coeff, beta
        return xf * scale

    @staticmethod
    def backward(ctx, grad):
        xf, wide, s, scale = ctx.saved_tensors
        g, half, factor = grad, ctx.size // 2, 2.0 * ctx.coeff * ctx.beta  # grad: the output's dtype, xf's
        t = g * xf * scale / s  # g_i b_i / s_i: what each output asks of the squares in its window
        if wide is None:
            dx = g * scale - factor * xf * channel_window_sum(t, ctx.size)
            return dx, None, None, None, None, None, None
        channels = xf.shape[1]
        # a halo channel is in the windows of the outputs within half of it: t padded, summed again
        dwide = wide * channel_window_sum(_pad_channels(t, half), ctx.size).mul_(-factor)
        dwide[:, half:half + channels] += g * scale
        return dwide[:, half:half + channels], dwide[:, :half], dwide[:, half + channels:], None, None, None, None


def _pad_channels(x: torch.Tensor, half: int) -> torch.Tensor:
    """x (N, C, ...) with `half` zero channels before and after."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (half, half))


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
