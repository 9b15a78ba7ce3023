"""Reusable network pieces (one concept per file, timm-style)."""

from .lrn import LRN, lrn_reference

__all__ = ["LRN", "lrn_reference"]
