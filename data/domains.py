"""The domains of the user scripts' numeric options, declared once: each is an argparse ``type`` that
converts the text, refuses a value outside the domain in one line naming the option (argparse adds its
name), and lists values it must refuse, from which tests/test_option_domains.py tries every numeric option
of every script as the parsers define them. A bare ``type=int`` or ``type=float`` accepts -1, 0, nan and
inf alike: the test fails for such an option."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn


class Domain:
    """An argparse type: `convert` the text, then require `ok(value)`; `refused`: texts it must refuse."""

    def __init__(self, describe: str, convert: Callable[[str], float | int], ok: Callable[[float | int], bool],
                 refused: tuple[str, ...]):
        self.describe, self.convert, self.ok, self.refused = describe, convert, ok, refused
        self.__name__ = describe  # argparse's "invalid <name> value" for text that does not convert

    def __call__(self, text: str) -> float | int:
        try:
            value = self.convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {self.describe}, got {text!r}") from None
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe}, got {text}")
        return value

    def __repr__(self) -> str:
        return f"Domain({self.describe})"


MAX_INT = 2**63 - 1  # beyond, no count means anything (torch, numpy and h5py overflow)
_NOT_INT = ("1.5", "x", "", "nan", "1e999")
_NOT_FLOAT = ("x", "", "nan", "inf", "-inf", "1e999")


def at_least(low: int) -> Domain:
    """An integer from `low` up (to MAX_INT)."""
    return Domain(f"an integer >= {low}", int, lambda n: low <= n <= MAX_INT,
                  (str(low - 1), str(MAX_INT + 1), *_NOT_INT))


COUNT = at_least(1)          # how many: images, steps, files, workers, replicas ...
NON_NEGATIVE = at_least(0)   # may be none: seeds, epochs (0 where the default means "the last"), warmups
POSITIVE = Domain("a finite number > 0", float, lambda x: math.isfinite(x) and x > 0, ("0", "-1", *_NOT_FLOAT))
NON_NEGATIVE_FLOAT = Domain("a finite number >= 0", float, lambda x: math.isfinite(x) and x >= 0,
                            ("-0.5", *_NOT_FLOAT))


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (a bad value, a missing argument) are one line, `prog: error:
    ...`, exit 2, as the tools' other errors; --help still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
