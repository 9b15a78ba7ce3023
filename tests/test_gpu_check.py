"""scripts/gpu_check.py's CPU twin: every step reported, failures and hangs isolated, the exit code."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_script

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(gpu_check)

STEPS = [s.name for s in gpu_check.STEPS]
CUDA_ONLY = {"pytest-gpu": "CUDA", "multi-nccl-weights": "needs 2 GPUs, found 0",
             "multi-ddp-nccl": "needs 2 GPUs, found 0", "multi-torchrun": "needs 2 GPUs, found 0",
             "speed-compile": "CPU twin"}


def report(out: Path) -> dict[str, dict]:
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    return {s["name"]: s for s in steps}


@pytest.mark.slow
def test_cpu_twin_runs_every_step(tmp_path):
    out = tmp_path / "check"
    r = run_script("scripts/gpu_check.py", "--device", "cpu", "--out", str(out), timeout=900)
    assert (out / "gpu_check.md").is_file() and (out / "gpu_check.json").is_file(), r.stderr[-3000:]
    steps, md = report(out), (out / "gpu_check.md").read_text()
    assert list(steps) == STEPS  # every step, in order, each with a status
    for name, step in steps.items():
        assert f"| {name} |" in md
        if name in CUDA_ONLY:
            assert step["status"] == "skipped" and CUDA_ONLY[name] in step["reason"], step
        else:
            assert step["status"] == "passed", (name, step["reason"], step.get("log_tail"))
            assert (out / "logs" / f"{name}.log").is_file()
    assert r.returncode == 0, r.stdout[-3000:]
    assert steps["resume-sigint-deterministic"]["figures"]["bitwise"]
    assert steps["resume-sigint"]["figures"]["sigint"] == "after its first train record"
    assert steps["bench-train"]["figures"]["rows"] and "## Benchmarks" in md
    assert (out / "logs" / "resume-sigint" / "interrupted.log").is_file()
    env = json.loads((out / "gpu_check.json").read_text())["environment"]
    assert env["device"] == "cpu" and env["gpus"] == 0 and env["torch"] == torch.__version__
    assert not (out / "work").exists()  # temporary data and checkpoints removed without --keep-work


def test_failed_and_hung_steps_are_reported_and_the_others_go_on(tmp_path):
    out = tmp_path / "check"
    r = run_script("scripts/gpu_check.py", "--device", "cpu", "--out", str(out),
                   "--steps", "speed-bf16,speed-tf32,speed-slices",
                   "--inject-failure", "speed-bf16", "--inject-failure", "speed-tf32:hang", timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    steps = report(out)
    assert list(steps) == STEPS
    assert steps["speed-bf16"]["status"] == "failed" and "injected failure" in steps["speed-bf16"]["reason"]
    assert steps["speed-tf32"]["status"] == "failed" and "timed out" in steps["speed-tf32"]["reason"]
    assert steps["speed-tf32"]["seconds"] < gpu_check.HANG_TIMEOUT + 10  # killed at its limit, not waited for
    assert steps["data"]["status"] == "passed" and steps["speed-slices"]["status"] == "passed"
    others = set(STEPS) - {"data", "speed-bf16", "speed-tf32", "speed-slices"}
    assert all(steps[n]["status"] == "skipped" and steps[n]["reason"].startswith("not selected") for n in others)
    assert "| speed-bf16 | train.precision=bf16 | **failed** |" in (out / "gpu_check.md").read_text()


def test_a_step_that_no_longer_fits_is_skipped_out_of_time(tmp_path):
    ctx = gpu_check.Ctx(tmp_path, "cpu", 0)
    env = {"cuda_available": False}
    done = {"data": gpu_check.Result("data", "", "passed")}
    reason, _ = gpu_check.plan(ctx, gpu_check.BY_NAME["evaluate"], env, done, left=5, selected=None)
    assert reason.startswith("out of time")
    reason, limit = gpu_check.plan(ctx, gpu_check.BY_NAME["evaluate"], env, done, left=50, selected=None)
    assert reason == "" and limit == 50  # the rest of the budget, less than the step's own limit


@pytest.mark.parametrize("line, want", [
    ("12 passed, 4 skipped, 339 deselected in 95.20s (0:01:35)", {"passed": 12, "skipped": 4, "deselected": 339}),
    ("1 failed, 15 passed, 339 deselected, 2 warnings in 80.1s", {"failed": 1, "passed": 15, "deselected": 339}),
    ("==== 2 errors in 3.2s ====", {"error": 2}),
    ("355 deselected in 5.41s", {"deselected": 355}),
])
def test_pytest_summary_is_parsed(line, want):
    assert gpu_check.pytest_counts(f"....F\nshort test summary info\n{line}\n") == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_no_cuda_without_device_cpu_exits_2(tmp_path):
    r = run_script("scripts/gpu_check.py", "--out", str(tmp_path))
    assert r.returncode == 2 and "--device cpu" in r.stderr


def test_unknown_step_is_refused(tmp_path):
    r = run_script("scripts/gpu_check.py", "--device", "cpu", "--out", str(tmp_path), "--steps", "nope")
    assert r.returncode == 2 and "unknown step(s) nope" in r.stderr
