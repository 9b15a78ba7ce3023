"""scripts/evaluate.py with 1 and 10 crops on the device, against the CPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .commands import check
from .context import Ctx, Outcome, StepFailed
from .runs import train_cmd


def eval_checkpoint(ctx: Ctx) -> Path:
    """resume-sigint's checkpoint, else a short run of this step's own."""
    ckpt = ctx.work / "resume-sigint" / "straight" / "checkpoints" / "last.pt"
    if ckpt.exists():
        return ckpt
    run = ctx.work / ctx.step / "run"
    check(ctx, "train", train_cmd(ctx, run, {"train.epochs": 1}))
    return run / "checkpoints" / "last.pt"


def evaluate(ctx: Ctx, weights: Path, device: str, crops: int, n_val: int) -> dict:
    """One evaluate.py run: its --json record, with n checked against the val split."""
    out = ctx.work / ctx.step / f"{device}-{crops}crop.json"
    check(ctx, f"{device}-{crops}crop", [sys.executable, "scripts/evaluate.py", "--data", str(ctx.data),
                                         "--weights", str(weights), "--crops", str(crops), "--device", device,
                                         "--json", str(out), "--no-progress"])
    if not out.exists():
        raise StepFailed(f"evaluate.py --device {device} --crops {crops} wrote no {out.name}")
    rec = json.loads(out.read_text())
    if rec["n"] != n_val:
        raise StepFailed(f"--device {device} --crops {crops}: n = {rec['n']}, the val split has {n_val}")
    return rec


def step_evaluate(ctx: Ctx) -> Outcome:
    """1 and 10 crops on the device and on the CPU: n = the val count, errors within one image."""
    weights, n_val = eval_checkpoint(ctx), json.loads((ctx.data / "meta.json").read_text())["splits"]["val"]["count"]
    got = {f"{device}-{crops}crop": evaluate(ctx, weights, device, crops, n_val)
           for device in dict.fromkeys([ctx.device, "cpu"]) for crops in (1, 10)}
    for crops in (1, 10):
        dev, cpu = got[f"{ctx.device}-{crops}crop"], got[f"cpu-{crops}crop"]
        for key in ("top1_err", "top5_err"):
            if abs(dev[key] - cpu[key]) * n_val > 1 + 1e-6:
                raise StepFailed(f"{crops} crop(s): {key} {dev[key]:.4f} on {ctx.device}, {cpu[key]:.4f} on the "
                                 f"CPU: more than one image apart")
    figures = {k: {m: v[m] for m in ("top1_err", "top5_err", "n")} for k, v in got.items()}
    one, ten = got[f"{ctx.device}-1crop"], got[f"{ctx.device}-10crop"]
    agree = "the CPU twin: nothing to compare with" if ctx.device == "cpu" else "cuda and cpu within one image"
    return Outcome(f"n = {n_val}; top-1 error {one['top1_err']:.3f} (1 crop), {ten['top1_err']:.3f} (10 crops); "
                   f"{agree}", figures)
