"""alexnet/optim.py: the paper's update rule and per-parameter rules, LR policies, warmup, state."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from alexnet.config import TrainConfig
from alexnet.optim import LRSchedule, PaperSGD, build_optimizer, param_groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]]))
            self.fc.bias.copy_(torch.tensor([0.1, -0.2]))


def grads_of(model, x):
    model.zero_grad()
    model.fc(x).pow(2).sum().backward()
    return model.fc.weight.grad.clone(), model.fc.bias.grad.clone()


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_steps_against_hand_computation(nesterov):
    cfg = TrainConfig(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    model = Tiny()
    opt = build_optimizer(model, cfg)
    x = torch.tensor([[1.0, 2.0, -1.0]])
    w, b = model.fc.weight.detach().clone(), model.fc.bias.detach().clone()
    vw, vb = torch.zeros_like(w), torch.zeros_like(b)
    for lr in (0.1, 0.01):  # the lr drops between the steps: the paper form keeps the old velocity
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        gw, gb = grads_of(model, x)
        opt.step()
        gw_eff = gw + 0.01 * w            # weights: decay
        gb_eff = gb                       # biases: no decay ...
        vw = 0.9 * vw - lr * gw_eff
        vb = 0.9 * vb - 2 * lr * gb_eff   # ... and twice the lr
        if nesterov:
            w = w + 0.9 * vw - lr * gw_eff
            b = b + 0.9 * vb - 2 * lr * gb_eff
        else:
            w, b = w + vw, b + vb
        torch.testing.assert_close(model.fc.weight.detach(), w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(model.fc.bias.detach(), b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[model.fc.weight]["velocity"], vw, rtol=1e-6, atol=1e-7)


def test_groups_and_state_roundtrip():
    model = Tiny()
    opt = build_optimizer(model, TrainConfig(weight_decay=5e-4))
    names = {g["name"]: g for g in opt.param_groups}
    assert names["weights"]["weight_decay"] == 5e-4 and names["biases"]["weight_decay"] == 0.0
    assert names["biases"]["lr_mult"] == 2.0
    grads_of(model, torch.ones(1, 3))
    opt.step()
    other = build_optimizer(Tiny(), TrainConfig(weight_decay=5e-4))
    other.load_state_dict(opt.state_dict())
    for a, b in zip(opt.velocities(), other.velocities()):
        assert torch.equal(a, b) and a.abs().sum() > 0


def sched(steps_per_epoch=10, **kw) -> LRSchedule:
    return LRSchedule(TrainConfig(lr=0.1, **kw), steps_per_epoch)


def test_step_policy_after_the_named_epochs():
    s = sched(lr_policy="step", lr_steps=[2, 4], lr_gamma=0.1)
    assert s.lr_at(0) == s.lr_at(19) == pytest.approx(0.1)
    assert s.lr_at(20) == s.lr_at(39) == pytest.approx(0.01)  # after epoch 2
    assert s.lr_at(40) == pytest.approx(0.001)


def test_constant_and_warmup():
    s = sched(lr_policy="constant", warmup_epochs=1.0)
    assert s.lr_at(0) == 0.0 and s.lr_at(5) == pytest.approx(0.05) and s.lr_at(10) == pytest.approx(0.1)
    s = sched(lr_policy="constant", warmup_epochs=0.5, warmup_start_factor=0.2)
    assert s.lr_at(0) == pytest.approx(0.02) and s.lr_at(5) == pytest.approx(0.1)
    s = LRSchedule(TrainConfig(lr=0.1, lr_policy="constant", warmup_epochs=1.0), 10, scale=4.0)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(10) == pytest.approx(0.4)  # Goyal: from lr to k*lr


def test_cosine():
    s = sched(lr_policy="cosine", epochs=10, lr_min=0.001)
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(50) == pytest.approx(0.001 + (0.1 - 0.001) / 2)
    assert s.lr_at(100) == pytest.approx(0.001)
    w = sched(lr_policy="cosine", epochs=10, warmup_epochs=2)
    assert w.lr_at(10) == pytest.approx(0.05) and w.lr_at(20) == pytest.approx(0.1)
    assert w.lr_at(60) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_auto_policy_drops_when_progress_stalls_and_restores():
    s = sched(lr_policy="auto", lr_auto_threshold=0.01, lr_auto_patience=2)
    drops = [s.on_validation(e, err) for e, err in enumerate([0.9, 0.8, 0.7, 0.65, 0.645], start=1)]
    assert drops == [False, False, False, False, False]  # 0.7 - 0.645 = 0.055 >= 0.01
    assert s.on_validation(6, 0.644)  # 0.65 - 0.644 < 0.01: divide by 10
    assert s.lr_at(60) == pytest.approx(0.01)
    assert not s.on_validation(7, 0.644)  # waits `patience` epochs after a drop
    restored = sched(lr_policy="auto")
    restored.load_state_dict(s.state_dict())
    assert restored.lr_at(70) == s.lr_at(70) and restored.val_history == s.val_history
    assert restored.on_validation(8, 0.644) == s.on_validation(8, 0.644) is True


def test_apply_sets_bias_lr():
    model = Tiny()
    opt = build_optimizer(model, TrainConfig())
    lr = sched(lr_policy="constant").apply(opt, 3)
    assert [g["lr"] for g in opt.param_groups] == [lr, 2 * lr]


def test_apply_to_groups_without_lr_mult():
    """A torch optimizer's groups have no lr_mult: they get the base lr itself."""
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    lr = sched(lr_policy="step", lr_steps=[1], lr_gamma=0.5).apply(opt, 10)  # epoch 2: 0.1 x 0.5
    assert lr == pytest.approx(0.05) and [g["lr"] for g in opt.param_groups] == [lr]


def test_step_calls_the_closure_and_skips_groups_without_gradients():
    model = Tiny()
    opt = build_optimizer(model, TrainConfig(lr=0.5, momentum=0.0, weight_decay=0.0))
    w0, b0 = model.fc.weight.detach().clone(), model.fc.bias.detach().clone()
    model.fc.bias.grad = torch.tensor([1.0, -2.0])  # the weights (first group) have no gradient
    assert opt.step(lambda: 7.0) == 7.0
    assert opt.step() is None
    assert torch.equal(model.fc.weight.detach(), w0)
    # two steps at lr 0.5 (lr_mult is applied by LRSchedule.apply, not used here), no momentum: b0 - g
    torch.testing.assert_close(model.fc.bias.detach(), b0 - torch.tensor([1.0, -2.0]))
    assert len(opt.velocities()) == 2 and opt.velocities()[0].abs().sum() == 0


def test_optimizer_defaults_and_frozen_or_biasless_models():
    model = Tiny()
    opt = PaperSGD(model.parameters(), lr=0.1)
    (group,) = opt.param_groups
    assert (group["momentum"], group["weight_decay"], group["nesterov"], group["lr_mult"]) == (0.9, 0.0, False, 1.0)
    model.fc.bias.requires_grad_(False)  # frozen: in no group
    groups = param_groups(model, TrainConfig())
    assert [g["name"] for g in groups] == ["weights"] and groups[0]["params"] == [model.fc.weight]
    biasless = nn.Linear(3, 2, bias=False)
    assert [g["name"] for g in param_groups(biasless, TrainConfig())] == ["weights"]
    model.fc.weight.requires_grad_(False)
    model.fc.bias.requires_grad_(True)
    groups = param_groups(model, TrainConfig(weight_decay=0.1, bias_decay_mult=0.5, bias_lr_mult=3.0))
    assert groups[0]["params"] == [] and groups[1]["params"] == [model.fc.bias]
    assert (groups[1]["lr_mult"], groups[1]["weight_decay"]) == (3.0, pytest.approx(0.05))


def test_auto_policy_boundaries_by_hand():
    """patience 1, threshold 0.25, gamma 0.5; numbers exact in binary, so the comparisons are exact."""
    s = sched(lr_policy="auto", lr_auto_threshold=0.25, lr_auto_patience=1, lr_gamma=0.5)
    assert not s.on_validation(1, 1.0)     # no epoch `patience` back yet
    assert not s.on_validation(2, 0.5)     # improved by 0.5 over the last epoch
    assert not s.on_validation(3, 0.25)    # improved by exactly the threshold: not a stall
    assert s.on_validation(4, 0.125)       # 0.125 < 0.25: lr x 0.5
    assert s.on_validation(5, 0.125)       # `patience` (1) epochs after the drop, no progress: x 0.5 again
    assert s.lr_at(0) == pytest.approx(0.1 * 0.25)
    assert s.state_dict() == {"auto_factor": 0.25, "auto_last_drop": 5,
                              "val_history": [1.0, 0.5, 0.25, 0.125, 0.125]}
    other = sched(lr_policy="step")         # another policy never drops
    assert not any(other.on_validation(e, 0.5) for e in range(1, 6))


def test_cosine_and_warmup_edges_by_hand():
    s = sched(lr_policy="cosine", epochs=10, lr_min=0.001)
    assert s.lr_at(150) == pytest.approx(0.001)  # past the end: stays at lr_min
    one = sched(steps_per_epoch=1, lr_policy="cosine", epochs=1, lr_min=0.001)
    assert one.lr_at(0) == pytest.approx(0.1) and one.lr_at(1) == pytest.approx(0.001)
    assert LRSchedule(TrainConfig(lr=0.1, lr_policy="cosine"), 10, scale=0.0).lr_at(5) == 0.0
    w = sched(lr_policy="constant", warmup_epochs=1.0, warmup_start_factor=0.2)
    assert w.lr_at(5) == pytest.approx(0.1 * (0.2 + 0.8 * 5 / 10))
    k2 = LRSchedule(TrainConfig(lr=0.1, lr_policy="constant", warmup_epochs=1.0), 10, scale=2.0)
    assert k2.lr_at(0) == pytest.approx(0.1) and k2.lr_at(5) == pytest.approx(0.15)  # from lr to 2 x lr
