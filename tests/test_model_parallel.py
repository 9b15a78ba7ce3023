"""Model parallelism and the hybrid (Yadan et al. 2013; Krizhevsky 2012/2014), what only real processes over
gloo show: a dead or hung member of a model group ending the run, the benchmark's own measurement; and the
layouts' sizes and refusals.

The math of every layout (parts against the single-device model, training and resuming against one process)
runs on the rank simulator: tests/test_parallel_math.py (there too, one hybrid on 4 real processes with
DDP's buckets), tests/test_parallel_runs.py.
"""
from __future__ import annotations

import pytest
import torch

from alexnet.model_parallel import ShardedNet, parameter_bytes, sharding_problem
from alexnet.models import build_model
from layers import TorchComm
from tests.test_parallel import assert_fault_ends_the_run


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


# -- train.py end to end (its layouts against one process: the gpu-check CPU twin's model-parallel step, columns
# and fc through train.py's launcher; on the rank simulator, tests/test_parallel_runs.py) -------------------

@pytest.mark.processes
@pytest.mark.real_group
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_dead_or_hung_member_of_a_model_group_ends_the_run(train_data, tmp_path, fault):
    assert_fault_ends_the_run(train_data, tmp_path / "run", fault, **{
        "parallel.replicas": 1, "parallel.model_size": 2, "parallel.model": "fc", "train.batch_size": 4})


@pytest.mark.processes
@pytest.mark.real_group
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
