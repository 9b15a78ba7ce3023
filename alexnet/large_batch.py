"""Layer-wise adaptive optimizers for large batches: LARS (You, Gitman & Ginsburg 2017) and LAMB (You et al. 2019).

Both scale each parameter tensor's step by a trust ratio of norms, taken on the gradient the step applies:
after the data-parallel all-reduce and all micro-batches (``optimizer.step()`` runs after both), in fp32,
and, under model parallelism, over the whole layer: the squared norms of sharded tensors are summed over
the model group by :class:`ModelGroupNorms` (one small all-reduce per step), set as ``norm_reducer``.

**LARS** (Algorithm 1), in the velocity form of :class:`alexnet.optim.PaperSGD` (``v`` is the paper's
velocity negated, so checkpoints, the weights exchange and the Theano export read it as SGD's)::

    ratio = ||w|| / (||g|| + wd ||w|| + eps)       (1 where ||w|| or ||g|| is 0)
    local = eta * ratio                            (trust coefficient eta)
    scale: lr_t = lr * local        clip (LARC, NVCaffe/apex): lr_t = min(lr, local)
    v <- mu v - lr_t (g + wd w);    w <- w + v     (with lr_t = lr: exactly PaperSGD)

``lr`` is the group's (biases: lr x bias_lr_mult) and sits inside the momentum, as in the paper: a new lr
does not rescale the old velocity.

**LAMB**: Adam moments with bias correction, decay added before the trust ratio::

    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2;   r = m/(1 - b1^t) / (sqrt(v/(1 - b2^t)) + eps) + wd w
    w <- w - lr * ratio * r,  ratio = ||w|| / ||r||  (1 where a norm is 0)

**Exclusion** (``exclude="bias_and_norm"``): tensors with ndim <= 1 (biases, norm parameters) take neither
decay nor adaptation (ratio 1): a plain momentum (LARS) or Adam (LAMB) step at the group's lr.

**Zero norms**: the ratio counts as 1, so a LARS tensor with ||w|| = 0 (a zero-initialised bias) moves
by lr * eta * (g + wd w), an SGD-sized step, not by the raw global lr (2 to 32 in the paper's recipes).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from layers import Comm, all_reduce_sum

from .optimizer_base import Optimizer

LARS_EPS = 1e-9                 # keeps the ratio finite; the zero-norm rule handles ||w|| or ||g|| = 0
LAMB_BETAS = (0.9, 0.999)       # the LAMB paper's (and Adam's) defaults
LAMB_EPS = 1e-6                 # the LAMB paper's
EXCLUDE = ("none", "bias_and_norm")
NormReducer = Callable[[list[torch.Tensor], torch.Tensor], None]


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """fp32, or the tensor's own precision where it is higher (a float64 model keeps float64 norms)."""
    return t if t.dtype == torch.float64 else t.float()


class ModelGroupNorms:
    """Sums the squared norms of sharded tensors over the model group, so a split layer's trust ratio is
    that of the whole layer; replicated tensors (whose gradients are already the group's) keep their own."""

    def __init__(self, sharded: Iterable[nn.Parameter], comm: Comm):
        self.sharded, self.comm = {id(p) for p in sharded}, comm
        self._index: dict[tuple, torch.Tensor] = {}  # cached: a fresh index would be a host-to-device copy

    def __call__(self, params: list[torch.Tensor], squares: torch.Tensor) -> None:
        """`squares`: (k, len(params)) squared norms, column j of params[j]; summed in place."""
        cols = tuple(j for j, p in enumerate(params) if id(p) in self.sharded)
        if not cols or self.comm.size == 1:
            return
        key = (cols, squares.device)
        if key not in self._index:
            self._index[key] = torch.tensor(cols, device=squares.device)
        index = self._index[key]
        part = squares.index_select(1, index).contiguous()
        all_reduce_sum(part, self.comm)  # every member calls this each step, in the same order
        squares.index_copy_(1, index, part)


class _TrustRatioOptimizer(Optimizer):
    """What LARS and LAMB share: the adapted/excluded split and the (model-group) norms."""

    norm_reducer: NormReducer | None = None  # set by alexnet/replica.py for a ShardedNet

    @staticmethod
    def _split(group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(adapted, excluded) parameters of the group that have a gradient."""
        params = [p for p in group["params"] if p.grad is not None]
        if group["exclude"] == "bias_and_norm":
            return [p for p in params if p.ndim > 1], [p for p in params if p.ndim <= 1]
        return params, []

    def _norms(self, params: list[torch.Tensor], others: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(||params[j]||, ||others[j]||) as two fp32 vectors; whole-layer norms under model parallelism."""
        if not params:
            empty = torch.zeros(0)
            return empty, empty
        squares = torch.stack([torch.stack(torch._foreach_norm([_at_least_fp32(t) for t in ts]))
                               for ts in (params, others)])
        squares = squares.square()
        if self.norm_reducer is not None:
            self.norm_reducer(params, squares)
        norms = squares.sqrt()
        return norms[0], norms[1]

    @staticmethod
    def _ratio(num: torch.Tensor, den_norm: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """num / den, but 1 where `num` or `den_norm` is 0 (the zero-norm rule)."""
        ok = (num > 0) & (den_norm > 0)
        return torch.where(ok, num / torch.where(ok, den, 1.0), 1.0)

    def _buffers(self, key: str) -> list[torch.Tensor]:
        """The `key` state tensor of every parameter, in parameter order (created as zeros if new)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                out.append(state[key])
        return out


class LARS(_TrustRatioOptimizer):
    """LARS / LARC with momentum in the paper's velocity form (see the module docstring)."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, mode: str = "scale", exclude: str = "none"):
        if mode not in ("scale", "clip") or exclude not in EXCLUDE:
            raise ValueError(f"LARS mode must be scale or clip and exclude one of {EXCLUDE}, got {mode}, {exclude}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "lr_mult": 1.0,
                    "trust_coefficient": trust_coefficient, "mode": mode, "exclude": exclude}
        super().__init__(params, defaults)

    def velocities(self) -> list[torch.Tensor]:
        """The velocity buffer of every parameter (PaperSGD's state key and sign: the weights exchange's)."""
        return self._buffers("velocity")

    def local_lr(self, group: dict, w_norm: torch.Tensor, g_norm: torch.Tensor) -> torch.Tensor:
        """The lr of each adapted tensor of `group`: lr x eta x ratio (scale) or min(lr, eta x ratio) (clip)."""
        lr, wd = group["lr"], group["weight_decay"]
        local = group["trust_coefficient"] * self._ratio(w_norm, g_norm, g_norm + wd * w_norm + LARS_EPS)
        return local * lr if group["mode"] == "scale" else local.clamp(max=lr)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.velocities()  # every buffer exists, so state_dict() is complete from step 1
        work = [(group, *self._split(group)) for group in self.param_groups]
        adapted = [p for _, a, _ in work for p in a]
        w_norm, g_norm = self._norms(adapted, [p.grad for p in adapted])  # one model-group all-reduce
        start = 0
        for group, params, excluded in work:
            n = len(params)
            if n:
                lrs = self.local_lr(group, w_norm[start:start + n], g_norm[start:start + n])
                self._momentum_step(group, params, group["weight_decay"], list(lrs.unbind()))
            if excluded:  # no decay, no adaptation: the plain step at the group's lr
                self._momentum_step(group, excluded, 0.0, None)
            start += n
        return loss

    def _momentum_step(self, group: dict, params: list[torch.Tensor], wd: float, lrs: list | None) -> None:
        """v <- mu v - lr_t (g + wd w); w <- w + v, with lr_t per tensor (`lrs`) or the group's lr."""
        d = [p.grad for p in params]
        if wd:
            d = torch._foreach_add(d, params, alpha=wd)
        vels = [self.state[p]["velocity"] for p in params]
        torch._foreach_mul_(vels, group["momentum"])
        if lrs is None:
            torch._foreach_add_(vels, d, alpha=-group["lr"])
        else:
            torch._foreach_sub_(vels, torch._foreach_mul(d, lrs))
        torch._foreach_add_(params, vels)


class LAMB(_TrustRatioOptimizer):
    """LAMB: Adam with decoupled decay and a per-tensor trust ratio (see the module docstring)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, exclude: str = "none",
                 betas: tuple[float, float] = LAMB_BETAS, eps: float = LAMB_EPS):
        if exclude not in EXCLUDE:
            raise ValueError(f"LAMB exclude must be one of {EXCLUDE}, got {exclude}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "lr_mult": 1.0, "exclude": exclude,
                    "betas": tuple(betas), "eps": eps}
        super().__init__(params, defaults)

    def _init_state(self) -> None:
        """m, v (the parameter's shape) and the step count (a CPU scalar, as torch's Adam keeps it)."""
        self._buffers("exp_avg")
        self._buffers("exp_avg_sq")
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))

    def _direction(self, group: dict, params: list[torch.Tensor], wd: float) -> list[torch.Tensor]:
        """Update the moments of `params`; return r = m_hat / (sqrt(v_hat) + eps) + wd w for each."""
        if not params:
            return []
        b1, b2 = group["betas"]
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        t = [float(s) for s in steps]  # CPU scalars: no device synchronisation
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [(1 - b2 ** k) ** 0.5 for k in t])
        torch._foreach_add_(denom, group["eps"])
        r = torch._foreach_div(m, denom)
        torch._foreach_div_(r, [1 - b1 ** k for k in t])
        if wd:
            torch._foreach_add_(r, params, alpha=wd)
        return r

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._init_state()
        work = []
        for group in self.param_groups:
            params, excluded = self._split(group)
            work.append((group, params, self._direction(group, params, group["weight_decay"]),
                         excluded, self._direction(group, excluded, 0.0)))
        adapted = [p for _, a, _, _, _ in work for p in a]
        w_norm, r_norm = self._norms(adapted, [r for _, _, rs, _, _ in work for r in rs])
        ratio = self._ratio(w_norm, r_norm, r_norm)
        start = 0
        for group, params, r, excluded, r_excluded in work:
            n = len(params)
            if n:
                torch._foreach_mul_(r, list((ratio[start:start + n] * group["lr"]).unbind()))
                torch._foreach_sub_(params, r)
            if excluded:  # ratio 1, no decay: Adam's step
                torch._foreach_add_(excluded, r_excluded, alpha=-group["lr"])
            start += n
        return loss
