"""What a step sees: its device's sizes, its folders and deadline, what to inject; what it reports."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

REL_TOL = 1e-4          # cuDNN may pick other algorithms from run to run


@dataclass(frozen=True)
class Profile:
    """Sizes for one device: meaningful but quick on a GPU, tiny on the CPU twin."""

    classes: int
    train_per_class: int
    val_per_class: int
    min_side: int
    max_side: int
    size: int                   # preprocessed image side
    per_file: int
    crop: int
    width: float
    batch: int                  # per replica; the references use twice this
    log_every: int
    loading: str                # data.loading outside the SIGINT steps (which always use process)
    speed_steps: int            # train.max_steps of each speed option
    bench: dict[str, list[str]] = field(default_factory=dict)  # benchmark.py flags per subcommand


TINY_BENCH = ["--width", "0.125", "--crop", "67", "--batch-size", "8", "--steps", "2", "--warmup", "1",
              "--repeat", "1"]
PROFILES = {
    "cuda": Profile(classes=10, train_per_class=96, val_per_class=10, min_side=128, max_side=256, size=128,
                    per_file=64, crop=112, width=0.5, batch=32, log_every=2, loading="process", speed_steps=10,
                    bench={"train": ["--batch-size", "256"],
                           # the loader alone on the CPU at full size is no GPU path: not worth the budget
                           "loading": ["--batch-size", "256", "--no-cpu-full-size"], "exchange": []}),
    "cpu": Profile(classes=4, train_per_class=12, val_per_class=4, min_side=48, max_side=160, size=72,
                   per_file=16, crop=67, width=0.125, batch=8, log_every=2, loading="inline", speed_steps=2,
                   bench={"train": TINY_BENCH, "loading": [*TINY_BENCH, "--files-per-epoch", "2",
                                                           "--no-cpu-full-size"],
                          "exchange": ["--width", "0.125", "--batch-size", "8", "--warmup", "1", "--repeat", "1"]}),
}


class StepFailed(Exception):
    """The step ran and found something wrong; the message is the report's reason."""


class StepTimedOut(StepFailed):
    """A command of the step outlasted the step's time limit: a hang if that was the step's own limit,
    a cut if the budget had shortened it (the runner, which planned the limit, tells which)."""


@dataclass
class Ctx:
    """One step's view: where to write, which device, its deadline, what to inject."""

    out: Path
    device: str                  # cuda | cpu
    gpus: int                    # GPUs usable by this run (0 for the CPU twin)
    step: str = ""
    deadline: float = math.inf   # time.time() by which the step's commands must have ended
    inject: dict[str, str] = field(default_factory=dict)
    injected: bool = False

    @property
    def profile(self) -> Profile:
        return PROFILES[self.device]

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def left(self) -> float:
        return self.deadline - time.time()


@dataclass
class Outcome:
    """What a passed step reports: one line for the table, figures for the JSON."""

    detail: str
    figures: dict = field(default_factory=dict)
