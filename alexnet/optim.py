"""The paper's SGD, the optimizer a config asks for, and the learning-rate policies.

Update (Krizhevsky 2012; the Theano reproduction and Caffe use the same form):

    v <- mu * v - lr * (g + wd * w)        w <- w + v

The velocity holds the lr-scaled step, so a lr drop changes only new gradients' contribution (torch's
SGD keeps an unscaled buffer and rescales the whole momentum instead). Nesterov: w <- w + mu * v - lr * g'.
Biases learn at ``bias_lr_mult`` times the lr with ``bias_decay_mult`` times the decay (2 and 0).
``train.optimizer: lars | lamb`` builds alexnet/large_batch.py's optimizers on the same groups.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig
from .large_batch import LAMB, LARS
from .optimizer_base import Optimizer


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Weights (ndim > 1) and biases (ndim 1) with their lr and decay multipliers."""
    weights = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    biases = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": weights, "name": "weights", "lr_mult": 1.0, "weight_decay": cfg.weight_decay}]
    if biases:
        groups.append({"params": biases, "name": "biases", "lr_mult": cfg.bias_lr_mult,
                       "weight_decay": cfg.weight_decay * cfg.bias_decay_mult})
    return groups


class PaperSGD(Optimizer):
    """SGD with momentum in the paper's velocity form (see the module docstring)."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = False):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                    "lr_mult": 1.0}
        super().__init__(params, defaults)

    def velocities(self) -> list[torch.Tensor]:
        """The velocity buffer of every parameter, in parameter order (created as zeros if new)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                out.append(state["velocity"])
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.velocities()  # make sure every buffer exists, so state_dict() is complete from step 1
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            vels = [self.state[p]["velocity"] for p in params]
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            if wd:
                grads = torch._foreach_add(grads, params, alpha=wd)
            torch._foreach_mul_(vels, mu)
            torch._foreach_add_(vels, grads, alpha=-lr)
            if group["nesterov"]:
                torch._foreach_add_(params, vels, alpha=mu)
                torch._foreach_add_(params, grads, alpha=-lr)
            else:
                torch._foreach_add_(params, vels)
        return loss


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of train.optimizer over `model`'s weight and bias groups (the trainer's only way)."""
    groups = param_groups(model, cfg)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    trust_coefficient=cfg.trust_coefficient, mode=cfg.lars_mode, exclude=cfg.lars_exclude)
    if cfg.optimizer == "lamb":  # Adam's betas and eps are LAMB's fixed defaults; train.momentum is not used
        return LAMB(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, exclude=cfg.lars_exclude)
    return PaperSGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)


class LRSchedule:
    """The base learning rate at every step: policy x warmup; `scale` is the large-batch factor. A pure
    function of the global step (plus the auto policy's drops, kept in state_dict), so resuming is exact.

    Epochs count from 1 for users: ``lr_steps: [25, 45]`` divides the lr after epochs 25 and 45 (the
    Theano repo's meaning). Internally `epoch` is the 0-based index of the epoch in progress.
    """

    def __init__(self, cfg: TrainConfig, steps_per_epoch: int, scale: float = 1.0):
        self.cfg, self.steps_per_epoch, self.scale = cfg, steps_per_epoch, scale
        self.auto_factor = 1.0            # auto policy: product of the drops so far
        self.auto_last_drop = 0           # auto policy: epochs completed at the last drop
        self.val_history: list[float] = []  # auto policy: val top-1 error after each validated epoch

    def target_lr(self) -> float:
        return self.cfg.lr * self.scale

    def _policy(self, step: int) -> float:
        c, epoch = self.cfg, step // self.steps_per_epoch
        if c.lr_policy == "step":
            return c.lr_gamma ** sum(1 for s in c.lr_steps if epoch >= s)
        if c.lr_policy == "auto":
            return self.auto_factor
        if c.lr_policy == "cosine":
            warm = round(c.warmup_epochs * self.steps_per_epoch)
            total = max(1, c.epochs * self.steps_per_epoch - warm)
            t = min(1.0, max(0.0, (step - warm) / total))
            floor = c.lr_min / self.target_lr() if self.target_lr() else 0.0
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        if c.lr_policy == "poly":  # You et al.: (1 - t/T)^power over the whole run, t the 0-based step
            return max(0.0, 1 - step / (c.epochs * self.steps_per_epoch)) ** c.lr_power
        return 1.0

    def _warmup(self, step: int) -> float:
        warm = self.cfg.warmup_epochs * self.steps_per_epoch
        if step >= warm:
            return 1.0
        start = self.cfg.warmup_start_factor
        start = (1.0 / self.scale if self.scale > 1 else 0.0) if start is None else start
        return start + (1 - start) * step / warm

    def lr_at(self, step: int) -> float:
        """The base lr (weights) at 0-based global `step`; biases use lr x bias_lr_mult."""
        return self.target_lr() * self._policy(step) * self._warmup(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def on_validation(self, epochs_done: int, top1_err: float) -> bool:
        """Record a validation result; the auto policy may drop the lr (returns True if it did)."""
        self.val_history.append(top1_err)
        p = self.cfg.lr_auto_patience
        if self.cfg.lr_policy != "auto" or len(self.val_history) <= p or epochs_done - self.auto_last_drop < p:
            return False
        if self.val_history[-1 - p] - self.val_history[-1] < self.cfg.lr_auto_threshold:
            self.auto_factor *= self.cfg.lr_gamma
            self.auto_last_drop = epochs_done
            return True
        return False

    def state_dict(self) -> dict:
        return {"auto_factor": self.auto_factor, "auto_last_drop": self.auto_last_drop,
                "val_history": list(self.val_history)}

    def load_state_dict(self, state: dict) -> None:
        self.auto_factor = float(state["auto_factor"])
        self.auto_last_drop = int(state["auto_last_drop"])
        self.val_history = [float(v) for v in state["val_history"]]
