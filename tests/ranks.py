"""Running a test's members on the rank simulator or on real gloo processes, with one signature.

``members(backend, size, fn, *args)`` calls ``fn(comm, *args)`` on every member of a group of `size` and
returns their results in rank order: ``"sim"`` on layers/sim.py's SimWorld in this process (milliseconds),
``"gloo"`` in `size` processes over torch.distributed's gloo, forked from this one (the suite runs one torch
thread per process, so no thread pool is lost in the fork; forking spares each member the second or two of
CPU that importing torch again costs), each result saved by its process with torch.save and read back here.
`fn`'s results must be plain data and tensors.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

BACKENDS = ("sim", "gloo")
# The marks of a case on real processes: left out of make test-fast and of mutmut's runs (pytest.ini).
REAL_GROUP = [pytest.mark.processes, pytest.mark.real_group]


def members(backend: str, size: int, fn, *args) -> list:
    if backend == "sim":
        from layers.sim import SimWorld
        world = SimWorld(size)
        return world.run(lambda rank: fn(world.comm(rank), *args))
    if backend != "gloo":
        raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
    import torch.multiprocessing as mp

    from alexnet.launch import free_port
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_member, args=(size, free_port(), out, fn, args), nprocs=size, start_method="fork")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(size)]


def _member(rank: int, size: int, port: int, out: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    from alexnet.distributed import leave_together
    from layers import TorchComm
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    result = fn(TorchComm(dist.group.WORLD, None, rank, tuple(range(size))), *args)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    leave_together(rank, size)
    # Freeing a gloo group right after its last collective can deadlock (the group's worker thread waits
    # for the GIL to free the finished work while the freeing thread holds it): end without freeing.
    os._exit(0)


def mesh(backend: str, cfg, fn) -> list:
    """``fn(info)`` on every rank of cfg's R x M mesh (parallel.replicas x parallel.model_size), each rank's
    DistInfo made as a process's is: ``"sim"`` by alexnet.simulate, ``"gloo"`` by alexnet.distributed.setup
    itself in spawned processes (the environment torchrun sets, this host, the CPU)."""
    size = cfg.parallel.replicas * cfg.parallel.model_size
    if backend == "sim":
        from alexnet.simulate import run_ranks
        return run_ranks(size, fn, cfg.parallel.model_size, cfg)
    import torch.multiprocessing as mp

    from alexnet.launch import free_port
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_mesh_member, args=(size, free_port(), out, cfg, fn), nprocs=size, start_method="fork")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(size)]


def _mesh_member(rank: int, size: int, port: int, out: str, cfg, fn) -> None:
    from alexnet.distributed import setup, teardown
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = setup(cfg)
    torch.save(fn(info), Path(out) / f"rank{rank}.pt")
    teardown(info)
    os._exit(0)  # as _member
