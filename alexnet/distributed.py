"""Where this process runs: rank, world size, device and process groups, and the rank-0 helpers.

One initialisation path for every launch: torch.distributed's environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set by torchrun on many hosts or by
train.py itself for the replicas of one host (alexnet/launch.py). Without them: one replica.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .config import Config, ConfigError, ParallelConfig


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = torch.device("cpu")
    transport: str = "none"   # how replicas exchange: ipc | nccl | gloo (none for one replica)
    cpu_group: Any = None     # a gloo group for barriers and small host-side messages

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def device_for(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: the local rank's GPU if CUDA is present, else the CPU; ``cuda``: the local rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a device (cpu, cuda, cuda:N, auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) present")
    return device


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """device_for(), made this thread's current CUDA device where it is one."""
    device = device_for(name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def replica_device_name(devices: list[str], fallback: str, local_rank: int) -> str:
    """parallel.devices[local_rank % len] (several replicas may share one), else run.device."""
    return devices[local_rank % len(devices)] if devices else fallback


def resolve_transport(p: ParallelConfig, device_type: str, single_host: bool, shared_gpu: bool) -> str:
    """The transport for `p.transport`, with auto resolved; ConfigError for impossible choices."""
    t = p.transport
    if t == "auto":
        if device_type == "cuda" and not shared_gpu:
            return "nccl"
        return "ipc" if p.exchange == "weights" and single_host else "gloo"
    if t == "nccl" and (device_type != "cuda" or shared_gpu):
        raise ConfigError("parallel.transport=nccl needs one GPU per replica (NCCL refuses two ranks on one GPU, "
                          "and has no CPU path); use ipc (weights exchange) or gloo")
    if t == "ipc" and not single_host:
        raise ConfigError("parallel.transport=ipc works between replicas of one host; use nccl or gloo")
    return t


def setup(cfg: Config) -> DistInfo:
    """This process's replica: one alone, or one of WORLD_SIZE set up through torch.distributed."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(device=pick_device(replica_device_name(cfg.parallel.devices, cfg.run.device, 0)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    names = [replica_device_name(cfg.parallel.devices, cfg.run.device, r) for r in range(local_world)]
    local_devices = [device_for(n, r) for r, n in enumerate(names)]
    shared = local_devices[0].type == "cuda" and len(set(local_devices)) < local_world
    device = pick_device(names[local_rank], local_rank)
    transport = resolve_transport(cfg.parallel, device.type, local_world == world, shared)
    timeout = timedelta(seconds=cfg.parallel.timeout)
    backend = "nccl" if transport == "nccl" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return DistInfo(rank, world, local_rank, local_world, device, transport, cpu_group)


def teardown(info: DistInfo) -> None:
    """Leave together: a replica that tears its connections down while a peer still finishes (rank 0
    writing the last checkpoint) can make the C++ side abort at exit."""
    if info.distributed and dist.is_initialized():
        dist.barrier(group=info.cpu_group)
        dist.destroy_process_group()


def print0(info: DistInfo, *args, **kwargs) -> None:
    """print on rank 0 only."""
    if info.is_main:
        print(*args, **kwargs, flush=True)
