"""Process helpers shared by the preprocessing pool, the loader process and the replica launcher."""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

from .fsutil import pid_alive

T = TypeVar("T")
R = TypeVar("R")


# Set by a process in the environment of a child that is to end with it (watched_env): the child, its imports
# done, asks for SIGTERM at that pid's death and ends at once if it is gone already (follow_parent).
ENV_PARENT = "ALEXNET_PARENT_PID"


def watched_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a child that is to end with this process, SIGKILL included."""
    return {**(os.environ if env is None else env), ENV_PARENT: str(os.getpid())}


def follow_parent(sig: int = signal.SIGTERM) -> None:
    """End with the process that started this one, if it asked (ENV_PARENT). The variable is taken out of
    the environment, so that this process's own children are not told their grandparent's pid."""
    pid = os.environ.pop(ENV_PARENT, None)
    if pid:
        die_with_parent(sig, int(pid))


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; no-op elsewhere).

    A worker whose parent was killed with SIGKILL would otherwise live on as an orphan, holding
    memory (and on a GPU, device memory) forever. A parent that died before the request was in place
    (a spawned worker or a replica asks after importing its modules: seconds) is told by its pid: `parent`
    (what its starter said), multiprocessing's record of it, or else the parent of this moment.
    """
    if not sys.platform.startswith("linux"):
        return
    if parent is None:
        import multiprocessing
        known = multiprocessing.parent_process()
        parent = known.pid if known is not None else os.getppid()
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG (best effort: its result is not read)
    except (OSError, AttributeError):
        return
    # The parent died before the request was in place (this process was adopted). A pid that is not the
    # parent but lives is a grandparent's, passed on by a process in between that did not take it (torchrun's
    # agent): the kernel's request watches that process instead.
    if os.getppid() != parent and not pid_alive(parent):
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


@contextmanager
def stops_between_calls() -> Iterator[Callable[[], None]]:
    """Yields `check()`. Meanwhile SIGINT, SIGTERM and SIGHUP, where Python handles them (Ctrl-C's
    KeyboardInterrupt, cli.stopping_on_signals' Stopped, train.py's handlers), are noted instead, and
    `check()` runs their handlers between a pool's calls (preprocess, upgrade_data, the batch reader's
    threads, the large-batch benchmark). Raised inside concurrent.futures' own code (wait and as_completed
    take the futures' locks one by one), a KeyboardInterrupt left a future's lock held for ever: the pool's
    manager thread waited on it, and the shutdown on the manager, so a Ctrl-C hung the run (seen once in the
    suite: preprocess, SIGINT while the second part's tasks were submitted and waited on). A signal noted
    as the block ends is handled on leaving. Outside the main thread (where Python runs no handlers) or for
    a signal ignored or left to the system, nothing changes. Also the hold of a step a stop must not cut in
    two (cli.temporary_directory, a benchmark's worker starts): handlers, not a signal mask, which holds
    nothing once torch's threads are there (the kernel gives the signal to one of them)."""
    got: list[int] = []
    saved: dict[int, Callable] = {}
    restore: dict[int, Callable] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            # inside another such block (preprocess's shard pass inside its pool's), the handler to run is the
            # real one, not the outer block's note: that would wait for the outer's next call, after the pass
            real = getattr(old, "real_handler", old)
            if callable(real):
                saved[sig], restore[sig] = real, old

                def note(signum, frame):
                    got.append(signum)
                note.real_handler = real  # type: ignore[attr-defined]
                signal.signal(sig, note)

    def check() -> None:
        while got:
            signum = got.pop(0)
            saved[signum](signum, None)  # raises (KeyboardInterrupt, Stopped) or notes, as it would have
    try:
        yield check
    finally:
        for sig, old in restore.items():
            signal.signal(sig, old)
    check()  # a signal that came as the pool shut down


def run_all(pool: cf.Executor, calls: Iterable[tuple[Callable, tuple]], check: Callable[[], None],
            waited: Callable[[set[cf.Future], int], None] | None = None) -> list[cf.Future]:
    """Every call (fn, args) submitted to `pool` (a process pool: all of them, so that no worker waits for
    work), then waited for; `check()` (stops_between_calls') runs after each submit and each wait, so that a
    stop is raised between the pool's own calls. After each wait, every finished call's result is taken (a
    worker's error is raised there) and `waited(finished, left)` runs (a progress bar). On any exception the
    calls not started are cancelled. The futures, in the calls' order."""
    futures: list[cf.Future] = []
    try:
        for fn, args in calls:
            futures.append(pool.submit(fn, *args))
            check()
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            check()
            for f in finished:
                f.result()  # re-raises a worker's error (disk full, a bad archive) or BrokenProcessPool
            if waited is not None:
                waited(finished, len(pending))
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    return futures


def in_threads(fn: Callable[[T], R], items: Sequence[T], jobs: int,
               done: Callable[[int, R], None] | None = None, stop: threading.Event | None = None) -> list[R]:
    """fn over `items` in their order, `jobs` at a time in threads; the results in that order. `done(i,
    result)` runs in this thread as each one finishes. An item is handed to the pool only when a thread is
    free for it, so that a stop signal (Ctrl-C, SIGTERM, SIGHUP: raised between the pool's calls, by
    stops_between_calls) or an item that raises leaves nothing queued: only the running items finish (a
    thread cannot be stopped; `stop`, set then, asks them to give up early). A pool given every item at once
    ran all of them after a Ctrl-C, in its shutdown."""
    results: list = [None] * len(items)
    todo = iter(enumerate(items))
    with stops_between_calls() as check, cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        running = {pool.submit(fn, item): i for i, item in itertools.islice(todo, max(1, jobs))}
        try:
            while running:
                finished, _ = cf.wait(running, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                check()
                for f in sorted(finished, key=running.__getitem__):
                    i = running.pop(f)
                    results[i] = f.result()
                    if done is not None:
                        done(i, results[i])
                    running.update({pool.submit(fn, item): k for k, item in itertools.islice(todo, 1)})
        except BaseException:
            if stop is not None:
                stop.set()  # before the pool's shutdown waits for the running items
            raise
    return results
