"""Training runs as the steps start them, and their comparison (checkpoints, metrics records)."""
from __future__ import annotations

import sys
from pathlib import Path

from .commands import check
from .context import Ctx, StepFailed

# Dropout draws differ per replica; without it N replicas x B follow 1 replica x N*B exactly.
SAME_UPDATE = {"model.dropout": 0.0}
TWO_GPUS = {"parallel.devices": "[cuda:0,cuda:1]"}


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


def reference_run(ctx: Ctx) -> Path:
    """1 replica with twice the batch, shared by the replica and model-parallel steps (a second call
    finds it finished, or resumes the one a cut step left)."""
    ref = ctx.work / "reference-2x-batch"
    extra = {**SAME_UPDATE, "train.batch_size": 2 * ctx.profile.batch}
    if ctx.device == "cuda":
        extra["run.device"] = "cuda:0"
    check(ctx, "reference", train_cmd(ctx, ref, extra))
    return ref
