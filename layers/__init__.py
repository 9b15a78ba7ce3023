"""Reusable network pieces (one concept per file, timm-style)."""

from .collectives import Comm, TorchComm, all_reduce_sum, gather, gather_counts
from .dropout import DROPOUT_STYLES, Dropout
from .lrn import LRN, LRN_FORMS, channel_window_sum, lrn_reference, lrn_with_halo, make_lrn
from .pool import AdaptiveAvgPool, MaxPool, adaptive_avg_pool2d_fixed_order, max_pool2d_fixed_order

__all__ = ["DROPOUT_STYLES", "LRN_FORMS", "AdaptiveAvgPool", "Comm", "Dropout", "LRN", "MaxPool", "TorchComm",
           "adaptive_avg_pool2d_fixed_order", "all_reduce_sum", "channel_window_sum", "gather", "gather_counts",
           "lrn_reference", "lrn_with_halo", "make_lrn", "max_pool2d_fixed_order"]
