"""Dropout in either of its two equivalent-in-expectation forms.

``inverted`` (PyTorch): kept units are scaled by 1/(1-p) in training, nothing happens at test time.
``theano`` (Krizhevsky 2012, the Theano reproduction): kept units are NOT scaled in training, and every
unit is multiplied by (1-p) at test time. The two compute the same function when the weights that read
the dropped units differ by the factor (1-p); only the ``theano`` form continues a Theano run with the
very same weights and the very same SGD dynamics (the gradient of a rescaled weight is rescaled too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DROPOUT_STYLES = ("inverted", "theano")


class Dropout(nn.Module):
    """nn.Dropout with a `style` (see the module docstring); draws the same masks as nn.Dropout."""

    def __init__(self, p: float = 0.5, style: str = "inverted") -> None:
        super().__init__()
        if style not in DROPOUT_STYLES:
            raise ValueError(f"dropout style must be one of {', '.join(DROPOUT_STYLES)}, got {style!r}")
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.style = float(p), style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "inverted":
            return F.dropout(x, self.p, self.training)
        if not self.training:
            return x * (1 - self.p)
        if self.p == 0:
            return x
        # The same Bernoulli draw as nn.Dropout (same RNG use), without its 1/(1-p) scale.
        keep = torch.empty_like(x).bernoulli_(1 - self.p)
        return x * keep

    def extra_repr(self) -> str:
        return f"p={self.p}, style={self.style}"
