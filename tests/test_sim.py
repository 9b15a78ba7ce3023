"""The rank simulator (layers/sim.py) and the Comm interface: every collective against numpy by hand over
generated groups and scripts (Hypothesis), the same script on real gloo processes, and what the simulator
must refuse (a collective entered by some members only, members that disagree, a failed member) instead of
hanging."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alexnet.simulate import sim_infos
from layers.sim import SimError, SimWorld
from tests.conftest import examples
from tests.ranks import REAL_GROUP, members

KINDS = ("sum", "max", "min", "all_gather", "reduce_scatter", "broadcast", "all_gather_object", "gather_object",
         "broadcast_object", "barrier")


def _inputs(seed: int, rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Member `rank`'s tensor for step `step` of a script: small integers (float64), so sums are exact."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    return torch.randint(-50, 50, shape, generator=g).double()


def _play(comm, script: list[tuple], seed: int) -> list:
    """Run `script` (kind, shape, root) on `comm`; what this member got from each step."""
    got = []
    for step, (kind, shape, root) in enumerate(script):
        root = root % comm.size
        x = _inputs(seed, comm.rank, step, shape)
        if kind in ("sum", "max", "min"):
            comm.all_reduce(x, kind)
            got.append(x)
        elif kind == "all_gather":
            got.append(torch.stack(comm.all_gather(x)))
        elif kind == "reduce_scatter":
            got.append(comm.reduce_scatter([_inputs(seed, comm.rank, step, shape) + k for k in range(comm.size)]))
        elif kind == "broadcast":
            comm.broadcast(x, src=root)
            got.append(x)
        elif kind == "all_gather_object":
            got.append(comm.all_gather_object({"rank": comm.rank, "step": step}))
        elif kind == "gather_object":
            got.append(comm.gather_object([comm.rank, step], dst=root))
        elif kind == "broadcast_object":
            got.append(comm.broadcast_object(f"from {comm.rank}", src=root))
        else:
            comm.barrier()
            got.append(None)
    return got


def _by_hand(size: int, rank: int, script: list[tuple], seed: int) -> list:
    """What member `rank` of `size` must get from each step, computed with numpy from the inputs alone."""
    want = []
    for step, (kind, shape, root) in enumerate(script):
        root = root % size
        xs = np.stack([_inputs(seed, r, step, shape).numpy() for r in range(size)])
        if kind in ("sum", "max", "min"):
            want.append(getattr(np, kind)(xs, axis=0))
        elif kind == "all_gather":
            want.append(xs)
        elif kind == "reduce_scatter":
            want.append(xs.sum(axis=0) + size * rank)  # every member's chunk `rank` is its input + rank
        elif kind == "broadcast":
            want.append(xs[root])
        elif kind == "all_gather_object":
            want.append([{"rank": r, "step": step} for r in range(size)])
        elif kind == "gather_object":
            want.append([[r, step] for r in range(size)] if rank == root else None)
        elif kind == "broadcast_object":
            want.append(f"from {root}")
        else:
            want.append(None)
    return want


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        if isinstance(g, torch.Tensor):
            np.testing.assert_array_equal(g.numpy(), w)
        else:
            assert g == w


steps = st.tuples(st.sampled_from(KINDS), st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
                  st.integers(0, 7))


@settings(max_examples=examples(60), deadline=None)
@given(size=st.integers(1, 4), script=st.lists(steps, max_size=8), seed=st.integers(0, 99))
def test_every_collective_against_numpy(size, script, seed):
    world = SimWorld(size)
    got = world.run(lambda rank: _play(world.comm(rank), script, seed))
    for rank in range(size):
        _same(got[rank], _by_hand(size, rank, script, seed))


SCRIPT = [("sum", (2, 3), 0), ("max", (4,), 0), ("min", (4,), 0), ("all_gather", (2, 2), 0),
          ("reduce_scatter", (3,), 0), ("broadcast", (5,), 2), ("all_gather_object", (1,), 0),
          ("gather_object", (1,), 1), ("broadcast_object", (1,), 2), ("barrier", (1,), 0)]


def _script_member(comm):
    return _play(comm, SCRIPT, 7)


@pytest.mark.parametrize("backend", ["sim", pytest.param("gloo", marks=REAL_GROUP)])
def test_one_script_on_the_simulator_and_on_gloo(backend):
    """The same collectives give the same results through torch.distributed's gloo as on the simulator
    (both against numpy by hand)."""
    got = members(backend, 3, _script_member)
    for rank in range(3):
        _same(got[rank], _by_hand(3, rank, SCRIPT, 7))


def test_bytes_sent_and_heartbeats_by_hand():
    """What each collective counts as put on the wire by a member of 4 (float32, 6 values = 24 bytes), and
    one `before` call per tensor collective (none for host messages)."""
    world = SimWorld(4)

    def member(rank):
        beats = []
        comm = world.comm(rank, before=lambda: beats.append(1))
        x = torch.ones(6)
        counts = []
        for op in (lambda: comm.all_reduce(x), lambda: comm.all_gather(x),
                   lambda: comm.reduce_scatter([x] * 4), lambda: comm.broadcast(x, src=1),
                   lambda: comm.all_gather_object(1), lambda: comm.barrier()):
            before = comm.sent[0]
            op()
            counts.append(comm.sent[0] - before)
        return counts, len(beats)

    for rank, (counts, beats) in enumerate(world.run(member)):
        # ring all-reduce 2 (n-1)/n; gather to 3 peers; gloo's reduce-scatter is an all-reduce of 4 chunks;
        # a broadcast counts on its source only
        assert counts == [2 * 3 * 24 // 4, 3 * 24, 2 * 3 * 96 // 4, 24 if rank == 1 else 0, 0, 0]
        assert beats == 4


def test_a_sum_adds_the_members_in_order_and_everyone_gets_the_same_bits():
    """float32 1e8 + 1 rounds to 1e8: members 0, 1, 2 holding 1e8, 1, -1e8 sum to 0 in member order (1
    in any order that adds 1 last), on every member, every run."""
    values = [1e8, 1.0, -1e8]

    def member(world, rank):
        t = torch.tensor([values[rank]], dtype=torch.float32)
        world.comm(rank).all_reduce(t)
        return float(t)
    for _ in range(3):
        world = SimWorld(3)
        assert world.run(lambda rank, world=world: member(world, rank)) == [0.0, 0.0, 0.0]


def test_each_rank_draws_from_its_own_generator_as_a_process_would():
    """Rank r seeds torch's global generator with r, draws, meets the others, draws again: its draws are
    those of one generator seeded r, whatever the other ranks drew meanwhile; the caller's own stream is
    left as it was."""
    world = SimWorld(3)
    torch.manual_seed(123)
    expected_after = torch.rand(2)
    torch.manual_seed(123)

    def member(rank):
        torch.manual_seed(rank)
        a = torch.rand(3)
        world.comm(rank).barrier()
        torch.rand(rank + 1)  # different amounts per rank
        world.comm(rank).all_reduce(torch.zeros(1))
        return torch.cat([a, torch.rand(2)])

    got = world.run(member)
    assert torch.equal(torch.rand(2), expected_after)
    for rank in range(3):
        g = torch.Generator().manual_seed(rank)
        a = torch.rand(3, generator=g)
        torch.rand(rank + 1, generator=g)
        assert torch.equal(got[rank], torch.cat([a, torch.rand(2, generator=g)])), rank


def test_groups_are_told_apart_by_name_and_members():
    """Two pairs of a world of 4 and a second group over the same ranks: each meets only its own members."""
    world = SimWorld(4)

    def member(rank):
        pair = world.comm(rank, (0, 1) if rank < 2 else (2, 3), name="pair")
        other = world.comm(rank, name="other")
        t = torch.tensor([float(rank)])
        pair.all_reduce(t)
        u = torch.tensor([10.0 ** rank])
        other.all_reduce(u)
        return float(t), float(u)
    assert world.run(member) == [(1.0, 1111.0), (1.0, 1111.0), (5.0, 1111.0), (5.0, 1111.0)]


def test_objects_arrive_as_copies():
    """Changing what a member received does not change what its sender holds (as between processes)."""
    world = SimWorld(2)

    def member(rank):
        mine = {"rank": rank, "t": torch.zeros(2)}
        got = world.comm(rank).all_gather_object(mine)
        got[1 - rank]["t"].add_(1)
        world.comm(rank).barrier()
        return float(mine["t"].sum())
    assert world.run(member) == [0.0, 0.0]


def test_a_collective_one_member_never_enters_is_named_not_waited_for():
    world = SimWorld(3)

    def member(rank):
        if rank != 2:
            world.comm(rank).all_reduce(torch.zeros(2))
    with pytest.raises(SimError, match=r"deadlock.*all_reduce sum of group \(0, 1, 2\) \(rank\(s\) \[2\] missing\)"):
        world.run(member)


@pytest.mark.parametrize("second", ["barrier", "shape", "dtype", "root"])
def test_members_that_disagree_are_named(second):
    world = SimWorld(2)

    def member(rank):
        comm = world.comm(rank)
        if rank == 0 or second == "root":
            comm.broadcast(torch.zeros(3), src=rank) if second == "root" else comm.all_reduce(torch.zeros(3))
        elif second == "barrier":
            comm.barrier()
        else:
            comm.all_reduce(torch.zeros(4) if second == "shape" else torch.zeros(3, dtype=torch.float64))
    with pytest.raises(SimError, match="collective 1 of group \\(0, 1\\): rank 0 called .* rank 1 called"):
        world.run(member)


def test_a_failing_member_is_raised_and_its_peers_do_not_hang():
    world = SimWorld(3)
    reached = []

    def member(rank):
        if rank == 1:
            raise KeyError("member 1's own error")
        world.comm(rank).barrier()
        reached.append(rank)
    with pytest.raises(KeyError, match="member 1's own error"):
        world.run(member)
    assert reached == []


def test_a_member_outside_a_failed_group_finishes():
    world = SimWorld(4)

    def member(rank):
        if rank == 0:
            raise ValueError("rank 0")
        if rank in (2, 3):
            world.comm(rank, (2, 3), name="pair").barrier()
            return "done"
        world.comm(rank, (0, 1), name="pair").barrier()
    with pytest.raises(ValueError, match="rank 0"):
        world.run(member)


@pytest.mark.parametrize("world_size, model_size", [(6, 3), (4, 2), (4, 1), (8, 4), (1, 1)])
def test_simulated_ranks_sit_in_the_mesh_as_processes_do(world_size, model_size):
    """sim_infos: model groups of consecutive ranks, data groups every M-th rank (DistInfo's docstring), and
    the same coordinates as DistInfo's properties."""
    infos = sim_infos(SimWorld(world_size), model_size)
    for rank, info in enumerate(infos):
        data_rank, model_rank = divmod(rank, model_size)
        assert (info.rank, info.world, info.data_rank, info.model_rank) == (rank, world_size, data_rank, model_rank)
        assert info.data_peers.ranks == tuple(range(model_rank, world_size, model_size))
        assert info.data_peers.rank == data_rank
        assert info.comm.ranks == tuple(range(world_size)) and info.comm.rank == rank
        if model_size == 1:
            assert info.model_peers is None
        else:
            assert info.model_peers.ranks == tuple(range(data_rank * model_size, (data_rank + 1) * model_size))
            assert info.model_peers.rank == model_rank


def test_a_broadcast_comes_from_member_0_unless_told():
    world = SimWorld(3)

    def member(rank):
        t = torch.tensor([float(rank + 7)])
        world.comm(rank).broadcast(t)
        return float(t)
    assert world.run(member) == [7.0, 7.0, 7.0]


def test_a_world_runs_once_and_says_so_the_second_time():
    """Its ranks end done; a second run's threads waited for a turn that never came (the test hung)."""
    import threading
    world, raised = SimWorld(2), []
    assert world.run(lambda rank: rank * 10) == [0, 10]

    def again():
        try:
            world.run(lambda rank: rank)
        except RuntimeError as e:
            raised.append(str(e))
    second = threading.Thread(target=again, daemon=True)  # a daemon: were it to hang, the test fails, not hangs
    second.start()
    second.join(10)
    assert raised == ["this SimWorld has run: make a new one for each run"]
