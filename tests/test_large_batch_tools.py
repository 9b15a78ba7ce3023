"""The tools around LARS and LAMB checkpoints: compare_checkpoints reads every per-parameter optimizer state
(LAMB's moments and step count, not only SGD's velocity), and the Theano export refuses LAMB's state."""
from __future__ import annotations

import copy

import torch

from alexnet.checkpoint import compare_checkpoints
from alexnet.config import TrainConfig
from alexnet.models import build_model
from alexnet.optim import build_optimizer
from tests.conftest import load_script
from tests.test_theano_weights import our_checkpoint


def stepped(optimizer: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model after two steps of `optimizer` (every state tensor non-zero)."""
    torch.manual_seed(seed)
    model = build_model("alexnet_bn", 5, 0.125, 0.0, 67, "torch")
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=0.01))
    x, y = torch.randn(4, 3, 67, 67), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def save(path, model, opt) -> str:
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return str(path)


def test_compare_checkpoints_reads_every_optimizer_state(tmp_path):
    """LAMB's checkpoints hold exp_avg, exp_avg_sq and step per parameter, no velocity: compared, each by
    name, and a change in any one of them shows (it raised KeyError: 'velocity' before)."""
    model, opt = stepped("lamb")
    a = save(tmp_path / "a.pt", model, opt)
    same = compare_checkpoints(a, save(tmp_path / "b.pt", model, opt))
    assert same["bitwise"] and same["weights"] == same["velocities"] == 0.0
    assert same["state"] == {"exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0.0}
    for name in ("exp_avg", "exp_avg_sq", "step"):
        state = copy.deepcopy(opt.state_dict())  # its per-parameter dicts are the optimizer's own
        first = state["state"][0]
        first[name] = first[name] * 1.5
        torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "c.pt")
        c = compare_checkpoints(tmp_path / "c.pt", a)
        assert not c["bitwise"] and c["weights"] == 0.0
        assert c["state"][name] > 0 and c["velocities"] == c["state"][name], (name, c)
        assert all(v == 0.0 for k, v in c["state"].items() if k != name), (name, c)
    sgd_model, sgd = stepped("sgd")  # SGD's (and LARS's) velocity as before
    c = compare_checkpoints(save(tmp_path / "s.pt", sgd_model, sgd), save(tmp_path / "t.pt", *stepped("sgd", 1)))
    assert set(c["state"]) == {"velocity"} and c["velocities"] > 0 and c["weights"] > 0


def test_theano_export_refuses_a_lamb_checkpoint(tmp_path, capsys):
    """The Theano files hold momentum velocities only: a LAMB checkpoint is refused in one line naming the
    optimizer (exit 2), whether its config or only its state says LAMB; a LARS one exports (its velocity is
    PaperSGD's)."""
    convert = load_script("convert_weights").main
    ckpt = our_checkpoint("inverted")
    model = build_model("caffenet", 6, 0.125, 0.5, 227, init="paper")
    model.load_state_dict(ckpt["model"])
    for name, optimizer in (("lamb", "lamb"), ("state-only", "sgd")):
        lamb = build_optimizer(model, TrainConfig(optimizer="lamb"))
        lamb._init_state()
        ckpt["optimizer"] = lamb.state_dict()
        ckpt["config"]["train"]["optimizer"] = optimizer
        torch.save(ckpt, tmp_path / f"{name}.pt")
        assert convert([str(tmp_path / f"{name}.pt"), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "train.optimizer=lamb" in err and "momentum velocities only" in err, err
        assert not (tmp_path / name).exists()
    lars = our_checkpoint("inverted")
    lars["config"]["train"]["optimizer"] = "lars"
    torch.save(lars, tmp_path / "lars.pt")
    assert convert([str(tmp_path / "lars.pt"), str(tmp_path / "lars")]) == 0
    assert "momentum" in capsys.readouterr().out
