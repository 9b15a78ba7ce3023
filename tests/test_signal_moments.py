"""A stop signal at any moment of a run's life, drawn anew every run: SIGINT, SIGTERM or SIGHUP at a time drawn
over the whole of an uninterrupted run of the same command (imports, the replicas' start and rendezvous,
steps, validation, checkpoint writes, the last epoch, teardown; from EARLIEST_S: the interpreter's own start
is Python's), for one process, two replicas and a model-parallel pair. It must end with 128 + N (or 0 where
the run had finished), at most one line that is not progress, no traceback (Python's or a C++ stack), and
the same command must then finish with the weights of the uninterrupted run.

One (layout, signal, moment) per suite run: the seed is printed; ALEXNET_MOMENT_SEED=N reruns a case.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from alexnet.checkpoint import load
from tests import children
from tests.conftest import REPO, tiny_overrides

pytestmark = pytest.mark.processes

LAYOUTS = {"one process": {}, "2 replicas": {"parallel.replicas": 2},
           "fc pair": {"parallel.model_size": 2, "parallel.model": "fc"}}
DETERMINISTIC = {"data.shuffle": False, "data.random_crop": False, "data.flip": False, "model.dropout": 0.0,
                 "data.loading": "inline", "train.epochs": 2, "train.log_every": 1}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The interpreter's own start (site, before train.py's first line: some tens of ms) is the one moment no
# code of ours can answer; a signal there is Python's default (a KeyboardInterrupt traceback).
EARLIEST_S = 0.5


def said(err: str) -> list[str]:
    """stderr's lines that are not progress bars (tqdm's carriage-return updates)."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line
            and "s/it]" not in line and "%|" not in line]


@dataclass
class Started:
    """A train.py run and the token that every process of its tree inherits (`ended`)."""
    proc: subprocess.Popen
    token: str


def start(train_data, run, layout: dict) -> Started:
    over = tiny_overrides(train_data, run, **DETERMINISTIC, **layout)
    token, env = children.with_a_token()
    return Started(subprocess.Popen([sys.executable, "train.py", "configs/demo.yaml", *over], cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), token)


def ended(run: Started, what: str) -> str:
    """The run's stderr once it has ended, and no process of its tree left GONE_S later (after a stop signal
    or a normal end alike)."""
    _, err = children.communicate(run.proc, cpu_s=240)
    children.none_left(run.token, f"{what} (exit {run.proc.returncode})")
    return err


def weights(run) -> dict:
    return load(run / "checkpoints" / "last.pt")["model"]


def test_a_stop_signal_at_a_drawn_moment_ends_in_one_line_and_resumes_exactly(train_data, tmp_path):
    seed = int(os.environ.get("ALEXNET_MOMENT_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    name = rng.choice(sorted(LAYOUTS))
    sig = rng.choice(SIGNALS)
    print(f"ALEXNET_MOMENT_SEED={seed}: {name}, {sig.name}")
    layout = LAYOUTS[name]

    began = time.monotonic()
    ref = start(train_data, tmp_path / "ref", layout)
    err = ended(ref, "the uninterrupted run")
    length = time.monotonic() - began
    assert ref.proc.returncode == 0, err[-2000:]
    moment = rng.uniform(EARLIEST_S, length)
    print(f"the uninterrupted run took {length:.1f} s; the signal comes at {moment:.2f} s")

    run = tmp_path / "run"
    stopped = start(train_data, run, layout)
    time.sleep(moment)
    stopped.proc.send_signal(sig)
    err = ended(stopped, f"the run stopped by {sig.name}")
    proc = stopped.proc
    lines = said(err)
    case = f"seed {seed}: {name}, {sig.name} at {moment:.2f} s of {length:.1f} s"
    assert proc.returncode in (0, 128 + sig), (case, proc.returncode, lines[-10:])
    assert len(lines) <= 1 and "Traceback" not in err and "frame #" not in err, (case, lines[-10:])
    if proc.returncode:
        again = start(train_data, run, layout)
        err = ended(again, "the resumed run")
        assert again.proc.returncode == 0, (case, err[-2000:])
    got, want = weights(run), weights(tmp_path / "ref")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), case
