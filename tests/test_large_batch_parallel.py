"""LARS and LAMB split across processes train as one process: the trust ratio is taken on the gradient the
step applies (after DDP's all-reduce, after every micro-batch) and over whole layers under model parallelism.

Real processes over gloo, as tests/test_parallel.py and tests/test_model_parallel.py (whose helpers these
reuse); one launch per layout, since each costs seconds on two cores.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alexnet.checkpoint import load
from tests.test_parallel import train

# the paper's recipe in small: LARS (scale), poly, warmup; a local lr large enough that a wrong norm shows
LARS = {"train.optimizer": "lars", "train.lr": 2.0, "train.trust_coefficient": 0.01, "train.lr_policy": "poly",
        "train.warmup_epochs": 0.5, "train.momentum": 0.9}
LAMB = {"train.optimizer": "lamb", "train.lr": 0.002}


def state_rel_diff(a: Path, b: Path) -> float:
    """max over the weights and every per-parameter optimizer state tensor (velocities, Adam moments) of the
    two runs' last checkpoints of ||a - b|| / ||b||, in float64; both must hold the same tensors."""
    def tensors(run: Path) -> dict:
        state = load(run / "checkpoints" / "last.pt")
        out = {("model", k): v for k, v in state["model"].items()}
        for i, s in state["optimizer"]["state"].items():
            out.update({("optimizer", i, key): v for key, v in s.items() if v.ndim > 0})
        return out
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > len([k for k in ta if k[0] == "model"])
    worst = 0.0
    for key, want in tb.items():
        assert ta[key].shape == want.shape, key
        want = want.double()
        worst = max(worst, float((ta[key].double() - want).norm() / want.norm().clamp_min(1e-12)))
    return worst


@pytest.fixture(scope="module")
def runs(train_data, tmp_path_factory):
    """train(**overrides) once per distinct set of overrides in this module (the tests only read the runs)."""
    done: dict[tuple, Path] = {}

    def get(**extra) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in extra.items()))
        if key not in done:
            done[key] = tmp_path_factory.mktemp("run")
            train(train_data, done[key], cpu_s=420, **extra)
        return done[key]
    return get


def test_lars_two_replicas_equal_one_and_slices(runs):
    """2 replicas x 8 (gradients exchange) == 1 x 16 == 1 x 16 in 4 micro-batches (48 training images: 3 steps
    an epoch)."""
    one = runs(**LARS, **{"train.batch_size": 16})
    sliced = runs(**LARS, **{"train.batch_size": 16, "train.slices": 4})
    two = runs(**LARS, **{"train.batch_size": 8, "parallel.replicas": 2, "parallel.exchange": "gradients"})
    assert state_rel_diff(sliced, one) <= 1e-5
    assert state_rel_diff(two, one) <= 1e-5


@pytest.mark.parametrize("mode, batch", [("columns", 8), ("fc", 4)])
def test_lars_model_parallel_equals_one_process(runs, mode, batch):
    """Global batch 8 split over a model group of 2: a sharded layer's trust ratio must be the whole layer's."""
    one = runs(**LARS, **{"train.batch_size": 8})
    split = runs(**LARS, **{"parallel.model": mode, "parallel.model_size": 2, "train.batch_size": batch})
    assert state_rel_diff(split, one) <= 1e-5


def test_lamb_model_parallel_resumes_a_single_process_checkpoint(runs, tmp_path, train_data):
    """One process for epoch 1, fc over 2 processes (run.resume_from: the moments sliced) for epoch 2, its
    checkpoint assembled (the moments gathered) == 2 epochs in one process."""
    one = runs(**LAMB, **{"train.batch_size": 8})
    half = runs(**LAMB, **{"train.batch_size": 8, "train.max_steps": 6})
    assert load(half / "checkpoints" / "last.pt")["global_step"] == 6  # epoch 1's last step (48 / 8)
    split = tmp_path / "split"
    train(train_data, split, cpu_s=420, **LAMB, **{"parallel.model": "fc", "parallel.model_size": 2,
                                                      "train.batch_size": 4,
                                                      "run.resume_from": str(half / "checkpoints" / "last.pt")})
    state = load(split / "checkpoints" / "last.pt")
    assert state["global_step"] == 12
    assert all(torch.is_tensor(s["exp_avg"]) for s in state["optimizer"]["state"].values())
    assert state_rel_diff(split, one) <= 1e-5
