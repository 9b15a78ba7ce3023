"""Data parallelism: 2 replicas (on one GPU, or on two over NCCL, or under torchrun) against 1 replica
with twice the batch."""
from __future__ import annotations

import sys

from .commands import check, last_line
from .context import Ctx, Outcome, StepFailed
from .runs import (
    SAME_UPDATE,
    TWO_GPUS,
    compare_weights,
    one_gpu,
    positions,
    records,
    reference_floor,
    reference_run,
    train_cmd,
    within_tolerance,
)


def replicas_check(ctx: Ctx, extra: dict, expect: str, launcher: list[str] | None = None) -> Outcome:
    """2 replicas of batch B (train.py's launcher, or `launcher`) against 1 replica of batch 2B."""
    ref, run = reference_run(ctx), ctx.work / ctx.step
    over = {**SAME_UPDATE, **({} if launcher else {"parallel.replicas": 2}), **extra}
    done = check(ctx, "replicas", train_cmd(ctx, run, over, launcher))
    if expect not in done.output:
        raise StepFailed(f"the run did not report '{expect}': {last_line(done.output)}")
    figures = compare_weights(run, ref)
    rel, same = figures["rel_diff"], positions(records(run)) == positions(records(ref))
    figures.update(records_match=same, records=len(records(ref)))
    ok, bar, figures["rounding_floor"] = within_tolerance(rel, lambda: reference_floor(ctx))
    if not ok or not same:
        raise StepFailed(f"{expect}: weights rel diff {rel:.2e} against 1 replica x 2B, {bar}, "
                         f"records {'match' if same else 'differ'}")
    return Outcome(f"{expect}: weights rel diff {rel:.1e} against 1 replica x 2B, {bar} (velocities "
                   f"{figures['rel_diff_velocities']:.1e}), records match", figures)


def step_replicas_ipc(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**one_gpu(ctx), "parallel.exchange": "weights", "parallel.transport": "ipc"},
                          "exchange weights via ipc")


def step_replicas_gloo(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**one_gpu(ctx), "parallel.exchange": "gradients", "parallel.transport": "gloo"},
                          "exchange gradients via gloo")


def step_multi_nccl_weights(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**TWO_GPUS, "parallel.exchange": "weights", "parallel.transport": "nccl"},
                          "exchange weights via nccl")


def step_multi_ddp(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**TWO_GPUS, "parallel.exchange": "gradients", "parallel.transport": "nccl"},
                          "exchange gradients via nccl")


def step_multi_torchrun(ctx: Ctx) -> Outcome:
    from alexnet.launch import free_port
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                f"--master-port={free_port()}"]
    return replicas_check(ctx, {"run.device": "cuda", "parallel.exchange": "gradients"},
                          "exchange gradients via nccl", launcher)
