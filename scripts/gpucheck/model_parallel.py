"""Model parallelism in 2 processes (columns, then fc) against 1 process with the same global batch."""
from __future__ import annotations

from . import runs
from .commands import check
from .context import Ctx, Outcome, StepFailed


def step_model_parallel(ctx: Ctx) -> Outcome:
    """On 2 GPUs over NCCL, else both processes on cuda:0 over gloo (NCCL refuses two ranks on one GPU)."""
    ref, b = runs.reference_run(ctx), ctx.profile.batch
    devices = ({} if ctx.device == "cpu" else runs.TWO_GPUS if ctx.gpus > 1 else runs.one_gpu(ctx))
    details, figures = [], {}
    for mode in ("columns", "fc"):  # the reference's batch, a replica's: columns share it, fc splits it
        run = ctx.work / ctx.step / mode
        over = {**runs.SAME_UPDATE, **devices, "parallel.model_size": 2, "parallel.model": mode,
                "parallel.exchange": "gradients", "train.batch_size": 2 * b}
        done = check(ctx, mode, runs.train_cmd(ctx, run, over))
        if f"({mode} model parallel)" not in done.output:
            raise StepFailed(f"{mode}: the run did not report its model-parallel layout")
        fig = runs.compare_weights(run, ref)
        same = runs.positions(runs.records(run)) == runs.positions(runs.records(ref))
        ok, bar, fig["rounding_floor"] = runs.within_tolerance(fig["rel_diff"], lambda: runs.reference_floor(ctx))
        if not ok or not same:
            raise StepFailed(f"{mode}: weights rel diff {fig['rel_diff']:.2e} against 1 replica, {bar}, "
                             f"records {'match' if same else 'differ'}")
        figures[mode] = fig
        details.append(f"{mode} {fig['rel_diff']:.1e} {bar}")
    where = "2 GPUs (nccl)" if ctx.gpus > 1 else "one device (gloo)"
    return Outcome(f"{where}, weights rel diff against 1 process: {'; '.join(details)}", figures)
