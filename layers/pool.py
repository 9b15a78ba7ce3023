"""Pooling whose backward pass is deterministic when torch's deterministic mode is on.

AlexNet's max-pooling overlaps (3x3 windows, stride 2): an input pixel can be the maximum of up to
four windows, so the backward pass adds up to four gradients into one place. How a CUDA kernel does
that (gather or atomics) is torch's choice and has changed between releases; AdaptiveAvgPool2d's
CUDA backward has no deterministic kernel at all. With ``torch.use_deterministic_algorithms(True)``
(``train.deterministic``) these modules therefore switch to formulations made of dense, fixed-order
operations, on every device, so the CPU tests run the very code a deterministic GPU run uses.
Otherwise they are torch's own modules (same class, same state dict, same speed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _MaxPoolFixedOrder(torch.autograd.Function):
    """max_pool2d (no padding) whose backward adds the window gradients offset by offset."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
        out, idx = F.max_pool2d(x, kernel, stride, return_indices=True)
        ctx.save_for_backward(idx)
        ctx.shape, ctx.kernel, ctx.stride = x.shape, kernel, stride
        ctx.channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (idx,) = ctx.saved_tensors
        k, s, width = ctx.kernel, ctx.stride, ctx.shape[-1]
        fmt = torch.channels_last if ctx.channels_last else torch.contiguous_format
        grad_in = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device, memory_format=fmt).zero_()
        ho, wo = grad.shape[-2:]
        rows = torch.arange(ho, device=grad.device) * s
        cols = torch.arange(wo, device=grad.device) * s
        zero = grad.new_zeros(())
        for dy in range(k):  # a fixed order of additions: the same result on every run
            for dx in range(k):
                flat = (rows[:, None] + dy) * width + (cols[None, :] + dx)  # input pixel under (dy, dx)
                hit = torch.where(idx == flat, grad, zero)
                grad_in[..., dy:dy + s * (ho - 1) + 1:s, dx:dx + s * (wo - 1) + 1:s] += hit
        return grad_in, None, None


def max_pool2d_fixed_order(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """F.max_pool2d(x, kernel, stride) with a deterministic backward pass."""
    return _MaxPoolFixedOrder.apply(x, kernel, stride)


def _bins(size: int, out: int) -> list[tuple[int, int]]:
    """AdaptiveAvgPool's bins: [floor(i*size/out), ceil((i+1)*size/out))."""
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


def adaptive_avg_pool2d_fixed_order(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """F.adaptive_avg_pool2d(x, size) from slices and means (deterministic backward)."""
    (h, w), (oh, ow) = x.shape[-2:], size
    if (h, w) == (oh, ow):
        return x
    if h % oh == 0 and w % ow == 0:
        return F.avg_pool2d(x, (h // oh, w // ow))
    rows = torch.cat([x[..., a:b, :].mean(-2, keepdim=True) for a, b in _bins(h, oh)], dim=-2)
    return torch.cat([rows[..., a:b].mean(-1, keepdim=True) for a, b in _bins(w, ow)], dim=-1)


class MaxPool(nn.MaxPool2d):
    """nn.MaxPool2d(kernel, stride); deterministic backward in deterministic mode (module docstring)."""

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__(kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            return max_pool2d_fixed_order(x, self.kernel_size, self.stride)
        return super().forward(x)


class AdaptiveAvgPool(nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d(size); deterministic backward in deterministic mode (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            size = self.output_size if isinstance(self.output_size, tuple) else (self.output_size,) * 2
            return adaptive_avg_pool2d_fixed_order(x, size)
        return super().forward(x)
