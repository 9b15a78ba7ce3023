"""Training and resume: SIGINT mid-epoch with a loader process, then the same command again, against
an uninterrupted run; and LARS under bf16 autocast against fp32."""
from __future__ import annotations

import json
import math
import time

from .commands import INJECTED, check, last_line, run_interrupted
from .context import Ctx, Outcome, StepFailed
from .runs import (
    SAME_UPDATE,
    checkpoint_position,
    compare_weights,
    positions,
    records,
    rounding_floor,
    stable,
    train_cmd,
    within_tolerance,
)


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
    ok, bar, figures["rounding_floor"] = within_tolerance(
        rel, lambda: rounding_floor(ctx, straight, over, "straight-2-slices"))
    if not ok or positions(a) != positions(b):
        raise StepFailed(f"{where}; resumed: weights rel diff {rel:.2e}, {bar}, records "
                         f"{'match' if positions(a) == positions(b) else 'differ'} ({len(a)} vs {len(b)})")
    return Outcome(f"{where}; resumed: weights rel diff {rel:.1e}, {bar} (velocities "
                   f"{figures['rel_diff_velocities']:.1e}), {len(b)} records match", figures)


def step_resume(ctx: Ctx) -> Outcome:
    """Without dropout, so that its rounding floor (the same run in 2 slices) draws the same masks;
    dropout's random stream across a resume is proven bitwise by resume-sigint-deterministic."""
    return resume_check(ctx, SAME_UPDATE, exact=False)


def step_resume_deterministic(ctx: Ctx) -> Outcome:
    return resume_check(ctx, {"train.deterministic": "true"}, exact=True)


# lars-bf16: AlexNet-BN with LARS at the paper's global lr at batch 512 (You et al. 2017; trust coefficient
# 0.001), LARS_STEPS steps on one batch, under bf16 autocast and in fp32 from the same weights. bf16 rounds
# activations and their gradients to 8 bits: measured on the CPU (both profiles' sizes), the conv layers'
# updates differ by 16-35 % between the two runs while the losses agree to 1e-4; after 10 steps the worst
# kernel (conv, fc weight) differs by 0.9-1.3e-2 relative, the worst bias by 2.7-3.9e-2: a bias feeding a
# batch norm has a gradient that nearly cancels, and LARS steps it by lr x eta x ||b|| whatever its size,
# so bf16's rounding turns its direction. The limits leave room for the GPU's kernels.
LARS_STEPS = 10
LARS_LR = 2.0
BF16_WEIGHTS_TOL = 5e-2   # max over kernels of ||w_bf16 - w_fp32|| / ||w_fp32|| after LARS_STEPS steps
BF16_BIAS_TOL = 0.15      # the same over biases
BF16_LOSS_TOL = 1e-2      # max over steps of |loss_bf16 - loss_fp32| / loss_fp32


def _first_batch(ctx: Ctx, device):
    """The first training batch of the data step's output, on `device` (cropped, flipped, normalised as
    the trainer's); and the number of classes."""
    from data.loader import InlineLoader, LoaderSpec
    p = ctx.profile
    loader = InlineLoader(LoaderSpec(root=str(ctx.data), batch_size=p.batch, val_batch_size=p.batch, crop=p.crop,
                                     device=str(device), splits=("train",)))
    try:
        b = next(iter(loader.batches("train", 0)))
        x, y = b.x.clone(), b.y.clone()  # the loader may reuse its buffers
    finally:
        loader.close()
    return x, y, json.loads((ctx.data / "meta.json").read_text())["num_classes"]


def _lars_run(precision: str, device, x, y, classes: int, ctx: Ctx) -> dict:
    """LARS_STEPS LARS steps of a fresh AlexNet-BN (seed 0, no dropout) on (x, y) with the trainer's step
    (alexnet.replica.sgd_step) and lr schedule under `precision`'s autocast; every step's trust ratios and
    the dtypes of the norms and gradients the optimizer saw."""
    import torch

    from alexnet.config import TrainConfig
    from alexnet.models import build_model
    from alexnet.optim import LRSchedule, build_optimizer
    from alexnet.precision import autocast_for, configure_backends
    from alexnet.replica import sgd_step
    configure_backends(precision, device)  # fp32 and bf16: no tf32, so the reference is plain fp32
    torch.manual_seed(0)
    model = build_model("alexnet_bn", classes, ctx.profile.width, 0.0, ctx.profile.crop, "paper").to(device)
    cfg = TrainConfig(optimizer="lars", lr=LARS_LR, lr_policy="constant")
    opt, schedule = build_optimizer(model, cfg), LRSchedule(cfg, LARS_STEPS)  # biases at 2x, as the trainer
    ratios: list[list] = [[] for _ in range(LARS_STEPS)]
    dtypes: set[str] = set()
    step = [0]
    local_lr = opt.local_lr

    def spy(group, w_norm, g_norm):  # the trust ratio of each adapted tensor: local lr / (lr x eta)
        dtypes.update(f"norm {t.dtype}" for t in (w_norm, g_norm))
        lrs = local_lr(group, w_norm, g_norm)
        ratios[step[0]].append(lrs / (group["lr"] * group["trust_coefficient"]))
        return lrs
    opt.local_lr = spy
    losses = []
    for i in range(LARS_STEPS):
        step[0] = i
        schedule.apply(opt, i)
        loss, _ = sgd_step(model, opt, x, y, lambda: autocast_for(precision, device),
                           before_update=lambda: dtypes.update(f"grad {q.grad.dtype}" for q in model.parameters()))
        losses.append(loss)
    dtypes.update(f"param {q.dtype}" for q in model.parameters())
    return {"model": model, "losses": [float(v) for v in losses], "dtypes": dtypes,
            "ratios": [torch.cat(r).double().cpu() for r in ratios]}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def step_lars_bf16(ctx: Ctx) -> Outcome:
    """AlexNet-BN with LARS for a few steps under bf16 autocast against fp32, from the same weights on the
    same batch: the norms and gradients fp32, every step's trust ratios finite, the losses and weights
    within stated tolerances (one batch repeated, so both runs descend on it: a comparison of learning,
    not of noise)."""
    import torch
    mode = ctx.inject.get(ctx.step)  # no command to swap: the injection acts here
    if mode in INJECTED:
        if mode == "slow":
            time.sleep(3600)
        raise StepFailed("gpu_check: injected failure (--inject-failure)")
    device = torch.device("cuda:0" if ctx.device == "cuda" else "cpu")
    x, y, classes = _first_batch(ctx, device)
    fp32, bf16 = (_lars_run(p, device, x, y, classes, ctx) for p in ("fp32", "bf16"))
    for name, run in (("fp32", fp32), ("bf16", bf16)):
        if run["dtypes"] != {"norm torch.float32", "grad torch.float32", "param torch.float32"}:
            raise StepFailed(f"the {name} run's parameters, gradients or trust-ratio norms were not all fp32: "
                             f"{sorted(run['dtypes'])}")
        bad = [i + 1 for i, r in enumerate(run["ratios"]) if not bool(torch.isfinite(r).all())]
        if bad:
            raise StepFailed(f"the {name} run's trust ratios are NaN or inf at step(s) {bad}")
    ratios = torch.cat(fp32["ratios"] + bf16["ratios"])
    loss_diff = max(abs(b - a) / abs(a) for a, b in zip(fp32["losses"], bf16["losses"]))
    base = dict(fp32["model"].named_parameters())
    rels = {k: _rel(v.detach(), base[k].detach()) for k, v in bf16["model"].named_parameters()}
    kernels = {k: v for k, v in rels.items() if base[k].ndim > 1}
    biases = {k: v for k, v in rels.items() if base[k].ndim <= 1}
    worst, worst_bias = max(kernels, key=kernels.get), max(biases, key=biases.get)
    buffers = dict(fp32["model"].named_buffers())
    stats = max((_rel(v, buffers[k]) for k, v in bf16["model"].named_buffers() if v.is_floating_point()),
                default=0.0)
    figures = {"steps": LARS_STEPS, "lr": LARS_LR, "batch": int(y.shape[0]), "weights_rel_diff": kernels[worst],
               "worst_tensor": worst, "weights_tol": BF16_WEIGHTS_TOL, "biases_rel_diff": biases[worst_bias],
               "worst_bias": worst_bias, "biases_tol": BF16_BIAS_TOL, "bn_stats_rel_diff": stats,
               "loss_rel_diff": loss_diff, "loss_tol": BF16_LOSS_TOL, "loss_fp32": fp32["losses"],
               "loss_bf16": bf16["losses"], "trust_ratios": len(ratios), "trust_ratio_min": float(ratios.min()),
               "trust_ratio_max": float(ratios.max())}
    if not fp32["losses"][-1] < fp32["losses"][0] or not all(map(math.isfinite, fp32["losses"] + bf16["losses"])):
        raise StepFailed(f"the fp32 run did not learn its batch in {LARS_STEPS} steps (losses {fp32['losses'][0]:.4f} "
                         f"-> {fp32['losses'][-1]:.4f}; bf16 {bf16['losses'][-1]:.4f}): nothing to compare")
    if loss_diff > BF16_LOSS_TOL or kernels[worst] > BF16_WEIGHTS_TOL or biases[worst_bias] > BF16_BIAS_TOL:
        raise StepFailed(f"bf16 vs fp32 after {LARS_STEPS} LARS steps: weights rel diff {kernels[worst]:.2e} ({worst}; "
                         f"limit {BF16_WEIGHTS_TOL:g}), biases {biases[worst_bias]:.2e} ({worst_bias}; limit "
                         f"{BF16_BIAS_TOL:g}), losses {loss_diff:.2e} (limit {BF16_LOSS_TOL:g})")
    return Outcome(f"AlexNet-BN, LARS lr {LARS_LR:g}, {LARS_STEPS} steps: bf16 weights within {kernels[worst]:.1e} of "
                   f"fp32 (limit {BF16_WEIGHTS_TOL:g}), biases {biases[worst_bias]:.1e} (limit {BF16_BIAS_TOL:g}), "
                   f"losses {loss_diff:.1e} (limit {BF16_LOSS_TOL:g}); {len(ratios)} trust ratios finite "
                   f"({float(ratios.min()):.3g} to {float(ratios.max()):.3g}); norms and gradients fp32", figures)
