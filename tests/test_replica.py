"""alexnet/replica.py in one process: a batch run as slices is the same update as the whole batch (a second
route to the same step), and each process's place in the R x M mesh (what it reads, how it counts, how its
loss is scaled) as a table written by hand from the module docstring."""
from __future__ import annotations

import contextlib

import pytest
import torch

from alexnet.config import load_config
from alexnet.distributed import DistInfo
from alexnet.models import build_model
from alexnet.optim import build_optimizer
from alexnet.replica import MeshLayout, sgd_step


def _model_and_optimizer(cfg):
    torch.manual_seed(0)
    model = build_model("alexnet", 5, 0.125, 0.0, 67, "torch")  # no dropout: both routes see one function
    return model, build_optimizer(model, cfg.train)


@pytest.mark.parametrize("slices", [2, 3])
def test_a_batch_in_slices_is_one_step_on_the_whole_batch(slices):
    """train.slices: the micro-batches' gradients add up to the whole batch's mean-loss gradient; the loss
    returned is the batch's mean and the logits are every row's."""
    cfg = load_config("configs/demo.yaml", ["train.batch_size=6", "train.weight_decay=0"])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 67, 67, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    results = []
    for k in (1, slices):
        model, optimizer = _model_and_optimizer(cfg)
        for group in optimizer.param_groups:
            group["lr"] = 0.5  # large: a gradient off by a factor shows in the weights
        loss, logits = sgd_step(model, optimizer, x, y, contextlib.nullcontext, slices=k)
        results.append((loss, logits, [p.detach().clone() for p in model.parameters()]))
    (loss1, logits1, w1), (loss_k, logits_k, w_k) = results
    torch.testing.assert_close(loss_k, loss1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits_k, logits1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss1, torch.nn.functional.cross_entropy(logits1, y), rtol=1e-6, atol=1e-7)
    for a, b in zip(w_k, w1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# (mode, R, M): per rank (reader_rank, reader_world, counts_metrics, keep_empty_batches); the images one
# process reads per step; global batch; loss scale. train.batch_size=8 is a replica's batch in every layout.
MESH = {
    ("fc", 2, 2): ([(0, 4, True, True), (1, 4, True, True), (2, 4, True, True), (3, 4, True, True)], 4, 2 * 8, 0.5),
    ("columns", 2, 2): ([(0, 2, True, False), (0, 2, False, False), (1, 2, True, False), (1, 2, False, False)],
                        8, 2 * 8, 0.5),
    ("columns", 1, 4): ([(0, 1, True, False)] + [(0, 1, False, False)] * 3, 8, 8, 0.25),
    ("fc", 3, 1): ([(0, 3, True, False), (1, 3, True, False), (2, 3, True, False)], 8, 3 * 8, 1.0),
    ("fc", 1, 4): ([(r, 4, True, True) for r in range(4)], 2, 8, 0.25),
}


@pytest.mark.parametrize("mode, replicas, size", list(MESH))
def test_each_process_reads_counts_and_scales_as_its_place_says(mode, replicas, size):
    cfg = load_config("configs/demo.yaml", ["train.batch_size=8", f"parallel.model={mode}",
                                             f"parallel.model_size={size}", f"parallel.replicas={replicas}"])
    places, reads, batch, scale = MESH[(mode, replicas, size)]
    for rank, want in enumerate(places):
        layout = MeshLayout(cfg, DistInfo(rank=rank, world=replicas * size, model_size=size))
        got = (layout.reader_rank, layout.reader_world, layout.counts_metrics, layout.keep_empty_batches)
        assert got == want, rank
        assert (layout.reader_batch, layout.global_batch, layout.loss_scale) == (reads, batch, scale)


def test_fc_refuses_a_batch_its_model_group_cannot_split():
    from alexnet.config import ConfigError
    with pytest.raises(ConfigError, match=r"train.batch_size=6 is a replica's batch, which parallel.model=fc splits "
                                          r"over its parallel.model_size=4 processes: give a multiple of 4"):
        load_config("configs/demo.yaml", ["train.batch_size=6", "parallel.model=fc", "parallel.model_size=4"])
    with pytest.raises(ConfigError, match=r"train.batch_size=8 \(4 per process of the fc model group\) is not "
                                          r"divisible by train.slices=8"):
        load_config("configs/demo.yaml", ["train.batch_size=8", "parallel.model=fc", "parallel.model_size=2",
                                          "train.slices=8"])
    load_config("configs/demo.yaml", ["train.batch_size=6", "parallel.model=columns", "parallel.model_size=4"])


@pytest.mark.parametrize("mode, replicas, size, rank, unit, words", [
    ("fc", 3, 1, 2, "per replica", "3 replica(s)"),
    ("fc", 2, 2, 3, "per replica, 25 per process of its model group",
     "2 replica(s) x model groups of 2 (fc model parallel), this process model rank 1 of replica 1"),
    ("columns", 1, 2, 1, "per replica, each of its model group's processes reading all of them",
     "1 replica(s) x model groups of 2 (columns model parallel), this process model rank 1 of replica 0"),
])
def test_what_the_start_line_says_of_the_layout(mode, replicas, size, rank, unit, words):
    cfg = load_config("configs/demo.yaml", [f"parallel.model={mode}", f"parallel.model_size={size}",
                                             f"parallel.replicas={replicas}"])
    layout = MeshLayout(cfg, DistInfo(rank=rank, world=replicas * size, model_size=size))
    assert (layout.batch_unit, layout.describe()) == (unit, words)


TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")  # what the heartbeat counts


@pytest.mark.parametrize("overrides", [
    ["parallel.replicas=2", "parallel.exchange=weights", "parallel.transport=gloo"],
    ["parallel.replicas=2", "parallel.exchange=gradients", "train.slices=2"],
    ["parallel.replicas=2", "parallel.exchange=gradients", "model.arch=alexnet_bn"],
    ["parallel.replicas=2", "parallel.model_size=2", "parallel.model=fc", "parallel.exchange=gradients"],
    ["parallel.replicas=1", "parallel.model_size=2", "parallel.model=columns", "model.arch=alexnet_bn"],
], ids=["weights", "gradients-slices", "gradients-bn", "fc-hybrid", "columns-bn"])
def test_the_heartbeat_comes_before_every_tensor_collective_of_a_replica(overrides, monkeypatch):
    """The launcher blames the rank whose count of collectives entered lags (alexnet/launch.py): a Replica's
    `arrive` must be called once before each tensor collective it enters (start-up broadcast, every step's
    exchange or gradient average, the model group's gathers, the statistics' average), counted here by
    the simulator itself, not by the code under test."""
    import threading

    from alexnet.replica import Replica
    from alexnet.simulate import run_ranks
    from layers.sim import SimWorld
    cfg = load_config("configs/demo.yaml", ["train.batch_size=4", "model.width=0.125", "data.crop=67",
                                             "model.init=torch", *overrides])
    size = cfg.parallel.replicas * cfg.parallel.model_size
    entered, arrived, lock = [0] * size, [0] * size, threading.Lock()
    original = SimWorld.collective

    def counting(self, key, rank, members, kind, *args, **kwargs):
        if kind.split()[0] in TENSOR_COLLECTIVES:
            with lock:
                entered[rank] += 1
        return original(self, key, rank, members, kind, *args, **kwargs)
    monkeypatch.setattr(SimWorld, "collective", counting)

    def member(info):
        def arrive():
            with lock:
                arrived[info.rank] += 1
        replica = Replica(cfg, info, 4, arrive=arrive)
        gen = torch.Generator().manual_seed(info.rank)
        x, y = torch.randn(4, 3, 67, 67, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        replica.step(x, y, 1, contextlib.nullcontext)
        replica.average_statistics()
        replica.close()
    run_ranks(size, member, cfg.parallel.model_size, cfg)
    assert min(entered) > 0 and arrived == entered, (arrived, entered)


def test_a_replica_builds_the_configured_model_in_every_layout():
    """model.lrn reaches the model whether or not it is split; train.channels_last lays the conv weights
    out as asked; a layer the model parallelism cannot split is a ConfigError in the sharding's words."""
    from alexnet.config import ConfigError
    from alexnet.replica import Replica
    from alexnet.simulate import run_ranks
    from layers import LRN
    base = ["model.width=0.125", "data.crop=67", "model.init=torch", "train.batch_size=4"]

    def lrn_forms(info, cfg):
        replica = Replica(cfg, info, 4)
        forms = {m.divide_by_size for m in replica.model.modules() if isinstance(m, LRN)}
        convs = [m.weight for m in replica.model.modules() if isinstance(m, torch.nn.Conv2d)]
        last = all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
        replica.close()
        return forms, last
    for layout in ([], ["parallel.model_size=2", "parallel.model=columns"]):
        for lrn, channels_last in (("caffe", True), ("paper", False)):
            cfg = load_config("configs/demo.yaml", [*base, *layout, f"model.lrn={lrn}",
                                                    f"train.channels_last={str(channels_last).lower()}"])
            got = run_ranks(cfg.parallel.model_size, lambda info, c=cfg: lrn_forms(info, c), cfg.parallel.model_size,
                            cfg)
            assert all(g == ({lrn == "caffe"}, channels_last) for g in got), (layout, lrn, got)
    cfg = load_config("configs/demo.yaml", [*base, "train.batch_size=6", "parallel.model_size=3", "parallel.model=fc"])
    with pytest.raises(ConfigError, match=r"^parallel.model_size=3 does not divide a layer of 512 units \(Linear"):
        run_ranks(3, lambda info: Replica(cfg, info, 4), 3, cfg)


def test_train_compile_wraps_the_forward_module_and_nothing_else(monkeypatch):
    """train.compile=true hands the forward module to torch.compile (what that gives is proven on CUDA by
    the GPU check; here torch.compile is a stand-in that records its argument, sparing the import of
    dynamo); false leaves it as it is."""
    from alexnet.config import load_config as load
    from alexnet.replica import Replica
    given = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: given.append(module) or ("compiled", module))
    for on in (True, False):
        cfg = load("configs/demo.yaml", ["model.width=0.125", "data.crop=67", f"train.compile={str(on).lower()}"])
        replica = Replica(cfg, DistInfo(), 4)
        assert replica.forward == (("compiled", replica.model) if on else replica.model)
    assert len(given) == 1


def test_the_loss_is_taken_in_float32_at_least_and_a_float64_model_keeps_float64():
    """bf16 logits (autocast) give a float32 loss, not a bf16 one; a float64 model's loss stays float64."""
    cases = ((torch.float64, contextlib.nullcontext, torch.float64),
             (torch.float32, lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.float32))
    for dtype, autocast, want in cases:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(dtype)
        x, y = torch.randn(5, 4, dtype=dtype), torch.randint(0, 3, (5,))
        loss, logits = sgd_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, autocast)
        assert loss.dtype == want and logits.dtype == (torch.bfloat16 if want == torch.float32 else dtype)


def test_a_comm_refuses_a_rank_outside_its_group():
    from layers.sim import SimComm, SimWorld
    world = SimWorld(2)
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=f"^rank {rank} is not a member of a group of 2$"):
            SimComm(world, ("world",), rank, (0, 1))


@pytest.mark.parametrize("transport, impl", [("ipc", "IpcAverage"), ("gloo", "AllReduceAverage")])
def test_a_replicas_weights_exchange_takes_the_resolved_transport(transport, impl):
    from alexnet.replica import Replica
    from alexnet.simulate import run_ranks
    cfg = load_config("configs/demo.yaml", ["model.width=0.125", "data.crop=67", "train.batch_size=4",
                                             "parallel.replicas=2", "parallel.exchange=weights",
                                             f"parallel.transport={transport}"])

    def member(info):
        replica = Replica(cfg, info, 4)
        name = type(replica.exchange.impl).__name__
        replica.close()
        return name
    assert run_ranks(2, member, 1, cfg) == [impl, impl]
