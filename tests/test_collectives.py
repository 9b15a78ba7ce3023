"""layers/collectives.py: what the uneven gathers put on the stream before their collective, and the
gathers' forward and backward passes against the plain concatenation, on the rank simulator (layers/sim.py)
with both reduce-scatter routes (NCCL's native one, gloo's all-reduce), and the bytes each counts."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layers.collectives import Comm, gather, gather_counts
from layers.sim import SimWorld

HOST_DATA = ("aten.lift_fresh", "aten._to_copy", "aten.copy_")  # a tensor made from host values


class _Ops(TorchDispatchMode):
    """Records the name of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class _Recorder(Comm):
    """Member 0 of 2, whose all-gather notes the ops that ran before it and answers 3 for member 1."""

    def __init__(self, ops: _Ops):
        super().__init__(0, (0, 1))
        self.ops, self.before_gather = ops, []

    def with_before(self, before):
        return self

    def _all_gather(self, t):
        self.before_gather.extend(self.ops.names)  # what ran before the collective: the count's construction
        return [t.clone(), torch.full_like(t, 3)]

    _all_reduce = _reduce_scatter = _broadcast = all_gather_object = gather_object = broadcast_object = barrier = None


def test_count_is_made_on_the_device_not_copied_from_the_host():
    """torch.tensor([n], device=cuda) is a pageable host copy that waits for the stream, every batch."""
    with _Ops() as ops:
        comm = _Recorder(ops)
        counts = gather_counts(5, comm, torch.device("cpu"))
    assert counts == (5, 3)
    assert any(name.startswith(("aten.full", "aten.fill")) for name in comm.before_gather), comm.before_gather
    assert not [name for name in comm.before_gather if name.startswith(HOST_DATA)], comm.before_gather


# -- forward and backward against the plain concatenation, on the simulator ---------------------------------

def _run(size: int, nccl: bool, member) -> list:
    world = SimWorld(size, nccl=nccl)
    return world.run(lambda rank: member(rank, world.comm(rank)))


@pytest.mark.parametrize("nccl", [False, True], ids=["gloo-route", "nccl-route"])
@pytest.mark.parametrize("counts, features", [((2, 0, 3), 4), ((1, 1, 1), 4), ((2, 0, 3), 3)])
def test_gather_along_the_batch_and_its_gradient(counts, features, nccl):
    """Members holding 2, 0 and 3 rows (an uneven last batch) get the 5 rows in member order; each member
    weighs the gathered rows by its own W_m, so the gradient of its rows is the sum over members of their
    rows of W_m (every member used every row). 3 features: as many as the largest count of rows."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, features, generator=gen, dtype=torch.float64) for n in counts]
    ws = [torch.randn(sum(counts), features, generator=gen, dtype=torch.float64) for _ in counts]

    def member(rank, comm):
        x = xs[rank].clone().requires_grad_(True)
        y = gather(x, comm, 0, counts if len(set(counts)) > 1 else None)
        (y * ws[rank]).sum().backward()
        return y.detach(), x.grad, comm.sent[0]

    got = _run(3, nccl, member)
    whole, total = torch.cat(xs), sum(ws)
    starts = [sum(counts[:r]) for r in range(3)]
    rows = max(counts)  # the transfer pads every member to the largest count
    for rank, (y, grad, sent) in enumerate(got):
        torch.testing.assert_close(y, whole, rtol=0, atol=0)
        torch.testing.assert_close(grad, total[starts[rank]:starts[rank] + counts[rank]])
        # by hand: the forward all-gather sends its rows to 2 peers; the backward sends its gradient chunk
        # to 2 peers (NCCL's reduce-scatter), or 2 x (2/3) of all 3 chunks (gloo's all-reduce); 8 bytes a value
        forward = rows * features * 8 * 2
        backward = rows * features * 8 * 2 if nccl else 2 * 3 * rows * features * 8 * 2 // 3
        assert sent == forward + backward, (rank, sent)


@pytest.mark.parametrize("nccl", [False, True], ids=["gloo-route", "nccl-route"])
def test_gather_along_the_channels_and_its_gradient(nccl):
    """Columns concatenate their channels (dim 1): member m's channels are its own, at its place."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 3, 2, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    ws = [torch.randn(2, 9, 2, 2, generator=gen, dtype=torch.float64) for _ in range(3)]

    def member(rank, comm):
        x = xs[rank].clone().requires_grad_(True)
        y = gather(x, comm, 1)
        (y * ws[rank]).sum().backward()
        return y.detach(), x.grad

    total = sum(ws)
    for rank, (y, grad) in enumerate(_run(3, nccl, member)):
        torch.testing.assert_close(y, torch.cat(xs, dim=1), rtol=0, atol=0)
        torch.testing.assert_close(grad, total[:, 3 * rank:3 * rank + 3])


def test_a_group_of_one_gathers_nothing():
    world = SimWorld(1)
    x = torch.randn(2, 3)
    y = world.run(lambda rank: gather(x, world.comm(rank), 1))[0]
    assert y is x


def test_bytes_sent_are_whole_bytes_by_hand_for_a_group_of_three():
    """A ring all-reduce sends 2 (n - 1) / n of the buffer, rounded down to whole bytes: one float32 over 3
    members is 2 x 4 x 2 // 3 = 5 bytes (not 5.33); gloo's reduce-scatter is an all-reduce of all 3 chunks
    (2 x 12 x 2 // 3 = 16); a broadcast counts at its source only, member 0 unless told."""
    world = SimWorld(3)

    def member(rank):
        comm = world.comm(rank)
        comm.all_reduce(torch.ones(1))
        reduced = comm.sent[0]
        comm.reduce_scatter([torch.ones(1) * rank for _ in range(3)])
        scattered = comm.sent[0] - reduced
        t = torch.full((2,), float(rank))
        comm.broadcast(t)
        return reduced, scattered, comm.sent[0] - reduced - scattered, t.tolist()
    for rank, (reduced, scattered, broadcast, t) in enumerate(world.run(member)):
        assert (reduced, scattered) == (5, 16) and type(reduced) is int and type(scattered) is int
        assert broadcast == (8 if rank == 0 else 0) and t == [0.0, 0.0]


def test_bad_arguments_are_refused_in_words():
    world = SimWorld(2)
    with pytest.raises(ValueError, match=r"all_reduce op must be one of \('sum', 'max', 'min'\), got 'mean'"):
        world.comm(0).all_reduce(torch.ones(1), "mean")
    with pytest.raises(ValueError, match=r"^counts apply to a gather along the batch \(dim 0\)$"):
        gather(torch.ones(1, 2), world.comm(0), 1, (1, 1))
