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


def test_an_affine_batch_norm_is_split_by_channel_with_its_scale_and_shift():
    """alexnet_bn's batch norm has no scale or shift, but a column's part of one that has them holds its own
    channels of every tensor (weight, bias, running statistics), by hand; the count stays whole."""
    from torch import nn

    from alexnet.model_parallel import _channels_of
    bn = nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.weight.copy_(torch.arange(6.0) + 10)
        bn.bias.copy_(torch.arange(6.0) + 20)
    bn.running_mean.copy_(torch.arange(6.0) + 30)
    bn.running_var.copy_(torch.arange(6.0) + 40)
    bn.num_batches_tracked.fill_(5)
    for m, channels in ((0, [0, 1, 2]), (1, [3, 4, 5])):
        part = _channels_of(bn, m, 2)
        assert part.num_features == 3 and int(part.num_batches_tracked) == 5
        assert isinstance(part.weight, nn.Parameter) and isinstance(part.bias, nn.Parameter)
        for key, base in (("weight", 10), ("bias", 20), ("running_mean", 30), ("running_var", 40)):
            assert getattr(part, key).tolist() == [base + c for c in channels], (m, key)
        assert sorted(k for k, _ in part.named_parameters()) == ["bias", "weight"]
    assert bn.num_features == 6 and bn.weight.shape == (6,) and bn.running_mean.shape == (6,)  # left whole


def test_a_replica_counts_its_parameter_bytes():
    from alexnet.config import Config, apply
    from alexnet.distributed import DistInfo
    from alexnet.replica import Replica
    cfg = Config()
    apply(cfg, {"model.width": 0.125, "data.crop": 67, "data.root": "unused", "model.init": "torch"}, "test")
    replica = Replica(cfg, DistInfo(), 4)
    assert replica.parameter_bytes() == 4 * sum(p.numel() for p in replica.model.parameters()) > 0


def test_a_refusal_names_the_first_layer_that_does_not_divide_and_what_it_counts():
    """fc splits the Linear layers only: with 3 parts the first it cannot split is fc6 (4096 units), not
    conv1 (64 channels, which fc leaves whole); a last layer counts classes."""
    with torch.device("meta"):
        full = build_model("owt", 9, 1.0, 0.5, 224, "torch")
    assert sharding_problem("fc", "owt", 3, full) == (
        "parallel.model_size=3 does not divide a layer of 4096 units (Linear (4096, 9216)); choose a "
        "model_size that divides it")
    assert sharding_problem("fc", "owt", 2, full).startswith("parallel.model_size=2 does not divide a layer of "
                                                              "9 classes (Linear (9, 4096))")


def test_build_sharded_refuses_in_the_words_of_sharding_problem_and_keeps_the_lrn_form():
    from alexnet.model_parallel import build_sharded
    from layers import LRN
    comm = TorchComm(None, None, 0, (0, 1))
    with pytest.raises(ValueError, match=r"^parallel.model_size=2 does not divide a layer of 9 classes"):
        build_sharded("owt", 9, 0.125, 0.5, 224, "torch", "inverted", "fc", comm)
    with pytest.raises(ValueError, match=r"^model parallelism must be one of columns, fc, got 'rows'"):
        ShardedNet(build_model("alexnet", 4, 0.125, 0.5, 67, "torch"), "rows", comm)
    for form, divided in (("paper", False), ("caffe", True)):
        part = build_sharded("alexnet", 4, 0.125, 0.5, 67, "torch", "inverted", "columns", comm, lrn=form)
        lrns = [m for m in part.modules() if isinstance(m, LRN)]
        assert lrns and all(m.divide_by_size is divided for m in lrns), form


def test_a_split_layer_says_its_own_size():
    """Each part's Conv2d/Linear reports the units it holds (what print(model) and the shape checks read)."""
    with torch.device("meta"):
        full = build_model("alexnet", 4, 0.125, 0.5, 67, "torch")
        for mode in ("columns", "fc"):
            part = ShardedNet(full, mode, TorchComm(None, None, 1, (0, 1)))
            for layer in part.modules():
                if isinstance(layer, torch.nn.Linear):
                    assert layer.out_features == layer.weight.shape[0], mode
                if isinstance(layer, torch.nn.Conv2d):
                    assert (layer.out_channels, layer.in_channels // layer.groups) == layer.weight.shape[:2], mode
                    assert type(layer.in_channels) is int and type(layer.out_channels) is int, mode
