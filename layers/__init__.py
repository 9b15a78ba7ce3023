"""Reusable network pieces (one concept per file, timm-style)."""

from .dropout import DROPOUT_STYLES, Dropout
from .lrn import LRN, lrn_reference

__all__ = ["DROPOUT_STYLES", "Dropout", "LRN", "lrn_reference"]
