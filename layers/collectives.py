"""Every collective the library uses, behind one interface, and the gathers autograd can differentiate.

A :class:`Comm` is one group of processes seen from one member: its index in the group (`rank`), every
member's global rank (`ranks`), the collectives on tensors (sum/max/min all-reduce, all-gather,
reduce-scatter, broadcast) and on host objects (all-gather, gather, broadcast, barrier). It counts what
this member puts on the wire (`sent`, for the benchmarks) and calls `before` ahead of every tensor
collective (the launcher's heartbeat). Two kinds implement it:

- :class:`TorchComm`: torch.distributed (gloo, NCCL); host messages go through a gloo twin of the group;
- ``layers.sim.SimComm``: R ranks of one process, run in lock step by threads (the tests' rank simulator).

The distributed math (what is averaged, over which group, with which scale) lives above this interface
and does not know which kind runs it. A group of one member does nothing: every collective returns at
once, uncounted.

``gather(x, comm, dim)`` concatenates the tensors of every member along `dim` (the features of a sharded
layer, the channels of a column); its backward pass gives each member the sum, over the group, of the
gradients of its own slice, since every member used the whole result. ``gather(x, comm, 0, counts)``
does the same along the batch with a different number of rows per member (a short last validation
batch): rows are padded to the largest count for the transfer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

OPS = ("sum", "max", "min")


class Comm(ABC):
    """One member's view of a group (see the module docstring)."""

    def __init__(self, rank: int, ranks: tuple[int, ...], before: Callable[[], None] | None = None):
        if not 0 <= rank < len(ranks):
            raise ValueError(f"rank {rank} is not a member of a group of {len(ranks)}")
        self.rank, self.ranks, self.before = rank, tuple(ranks), before
        self.sent = [0]  # bytes this member put on the wire

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nccl(self) -> bool:
        """Whether reduce-scatter is native (NCCL): it decides what a gather's backward puts on the wire."""
        return False

    def arrive(self) -> None:
        if self.before is not None:
            self.before()

    @abstractmethod
    def with_before(self, before: Callable[[], None] | None) -> Comm:
        """The same group, with another `before` and a byte counter of its own."""

    # -- tensor collectives (on the tensors' device); nothing for a group of one ------------------------

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place: the elementwise sum (max, min) over the group."""
        if op not in OPS:
            raise ValueError(f"all_reduce op must be one of {OPS}, got {op!r}")
        if self.size == 1:
            return
        self.arrive()
        self._all_reduce(t, op)
        self.sent[0] += 2 * t.numel() * t.element_size() * (self.size - 1) // self.size

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `t` (equal shapes), in member order."""
        if self.size == 1:
            return [t]
        self.arrive()
        parts = self._all_gather(t.contiguous())
        self.sent[0] += t.numel() * t.element_size() * (self.size - 1)
        return parts

    def reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Σ over the group of every member's `parts[self.rank]` (parts: one equal-shape chunk per member)."""
        if self.size == 1:
            return parts[0]
        self.arrive()
        parts = [p.contiguous() for p in parts]
        if self.nccl:
            out = self._reduce_scatter(parts)
            self.sent[0] += out.numel() * out.element_size() * (self.size - 1)
            return out
        # gloo has no reduce-scatter in every supported torch: reduce everything, keep our chunk.
        flat = torch.stack(parts)
        self._all_reduce(flat, "sum")
        self.sent[0] += 2 * flat.numel() * flat.element_size() * (self.size - 1) // self.size
        return flat[self.rank]

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """In place: member `src`'s `t` (src: an index in the group, not a global rank)."""
        if self.size == 1:
            return
        self.arrive()
        self._broadcast(t, src)
        if self.rank == src:
            self.sent[0] += t.numel() * t.element_size()

    # -- host messages: small Python objects and barriers (not counted, no `before`) ----------------------

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in member order."""

    @abstractmethod
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every member's `obj` on member `dst`, None on the others."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Member `src`'s `obj` on every member."""

    @abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """Every member arrives before any leaves. `timeout`: seconds member 0 waits for the others after
        it arrived (it names one that never comes); the others wait as long as the group allows."""

    # -- the implementation's part ------------------------------------------------------------------------

    @abstractmethod
    def _all_reduce(self, t: torch.Tensor, op: str) -> None: ...

    @abstractmethod
    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def _reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, t: torch.Tensor, src: int) -> None: ...


class TorchComm(Comm):
    """A torch.distributed group (`group`, for tensors) and its gloo twin (`cpu_group`, for host messages
    and host tensors; the same group where the backend is gloo)."""

    def __init__(self, group: Any, cpu_group: Any, rank: int, ranks: tuple[int, ...],
                 before: Callable[[], None] | None = None):
        super().__init__(rank, ranks, before)
        self.group, self.cpu_group = group, cpu_group if cpu_group is not None else group

    def with_before(self, before: Callable[[], None] | None) -> TorchComm:
        return TorchComm(self.group, self.cpu_group, self.rank, self.ranks, before)

    @property
    def nccl(self) -> bool:
        import torch.distributed as dist
        return dist.get_backend(self.group) == "nccl"

    def _group_for(self, t: torch.Tensor) -> Any:
        return self.cpu_group if t.device.type == "cpu" else self.group  # NCCL takes no host tensor

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        import torch.distributed as dist
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=self._group_for(t))

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self._group_for(t))
        return parts

    def _reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist
        out = torch.empty_like(parts[self.rank])
        dist.reduce_scatter(out, parts, group=self.group)
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist
        dist.broadcast(t, src=self.ranks[src], group=self._group_for(t))

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        import torch.distributed as dist
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self, timeout: float | None = None) -> None:
        import torch.distributed as dist
        if self.size == 1:
            return
        if timeout is None:
            dist.barrier(group=self.cpu_group)
        else:
            dist.monitored_barrier(group=self.cpu_group, timeout=timedelta(seconds=timeout))


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad]).contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int, counts: tuple[int, ...] | None) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.counts = comm, dim, counts
        if counts is None:
            parts = comm.all_gather(x.contiguous() if dim == 0 else x.movedim(dim, 0).contiguous())
            return torch.cat(parts).movedim(0, dim) if dim else torch.cat(parts)
        parts = comm.all_gather(_pad_rows(x, max(counts)))
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, dim, counts = ctx.comm, ctx.dim, ctx.counts
        if counts is None:
            g = grad.movedim(dim, 0) if dim else grad
            own = comm.reduce_scatter(list(g.chunk(comm.size)))
            return (own.movedim(0, dim) if dim else own), None, None, None
        rows = max(counts)
        parts = [_pad_rows(g, rows) for g in grad.split(list(counts))]
        return comm.reduce_scatter(parts)[:counts[comm.rank]], None, None, None


def gather(x: torch.Tensor, comm: Comm, dim: int, counts: tuple[int, ...] | None = None) -> torch.Tensor:
    """Concatenate every group member's `x` along `dim` (differentiable; see the module docstring).

    counts: rows per member when `dim` is 0 and they differ (the batch); None: equal shapes.
    """
    if comm.size == 1:
        return x
    if counts is not None and dim != 0:
        raise ValueError("counts apply to a gather along the batch (dim 0)")
    return _Gather.apply(x, comm, dim, tuple(counts) if counts is not None else None)


def gather_counts(n: int, comm: Comm, device: torch.device) -> tuple[int, ...]:
    """Every member's row count (one tiny all-gather), for gathers of uneven batches."""
    if comm.size == 1:
        return (n,)
    # Filled on the device: torch.tensor([n], device=...) would be a pageable host copy, which waits
    # for everything queued on the stream before the gather is even issued.
    parts = comm.all_gather(torch.full((1,), n, dtype=torch.int64, device=device))
    return tuple(int(p) for p in torch.cat(parts).cpu())


def all_reduce_sum(flat: torch.Tensor, comm: Comm) -> None:
    """In-place sum over the group (not differentiable: for gradients after backward)."""
    comm.all_reduce(flat, "sum")
