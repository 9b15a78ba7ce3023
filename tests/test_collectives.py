"""layers/collectives.py: what the uneven gathers put on the stream before their collective, and the
gathers' forward and backward passes against the plain concatenation (members simulated by threads)."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layers.collectives as collectives
from layers.collectives import Comm, gather, gather_counts

HOST_DATA = ("aten.lift_fresh", "aten._to_copy", "aten.copy_")  # a tensor made from host values


class _Ops(TorchDispatchMode):
    """Records the name of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_count_is_made_on_the_device_not_copied_from_the_host(monkeypatch):
    """torch.tensor([n], device=cuda) is a pageable host copy that waits for the stream, every batch."""
    before_gather = []

    def all_gather(parts, x, group=None):
        before_gather.extend(ops.names)  # what ran before the collective: the count's construction
        parts[0].copy_(x)
        parts[1].fill_(3)

    monkeypatch.setattr(collectives.dist, "all_gather", all_gather)
    with _Ops() as ops:
        counts = gather_counts(5, Comm(group=None, rank=0, size=2), torch.device("cpu"))
    assert counts == (5, 3)
    assert any(name.startswith(("aten.full", "aten.fill")) for name in before_gather), before_gather
    assert not [name for name in before_gather if name.startswith(HOST_DATA)], before_gather


# -- forward and backward against the plain concatenation, members simulated by threads -----------------

class _ThreadGroup:
    """dist.all_gather and dist.all_reduce (sum) among `size` threads of this process, each knowing its rank:
    a group's collectives with no process group at all."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots, self.local = size, threading.Barrier(size, timeout=30), [None] * size, \
            threading.local()

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = t.detach().clone()
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen

    def all_gather(self, parts, x, group=None):
        for part, got in zip(parts, self._exchange(x), strict=True):
            part.copy_(got)

    def all_reduce(self, t, group=None):
        t.copy_(torch.stack(self._exchange(t)).sum(0))

    def run(self, member) -> list:
        """member(rank, comm) in every thread; their results in rank order."""
        out, errors = [None] * self.size, []

        def body(rank):
            self.local.rank = rank
            try:
                out[rank] = member(rank, Comm(group=None, rank=rank, size=self.size))
            except BaseException as e:  # noqa: BLE001 - raised again below
                errors.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


@pytest.fixture
def group3(monkeypatch) -> _ThreadGroup:
    g = _ThreadGroup(3)
    monkeypatch.setattr(collectives.dist, "all_gather", g.all_gather)
    monkeypatch.setattr(collectives.dist, "all_reduce", g.all_reduce)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "gloo")
    return g


@pytest.mark.parametrize("counts", [(2, 0, 3), (1, 1, 1)])
def test_gather_along_the_batch_and_its_gradient(group3, counts):
    """Members holding 2, 0 and 3 rows (an uneven last batch) get the 5 rows in member order; each member
    weighs the gathered rows by its own W_m, so the gradient of its rows is the sum over members of their
    rows of W_m (every member used every row)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 4, generator=gen, dtype=torch.float64) for n in counts]
    ws = [torch.randn(sum(counts), 4, generator=gen, dtype=torch.float64) for _ in counts]

    def member(rank, comm):
        x = xs[rank].clone().requires_grad_(True)
        y = gather(x, comm, 0, counts if len(set(counts)) > 1 else None)
        (y * ws[rank]).sum().backward()
        return y.detach(), x.grad

    got = group3.run(member)
    whole, total = torch.cat(xs), sum(ws)
    starts = [sum(counts[:r]) for r in range(3)]
    for rank, (y, grad) in enumerate(got):
        torch.testing.assert_close(y, whole, rtol=0, atol=0)
        torch.testing.assert_close(grad, total[starts[rank]:starts[rank] + counts[rank]])


def test_gather_along_the_channels_and_its_gradient(group3):
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
    for rank, (y, grad) in enumerate(group3.run(member)):
        torch.testing.assert_close(y, torch.cat(xs, dim=1), rtol=0, atol=0)
        torch.testing.assert_close(grad, total[:, 3 * rank:3 * rank + 3])
