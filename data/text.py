"""Quoting a user's value in a message: bounded, so that no value (an alias bomb's list, a 400-digit number)
makes a long line. Shared by the config loader (alexnet/config.py) and the data checks (data/meta.py)."""
from __future__ import annotations

import reprlib
from typing import Any

SHOWN = 200  # characters of a user's value quoted in a message, at most


class _Short(reprlib.Repr):
    """reprlib with room for a config value; never converts a huge int to decimal (which Python refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 4, SHOWN, SHOWN, SHOWN
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 30

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * SHOWN:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _Short()


def shown(value: Any, limit: int = SHOWN) -> str:
    """repr(value) for a message, at most about `limit` characters: a longer one is cut, "...", and the
    value's length added, so that no value (an alias bomb's list, a 400-digit number) makes a long line."""
    text = _SHORT.repr(value)
    cut = len(text) > limit
    if not cut and "..." not in text:
        return text
    size = f" ({len(value)} {'characters' if isinstance(value, (str, bytes)) else 'items'})" \
        if isinstance(value, (str, bytes, list, tuple, dict)) else ""
    return (text[:limit] + "..." if cut else text) + size
