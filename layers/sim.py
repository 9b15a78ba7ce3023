"""The rank simulator: R ranks of one process, each a thread, run in lock step behind the Comm interface.

``SimWorld(R).run(fn)`` calls ``fn(rank)`` for every rank, each in a thread of its own, and returns their
results in rank order. Exactly one rank runs at any moment (it holds the baton) and it gives the baton up
only inside a collective that is still waiting for other members, to the next rank (in rank order) that
can run. So a run is deterministic: the same interleaving, the same results, every time, and what a rank
draws from torch's global generator is its own: the simulator keeps one generator state per rank and
swaps it in with the baton, as if each rank were a process of its own.

Collectives (:class:`SimComm`, made by :meth:`SimWorld.comm`) match by group and by order: the k-th
collective a member issues on a group meets the k-th of every other member. They check what real
backends would hang or fail on: members that disagree on the operation, a shape or a dtype raise
:class:`SimError` naming the ranks and both calls; ranks all waiting while none can run (a collective a
member never enters) raise it naming what each waits in, instead of hanging; a rank that raises makes
the members waiting for it raise too, and ``run`` raises the first rank's own exception. Results are
computed once, in member order (a sum adds member 0, then 1, ...), so every member gets bit-identical
results.

Autograd works across it: on the CPU, a backward pass runs on the thread that started it, so a gather's
backward (a reduce-scatter) is issued by its rank's thread like any other collective.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

from .collectives import Comm


class SimError(RuntimeError):
    """A collective that real processes would hang or fail on (see the module docstring)."""


class _Aborted(BaseException):
    """Raised in the ranks still waiting once the run cannot go on (not an Exception: nothing catches it)."""


class _Op:
    def __init__(self, kind: str, members: tuple[int, ...], spec: Any):
        self.kind, self.members, self.spec = kind, members, spec
        self.inputs: dict[int, Any] = {}
        self.result: Any = None
        self.done = False


class SimWorld:
    """R simulated ranks (see the module docstring). `nccl`: reduce-scatter is native (as on NCCL),
    which changes what a gather's backward counts as sent."""

    def __init__(self, size: int, nccl: bool = False):
        if size < 1:
            raise ValueError(f"a world of {size} ranks")
        self.size, self.nccl = size, nccl
        self._cv = threading.Condition()
        self._turn = 0
        self._state = ["ready"] * size          # ready | blocked | done | failed
        self._waiting: list[_Op | None] = [None] * size
        self._rng: list[torch.Tensor | None] = [None] * size
        self._ops: dict[tuple, _Op] = {}
        self._issued: dict[tuple, int] = {}     # (group key, rank) -> collectives issued on it
        self._abort: str | None = None
        self._ran = False

    def comm(self, rank: int, ranks: tuple[int, ...] | None = None, name: str = "world",
             before: Callable[[], None] | None = None) -> SimComm:
        """Global rank `rank`'s view of the group `ranks` (default: every rank). Groups are told apart by
        `name` and their members, as two torch.distributed groups of the same ranks are distinct."""
        ranks = tuple(range(self.size)) if ranks is None else tuple(ranks)
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the group {ranks}")
        return SimComm(self, (name, ranks), ranks.index(rank), ranks, before)

    # -- running the ranks ------------------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank (see the module docstring); their results in rank order. Once per world:
        its ranks end done or failed (a second run's would wait for a turn that never comes)."""
        if self._ran:
            raise RuntimeError("this SimWorld has run: make a new one for each run")
        self._ran = True
        start = torch.get_rng_state()
        self._rng = [start.clone() for _ in range(self.size)]
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            with self._cv:
                self._cv.wait_for(lambda: self._turn == rank or self._abort is not None)
                if self._abort is not None:
                    self._state[rank] = "failed"
                    return
                torch.set_rng_state(self._rng[rank])
            try:
                results[rank] = fn(rank)
                state = "done"
            except _Aborted:
                state = "failed"
            except BaseException as e:  # noqa: BLE001 - raised again by run()
                errors[rank], state = e, "failed"
            with self._cv:
                self._state[rank] = state
                self._pass_baton(rank)

        saved = torch.get_rng_state()
        threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.set_rng_state(saved)
        if errors:
            raise errors[min(errors)]
        if self._abort is not None:
            raise SimError(self._abort)
        return results

    def _pass_baton(self, rank: int) -> None:
        """Hand the baton to the next rank that can run (lock held); abort if none can but some wait."""
        self._rng[rank] = torch.get_rng_state()
        for k in range(1, self.size + 1):
            r = (rank + k) % self.size
            if self._state[r] == "ready":
                self._turn = r
                self._cv.notify_all()
                return
        waiting = [r for r in range(self.size) if self._state[r] == "blocked"]
        if waiting and self._abort is None:
            failed = [r for r in range(self.size) if self._state[r] == "failed"]
            if failed:
                self._abort = f"rank(s) {', '.join(map(str, failed))} failed while rank(s) {waiting} waited for them"
            else:
                self._abort = "deadlock: every rank waits in a collective that a member never enters: " + "; ".join(
                    f"rank {r} in {self._describe(self._waiting[r])}" for r in waiting)
        self._turn = -1
        self._cv.notify_all()

    @staticmethod
    def _describe(op: _Op | None) -> str:
        if op is None:
            return "nothing"
        missing = [m for m in op.members if m not in op.inputs]
        return f"{op.kind} of group {op.members} (rank(s) {missing} missing)"

    # -- collectives ------------------------------------------------------------------------------------

    def collective(self, key: tuple, rank: int, members: tuple[int, ...], kind: str, spec: Any, payload: Any,
                   combine: Callable[[list[Any]], Any]) -> Any:
        """Global rank `rank`'s part in its next collective on group `key`; blocks (giving up the baton)
        until every member has entered it; returns the combined result (combine(inputs in member order))."""
        with self._cv:
            if self._abort is not None:
                raise _Aborted()
            n = self._issued.get((key, rank), 0)
            self._issued[(key, rank)] = n + 1
            op = self._ops.setdefault((key, n), _Op(kind, members, spec))
            if (op.kind, op.spec) != (kind, spec):
                first = min(op.inputs)
                self._abort = (f"collective {n + 1} of group {members}: rank {first} called {op.kind} {op.spec}, "
                               f"rank {rank} called {kind} {spec}")
                self._cv.notify_all()
                raise SimError(self._abort)
            op.inputs[rank] = payload
            if len(op.inputs) == len(members):
                op.result = combine([op.inputs[m] for m in members])
                op.done = True
                del self._ops[(key, n)]
                for m in members:
                    if self._state[m] == "blocked" and self._waiting[m] is op:
                        self._state[m], self._waiting[m] = "ready", None
                return op.result
            self._state[rank], self._waiting[rank] = "blocked", op
            self._pass_baton(rank)
            self._cv.wait_for(lambda: (self._turn == rank and op.done) or self._abort is not None)
            if self._abort is not None and not (self._turn == rank and op.done):
                raise _Aborted()
            torch.set_rng_state(self._rng[rank])
            return op.result


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc.add_(t)
    return acc


_REDUCE = {"sum": _sum,
           "max": lambda ts: torch.stack(ts).amax(0),
           "min": lambda ts: torch.stack(ts).amin(0)}


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), str(t.dtype)


class SimComm(Comm):
    """A group of a :class:`SimWorld` seen from one member."""

    def __init__(self, world: SimWorld, key: tuple, rank: int, ranks: tuple[int, ...],
                 before: Callable[[], None] | None = None):
        super().__init__(rank, ranks, before)
        self.world, self.key = world, key

    def with_before(self, before: Callable[[], None] | None) -> SimComm:
        return SimComm(self.world, self.key, self.rank, self.ranks, before)

    @property
    def nccl(self) -> bool:
        return self.world.nccl

    def _meet(self, kind: str, spec: Any, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        return self.world.collective(self.key, self.ranks[self.rank], self.ranks, kind, spec, payload, combine)

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        t.copy_(self._meet(f"all_reduce {op}", _spec(t), t.detach().clone(), _REDUCE[op]))

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = self._meet("all_gather", _spec(t), t.detach().clone(), list)
        return [p.clone() for p in parts]

    def _reduce_scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        spec = tuple(_spec(p) for p in parts)
        sums = self._meet("reduce_scatter", spec, [p.detach().clone() for p in parts],
                          lambda inputs: [_sum([chunks[i] for chunks in inputs]) for i in range(len(inputs))])
        return sums[self.rank].clone()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        got = self._meet("broadcast", (_spec(t), src), t.detach().clone() if self.rank == src else None,
                         lambda inputs: inputs[src])
        t.copy_(got)

    # Objects are copied as they are sent, as pickling them to another process would.
    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self._meet("all_gather_object", None, copy.deepcopy(obj), list))

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        got = self._meet("gather_object", dst, copy.deepcopy(obj), list)
        return list(got) if self.rank == dst else None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        got = self._meet("broadcast_object", src, copy.deepcopy(obj) if self.rank == src else None,
                         lambda inputs: inputs[src])
        return copy.deepcopy(got)

    def barrier(self, timeout: float | None = None) -> None:
        self._meet("barrier", None, None, lambda inputs: None)
