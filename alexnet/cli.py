"""What command-line scripts share: a positive-integer argument type, a parser whose usage errors are one line,
and one mapping of errors to exit codes (2 bad input, the operating system's verdict for OSErrors, 130 Ctrl-C),
each printed as one line."""
from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from data.batchfile import BatchFileError
from data.fsutil import os_error_exit_code, os_error_message

from .checkpoint import CheckpointError

T = TypeVar("T")


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (a bad value, a missing argument) are one line, `prog: error:
    ...`, exit 2, as the tools' other errors; --help still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def guarded(prog: str, work: Callable[[], T], interrupted: str = "") -> tuple[int, T | None]:
    """(0, work()) or, where it raised, (the exit code, None) after one line `prog: error: ...` on stderr.

    Bad input (CheckpointError; ValueError, which DataError, ConfigError and FormatError are; BatchFileError,
    a damaged batch file) is 2; another OSError (unwritable output, disk full) is the operating system's code;
    Ctrl-C is 130, its line `prog: interrupted` followed by `interrupted` (what it left, e.g.).
    """
    try:
        return 0, work()
    except (CheckpointError, BatchFileError, ValueError) as e:  # BatchFileError is an OSError: caught first
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2, None
    except OSError as e:
        print(f"{prog}: error: {os_error_message(e)}", file=sys.stderr)
        return os_error_exit_code(e), None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted{interrupted}", file=sys.stderr)
        return 128 + signal.SIGINT, None
