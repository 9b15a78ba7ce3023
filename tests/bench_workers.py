"""Benchmark workers for tests/test_benchmarks.py, in a module of their own: a spawned worker imports the
module its function lives in, and this one imports nothing heavy."""
from __future__ import annotations

import time
from pathlib import Path


def fails_or_waits(rank: int, world: int, port: int, finished: str, out: str) -> None:
    """Rank 1 fails at once; rank 0 waits, as a rank in a collective with it would, then says it finished."""
    if rank == 1:
        raise SystemExit(3)
    time.sleep(60)
    Path(finished).write_text("rank 0 ran to its end")


def waits(rank: int, world: int, port: int, out: str) -> None:
    """A rank that would wait a minute for the others (in a rendezvous, a collective)."""
    time.sleep(60)
