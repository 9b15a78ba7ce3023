"""Keeping data-parallel replicas in step.

``parallel.exchange: weights`` (Ding et al. 2014, section 2.2): every ``exchange_every`` steps each
replica's parameters and momentum are averaged with its peers'. Everything is packed into one flat
buffer first, so a transport moves a few large blocks, never one message per tensor:

- ``ipc`` (one host): each replica exposes two flat buffers (alternating between exchanges), through
  CUDA IPC on a GPU or a shared-memory mapping on the CPU, and reads its peers' buffers directly: the
  paper's peer-to-peer copies. It also works for several replicas on one GPU, where NCCL refuses.
  Every replica sums the buffers in rank order, so all replicas hold bit-identical weights afterwards.
- ``nccl`` / ``gloo``: one all-reduce of the flat buffer through torch.distributed.

``parallel.exchange: gradients`` (synchronous SGD, Synkhronos / Goyal et al.): gradients are averaged
during the backward pass by DistributedDataParallel (bucketed, overlapped with computation); see
:func:`wrap_gradients`.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .distributed import DistInfo


def flat_size(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy `tensors` (any memory format) one after another into the 1-d `flat`."""
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Make every replica start from rank 0's values (one flat broadcast)."""
    if not info.distributed:
        return
    flat = torch.empty(flat_size(tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    pack(tensors, flat)
    dist.broadcast(flat, src=0)
    unpack(flat, tensors)


class AllReduceAverage:
    """The mean over replicas through one all-reduce (nccl or gloo)."""

    def __init__(self, numel: int, device: torch.device, info: DistInfo):
        self.flat = torch.empty(numel, device=device)
        self.world = info.world

    def average(self, tensors: list[torch.Tensor]) -> None:
        pack(tensors, self.flat)
        dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        unpack(self.flat, tensors)

    def close(self) -> None:
        """Nothing to release: the buffer is ordinary device memory."""


class IpcAverage:
    """The mean over the replicas of one host, each reading its peers' buffers directly."""

    def __init__(self, numel: int, device: torch.device, info: DistInfo):
        self.info, self.device = info, device
        self.turn = 0
        if device.type == "cuda":
            own = [torch.empty(numel, device=device) for _ in range(2)]
            self.peers = self._share_cuda(own)
        else:
            self.peers = self._share_cpu(numel)
        self.acc = torch.empty(numel, device=device)
        self.tmp = None  # for peers on another GPU: copied over first, then added

    def _share_cuda(self, own: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's two buffers, rebuilt here from CUDA IPC handles (our own used as they are)."""
        from torch.multiprocessing.reductions import reduce_tensor
        handles = [None] * self.info.world
        dist.all_gather_object(handles, [reduce_tensor(b) for b in own], group=self.info.cpu_group)
        return [own if r == self.info.rank else [fn(*args) for fn, args in handles[r]]
                for r in range(self.info.world)]

    def _share_cpu(self, numel: int) -> list[list[torch.Tensor]]:
        """Shared mappings of files in /dev/shm, unlinked once every peer has mapped them (no leftovers)."""
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0, group=self.info.cpu_group)
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
        name = lambda r, b: folder / f"alexnet-{token[0]}-{r}-{b}"  # noqa: E731
        for b in range(2):
            with open(name(self.info.rank, b), "wb") as f:
                f.truncate(numel * 4)
        dist.barrier(group=self.info.cpu_group)
        peers = [[torch.from_file(str(name(r, b)), shared=True, size=numel, dtype=torch.float32) for b in range(2)]
                 for r in range(self.info.world)]
        dist.barrier(group=self.info.cpu_group)
        for b in range(2):
            os.unlink(name(self.info.rank, b))
        return peers

    def average(self, tensors: list[torch.Tensor]) -> None:
        own = self.peers[self.info.rank][self.turn]
        pack(tensors, own)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # our buffer is complete before peers read
        # After this barrier every peer's buffer of this turn is complete; the other turn's buffers may
        # still be read by slower peers, which is why each replica alternates between two.
        dist.barrier(group=self.info.cpu_group)
        for r in range(self.info.world):  # rank order on every replica: bit-identical sums
            src = self.peers[r][self.turn]
            if src.device != self.device:
                if self.tmp is None:
                    self.tmp = torch.empty_like(self.acc)
                src = self.tmp.copy_(src, non_blocking=True)
            if r == 0:
                self.acc.copy_(src)
            else:
                self.acc.add_(src)
        self.acc.div_(self.info.world)
        unpack(self.acc, tensors)
        self.turn = 1 - self.turn

    def close(self) -> None:
        self.peers = []
        self.acc = self.tmp = None


class WeightExchange:
    """Average parameters and momentum buffers across replicas every `every` steps."""

    def __init__(self, model: nn.Module, optimizer, info: DistInfo, every: int = 1):
        self.model, self.optimizer, self.every = model, optimizer, every
        tensors = self.tensors()
        impl = IpcAverage if info.transport == "ipc" else AllReduceAverage
        self.impl = impl(flat_size(tensors), tensors[0].device, info)

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, then velocities (looked up each time: loading a checkpoint replaces them)."""
        return [p.data for p in self.model.parameters()] + self.optimizer.velocities()

    def bytes_per_exchange(self) -> int:
        return flat_size(self.tensors()) * 4

    @torch.no_grad()
    def after_step(self, steps_done: int) -> bool:
        """Call after each optimizer step; exchanges when `steps_done` is a multiple of `every`."""
        if steps_done % self.every:
            return False
        self.impl.average(self.tensors())
        return True

    def close(self) -> None:
        self.impl.close()


def wrap_gradients(model: nn.Module, info: DistInfo, bucket_mb: float, before_allreduce=None) -> nn.Module:
    """DistributedDataParallel: gradients averaged in buckets, overlapped with the backward pass.

    `before_allreduce` runs before each bucket's all-reduce (the launcher's heartbeat).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    if before_allreduce is not None:
        def hook(state, bucket):
            before_allreduce()
            return allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)
    return ddp
