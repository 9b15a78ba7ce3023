"""Model parallelism in 2 processes (columns, then fc) against 1 process with the same global batch."""
from __future__ import annotations

from .commands import check
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


def step_model_parallel(ctx: Ctx) -> Outcome:
    """On 2 GPUs over NCCL, else both processes on cuda:0 over gloo (NCCL refuses two ranks on one GPU)."""
    ref, b = reference_run(ctx), ctx.profile.batch
    devices = ({} if ctx.device == "cpu" else TWO_GPUS if ctx.gpus > 1 else one_gpu(ctx))
    details, figures = [], {}
    for mode, batch in (("columns", 2 * b), ("fc", 2 * b)):  # a replica's batch: columns share it, fc splits it
        run = ctx.work / ctx.step / mode
        over = {**SAME_UPDATE, **devices, "parallel.model_size": 2, "parallel.model": mode,
                "parallel.exchange": "gradients", "train.batch_size": batch}
        done = check(ctx, mode, train_cmd(ctx, run, over))
        if f"({mode} model parallel)" not in done.output:
            raise StepFailed(f"{mode}: the run did not report its model-parallel layout")
        fig = compare_weights(run, ref)
        same = positions(records(run)) == positions(records(ref))
        ok, bar, fig["rounding_floor"] = within_tolerance(fig["rel_diff"], lambda: reference_floor(ctx))
        if not ok or not same:
            raise StepFailed(f"{mode}: weights rel diff {fig['rel_diff']:.2e} against 1 replica, {bar}, "
                             f"records {'match' if same else 'differ'}")
        figures[mode] = fig
        details.append(f"{mode} {fig['rel_diff']:.1e} {bar}")
    where = "2 GPUs (nccl)" if ctx.gpus > 1 else "one device (gloo)"
    return Outcome(f"{where}, weights rel diff against 1 process: {'; '.join(details)}", figures)
