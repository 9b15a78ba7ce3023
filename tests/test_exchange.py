"""alexnet/exchange.py between real processes (gloo and ipc on CPU): averaging of weights and momentum."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from alexnet.config import ParallelConfig, TrainConfig
from alexnet.distributed import leave_together
from alexnet.exchange import WeightExchange, broadcast_from_first
from alexnet.launch import free_port
from alexnet.optim import build_optimizer
from alexnet.replica import sgd_step
from layers import Comm, TorchComm

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

SCENARIOS = {  # name: (transport, exchange every, steps); all four run in one group of 3 processes
    "average ipc": ("ipc", 1, 4), "average gloo": ("gloo", 1, 4),
    "every 3 ipc": ("ipc", 3, 6), "every 3 gloo": ("gloo", 3, 6),
}


def _history(rank: int, transport: str, every: int, steps: int, peers: Comm | None = None) -> list[dict]:
    """One replica's parameters and velocities before and after each step's exchange (among `peers`,
    default the whole world)."""
    torch.manual_seed(100 + rank)  # deliberately different starts: the broadcast must fix that
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    peers = peers or TorchComm(dist.group.WORLD, None, rank, tuple(range(dist.get_world_size())))
    broadcast_from_first([p.data for p in model.parameters()], peers)
    opt = build_optimizer(model, TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-3))
    exchange = WeightExchange(model, opt, peers, transport, every)
    # read from the model and the optimizer's own state, not from what the exchange (or velocities()) lists
    state = lambda: ([p.data.clone() for p in model.parameters()]  # noqa: E731
                     + [opt.state[p]["velocity"].clone() for p in model.parameters()])
    history = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each replica its own data
        x, y = torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
        sgd_step(model, opt, x, y, lambda: torch.autocast("cpu", enabled=False))
        before = state()
        exchanged = exchange.after_step(step)
        history.append({"before": before, "after": state(), "exchanged": exchanged})
    exchange.close()
    return history


def _bucket_views(out: str) -> dict:
    """keep_grads under a one-process DDP: where the gradients live across steps."""
    from alexnet.exchange import wrap_gradients
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", 1), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    ddp = wrap_gradients(model, torch.device("cpu"), bucket_mb=25)  # no comm: no heartbeat, nothing counted
    opt = build_optimizer(model, TrainConfig(lr=0.1))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    ptrs = lambda: [None if p.grad is None else p.grad.data_ptr() for p in model.parameters()]  # noqa: E731
    for _ in range(2):  # DDP rebuilds its buckets once, after the first step
        sgd_step(ddp, opt, x, y, no_autocast, keep_grads=True)
    seen = {"kept zeroed": [p.grad is not None and not p.grad.any() for p in model.parameters()],
            "ptrs": [ptrs()]}
    for _ in range(2):
        sgd_step(ddp, opt, x, y, no_autocast, keep_grads=True)
        seen["ptrs"].append(ptrs())
    sgd_step(ddp, opt, x, y, no_autocast, keep_grads=False)
    seen["dropped"] = [p.grad is None for p in model.parameters()]
    return seen


def _member(rank: int, world: int, port: int, out: str) -> None:
    """One of 3 processes: every scenario in turn, then (rank 0) the DDP gradient views."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, (transport, every, steps) in SCENARIOS.items():
        torch.save(_history(rank, transport, every, steps), f"{out}/{name} rank{rank}.pt")
    pair = dist.new_group([1, 2])  # a data group smaller than the world, as in a hybrid mesh; all make it
    if rank in (1, 2):
        for transport in ("ipc", "gloo"):
            peers = TorchComm(pair, None, rank - 1, (1, 2))
            torch.save(_history(rank, transport, 1, 2, peers), f"{out}/pair {transport} rank{rank}.pt")
    leave_together(rank, world)  # rank 0 hosts the store that ranks 1 and 2 may still be using
    if rank == 0:
        torch.save(_bucket_views(out), f"{out}/bucket views.pt")
    # Freeing a gloo group right after its last collective can deadlock (the group's worker thread
    # waits for the GIL to free the finished work, the freeing thread holds it and joins the worker):
    # this process ends without freeing anything.
    os._exit(0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict:
    """{scenario: [history of rank 0, 1, 2]} and {"bucket views": what rank 0 saw}."""
    out = tmp_path_factory.mktemp("exchange")
    mp.start_processes(_member, args=(3, free_port(), str(out)), nprocs=3, start_method="fork")
    got = {name: [torch.load(out / f"{name} rank{r}.pt", weights_only=True) for r in range(3)]
           for name in SCENARIOS}
    pairs = {f"pair {t}": [torch.load(out / f"pair {t} rank{r}.pt", weights_only=True) for r in (1, 2)]
             for t in ("ipc", "gloo")}
    return {**got, **pairs, "bucket views": torch.load(out / "bucket views.pt", weights_only=True)}


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_exchange_averages_weights_and_momentum(replicas, transport):
    h = replicas[f"average {transport}"]
    for step in range(4):
        before = [h[r][step]["before"] for r in range(3)]
        assert len(before[0]) == 8  # 2 weights and 2 biases, each with its velocity
        for i in range(len(before[0])):  # parameters, then velocities
            assert not torch.equal(before[0][i], before[1][i])  # replicas trained on different data ...
            mean = (before[0][i] + before[1][i] + before[2][i]) / 3
            for r in range(3):  # ... and every one holds the average afterwards, momentum included
                torch.testing.assert_close(h[r][step]["after"][i], mean, rtol=1e-6, atol=1e-7)
            assert torch.equal(h[0][step]["after"][i], h[2][step]["after"][i])  # bit-identical replicas


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_exchange_within_a_data_group_averages_its_members_only(replicas, transport):
    """Ranks 1 and 2 of 3 form the data group (in a hybrid mesh the world is R x M, the group R): the
    average is over the group's 2 members, whatever the world's size."""
    h = replicas[f"pair {transport}"]  # rank 1's history, rank 2's
    for step in range(2):
        for i, (a, b) in enumerate(zip(h[0][step]["before"], h[1][step]["before"])):
            assert not torch.equal(a, b)  # other data on each member ...
            for r in range(2):  # ... then both hold the mean of the two
                torch.testing.assert_close(h[r][step]["after"][i], (a + b) / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_exchange_every_k_steps(replicas, transport):
    h = replicas[f"every 3 {transport}"]
    assert [s["exchanged"] for s in h[0]] == [False, False, True, False, False, True]
    for step, s in enumerate(h[0]):
        for other in (1, 2):
            same = all(torch.equal(a, b) for a, b in zip(s["after"], h[other][step]["after"]))
            assert same == s["exchanged"]  # replicas differ between exchanges and agree right after
        if not s["exchanged"]:
            assert all(torch.equal(a, b) for a, b in zip(s["before"], s["after"]))  # untouched


def test_transport_resolution():
    from alexnet.config import ConfigError
    from alexnet.distributed import Placement, resolve_transport
    p, g = ParallelConfig(), ParallelConfig(exchange="gradients")
    one_host = ("h", "h")
    cpu = Placement(one_host, (None, None))
    assert resolve_transport(p, cpu) == "ipc" and resolve_transport(g, cpu) == "gloo"
    assert resolve_transport(p, Placement(("a", "b"), (None, None))) == "gloo"
    own = Placement(one_host, ("GPU-1", "GPU-2"))
    assert resolve_transport(p, own) == "nccl" and resolve_transport(g, own) == "nccl"
    shared = Placement(one_host, ("GPU-1", "GPU-1"))  # two replicas on one GPU
    assert resolve_transport(p, shared) == "ipc" and resolve_transport(g, shared) == "gloo"
    mixed = Placement(("h",) * 4, ("GPU-1", "GPU-1", "GPU-2", "GPU-2"))  # 4 replicas on 2 GPUs
    assert resolve_transport(p, mixed) == "gloo"
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        resolve_transport(ParallelConfig(transport="nccl"), shared)
    with pytest.raises(ConfigError, match="one host"):
        resolve_transport(ParallelConfig(transport="ipc"), Placement(("a", "b"), (None, None)))
    for placement in (own, mixed):
        with pytest.raises(ConfigError, match="ipc across distinct GPUs"):
            resolve_transport(ParallelConfig(transport="ipc"), placement)


def test_placement_is_physical_not_by_index(monkeypatch):
    """Per-process CUDA_VISIBLE_DEVICES: every rank calls its GPU cuda:0, yet they are distinct GPUs."""
    import threading

    from alexnet import distributed
    from alexnet.distributed import Placement, exchange_placement, resolve_transport
    store = dist.HashStore()
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb"}
    local = threading.local()
    monkeypatch.setattr(distributed, "gpu_id", lambda device: uuids[local.rank])
    out = {}

    def rank_main(rank):
        local.rank = rank
        out[rank] = exchange_placement(store, rank, 2, torch.device("cpu"))
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1] == Placement((distributed.machine_id(),) * 2, ("GPU-aaaa", "GPU-bbbb"))
    assert resolve_transport(ParallelConfig(), out[0]) == "nccl"


def _ipc_gpu_replica(rank: int, world: int, port: int, out: str) -> None:
    """Two replicas on cuda:0: the ipc average queued behind a busy stream, host not waiting for it."""
    from alexnet.exchange import IpcAverage
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    avg = IpcAverage(1000, device, TorchComm(dist.group.WORLD, None, rank, tuple(range(world))))
    # The first exchange opens the other replica's memory, and the other replica may still be starting
    # CUDA: the host waits for that once (on an H200 long enough for the sleep below to end), so the
    # steps measured are the steady state after a warm-up and a barrier.
    avg.average([torch.zeros(600, device=device), torch.zeros(400, device=device)])
    torch.cuda.synchronize()
    dist.barrier()
    results, host_waited = [], []
    for step in range(4):
        tensors = [torch.full((600,), float(rank + step), device=device), torch.full((400,), float(10 * rank))]
        tensors[1] = tensors[1].to(device)
        torch.cuda._sleep(1_000_000_000)  # the stream is busy; anything the exchange queues waits behind it
        avg.average(tensors)
        host_waited.append(torch.cuda.current_stream().query())
        results.append([t.cpu() for t in tensors])
    avg.close()
    torch.save({"results": results, "host_waited": host_waited}, f"{out}/gpu{rank}.pt")
    leave_together(rank, world)


@pytest.mark.gpu
def test_ipc_exchange_on_one_gpu_leaves_the_host_free(tmp_path):
    mp.start_processes(_ipc_gpu_replica, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"gpu{rank}.pt", weights_only=True)
        assert not any(got["host_waited"]), got["host_waited"]  # no stream synchronisation on the host
        for step, (a, b) in enumerate(got["results"]):
            assert torch.equal(a, torch.full((600,), 0.5 + step)) and torch.equal(b, torch.full((400,), 5.0))


def test_ddp_gradients_stay_bucket_views_across_steps(replicas):
    """keep_grads: the gradients stay allocated as DDP's bucket views (no re-allocation and copy per step)."""
    seen = replicas["bucket views"]
    assert seen["kept zeroed"] == [True] * 4  # zeroed, kept
    assert len(seen["ptrs"]) == 3 and all(p == seen["ptrs"][0] for p in seen["ptrs"])
    assert seen["dropped"] == [True] * 4  # the test can tell the difference
