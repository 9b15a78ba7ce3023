"""layers/collectives.py: what the uneven gathers put on the stream before their collective."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layers.collectives as collectives
from layers.collectives import Comm, gather_counts

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
