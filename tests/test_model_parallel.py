"""Model parallelism and the hybrid (Yadan et al. 2013; Krizhevsky 2012/2014), what only real processes over
gloo show: train.py's launcher with 4 processes, a dead or hung member of a model group ending the run, the
benchmark's own measurement; and the layouts' sizes and refusals.

The math of every layout (parts against the single-device model, training and resuming against one process)
runs on the rank simulator: tests/test_parallel_math.py (there too, one hybrid on 4 real processes with
DDP's buckets), tests/test_parallel_runs.py.
"""
from __future__ import annotations

import pytest
import torch

from alexnet.metrics import read_metrics
from alexnet.model_parallel import ShardedNet, parameter_bytes, sharding_problem
from alexnet.models import build_model
from layers import TorchComm
from tests.test_parallel import assert_fault_ends_the_run, rel_diff, train


@pytest.mark.parametrize("mode, world", [("columns", 2), ("fc", 2), ("fc", 4)])
def test_parameter_bytes_per_process(mode, world):
    """Full-size AlexNet: each process holds 1/M of the sharded layers plus the replicated ones."""
    with torch.device("meta"):
        full = build_model("alexnet", 1000, 1.0, 0.5, 227, "torch")
        parts = [ShardedNet(full, mode, TorchComm(None, None, m, tuple(range(world)))) for m in range(world)]
    sharded = sum(p.numel() * 4 for k, p in full.named_parameters() if k in parts[0].sharded_keys)
    replicated = parameter_bytes(full) - sharded
    for part in parts:
        assert parameter_bytes(part) == replicated + sharded // world
    assert (replicated == 0) == (mode == "columns")
    assert sharded / parameter_bytes(full) > 0.95  # the fc layers: 96 % of AlexNet's weights


def test_unsplittable_layouts_are_refused():
    with torch.device("meta"):
        full = build_model("owt", 10, 1.0, 0.5, 224, "torch")
    assert "model_size=2 and model.arch alexnet or caffenet" in sharding_problem("columns", "owt", 2, full)
    assert "does not divide a layer of 10 classes" in sharding_problem("fc", "owt", 4, full)
    assert sharding_problem("fc", "owt", 2, full) is None


# -- train.py end to end --------------------------------------------------------------------------------

def run(train_data, run_dir, **extra):
    return train(train_data, run_dir, cpu_s=420, **extra)


@pytest.fixture(scope="module")
def single(train_data, tmp_path_factory):
    """One process, global batch 8."""
    ref = tmp_path_factory.mktemp("single")
    run(train_data, ref, **{"train.batch_size": 8})
    return ref


# One layout through train.py's launcher as 4 processes (the others, and this one, on the rank simulator:
# tests/test_parallel_runs.py); its global batch is 8.
LAYOUTS = {
    "fc R=2 x M=2, gradients, 2 slices": {"parallel.model": "fc", "parallel.model_size": 2, "parallel.replicas": 2,
                                          "train.batch_size": 2, "parallel.exchange": "gradients", "train.slices": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(train_data, tmp_path, single, name):
    over = LAYOUTS[name]
    r = run(train_data, tmp_path / "run", **over)
    assert "model parallel" in r.stdout and "global batch 8" in r.stdout
    ref = single
    assert rel_diff(tmp_path / "run", ref) <= 1e-5
    a, b = read_metrics(tmp_path / "run" / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [(x["split"], x["iter"], x.get("n")) for x in a] == [(y["split"], y["iter"], y.get("n")) for y in b]
    assert all(abs(x["loss"] - y["loss"]) < 1e-4 and x["top1_err"] == y["top1_err"] for x, y in zip(a, b))


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_dead_or_hung_member_of_a_model_group_ends_the_run(train_data, tmp_path, fault):
    assert_fault_ends_the_run(train_data, tmp_path / "run", fault, **{
        "parallel.replicas": 1, "parallel.model_size": 2, "parallel.model": "fc", "train.batch_size": 4})


@pytest.mark.parametrize("name", ["2 fc parallel"])
def test_benchmark_counts_match_the_cost_model(name):
    """benchmark.py parallel's own measurement (2 real processes over gloo): its bytes per step == the formulas
    of its cost model. Every layout, with gloo's and NCCL's routes: tests/test_parallel_bytes.py."""
    import sys
    import types

    from tests.conftest import REPO
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import parallel as bp
    _, r, m, mode = next(layout for layout in bp.LAYOUTS if layout[0] == name)
    args = types.SimpleNamespace(batch_size=8, width=0.125, precision="fp32", steps=1, warmup=1, repeat=1)
    row = bp.measure(name, r, m, mode, args, ["cpu"] * 2)
    expected = bp.bytes_per_step(bp.alexnet_shapes(0.125), 8, r, m, mode, nccl=False)
    assert row["MB_sent_per_step"] == round(expected / 1e6, 2) and expected > 0
    assert row["MB_params_per_process"] > 0 and row["ms_per_step"] > 0
