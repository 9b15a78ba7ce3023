"""Model parallelism and the hybrid (issue: Yadan et al. 2013; Krizhevsky 2012/2014), real processes over gloo.

With dropout 0 and the randomness off, every layout must train exactly as one process with the same
global batch (relative difference <= 1e-5), its checkpoints must resume in any other layout and
evaluate with scripts/evaluate.py, and a dead or hung member of a model group must end the run.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from alexnet.checkpoint import load
from alexnet.distributed import leave_together
from alexnet.launch import free_port
from alexnet.metrics import read_metrics
from alexnet.model_parallel import ShardedNet, build_sharded, parameter_bytes, sharding_problem
from alexnet.models import build_model
from layers import Comm, TorchComm
from tests.conftest import load_script
from tests.test_parallel import assert_fault_ends_the_run, rel_diff, train

PART_CASES = [("columns", "alexnet", 2), ("columns", "caffenet", 2), ("fc", "alexnet", 2), ("fc", "caffenet", 4),
              ("fc", "owt", 4)]


def _check_layout(comm: Comm, mode: str, arch: str, path: str) -> None:
    """One member: logits and gradients of its part against the single-device model on all images."""
    rank, world = comm.rank, comm.size
    crop, b = (80, 3) if arch == "owt" else (67, 3)
    torch.manual_seed(0)
    net = build_sharded(arch, 4, 0.125, 0.0, crop, "torch", "inverted", mode, comm)
    torch.manual_seed(1)
    images = b * (world if mode == "fc" else 1)
    x_all, y_all = torch.randn(images, 3, crop, crop), torch.randint(0, 4, (images,))
    x, y = (x_all[rank * b:(rank + 1) * b], y_all[rank * b:(rank + 1) * b]) if mode == "fc" else (x_all, y_all)
    logits = net(x)
    (F.cross_entropy(logits, y) / world).backward()  # each member's share of the group's mean loss
    net.sync_model_group()
    # Evaluation's last batches are uneven, one of them empty: members hold 2, 0, 3, 1 ... rows (fc)
    rows = [(2, 0, 3, 1)[m % 4] for m in range(world)] if mode == "fc" else [images] * world
    net.eval()
    with torch.no_grad():
        start = sum(rows[:rank]) if mode == "fc" else 0
        eval_logits = net(x_all[start:start + rows[rank]])
    mine = ({k: p.grad for k, p in net.named_parameters()}, logits.detach(), eval_logits)
    pieces = [None] * world
    dist.all_gather_object(pieces, mine, group=comm.group)
    if rank == 0:
        torch.manual_seed(0)
        ref = build_model(arch, 4, 0.125, 0.0, crop, "torch")
        ref_logits = ref(x_all)
        F.cross_entropy(ref_logits, y_all).backward()
        grads = net.assemble([p[0] for p in pieces])
        logits = torch.cat([p[1] for p in pieces]) if mode == "fc" else pieces[0][1]
        uneven = torch.cat([p[2] for p in pieces]) if mode == "fc" else pieces[0][2]
        with torch.no_grad():
            ref.eval()
            ref_uneven = ref(x_all[:sum(rows)] if mode == "fc" else x_all)
        torch.save({"logits": (logits, ref_logits.detach()), "uneven": (uneven, ref_uneven),
                    "grads": {k: (grads[k], p.grad) for k, p in ref.named_parameters()}}, path)


def _member(rank: int, ports: tuple[int, int], out: str) -> None:
    """One of 4 processes (spawned once for the module, as process start-ups dominate): every case of
    PART_CASES on a group of its first `world` ranks, then the hybrid mesh's training steps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)  # 4 processes on as few as 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=4)
    for mode, arch, world in PART_CASES:
        group = dist.new_group(list(range(world)))  # every process takes part in making a group
        if rank < world:
            comm = TorchComm(group, None, rank, tuple(range(world)))
            _check_layout(comm, mode, arch, f"{out}/{mode}-{arch}-{world}.pt")
    leave_together(rank, 4)
    _hybrid_member(rank, 4, ports[1], 2, out)


@pytest.fixture(scope="module")
def members(tmp_path_factory) -> Path:
    """The folder of what the 4 processes of `_member` saved."""
    out = tmp_path_factory.mktemp("members")
    mp.start_processes(_member, args=((free_port(), free_port()), str(out)), nprocs=4, start_method="spawn")
    return out


@pytest.mark.parametrize("mode, arch, world", PART_CASES)
def test_parts_compute_the_single_device_function(members, mode, arch, world):
    got = torch.load(members / f"{mode}-{arch}-{world}.pt", weights_only=True)
    logits, ref = got["logits"]
    assert logits.shape == ref.shape and ((logits - ref).norm() / ref.norm()) <= 1e-5
    uneven, ref = got["uneven"]  # evaluation with members holding different numbers of rows, one none
    assert uneven.shape == ref.shape and ((uneven - ref).norm() / ref.norm()) <= 1e-5
    for key, (g, want) in got["grads"].items():
        assert g.shape == want.shape and ((g - want).norm() / want.norm()) <= 1e-5, key


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


# -- the data-parallel gradient average of a hybrid mesh ----------------------------------------------------

def _hybrid_member(rank: int, world: int, port: int, slices: int, out: str) -> None:
    """One process of fc R=2 x M=2 training 2 steps with Replica; records every data-group all-reduce
    (which gradient buffer, and whether the backward pass had finished) and where each gradient lives."""
    from alexnet.config import Config, apply
    from alexnet.distributed import setup, teardown
    from alexnet.replica import Replica
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cfg = Config()
    apply(cfg, {"model.arch": "alexnet", "model.width": 0.125, "model.dropout": 0.0, "model.init": "torch",
                "data.crop": 67, "data.root": "unused", "train.batch_size": 4, "train.slices": slices,
                "parallel.model": "fc", "parallel.model_size": 2, "parallel.exchange": "gradients",
                "parallel.bucket_mb": 0.05}, "test")
    info = setup(cfg)
    replica = Replica(cfg, info, 4)
    events, real_all_reduce = [], dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kwargs):
        if group is info.data_peers.group:
            events.append(["reduce", tensor.data_ptr(), tensor.numel() * tensor.element_size()])
        return real_all_reduce(tensor, *args, group=group, **kwargs)
    dist.all_reduce = all_reduce
    steps = []
    for step in range(1, 3):
        g = torch.Generator().manual_seed(10 * rank + step)  # every process its own images
        x = torch.randn(4, 3, 67, 67, generator=g).requires_grad_()
        x.register_hook(lambda grad: events.append(["input grad"]))  # the last gradient of a backward pass
        events.clear()
        replica.step(x, torch.randint(0, 4, (4,), generator=g), step, lambda: torch.autocast("cpu", enabled=False))
        grads = {k: [p.grad.data_ptr(), p.grad.numel() * p.grad.element_size()]
                 for k, p in replica.model.named_parameters()}
        steps.append({"events": list(events), "grads": grads})
    dist.all_reduce = real_all_reduce
    torch.save({"steps": steps, "weights": replica.model.state_dict()}, f"{out}/rank{rank}.pt")
    teardown(info)


def test_hybrid_gradients_reduced_once_each_during_backward(members):
    """fc R=2 x M=2, 2 micro-batches per step: each gradient is in exactly one data-group all-reduce per
    step, the first of which starts before backward ends; the replicas of a part end equal."""
    got = [torch.load(members / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank, g in enumerate(got):  # DDP's first step is one bucket; the second has those of bucket_mb
        kinds = [e[0] for e in g["steps"][1]["events"]]
        last_input_grad = len(kinds) - 1 - kinds[::-1].index("input grad")
        assert "reduce" in kinds and kinds.index("reduce") < last_input_grad, (rank, kinds)  # during backward
        assert kinds.count("reduce") > 2, (rank, kinds)
    for rank, g in enumerate(got):
        for step, s in enumerate(g["steps"], 1):
            reduced = [e[1:] for e in s["events"] if e[0] == "reduce"]
            for key, (ptr, size) in s["grads"].items():
                covering = [b for b in reduced if b[0] <= ptr and ptr + size <= b[0] + b[1]]
                assert len(covering) == 1, (rank, step, key, len(covering))
            assert sum(b[1] for b in reduced) == sum(size for _, size in s["grads"].values()), (rank, step)
    for a, b in ((0, 2), (1, 3)):  # the same part in both model groups: trained on other images, kept equal
        for key, w in got[a]["weights"].items():
            assert torch.equal(w, got[b]["weights"][key]), key


# -- train.py end to end --------------------------------------------------------------------------------

def run(train_data, run_dir, **extra):
    return train(train_data, run_dir, cpu_s=420, **extra)


@pytest.fixture(scope="module")
def single(train_data, tmp_path_factory):
    """One process, global batch 8: with momentum, and plain SGD (for weights mode)."""
    refs = {}
    for momentum in (0.9, 0.0):
        refs[momentum] = tmp_path_factory.mktemp(f"single{momentum}")
        run(train_data, refs[momentum], **{"train.batch_size": 8, "train.momentum": momentum})
    return refs


LAYOUTS = {  # name: overrides; every one has a global batch of 8
    "columns M=2": {"parallel.model": "columns", "parallel.model_size": 2, "train.batch_size": 8},
    "fc M=2": {"parallel.model": "fc", "parallel.model_size": 2, "train.batch_size": 4},
    "fc M=4": {"parallel.model": "fc", "parallel.model_size": 4, "train.batch_size": 2},
    "columns R=2 x M=2, gradients": {"parallel.model": "columns", "parallel.model_size": 2, "parallel.replicas": 2,
                                     "train.batch_size": 4, "parallel.exchange": "gradients"},
    "columns R=2 x M=2, gradients, 2 slices": {"parallel.model": "columns", "parallel.model_size": 2,
                                               "parallel.replicas": 2, "train.batch_size": 4,
                                               "parallel.exchange": "gradients", "train.slices": 2},
    "fc R=2 x M=2, gradients, 2 slices": {"parallel.model": "fc", "parallel.model_size": 2, "parallel.replicas": 2,
                                          "train.batch_size": 2, "parallel.exchange": "gradients", "train.slices": 2},
    "columns R=2 x M=2, weights": {"parallel.model": "columns", "parallel.model_size": 2, "parallel.replicas": 2,
                                   "train.batch_size": 4, "parallel.exchange": "weights", "train.momentum": 0.0},
    "fc R=2 x M=2, weights": {"parallel.model": "fc", "parallel.model_size": 2, "parallel.replicas": 2,
                              "train.batch_size": 2, "parallel.exchange": "weights", "train.momentum": 0.0},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(train_data, tmp_path, single, name):
    over = LAYOUTS[name]
    r = run(train_data, tmp_path / "run", **over)
    assert "model parallel" in r.stdout and "global batch 8" in r.stdout
    ref = single[over.get("train.momentum", 0.9)]
    assert rel_diff(tmp_path / "run", ref) <= 1e-5
    a, b = read_metrics(tmp_path / "run" / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [(x["split"], x["iter"], x.get("n")) for x in a] == [(y["split"], y["iter"], y.get("n")) for y in b]
    assert all(abs(x["loss"] - y["loss"]) < 1e-4 and x["top1_err"] == y["top1_err"] for x, y in zip(a, b))


def test_checkpoints_resume_in_other_layouts_and_evaluate(train_data, tmp_path):
    """columns M=2 for epoch 1, one process for epoch 2, fc R=2 x M=2 for epoch 3 == 3 epochs in one process."""
    ref, mixed = tmp_path / "ref", tmp_path / "mixed"
    steps = {"train.lr_steps": [2]}
    run(train_data, ref, **steps, **{"train.batch_size": 8, "train.epochs": 3})
    run(train_data, mixed, **steps, **{**LAYOUTS["columns M=2"], "train.epochs": 1})
    run(train_data, mixed, **steps, **{"train.batch_size": 8, "train.epochs": 2})
    run(train_data, mixed, **steps, **{"parallel.model": "fc", "parallel.model_size": 2, "parallel.replicas": 2,
                                       "train.batch_size": 2, "parallel.exchange": "gradients", "train.epochs": 3})
    assert rel_diff(mixed, ref) <= 1e-5
    state = load(mixed / "checkpoints" / "last.pt")
    assert state["epoch"] == 3 and state["config"]["parallel"]["model_size"] == 2
    vals = [x for x in read_metrics(mixed / "metrics.jsonl") if x["split"] == "val"]
    evaluate_main = load_script("evaluate").main
    for epoch, layout in ((1, "columns"), (2, "one process"), (3, "fc R=2 x M=2")):  # each layout's checkpoint
        out, weights = tmp_path / f"eval{epoch}.json", mixed / "checkpoints" / f"epoch_{epoch:03d}.pt"
        assert evaluate_main(["--data", str(train_data), "--weights", str(weights), "--json", str(out),
                              "--no-progress"]) == 0, layout
        record = json.loads(out.read_text())
        assert record["n"] == vals[epoch - 1]["n"] and abs(record["top1_err"] - vals[epoch - 1]["top1_err"]) < 1e-9


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_dead_or_hung_member_of_a_model_group_ends_the_run(train_data, tmp_path, fault):
    assert_fault_ends_the_run(train_data, tmp_path / "run", fault, **{
        "parallel.replicas": 1, "parallel.model_size": 2, "parallel.model": "fc", "train.batch_size": 4})


@pytest.mark.parametrize("name", ["2 model parallel (columns)", "2 data parallel", "2 fc parallel"])
def test_benchmark_counts_match_the_cost_model(name):
    """benchmark.py parallel's measured bytes per step == the formulas of its cost model (gloo variant)."""
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
