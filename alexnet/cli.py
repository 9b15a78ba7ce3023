"""What command-line scripts share: a positive-integer argument type, a parser whose usage errors are one line,
one mapping of errors to exit codes (2 bad input, the operating system's verdict for OSErrors, 130 Ctrl-C,
128+N signal N), each printed as one line, and standard streams whose loss (a closed stdout, a reader that went
away, a hung-up terminal) is not an error."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO, TypeVar

from data.batchfile import BatchFileError
from data.domains import COUNT, OneLineParser  # noqa: F401 (re-exported: the scripts' parser)
from data.fsutil import os_error_exit_code, os_error_message
from data.procs import follow_parent, stops_between_calls

from . import startup

T = TypeVar("T")
# A reader that went away (| head), a stream closed under us, a terminal hung up (ssh dropped): writes to
# such a stream can never succeed again.
_GONE = {errno.EPIPE, errno.EBADF, errno.EIO}
# Signals that stop a tool the way Ctrl-C does (an exception, so that atomic writers remove their temporary
# files): kill's default and the terminal's hangup.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


positive = COUNT  # argparse type: an integer >= 1 (data/domains.py declares every numeric option's domain)


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) turned into an exception, as Ctrl-C is one. `late`: raised when the
    block it stopped had ended anyway (its exception was lost in a finalizer): the block's work was done."""

    def __init__(self, signum: int, late: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.late = signum, late


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """While the block runs, STOP_SIGNALS raise Stopped instead of killing the process at once; a signal
    someone ignores (nohup's SIGHUP) or handles already is left as it is, and so is every signal outside
    the main thread (where Python cannot set handlers).

    A handler's exception can be lost: raised while Python runs a finalizer (`__del__`, a weakref's
    callback), it is printed as "Exception ignored"; raised inside a compiled module's start (Cython
    registers its classes with `abc` and drops any error: numpy.random's first import, 2026-11-29) it
    vanishes. The code goes on, with the stop signals then ignored (the first one's clean-up must not be cut
    short). So the stop is also recorded, Ctrl-C's too (Python's own KeyboardInterrupt, where that is the
    handler), and a block that ends without it raises it at its end, marked `late`."""
    saved, got = {}, []

    def raise_stopped(signum: int, frame: Any) -> None:
        got.append(signum)
        for sig in saved:  # a second one must not cut short the clean-up (a temporary file's removal)
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    def interrupt(signum: int, frame: Any) -> None:
        got.append(signum)
        signal.default_int_handler(signum, frame)
    main = threading.current_thread() is threading.main_thread()
    for sig in STOP_SIGNALS if main else ():
        if signal.getsignal(sig) == signal.SIG_DFL:
            saved[sig] = signal.signal(sig, raise_stopped)
    ctrl_c = main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ctrl_c:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
        if ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if got:  # the block went on past a stop whose exception was lost
        raise Stopped(got[0], late=True) if got[0] != signal.SIGINT else _late(KeyboardInterrupt())


def _late(e: KeyboardInterrupt) -> KeyboardInterrupt:
    e.late = True  # type: ignore[attr-defined]
    return e


@contextlib.contextmanager
def temporary_directory(**kwargs: Any) -> Iterator[str]:
    """tempfile.TemporaryDirectory(**kwargs)'s path, made and removed with the stops held until each is done
    (data.procs.stops_between_calls): a stop landing as it is made, or as it is removed once the block is done,
    left it behind (its name not yet returned; the removal cut short, after which nothing tries again)."""
    folder = None
    try:
        with stops_between_calls():
            folder = tempfile.TemporaryDirectory(**kwargs)
        yield folder.name
    finally:
        if folder is not None:
            with stops_between_calls():
                folder.cleanup()


def late_or(e: KeyboardInterrupt, said: str) -> str:
    """What an interruption's line says after "interrupted": `said` (what a stop leaves), or, where the stop
    came only once the work was done (Stopped.late), that."""
    return " after its work was done" if getattr(e, "late", False) else said


def interrupt_code(e: KeyboardInterrupt) -> int:
    """128 + the signal: SIGINT for Ctrl-C, the signal of a Stopped."""
    return 128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT)


def guarded(prog: str, work: Callable[[], T], interrupted: str = "") -> tuple[int, T | None]:
    """(0, work()) or, where it raised, (the exit code, None) after one line `prog: error: ...` on stderr.

    Bad input (CheckpointError; ValueError, which DataError, ConfigError and FormatError are; BatchFileError,
    a damaged batch file) is 2; another OSError (unwritable output, disk full) is the operating system's code;
    Ctrl-C is 130, SIGTERM and SIGHUP 128 + N (raised as exceptions meanwhile: temporary files are removed),
    their line `prog: interrupted` followed by `interrupted` (what it left, e.g.), or, for a stop that came
    too late to cut the work short (Stopped.late), by "after its work was done".
    """
    from .checkpoint import CheckpointError  # here: the scripts of protect_streams alone need not import torch
    try:
        with stopping_on_signals():
            return 0, work()
    except (CheckpointError, BatchFileError, ValueError) as e:  # BatchFileError is an OSError: caught first
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2, None
    except OSError as e:
        print(f"{prog}: error: {os_error_message(e)}", file=sys.stderr)
        return os_error_exit_code(e), None
    except KeyboardInterrupt as e:
        by = f" by {e}" if isinstance(e, Stopped) else ""
        print(f"{prog}: interrupted{by}{late_or(e, interrupted)}", file=sys.stderr)
        return interrupt_code(e), None


class _Lossless:
    """A text stream whose loss is not an error: once a write or flush fails because the stream is gone
    (_GONE), its file descriptor is pointed at /dev/null, what follows is dropped, and `on_lost()` is called
    once. Everything else is the stream's own."""

    def __init__(self, stream: TextIO, on_lost: Callable[[], None] | None = None):
        self._stream, self._on_lost, self.lost = stream, on_lost, False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._lose(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._lose(e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _lose(self, e: OSError) -> None:
        if e.errno not in _GONE:
            raise e
        with contextlib.suppress(OSError, ValueError):
            _to_devnull(self._stream.fileno())
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what the buffer holds goes to /dev/null: nothing fails at exit
        if not self.lost:
            self.lost = True
            if self._on_lost is not None:
                self._on_lost()


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:  # with `fd` closed, /dev/null may have taken its number already
        os.dup2(null, fd)
        os.close(null)


def protect_streams(prog: str, lost_stdout: str = "", keep_start_handlers: bool = False) -> None:
    """Call first in a script's __main__: standard streams closed at start (`>&-`) are opened on /dev/null
    (else the next file opened would take their number, and output would land in it), and stdout and stderr
    become _Lossless. With `lost_stdout`, a vanished stdout is said once on stderr: `prog: lost_stdout`.
    Stop signals go back to Python's handling from startup.quiet_start's, unless `keep_start_handlers`
    (train.py: its own handlers take over later). The imports are done: `startup.imported()`. A process
    started by one that is to take it along when it dies (procs.watched_env) now asks for that."""
    startup.imported()
    follow_parent()
    if not keep_start_handlers:
        startup.done()
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            _to_devnull(fd)
        if getattr(sys, name) is None:  # Python found the descriptor closed at start
            setattr(sys, name, open(fd, mode, closefd=False))

    def say() -> None:
        print(f"{prog}: {lost_stdout}", file=sys.stderr, flush=True)
    sys.stdout = _Lossless(sys.stdout, say if lost_stdout else None)
    sys.stderr = _Lossless(sys.stderr)
