"""alexnet/exchange.py between real processes (gloo and ipc on CPU): averaging of weights and momentum."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from alexnet.config import ParallelConfig, TrainConfig
from alexnet.distributed import DistInfo
from alexnet.exchange import WeightExchange, broadcast_from_rank0
from alexnet.launch import free_port
from alexnet.optim import build_optimizer
from alexnet.trainer import sgd_step


def _replica(rank: int, world: int, port: int, transport: str, every: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), transport, dist.group.WORLD)
    torch.manual_seed(100 + rank)  # deliberately different starts: the broadcast must fix that
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    broadcast_from_rank0([p.data for p in model.parameters()], info)
    opt = build_optimizer(model, TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-3))
    exchange = WeightExchange(model, opt, info, every)
    history = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each replica its own data
        x, y = torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
        sgd_step(model, opt, x, y, lambda: torch.autocast("cpu", enabled=False))
        before = [t.clone() for t in exchange.tensors()]
        exchanged = exchange.after_step(step)
        history.append({"before": before, "after": [t.clone() for t in exchange.tensors()], "exchanged": exchanged})
    exchange.close()
    torch.save(history, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def run_replicas(tmp_path, transport: str, every: int = 1, steps: int = 4, world: int = 2) -> list[list[dict]]:
    mp.start_processes(_replica, args=(world, free_port(), transport, every, steps, str(tmp_path)), nprocs=world,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_exchange_averages_weights_and_momentum(tmp_path, transport):
    h = run_replicas(tmp_path, transport, world=3)
    for step in range(4):
        before = [h[r][step]["before"] for r in range(3)]
        for i in range(len(before[0])):  # parameters, then velocities
            assert not torch.equal(before[0][i], before[1][i])  # replicas trained on different data ...
            mean = (before[0][i] + before[1][i] + before[2][i]) / 3
            for r in range(3):  # ... and every one holds the average afterwards, momentum included
                torch.testing.assert_close(h[r][step]["after"][i], mean, rtol=1e-6, atol=1e-7)
            assert torch.equal(h[0][step]["after"][i], h[2][step]["after"][i])  # bit-identical replicas


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_exchange_every_k_steps(tmp_path, transport):
    h = run_replicas(tmp_path, transport, every=3, steps=6)
    assert [s["exchanged"] for s in h[0]] == [False, False, True, False, False, True]
    for step, s in enumerate(h[0]):
        same = all(torch.equal(a, b) for a, b in zip(s["after"], h[1][step]["after"]))
        assert same == s["exchanged"]  # replicas differ between exchanges and agree right after
        if not s["exchanged"]:
            assert all(torch.equal(a, b) for a, b in zip(s["before"], s["after"]))  # untouched


def test_transport_resolution():
    from alexnet.config import ConfigError
    from alexnet.distributed import resolve_transport
    p = ParallelConfig()
    assert resolve_transport(p, "cpu", True, False) == "ipc"
    assert resolve_transport(p, "cpu", False, False) == "gloo"
    assert resolve_transport(p, "cuda", True, False) == "nccl"
    assert resolve_transport(p, "cuda", True, True) == "ipc"  # two replicas on one GPU
    g = ParallelConfig(exchange="gradients")
    assert resolve_transport(g, "cuda", True, True) == "gloo" and resolve_transport(g, "cpu", True, False) == "gloo"
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        resolve_transport(ParallelConfig(transport="nccl"), "cuda", True, True)
    with pytest.raises(ConfigError, match="one host"):
        resolve_transport(ParallelConfig(transport="ipc"), "cpu", False, False)
