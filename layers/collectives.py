"""Collectives that autograd can differentiate: the cross-connections of model parallelism.

``gather(x, comm, dim)`` concatenates the tensors of every process of a group along `dim` (the
features of a sharded layer, the channels of a column); its backward pass gives each process the
sum, over the group, of the gradients of its own slice, since every process used the whole result.
``gather(x, comm, 0, counts)`` does the same along the batch with a different number of rows per
process (a short last validation batch): rows are padded to the largest count for the transfer.

A :class:`Comm` names the group and counts what crosses it (bytes sent per process, for the
benchmarks) and calls `before` ahead of every collective (the launcher's heartbeat).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Comm:
    """A process group, this process's rank and the group's size, and a byte counter."""

    group: object
    rank: int
    size: int
    before: Callable[[], None] | None = None
    sent: list[int] = field(default_factory=lambda: [0])  # bytes this process put on the wire

    def arrive(self) -> None:
        if self.before is not None:
            self.before()

    @property
    def nccl(self) -> bool:
        return dist.get_backend(self.group) == "nccl"


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad]).contiguous()


def _all_gather(x: torch.Tensor, comm: Comm) -> list[torch.Tensor]:
    comm.arrive()
    parts = [torch.empty_like(x) for _ in range(comm.size)]
    dist.all_gather(parts, x, group=comm.group)
    comm.sent[0] += x.numel() * x.element_size() * (comm.size - 1)
    return parts


def _reduce_own(parts: list[torch.Tensor], comm: Comm) -> torch.Tensor:
    """Σ over the group of every process's `parts[comm.rank]` (parts: one equal-shape chunk per rank)."""
    comm.arrive()
    if comm.nccl:
        out = torch.empty_like(parts[comm.rank])
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=comm.group)
        comm.sent[0] += out.numel() * out.element_size() * (comm.size - 1)
        return out
    # gloo has no reduce-scatter in every supported torch: reduce everything, keep our chunk.
    flat = torch.stack(parts).contiguous()
    dist.all_reduce(flat, group=comm.group)
    comm.sent[0] += 2 * flat.numel() * flat.element_size() * (comm.size - 1) // comm.size
    return flat[comm.rank]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int, counts: tuple[int, ...] | None) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.counts = comm, dim, counts
        if counts is None:
            parts = _all_gather(x.contiguous() if dim == 0 else x.movedim(dim, 0).contiguous(), comm)
            return torch.cat(parts).movedim(0, dim) if dim else torch.cat(parts)
        parts = _all_gather(_pad_rows(x, max(counts)), comm)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, dim, counts = ctx.comm, ctx.dim, ctx.counts
        if counts is None:
            g = grad.movedim(dim, 0) if dim else grad
            own = _reduce_own(list(g.chunk(comm.size)), comm)
            return (own.movedim(0, dim) if dim else own), None, None, None
        rows = max(counts)
        parts = [_pad_rows(g, rows) for g in grad.split(list(counts))]
        return _reduce_own(parts, comm)[:counts[comm.rank]], None, None, None


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
    parts = _all_gather(torch.full((1,), n, dtype=torch.int64, device=device), comm)
    return tuple(int(p) for p in torch.cat(parts).cpu())


def all_reduce_sum(flat: torch.Tensor, comm: Comm) -> None:
    """In-place sum over the group (not differentiable: for gradients after backward)."""
    if comm.size == 1:
        return
    comm.arrive()
    dist.all_reduce(flat, group=comm.group)
    comm.sent[0] += 2 * flat.numel() * flat.element_size() * (comm.size - 1) // comm.size
