"""Where this process runs: rank, world size and device, and the rank-0 helpers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: the local rank's GPU if CUDA is present, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def setup(device: str = "auto") -> DistInfo:
    """A single-process run on `device`."""
    return DistInfo(0, 1, 0, pick_device(device))


def print0(dist: DistInfo, *args, **kwargs) -> None:
    """print on rank 0 only."""
    if dist.is_main:
        print(*args, **kwargs, flush=True)
