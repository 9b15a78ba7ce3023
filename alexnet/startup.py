"""A stop signal while a tool is still importing (torch takes seconds): one line and 128 + N, not a traceback.

Every user script calls `quiet_start(__name__, PROG)` before its heavy imports; `cli.protect_streams`, the
first call of every script's `__main__`, hands the signals back (`done`) to Python's own handling, which
the tools then refine (`cli.stopping_on_signals`, train.py's handlers). Imported as a module (tests), a
script changes nothing. A run of several processes says it once: train.py's launcher for its replicas,
rank 0 under torchrun.

The same pair brackets the imports for the garbage collector: collection is off from `quiet_start` until
`imported()` (called by `done()`'s caller, `protect_streams`), which freezes what the imports made. Importing
torch makes about 250,000 objects that the collector tracks; it scanned them again and again while they
were made, and once more in the interpreter's last collection at exit: 0.4-0.8 s of the 1.5-1.9 s of CPU
that `python -c "import torch"` takes on this project's 2-core VM, paid by every process of a run and every
tool. Frozen, they are never scanned. They live as long as their modules; the few thousand cyclic leftovers
of the imports (under 1 MB with torch's) stay with them.
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import struct

# The launcher's heartbeat records (alexnet/launch.py): rank, collectives entered, kind.
RECORD = struct.Struct("<iqb")
LISTENING = 3  # the kind a replica sends once quiet_start's handlers are in place
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_saved: dict[int, object] = {}
_frozen_imports: list[bool] = []  # whether collection was on at quiet_start, until imported()


def quiet_start(module_name: str, prog: str) -> None:
    """Until `done()`: SIGINT, SIGTERM and SIGHUP (unless ignored, as under nohup) end the process at once
    with `prog: interrupted by SIG... while starting; nothing was done` and exit code 128 + N."""
    if module_name != "__main__" or _saved:
        return
    _frozen_imports.append(gc.isenabled())
    gc.disable()
    # A replica of train.py's launcher (which says it once for all), or a rank other than 0 (torchrun's):
    # one line per run, not per process.
    quiet = "ALEXNET_HEARTBEAT_FD" in os.environ or os.environ.get("RANK", "0") != "0"

    def stop(signum, frame) -> None:
        if not quiet:
            name = signal.Signals(signum).name
            os.write(2, f"{prog}: interrupted by {name} while starting; nothing was done\n".encode())
        os._exit(128 + signum)
    for sig in _SIGNALS:
        old = signal.getsignal(sig)
        if old != signal.SIG_IGN:
            _saved[sig] = old
            signal.signal(sig, stop)
    fd = os.environ.get("ALEXNET_HEARTBEAT_FD")
    if fd:  # a replica of train.py's launcher, which forwards a stop signal only from now on
        with contextlib.suppress(OSError, ValueError):
            os.write(int(fd), RECORD.pack(int(os.environ.get("RANK", 0)), 0, LISTENING))


def imported() -> None:
    """The imports are done: what they made goes to the collector's permanent generation (`gc.freeze`), and
    collection is back on (if it was on before `quiet_start`). Idempotent; nothing without `quiet_start`."""
    while _frozen_imports:
        gc.freeze()
        if _frozen_imports.pop():
            gc.enable()


def done() -> None:
    """The handlers from before quiet_start (Python's: KeyboardInterrupt for SIGINT, the default for others)."""
    while _saved:
        sig, old = _saved.popitem()
        signal.signal(sig, old)


def ignore_stops() -> None:
    """From here on the exit code is decided (the run finished, or stopped with its checkpoint; the launcher's
    replicas all ended): a stop signal that comes now (a forwarded or second Ctrl-C) changes nothing."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
