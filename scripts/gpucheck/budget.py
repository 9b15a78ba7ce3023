"""The run's time budget: what the runner plans each step's limit within, and what the report states."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Budget:
    """The run's seconds, counted from the process's start (the entry script's first line), less a
    reserve for the clean-up."""

    total: float
    start: float                # time.monotonic() at the process's start
    reserve: float = 0.0

    def spent(self) -> float:
        return time.monotonic() - self.start

    def started_at(self) -> float:
        """The start as a wall-clock time (seconds since the epoch): how a watcher outside the process
        checks that the run, its clean-up included, ended within the budget."""
        return time.time() - self.spent()

    def left(self) -> float:
        """Seconds the steps may still use."""
        return self.total - self.reserve - self.spent()
