"""Training runs as the steps start them, and their comparison (checkpoints, metrics records)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from .commands import check
from .context import REL_TOL, Ctx, StepFailed

# Dropout draws differ per replica; without it N replicas x B follow 1 replica x N*B exactly.
SAME_UPDATE = {"model.dropout": 0.0}
TWO_GPUS = {"parallel.devices": "[cuda:0,cuda:1]"}
# Measured on an H200 (2026-11-27), the comparisons ended 0.8 to 7.1 times their floor (resume 2.8e-2 vs
# 3.7e-2; replicas, model parallel 1.3e-3 to 2.9e-3 vs 4.1e-4): 20 leaves room for that spread.
FLOOR_FACTOR = 20.0


def train_cmd(ctx: Ctx, run_dir: Path, extra: dict | None = None, launcher: list[str] | None = None) -> list[str]:
    """train.py with configs/demo.yaml and this device's small sizes; `extra` overrides win."""
    p = ctx.profile
    over = {"data.root": ctx.data, "data.crop": p.crop, "data.loading": p.loading, "model.width": p.width,
            "model.init": "torch", "train.batch_size": p.batch, "train.epochs": 2, "train.log_every": p.log_every,
            "train.lr_steps": "[1]", "run.dir": run_dir, "run.device": ctx.device, "run.progress": "false",
            "run.tensorboard": "false", "run.keep_last": 1, **(extra or {})}
    return [*(launcher or [sys.executable]), "train.py", "configs/demo.yaml", *(f"{k}={v}" for k, v in over.items())]


def one_gpu(ctx: Ctx) -> dict:
    """Two processes sharing cuda:0 (nothing on the CPU twin)."""
    return {"parallel.devices": "[cuda:0,cuda:0]"} if ctx.device == "cuda" else {}


def records(run_dir: Path) -> list[dict]:
    from alexnet.metrics import read_metrics
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def stable(recs: list[dict]) -> list[dict]:
    from alexnet.metrics import without_wall_clock
    return without_wall_clock(recs)


def positions(recs: list[dict]) -> list[tuple]:
    return [(r["split"], r["epoch"], r["iter"]) for r in recs]


def compare_weights(a: Path, b: Path) -> dict:
    """Two runs' last checkpoints: rel_diff (weights: the tolerance applies to them), rel_diff_velocities
    and bitwise (alexnet.checkpoint.compare_checkpoints)."""
    from alexnet.checkpoint import compare_checkpoints
    try:
        c = compare_checkpoints(a / "checkpoints" / "last.pt", b / "checkpoints" / "last.pt")
    except ValueError as e:
        raise StepFailed(str(e)) from None
    return {"rel_diff": c["weights"], "rel_diff_velocities": c["velocities"], "bitwise": c["bitwise"]}


def checkpoint_position(run_dir: Path) -> dict:
    from alexnet.checkpoint import load
    state = load(run_dir / "checkpoints" / "last.pt")
    return {k: int(state[k]) for k in ("epoch", "step", "global_step")}


def reference_over(ctx: Ctx) -> dict:
    extra = {**SAME_UPDATE, "train.batch_size": 2 * ctx.profile.batch}
    if ctx.device == "cuda":
        extra["run.device"] = "cuda:0"
    return extra


def reference_run(ctx: Ctx) -> Path:
    """1 replica with twice the batch, shared by the replica and model-parallel steps (a second call
    finds it finished, or resumes the one a cut step left)."""
    ref = ctx.work / "reference-2x-batch"
    check(ctx, "reference", train_cmd(ctx, ref, reference_over(ctx)))
    return ref


def reference_floor(ctx: Ctx) -> float:
    """The rounding floor of the 1 replica x 2B reference (its twin is made once, like the reference)."""
    return rounding_floor(ctx, reference_run(ctx), reference_over(ctx), "reference-2-slices")


def rounding_floor(ctx: Ctx, base: Path, over: dict, label: str) -> float:
    """How far apart two runs end here that differ only in float rounding: the run `base` (made with the
    overrides `over`) against the same run in 2 sequential micro-batches (train.slices=2), which sums
    the same gradients in another order. On a GPU, cuDNN's algorithms (autotuned, and chosen per batch
    size) round differently from run to run and training amplifies that step after step, so two correct
    runs end far apart (on an H200, 2026-11-27: the replica and model-parallel comparisons 1.2e-3 to
    2.9e-3 after 30 steps, the resume comparison 2.8e-2 and 7.7e-2 after 60), where the CPU twin's stay
    below REL_TOL. A comparison that misses REL_TOL is judged against this floor instead."""
    twin = base.parent / f"{base.name}-2-slices"
    check(ctx, label, train_cmd(ctx, twin, {**over, "train.slices": 2}))
    return compare_weights(twin, base)["rel_diff"]


def within_tolerance(rel: float, floor: Callable[[], float]) -> tuple[bool, str, float | None]:
    """rel <= REL_TOL, else rel <= FLOOR_FACTOR x the rounding floor (asked for only then): the verdict,
    the words that say which bar applied, and the floor (None where it was not needed)."""
    if rel <= REL_TOL:
        return True, f"<= {REL_TOL:g}", None
    f = floor()
    limit = FLOOR_FACTOR * f
    return rel <= limit, (f"{'within' if rel <= limit else 'above'} {FLOOR_FACTOR:g} x the rounding floor "
                          f"{f:.1e} (limit {REL_TOL:g} missed; floor: the same run in 2 slices)"), f
