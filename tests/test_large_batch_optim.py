"""alexnet/large_batch.py and the poly policy: LARS (both modes) and LAMB against numpy hand computations of
the published algorithms, the zero-norm rule, the model-group norms, exact resume, and the refusals."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from torch import nn

import alexnet.large_batch as lb
import train
from alexnet.checkpoint import load
from alexnet.config import Config, ConfigError, TrainConfig, apply
from alexnet.distributed import DistInfo
from alexnet.large_batch import LAMB, LARS, ModelGroupNorms
from alexnet.optim import LRSchedule, PaperSGD, build_optimizer, param_groups
from alexnet.replica import Replica
from alexnet.trainer import Trainer
from layers import TorchComm
from tests.conftest import tiny_overrides

EPS = 1e-9          # LARS's epsilon, as documented in alexnet/large_batch.py
B1, B2, ADAM_EPS = 0.9, 0.999, 1e-6  # LAMB's documented constants
LRS = (0.5, 0.2, 0.005)  # the global lr changes between the steps (clip: below the local lr at the last)
SHAPES = {"w": (3, 4), "b": (4,), "z": (3,), "u": (2, 5)}  # weight, bias, zero bias, weight with a zero first grad


class Net(nn.Module):
    """Parameters only: their gradients are set by hand (the optimizers see nothing else)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(1)
        for name, shape in SHAPES.items():
            value = np.zeros(shape) if name == "z" else rng.normal(size=shape)  # z: a zero-initialised bias
            self.register_parameter(name, nn.Parameter(torch.tensor(value, dtype=torch.float32)))


def grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    out = {k: rng.normal(size=s).astype(np.float32).astype(np.float64) for k, s in SHAPES.items()}
    if step == 0:
        out["u"][:] = 0.0  # ||g|| = 0 at the first step
    return out


def start() -> dict[str, np.ndarray]:
    return {k: p.detach().double().numpy().copy() for k, p in Net().named_parameters()}


CFG = TrainConfig(lr=LRS[0], momentum=0.9, weight_decay=0.01, bias_lr_mult=2.0, bias_decay_mult=0.5,
                  trust_coefficient=0.02)


def lr_mult(k: str) -> float:
    return CFG.bias_lr_mult if len(SHAPES[k]) == 1 else 1.0


def decay(k: str) -> float:
    return CFG.weight_decay * (CFG.bias_decay_mult if len(SHAPES[k]) == 1 else 1.0)


def run_torch(cfg: TrainConfig) -> tuple[Net, torch.optim.Optimizer]:
    """Three steps of build_optimizer(cfg) on Net with the gradients of grads(), the lr changing (LRS)."""
    net = Net()
    opt = build_optimizer(net, cfg)
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_mult"]
        for k, p in net.named_parameters():
            p.grad = torch.tensor(grads(step)[k], dtype=torch.float32)
        opt.step()
    return net, opt


def lars_reference(mode: str, exclude: bool, branches: set | None = None) -> tuple[dict, dict]:
    """You et al. 2017, Algorithm 1 (the paper's signs: v <- m v + gamma lambda (g + beta w); w <- w - v);
    clip: the lr is min(gamma, lambda) (LARC, NVCaffe/apex). Returns (weights, paper velocities);
    `branches` collects which side of clip's min was taken."""
    w, v = start(), {k: np.zeros(s) for k, s in SHAPES.items()}
    for step, lr in enumerate(LRS):
        g = grads(step)
        for k in SHAPES:
            gamma, beta = lr * lr_mult(k), decay(k)
            if exclude and len(SHAPES[k]) <= 1:
                rate, beta = gamma, 0.0  # no decay, no adaptation
            else:
                wn, gn = np.linalg.norm(w[k]), np.linalg.norm(g[k])
                ratio = wn / (gn + beta * wn + EPS) if wn > 0 and gn > 0 else 1.0  # the zero-norm rule
                local = CFG.trust_coefficient * ratio
                rate = gamma * local if mode == "scale" else min(gamma, local)
                if branches is not None:
                    branches.add("global" if gamma < local else "local")
            v[k] = CFG.momentum * v[k] + rate * (g[k] + beta * w[k])
            w[k] = w[k] - v[k]
    return w, v


@pytest.mark.parametrize("exclude", ["none", "bias_and_norm"])
@pytest.mark.parametrize("mode", ["scale", "clip"])
def test_lars_against_algorithm_1(mode, exclude):
    cfg = TrainConfig(**{**vars(CFG), "optimizer": "lars", "lars_mode": mode, "lars_exclude": exclude})
    net, opt = run_torch(cfg)
    assert isinstance(opt, LARS)
    want_w, want_v = lars_reference(mode, exclude == "bias_and_norm")
    for k, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), want_w[k], rtol=2e-5, atol=1e-7, err_msg=k)
        # PaperSGD's convention: the stored velocity is the paper's negated (w <- w + v)
        np.testing.assert_allclose(opt.state[p]["velocity"].double().numpy(), -want_v[k], rtol=2e-5, atol=1e-7,
                                   err_msg=k)


def test_clip_takes_both_sides_of_its_min():
    """The clip case above tests something only if the hand computation takes both sides of
    min(gamma, lambda), and clip differs from scale there."""
    branches: set = set()
    clip, _ = lars_reference("clip", False, branches)
    assert branches == {"global", "local"}
    assert not np.allclose(clip["w"], lars_reference("scale", False)[0]["w"], rtol=1e-3)


def test_zero_norm_takes_eta_not_the_global_lr():
    """A zero-initialised bias (||w|| = 0) at global lr 10: the step is lr x 2 x eta x g, not lr x 2 x g."""
    net = Net()
    opt = build_optimizer(net, TrainConfig(optimizer="lars", lr=10.0, trust_coefficient=0.001, weight_decay=0.0))
    for group in opt.param_groups:
        group["lr"] = 10.0 * group["lr_mult"]
    for k, p in net.named_parameters():
        p.grad = torch.tensor(grads(0)[k], dtype=torch.float32)
    opt.step()
    want = -10.0 * 2 * 0.001 * grads(0)["z"]
    np.testing.assert_allclose(net.z.detach().numpy(), want, rtol=1e-5)
    # ||g|| = 0 (u, no decay here): no step at all, whatever the ratio
    np.testing.assert_array_equal(net.u.detach().double().numpy(), start()["u"])


def test_lars_with_a_trust_ratio_of_one_is_paper_sgd():
    """lr_t = lr for every tensor: the LARS step is PaperSGD's, velocities included."""
    class Plain(LARS):
        def local_lr(self, group, w_norm, g_norm):
            return torch.full_like(w_norm, group["lr"])

    model_a, model_b = Net(), Net()
    cfg = TrainConfig(weight_decay=0.01, bias_decay_mult=0.5)
    a = Plain(param_groups(model_a, cfg), lr=0.1, momentum=0.9, weight_decay=0.01)
    b = PaperSGD(param_groups(model_b, cfg), lr=0.1, momentum=0.9, weight_decay=0.01)
    for step, lr in enumerate(LRS):
        for opt, model in ((a, model_a), (b, model_b)):
            for group in opt.param_groups:
                group["lr"] = lr * group["lr_mult"]
            for k, p in model.named_parameters():
                p.grad = torch.tensor(grads(step)[k], dtype=torch.float32)
            opt.step()
    for (k, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=k)
    for va, vb in zip(a.velocities(), b.velocities()):
        torch.testing.assert_close(va, vb, rtol=1e-6, atol=1e-7)


def lamb_reference(exclude: bool) -> dict:
    """You et al. 2019: Adam moments with bias correction, r = m_hat / (sqrt(v_hat) + eps) + beta w,
    w <- w - gamma ||w|| / ||r|| r (ratio 1 where a norm is 0; excluded: no decay, ratio 1)."""
    w = start()
    m, v = ({k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(2))
    for t, lr in enumerate(LRS, start=1):
        g = grads(t - 1)
        for k in SHAPES:
            excluded = exclude and len(SHAPES[k]) <= 1
            beta = 0.0 if excluded else decay(k)
            m[k] = B1 * m[k] + (1 - B1) * g[k]
            v[k] = B2 * v[k] + (1 - B2) * g[k] ** 2
            r = (m[k] / (1 - B1 ** t)) / (np.sqrt(v[k] / (1 - B2 ** t)) + ADAM_EPS) + beta * w[k]
            wn, rn = np.linalg.norm(w[k]), np.linalg.norm(r)
            ratio = 1.0 if excluded or wn == 0 or rn == 0 else wn / rn
            w[k] = w[k] - lr * lr_mult(k) * ratio * r
    return w


@pytest.mark.parametrize("exclude", ["none", "bias_and_norm"])
def test_lamb_against_the_paper(exclude):
    net, opt = run_torch(TrainConfig(**{**vars(CFG), "optimizer": "lamb", "lars_exclude": exclude}))
    assert isinstance(opt, LAMB)
    want = lamb_reference(exclude == "bias_and_norm")
    for k, p in net.named_parameters():
        np.testing.assert_allclose(p.detach().double().numpy(), want[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert all(float(opt.state[p]["step"]) == 3 for p in net.parameters())


@pytest.mark.parametrize("optimizer", ["lars", "lamb"])
def test_state_dict_roundtrip_continues_exactly(optimizer):
    """Two steps, save, load into a fresh optimizer, one more == three steps straight (bitwise)."""
    cfg = TrainConfig(**{**vars(CFG), "optimizer": optimizer})
    straight, _ = run_torch(cfg)
    net = Net()
    opt = build_optimizer(net, cfg)

    def steps(net, opt, which):
        for step in which:
            for group in opt.param_groups:
                group["lr"] = LRS[step] * group["lr_mult"]
            for k, p in net.named_parameters():
                p.grad = torch.tensor(grads(step)[k], dtype=torch.float32)
            opt.step()
    steps(net, opt, (0, 1))
    saved = {"model": {k: v.clone() for k, v in net.state_dict().items()}, "opt": opt.state_dict()}
    other = Net()
    other.load_state_dict(saved["model"])
    again = build_optimizer(other, cfg)
    again.load_state_dict(saved["opt"])
    steps(other, again, (2,))
    for (k, a), b in zip(other.named_parameters(), straight.parameters()):
        assert torch.equal(a, b), k


def test_model_group_norms_sum_only_the_sharded_columns(monkeypatch):
    """The hook sums the squared norms of sharded tensors over the group (here: a fake all-reduce that
    doubles), leaving replicated ones, and calls the heartbeat through the Comm's collective."""
    a, b, c = (nn.Parameter(torch.ones(2)) for _ in range(3))
    calls = []

    def fake_all_reduce(flat, comm):
        comm.arrive()
        flat.mul_(2)
    monkeypatch.setattr(lb, "all_reduce_sum", fake_all_reduce)
    reducer = ModelGroupNorms([a, c], TorchComm(None, None, 0, (0, 1), before=lambda: calls.append(1)))
    squares = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    reducer([a, b, c], squares)
    assert squares.tolist() == [[2.0, 2.0, 6.0], [8.0, 5.0, 12.0]] and calls == [1]


def test_weights_check_covers_lamb_moments():
    """Trainer._weights_bad: a NaN in LAMB's second moment counts (its step count, a CPU scalar, is skipped)."""
    net, opt = run_torch(TrainConfig(**{**vars(CFG), "optimizer": "lamb"}))
    fake = types.SimpleNamespace(model=net, optimizer=opt)
    assert int(Trainer._weights_bad(fake)) == 0
    opt.state[net.b]["exp_avg_sq"][1] = float("nan")
    assert int(Trainer._weights_bad(fake)) == 1


# -- poly ----------------------------------------------------------------------------------------------------

def test_poly_with_warmup_by_hand():
    """10 epochs of 10 steps, power 2, 1 epoch of linear warmup from 0: lr0 (1 - t/100)^2 x min(1, t/10)."""
    s = LRSchedule(TrainConfig(lr=2.0, lr_policy="poly", lr_power=2.0, epochs=10, warmup_epochs=1.0), 10)
    for t, want in [(0, 0.0), (5, 2.0 * 0.95 ** 2 * 0.5), (10, 2.0 * 0.9 ** 2), (50, 2.0 * 0.25),
                    (99, 2.0 * 1e-4), (100, 0.0)]:
        assert s.lr_at(t) == pytest.approx(want, rel=1e-12, abs=1e-15), t
    cubic = LRSchedule(TrainConfig(lr=1.0, lr_policy="poly", lr_power=3.0, epochs=2), 4)
    assert cubic.lr_at(2) == pytest.approx((1 - 2 / 8) ** 3)
    restored = LRSchedule(TrainConfig(lr=2.0, lr_policy="poly", lr_power=2.0, epochs=10, warmup_epochs=1.0), 10)
    restored.load_state_dict(s.state_dict())
    assert [restored.lr_at(t) for t in range(101)] == [s.lr_at(t) for t in range(101)]


# -- train.py: exact resume, refusals -------------------------------------------------------------------------

RECIPES = {"lars": {"train.optimizer": "lars", "train.lr": 2.0, "train.lr_policy": "poly", "train.warmup_epochs": 0.5,
                    "train.trust_coefficient": 0.01, "train.lars_exclude": "bias_and_norm"},
           "lamb": {"train.optimizer": "lamb", "train.lr": 0.002, "train.lr_policy": "poly"}}


def state_tensors(path) -> dict:
    """Every weight and every optimizer state tensor of a checkpoint (velocities, moments, step counts)."""
    state = load(path)
    out = {("model", k): v for k, v in state["model"].items()}
    for i, s in state["optimizer"]["state"].items():
        out.update({("optimizer", i, key): v for key, v in s.items()})
    return out


@pytest.mark.whole_runs
@pytest.mark.parametrize("optimizer", ["lars", "lamb"])
def test_resume_is_exact(train_data, tmp_path, optimizer):
    """2 epochs straight == a stop after epoch 1's last step (max_steps, so poly's T is the same) + the
    same command again; a single replica with the default weights exchange trains."""
    over = {**RECIPES[optimizer], "data.loading": "inline"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, straight, **over)]) == 0
    steps = load(straight / "checkpoints" / "epoch_001.pt")["global_step"]
    stop = f"train.max_steps={steps}"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, split, **over), stop]) == 0
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, split, **over)]) == 0
    a, b = state_tensors(straight / "checkpoints" / "last.pt"), state_tensors(split / "checkpoints" / "last.pt")
    assert a.keys() == b.keys() and any(k[-1] in ("velocity", "exp_avg") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    first = state_tensors(straight / "checkpoints" / "epoch_001.pt")
    assert all(not torch.equal(first[k], a[k]) for k in a if k[0] == "model")  # every layer trained in epoch 2


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("train.py: error: ")
    return err[0]


@pytest.mark.parametrize("over, expect", [
    ({"parallel.replicas": 2}, "train.optimizer=lars with parallel.exchange=weights would adapt each of the 2 "
                               "replicas to its own gradient, not to the global batch's; set "
                               "parallel.exchange=gradients"),
    ({"train.lr_scaling": "linear"}, "train.lr_scaling=linear does not apply to train.optimizer=lars: its global lr "
                                     "is not linear in the batch"),
    ({"train.nesterov": True}, "train.nesterov applies to train.optimizer=sgd only, not lars"),
])
@pytest.mark.whole_runs
def test_config_refusals_exit_2_in_one_line(train_data, tmp_path, capsys, over, expect):
    args = tiny_overrides(train_data, tmp_path / "run", **{"train.optimizer": "lars", **over})
    assert train.main(["configs/demo.yaml", *args]) == 2
    assert expect in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_replica_refuses_weights_exchange_over_replicas_known_from_the_world():
    """Under torchrun parallel.replicas is ignored: the world decides, at Replica construction."""
    cfg = Config()
    apply(cfg, {"train.optimizer": "lamb", "data.root": "unused"}, "test")
    with pytest.raises(ConfigError, match="^train.optimizer=lamb with parallel.exchange=weights would adapt each "
                                          "of the 2 replicas to its own gradient, not to the global batch's; set "
                                          "parallel.exchange=gradients$"):  # the remedy is what the user acts on
        Replica(cfg, DistInfo(world=2), 4)


@pytest.mark.whole_runs
def test_resume_with_another_optimizer_is_refused(train_data, tmp_path, capsys):
    run = tmp_path / "run"
    base = tiny_overrides(train_data, run, **{"data.loading": "inline", "train.max_steps": 1})
    assert train.main(["configs/demo.yaml", *base]) == 0
    capsys.readouterr()
    assert train.main(["configs/demo.yaml", *base, "train.optimizer=lars", "train.max_steps=2"]) == 2
    line = one_error_line(capsys)
    assert (f"{run / 'checkpoints' / 'last.pt'} was trained with train.optimizer=sgd, this config has "
            "train.optimizer=lars: the optimizer state does not carry over" in line), line
    assert load(run / "checkpoints" / "last.pt")["global_step"] == 1  # nothing written


def test_bad_optimizer_arguments():
    with pytest.raises(ValueError, match="LARS mode must be scale or clip"):
        LARS(Net().parameters(), lr=1.0, mode="both")
    with pytest.raises(ValueError, match="LAMB exclude must be one of"):
        LAMB(Net().parameters(), lr=1.0, exclude="all")
    assert math.isclose(LAMB(Net().parameters(), lr=1.0).param_groups[0]["eps"], ADAM_EPS)


# -- defaults and helpers, by hand --------------------------------------------------------------------------

def test_lars_and_lamb_defaults():
    """Built from a bare parameter list (no groups of build_optimizer's): the documented defaults, and a step
    that reads every one of them."""
    w = nn.Parameter(torch.ones(2, 2))
    lars, lamb = LARS([w], lr=0.1), LAMB([w], lr=0.1)
    assert {k: lars.param_groups[0][k] for k in ("momentum", "weight_decay", "trust_coefficient", "mode",
                                                 "exclude", "lr_mult")} == \
        {"momentum": 0.9, "weight_decay": 0.0, "trust_coefficient": 0.001, "mode": "scale", "exclude": "none",
         "lr_mult": 1.0}
    assert {k: lamb.param_groups[0][k] for k in ("weight_decay", "exclude", "lr_mult", "betas", "eps")} == \
        {"weight_decay": 0.0, "exclude": "none", "lr_mult": 1.0, "betas": (0.9, 0.999), "eps": 1e-6}
    for opt in (lars, lamb):
        LRSchedule(TrainConfig(lr=0.5, lr_policy="constant"), 1).apply(opt, 0)
        assert opt.param_groups[0]["lr"] == 0.5  # x lr_mult 1.0
        w.grad = torch.full((2, 2), 0.5)
        opt.step()  # every default is read by a step
    assert isinstance(lamb.state[w]["step"], torch.Tensor) and lamb.state[w]["step"].dtype == torch.float32


def test_norms_of_low_precision_tensors_are_taken_in_fp32_and_float64_keeps_its_own():
    assert lb._at_least_fp32(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert lb._at_least_fp32(torch.ones(2, dtype=torch.float16)).dtype == torch.float32
    assert lb._at_least_fp32(torch.ones(2, dtype=torch.float64)).dtype == torch.float64


def test_model_group_norms_follow_the_tensors_of_each_call(monkeypatch):
    """Two calls over different tensors (a cached index per set of sharded columns): each sums its own."""
    a, b, c = (nn.Parameter(torch.ones(2)) for _ in range(3))
    monkeypatch.setattr(lb, "all_reduce_sum", lambda flat, comm: flat.mul_(10))
    reducer = ModelGroupNorms([a, c], TorchComm(None, None, 0, (0, 1)))
    first = torch.tensor([[1.0, 2.0, 3.0]])
    reducer([a, b, c], first)  # a and c sharded: columns 0 and 2
    second = torch.tensor([[1.0, 2.0]])
    reducer([b, c], second)  # now only c, in column 1
    assert first.tolist() == [[10.0, 2.0, 30.0]] and second.tolist() == [[1.0, 20.0]]
    alone = torch.tensor([[4.0, 5.0]])
    ModelGroupNorms([a], TorchComm(None, None, 0, (0,)))([a, b], alone)  # a group of one: nothing to sum
    assert alone.tolist() == [[4.0, 5.0]]
