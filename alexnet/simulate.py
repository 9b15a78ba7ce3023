"""Every rank of a parallel run in this one process: the R x M mesh on the rank simulator (layers/sim.py).

``sim_infos(world, model_size, ...)`` gives each simulated rank the DistInfo that ``distributed.setup``
gives a real process (its world, slow, model and data groups from the same ``mesh_ranks``), with
SimComm groups instead of torch.distributed ones; ``run_ranks`` runs a function on every rank and
``train`` runs the trainer itself (``Trainer(cfg, info).fit()`` on every rank, rank 0 writing the run
directory), so a layout's whole training loop can be compared with one process in seconds, on the CPU.

What it leaves to real processes: start-up and teardown (the rendezvous, the store, leaving together),
signals, the launcher, DDP's buckets (replaced by the same mean after backward: exchange.AveragedGradients)
and the transports themselves.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layers.sim import SimWorld

from .config import Config
from .distributed import DistInfo, Placement, mesh_ranks, own_group, resolve_transport


def sim_infos(world: SimWorld, model_size: int = 1, cfg: Config | None = None) -> list[DistInfo]:
    """The DistInfo of every rank of `world` in R x `model_size` (`cfg`: its parallel.transport, resolved as
    for processes of one host on the CPU; default gloo)."""
    n = world.size
    model_groups, data_groups = mesh_ranks(n, model_size)
    transport = "gloo" if cfg is None else resolve_transport(cfg.parallel, Placement(("sim",) * n, (None,) * n))
    infos = []
    for rank in range(n):
        m, model_ranks = own_group(rank, model_groups)
        d, data_ranks = own_group(rank, data_groups)
        infos.append(DistInfo(
            rank=rank, world=n, local_rank=rank, local_world=n, device=torch.device("cpu"),
            transport=transport if n > 1 else "none", comm=world.comm(rank), slow=world.comm(rank, name="slow"),
            model_size=model_size,
            model_peers=world.comm(rank, model_ranks, name=f"model{m}") if model_size > 1 else None,
            data_peers=world.comm(rank, data_ranks, name=f"data{d}")))
    return infos


def run_ranks(size: int, fn: Callable[[DistInfo], Any], model_size: int = 1, cfg: Config | None = None,
              nccl: bool = False) -> list[Any]:
    """fn(info) on every rank of a simulated R x `model_size` mesh of `size` ranks; results in rank order."""
    world = SimWorld(size, nccl=nccl)
    infos = sim_infos(world, model_size, cfg)
    return world.run(lambda rank: fn(infos[rank]))


def train(cfg: Config, stops: dict[int, int] | None = None) -> list[dict]:
    """Train `cfg` on parallel.replicas x parallel.model_size simulated ranks; every rank's fit() result.

    `stops`: {rank: global step} from which that rank's stop flag is up (as after a Ctrl-C), to see the
    ranks agree on where to stop."""
    from .trainer import StopFlag, Trainer
    size = cfg.parallel.replicas * cfg.parallel.model_size
    stops = stops or {}

    class StopFrom(StopFlag):
        def __init__(self, step: int):
            super().__init__()
            self.step, self.trainer = step, None

        @property
        def requested(self) -> bool:
            return self.signum is not None or self.trainer.global_step >= self.step

    def fit(info: DistInfo) -> dict:
        flag = StopFrom(stops[info.rank]) if info.rank in stops else StopFlag()
        trainer = Trainer(cfg, info, flag)
        flag.trainer = trainer
        return trainer.fit()
    return run_ranks(size, fit, cfg.parallel.model_size, cfg)
