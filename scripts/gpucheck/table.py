"""The table of steps, in the order they run, and the three sequences drawn from it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .basics import step_data, step_pytest
from .benchmarks import bench_step
from .context import Ctx, Outcome
from .evaluation import step_evaluate
from .model_parallel import step_model_parallel
from .replicas import (
    step_multi_ddp,
    step_multi_nccl_weights,
    step_multi_torchrun,
    step_replicas_gloo,
    step_replicas_ipc,
)
from .speed import speed_step
from .training import step_lars_bf16, step_resume, step_resume_deterministic


@dataclass(frozen=True)
class Step:
    name: str
    what: str                   # the path it proves, for the report
    run: Callable[[Ctx], Outcome]
    # its own time limit in seconds (CUDA, CPU twin): past it, a hang; the twin's allow for a loaded 2-core CI
    limit: tuple[float, float]
    needs: tuple[str, ...] = ("data",)


# The most valuable proofs first, so that a budget running out cuts the least: the core (data, a SIGINT
# resume with a loader process, one replica pair, evaluation: --quick), the gpu-marked tests, the
# 2-GPU paths, LARS under bf16 (the large-batch recipes' optimizer and precision: a new numerical path
# no other step runs, and a short one), the other layouts, then the speed options, compile last (the
# slowest, often unbuildable).
STEPS = [
    Step("data", "synthetic ImageNet-format data, preprocessed", step_data, (120, 60), ()),
    Step("resume-sigint", "SIGINT mid-epoch (loader process), resume = uninterrupted (weights rel diff <= 1e-4, "
         "else <= 20 x the rounding floor)",
         step_resume, (120, 120)),
    Step("replicas-ipc", "2 replicas on one GPU, weights exchange via ipc = 1 replica x 2B", step_replicas_ipc,
         (120, 90)),
    Step("evaluate", "scripts/evaluate.py, 1 and 10 crops, against --device cpu", step_evaluate, (90, 60)),
    Step("pytest-gpu", "python -m pytest -q -m gpu", step_pytest, (240, 60), ("cuda", "pytest")),
    Step("multi-nccl-weights", "2 GPUs, weights exchange via nccl = 1 replica x 2B", step_multi_nccl_weights,
         (90, 90), ("data", "2gpus")),
    Step("multi-ddp-nccl", "2 GPUs, DDP gradients via nccl = 1 replica x 2B", step_multi_ddp, (90, 90),
         ("data", "2gpus")),
    Step("multi-torchrun", "torchrun --nproc-per-node=2 (nccl) = 1 replica x 2B", step_multi_torchrun, (90, 90),
         ("data", "2gpus")),
    Step("lars-bf16", "AlexNet-BN + LARS, 10 steps under bf16 autocast vs fp32: trust ratios finite, weights "
         "within 5e-2", step_lars_bf16, (60, 60)),
    Step("model-parallel", "model parallel in 2 processes (columns, fc) = 1 process, same global batch",
         step_model_parallel, (120, 120)),
    Step("resume-sigint-deterministic", "the same with train.deterministic=true: bitwise",
         step_resume_deterministic, (120, 120)),
    Step("replicas-gloo-gradients", "2 replicas on one GPU, gradients via gloo = 1 replica x 2B",
         step_replicas_gloo, (90, 90)),
    Step("speed-bf16", "train.precision=bf16", speed_step("train.precision", "bf16"), (60, 60)),
    Step("speed-tf32", "train.precision=tf32", speed_step("train.precision", "tf32"), (60, 60)),
    Step("speed-channels-last", "train.channels_last=true", speed_step("train.channels_last", "true"), (60, 60)),
    Step("speed-slices", "train.slices=2", speed_step("train.slices", "2"), (60, 60)),
    Step("speed-compile", "train.compile=true", speed_step("train.compile", "true"), (180, 120),
         ("data", "not-cpu-twin", "compiler")),
    # gpu-bench: on a GPU their own limits add up to 510 s, so that all fit a 540 s budget
    Step("bench-train", "scripts/benchmark.py train: precision x channels_last", bench_step("train"), (180, 60), ()),
    Step("bench-loading", "scripts/benchmark.py loading: process / thread / inline vs upper bound",
         bench_step("loading"), (210, 90), ()),
    Step("bench-exchange", "scripts/benchmark.py exchange: per transport, 2 replicas", bench_step("exchange"),
         (120, 90), ()),
]
BY_NAME = {s.name: s for s in STEPS}
BENCH = [s.name for s in STEPS if s.name.startswith("bench-")]
CHECK = [s.name for s in STEPS if s.name not in BENCH]
SEQUENCES = {"check": CHECK, "quick": CHECK[:4], "bench": BENCH}
# Seconds for a whole run, from the process's start: within a 600 s command limit with room to spare;
# --quick proves the core for a session with little device time.
BUDGETS = {"check": 540.0, "quick": 180.0, "bench": 540.0}
