"""Training and resume: SIGINT mid-epoch with a loader process, then the same command again, against
an uninterrupted run."""
from __future__ import annotations

from .commands import check, last_line, run_interrupted
from .context import REL_TOL, Ctx, Outcome, StepFailed
from .runs import checkpoint_position, compare_weights, positions, records, stable, train_cmd


def resume_check(ctx: Ctx, extra: dict, exact: bool) -> Outcome:
    """Uninterrupted run vs SIGINT mid-epoch + the same command again, with a loader process."""
    straight, split = ctx.work / ctx.step / "straight", ctx.work / ctx.step / "interrupted"
    over = {"data.loading": "process", **extra}
    check(ctx, "straight", train_cmd(ctx, straight, over))
    cmd = train_cmd(ctx, split, over)
    done, when = run_interrupted(ctx, "interrupted", cmd, split)
    if done.rc != 130:
        raise StepFailed(f"the interrupted run exited with code {done.rc}, not 130 (SIGINT sent {when}): "
                         f"{last_line(done.output)}")
    at = checkpoint_position(split)
    resumed = check(ctx, "resumed", cmd)
    if "resumed from" not in resumed.output:
        raise StepFailed("the second run did not say 'resumed from': it started afresh")
    figures = compare_weights(split, straight)
    rel, same = figures["rel_diff"], figures["bitwise"]
    a, b = records(split), records(straight)
    figures.update(records=len(b), checkpoint=at, sigint=when,
                   max_loss_diff=max((abs(x["loss"] - y["loss"]) for x, y in zip(a, b)), default=None))
    where = f"SIGINT {when}: exit 130 at epoch {at['epoch'] + 1}, step {at['step']}"
    if exact:
        if not same:
            raise StepFailed(f"{where}; resumed weights/velocities not bitwise equal (rel diff {rel:.2e})")
        if stable(a) != stable(b):
            raise StepFailed(f"{where}; metrics differ: {len(a)} records vs {len(b)} uninterrupted")
        return Outcome(f"{where}; resumed: weights and velocities bitwise equal, {len(b)} records identical",
                       figures)
    if rel > REL_TOL or positions(a) != positions(b):
        raise StepFailed(f"{where}; resumed: weights rel diff {rel:.2e} (limit {REL_TOL:g}), records "
                         f"{'match' if positions(a) == positions(b) else 'differ'} ({len(a)} vs {len(b)})")
    return Outcome(f"{where}; resumed: weights rel diff {rel:.1e} <= {REL_TOL:g} (velocities "
                   f"{figures['rel_diff_velocities']:.1e}), {len(b)} records match", figures)


def step_resume(ctx: Ctx) -> Outcome:
    return resume_check(ctx, {}, exact=False)


def step_resume_deterministic(ctx: Ctx) -> Outcome:
    return resume_check(ctx, {"train.deterministic": "true"}, exact=True)
