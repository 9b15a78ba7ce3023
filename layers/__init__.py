"""Reusable network pieces (one concept per file, timm-style)."""

from .dropout import DROPOUT_STYLES, Dropout
from .lrn import LRN, channel_window_sum, lrn_reference
from .pool import AdaptiveAvgPool, MaxPool, adaptive_avg_pool2d_fixed_order, max_pool2d_fixed_order

__all__ = ["DROPOUT_STYLES", "AdaptiveAvgPool", "Dropout", "LRN", "MaxPool", "adaptive_avg_pool2d_fixed_order",
           "channel_window_sum", "lrn_reference", "max_pool2d_fixed_order"]
