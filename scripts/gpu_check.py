#!/usr/bin/env python3
"""Prove the GPU paths, a sequence of steps within a time budget, and write a report; --device cpu: the CPU twin.

    python scripts/gpu_check.py --out gpu_check                 # the proofs (make gpu-check), <= 540 s
    python scripts/gpu_check.py --quick --out gpu_check         # the core only, <= 180 s
    python scripts/gpu_check.py --bench --out gpu_check/bench   # the full-size benchmarks (make gpu-bench)
    python scripts/gpu_check.py --device cpu --out /tmp/check   # no GPU: the same steps at tiny sizes

Each step runs in its own process (tree) under a time limit: a failure or a hang is recorded and the
others go on. --budget (540 s; --quick 180 s) counts from this process's start and includes the
clean-up, so a run ends within it: a step starts only if a third of its own limit (at least 10 s) is
left, and runs under its own limit or what is left, whichever is less. Verdicts: passed; failed (a
defect, or a step stopped at its OWN limit: a hang); skipped (with the reason: cannot run here, not
selected, out of time, or cut short by the budget).

The proofs, most valuable first (--quick: the first four):
  data                  scripts/make_synthetic.py + scripts/preprocess.py: every other step's input
  resume-sigint         a run with a loader process, SIGINT once it has written a train record, the
                        same command again (resume), against an uninterrupted run: exit 130, then
                        weights within a relative difference of 1e-4, the same records (split, epoch, iter)
  replicas-ipc          2 replicas sharing one GPU (weights exchange via ipc) against 1 replica with
                        twice the batch (weights' relative difference <= 1e-4, dropout off)
  evaluate              scripts/evaluate.py, 1 and 10 crops: n = the validation count, top-1/top-5
                        error within one image of --device cpu
  pytest-gpu            python -m pytest -q -m gpu (skipped without CUDA, or without pytest)
  multi-nccl-weights, multi-ddp-nccl, multi-torchrun   2 replicas on 2 GPUs over NCCL (skipped with fewer)
  model-parallel        parallel.model_size=2, columns then fc, against 1 process with the same global
                        batch (2 GPUs: NCCL; one: both processes on it, gloo)
  resume-sigint-deterministic   resume-sigint with train.deterministic=true: bitwise weights and
                        velocities, identical metrics apart from time and img_per_s
  replicas-gloo-gradients   2 replicas sharing one GPU, gradients via gloo
  speed-*               bf16, tf32, channels_last, slices=2, compile: exit 0 and finite losses
                        (compile skipped with the reason where it cannot build: no C compiler,
                        no Python.h, no triton)
The benchmarks (--bench): bench-train, bench-loading, bench-exchange: scripts/benchmark.py train /
loading / exchange (full size on a GPU); their --json figures go into the report.

The CPU twin (--device cpu) runs the same sequences on the CPU with tiny data, model.width 0.125 and a
few steps; it skips pytest-gpu (no CUDA), the 2-GPU steps and speed-compile. It proves the script,
not the GPU.

Output under --out: gpu_check.md (a table: per step its status, seconds, the time limit it ran under,
the reason or result; then the benchmark figures), gpu_check.json (the same, with the budget and the
environment), logs/<step>.log (what the step ran) and logs/<step>/<command>.log (each command's
output). Exit codes: 0 nothing failed (skips are fine), 1 a step failed, 2 bad arguments (e.g. no
CUDA without --device cpu), 130 interrupted.

example: python scripts/gpu_check.py --out gpu_check --budget 540
"""
import time

START = time.monotonic()  # the budget counts from here, before torch is imported

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the repository (data, alexnet) and scripts/ (gpucheck)

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "gpu_check.py")  # a Ctrl-C while torch imports: one line, not a traceback

from gpucheck.cli import main  # noqa: E402

from alexnet.cli import protect_streams  # noqa: E402


def end_now(code: int) -> None:
    """Exit without the interpreter's teardown. The budget counts to the process's end, and unloading
    torch alone took 1.4-3 s at a load of 8 (more than the CPU reserve); the run's reports are written and
    closed by now. A step's own process (--_step) exits normally: its clean-up runs at exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or vanished stdout: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    protect_streams("gpu_check.py")
    code = main(doc=__doc__, start=START)
    if any(a.startswith("--_step") for a in sys.argv[1:]):
        sys.exit(code)
    end_now(code)
