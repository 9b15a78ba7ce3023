"""Process helpers shared by the preprocessing pool, the loader process and the replica launcher."""
from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; no-op elsewhere).

    A worker whose parent was killed with SIGKILL would otherwise live on as an orphan, holding
    memory (and on a GPU, device memory) forever.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc), e.g. to find and stop a run's workers."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: parse after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return sorted(kids)
