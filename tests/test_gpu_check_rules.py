"""scripts/gpu_check.py's judgement in-process: the rounding floor that a non-bitwise comparison falls back
on, and the commands that exit 0 but leave a warning of torch's C++ side."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.append(str(REPO / "scripts"))  # last: its scripts must not shadow other modules
from gpucheck import commands, runs  # noqa: E402
from gpucheck.commands import Done  # noqa: E402
from gpucheck.context import REL_TOL, StepFailed  # noqa: E402

# Output seen on an H200 (2026-11-27) at the end of a 1-process run with a loader process.
IPC_WARNING = ("[W1127 22:53:11.097734701 CudaIPCTypes.cpp:16] Producer process has been terminated before all "
               "shared CUDA tensors released. See Note [Sharing CUDA tensors]")


def floor_of(value: float, asked: list):
    def floor() -> float:
        asked.append(value)
        return value
    return floor


@pytest.mark.parametrize("rel, floor, ok, asked", [
    (0.0, 1.0, True, False),            # within REL_TOL: the floor is not run at all
    (1e-4, 1.0, True, False),           # REL_TOL itself passes
    (2.9e-3, 4.1e-4, True, True),       # seen on an H200: above REL_TOL, 7.1 x its floor
    (4e-3, 2e-4, True, True),           # exactly 20 x
    (4.1e-3, 2e-4, False, True),        # above 20 x
    (1e-3, 0.0, False, True),           # runs that round alike cannot excuse any difference
    (0.05, 1e-3, False, True),          # a defect: 50 x the floor
])
def test_within_tolerance_falls_back_on_twenty_times_the_rounding_floor(rel, floor, ok, asked):
    seen = []
    got, words, measured = runs.within_tolerance(rel, floor_of(floor, seen))
    assert got is ok and measured == (floor if asked else None)
    assert bool(seen) is asked and len(seen) <= 1
    assert (str(REL_TOL) in words or f"{REL_TOL:g}" in words)
    if asked:
        assert f"{floor:.1e}" in words and ("within" if ok else "above") in words


def test_the_floor_is_the_same_run_in_two_slices(tmp_path, monkeypatch):
    """rounding_floor runs the base command again with train.slices=2 beside it and compares the two."""
    ran, compared = [], []
    monkeypatch.setattr(runs, "check", lambda ctx, label, cmd: ran.append((label, cmd)))
    monkeypatch.setattr(runs, "compare_weights", lambda a, b: compared.append((a, b)) or {"rel_diff": 3e-4})
    monkeypatch.setattr(runs, "train_cmd",
                        lambda ctx, d, over: ["train.py", str(d), *(f"{k}={v}" for k, v in over.items())])
    base = tmp_path / "straight"
    assert runs.rounding_floor(None, base, {"model.dropout": 0.0}, "straight-2-slices") == 3e-4
    assert ran == [("straight-2-slices", ["train.py", str(tmp_path / "straight-2-slices"), "model.dropout=0.0",
                                          "train.slices=2"])]
    assert compared == [(tmp_path / "straight-2-slices", base)]


@pytest.mark.parametrize("output, warned", [
    ("done: val top-1 error 0.67\n" + IPC_WARNING + "\n", True),
    (IPC_WARNING, True),
    ("[W1127 01:02:03.4 ProcessGroupNCCL.cpp:1250] destroy_process_group() was not called\n", True),
    ("done: val top-1 error 0.67\n", False),
    ("parallel.devices = ['cuda:0', 'cuda:0']\n[Wed] not torch's\n", False),
    ("a line [W1127 22:53:11.097 x.cpp:1] quoted mid-line\n", False),
])
def test_a_command_that_exits_0_with_a_cpp_warning_fails_its_step(monkeypatch, output, warned):
    monkeypatch.setattr(commands, "run_cmd", lambda ctx, label, cmd: Done(0, output, 1.0))
    if warned:
        with pytest.raises(StepFailed, match=r"train exited 0 but printed a warning of torch's C\+\+ side: \[W1127"):
            commands.check(None, "train", ["x"])
    else:
        assert commands.check(None, "train", ["x"]).rc == 0


@pytest.mark.processes
def test_a_steps_temporary_files_go_with_its_work_folder(tmp_path):
    """Whatever a step or a tool it starts leaves in the temporary directory (torchrun's log folder, the data
    of a benchmark killed at the step's limit) is inside work/, which the run removes."""
    import subprocess

    from gpucheck import runner
    from gpucheck.context import Ctx
    ctx = Ctx(tmp_path, "cpu", 0)
    runner.prepare(ctx)
    made = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='left-'))"],
                          env=runner.step_env(ctx), capture_output=True, text=True, check=True).stdout.strip()
    assert Path(made).parent == ctx.work / "tmp" and Path(made).is_dir()


def test_a_steps_commands_end_with_the_process_that_starts_them():
    """Steps and their commands run in sessions of their own (a kill of gpu_check's process group misses them):
    each is given its starter's pid (procs.follow_parent, in every script's protect_streams), so gpu_check
    killed by SIGKILL takes them along."""
    import os

    from gpucheck import runner

    from data.procs import ENV_PARENT
    assert commands.clean_env()[ENV_PARENT] == str(os.getpid())
    assert runner.step_env(runner.Ctx(REPO / "nowhere", "cpu", 0))[ENV_PARENT] == str(os.getpid())
