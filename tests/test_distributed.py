"""alexnet/distributed.py's parts that need no process group, by hand: the R x M mesh, each rank's place,
the transport each placement gets (or the refusal), the devices, the placement exchanged through an
in-process store, the group of one, and the rank-0 helpers. Joining real processes: tests/test_attempts.py,
tests/test_parallel.py, tests/test_elastic.py."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from alexnet.config import ConfigError, ParallelConfig
from alexnet.distributed import (
    DistInfo,
    Placement,
    StartError,
    _first_line,
    _ranks,
    alone,
    attempt_store,
    device_for,
    exchange_placement,
    mesh_ranks,
    own_group,
    print0,
    replica_device_name,
    resolve_transport,
    slow_barrier,
    teardown,
)
from alexnet.simulate import sim_infos
from layers.sim import SimWorld


@pytest.mark.parametrize("world, model_size, model, data", [
    (1, 1, [(0,)], [(0,)]),
    (4, 1, [(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)]),
    (4, 2, [(0, 1), (2, 3)], [(0, 2), (1, 3)]),
    (6, 3, [(0, 1, 2), (3, 4, 5)], [(0, 3), (1, 4), (2, 5)]),
    (8, 4, [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 4), (1, 5), (2, 6), (3, 7)]),
    (4, 4, [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
])
def test_mesh_by_hand(world, model_size, model, data):
    assert mesh_ranks(world, model_size) == (model, data)
    for rank in range(world):
        assert own_group(rank, model) == (rank // model_size, model[rank // model_size])
        assert own_group(rank, data) == (rank % model_size, data[rank % model_size])


@pytest.mark.parametrize("world, model_size", [(6, 4), (3, 2), (4, 0)])
def test_a_world_that_does_not_split_into_model_groups_is_refused(world, model_size):
    with pytest.raises(ConfigError, match=f"{world} processes cannot form model groups of "
                                          f"parallel.model_size={model_size}"):
        mesh_ranks(world, model_size)


@pytest.mark.parametrize("rank, world, model_size, model_rank, data_rank, replicas, main, distributed", [
    (0, 1, 1, 0, 0, 1, True, False),
    (3, 4, 1, 0, 3, 4, False, True),
    (3, 4, 2, 1, 1, 2, False, True),
    (5, 6, 3, 2, 1, 2, False, True),
    (0, 8, 4, 0, 0, 2, True, True),
])
def test_a_ranks_coordinates(rank, world, model_size, model_rank, data_rank, replicas, main, distributed):
    info = DistInfo(rank=rank, world=world, model_size=model_size)
    assert (info.model_rank, info.data_rank, info.replicas, info.is_main, info.distributed) == \
        (model_rank, data_rank, replicas, main, distributed)


CPU2, CPU2_HOSTS = Placement(("h", "h"), (None, None)), Placement(("a", "b"), (None, None))
OWN, SHARED = Placement(("h", "h"), ("GPU-1", "GPU-2")), Placement(("h", "h"), ("GPU-1", "GPU-1"))
MIXED = Placement(("h",) * 4, ("GPU-1", "GPU-1", "GPU-2", "GPU-2"))  # 4 replicas on 2 GPUs
OWN_HOSTS = Placement(("a", "b"), ("GPU-1", "GPU-2"))
SHARED_HOSTS = Placement(("a", "b"), ("GPU-1", "GPU-1"))  # two hosts, each calling its GPU the same (a clash)

# Each refusal says why and what to use instead (the whole line: the alternatives are what the user acts on).
NCCL_NEEDS = (r"^parallel.transport=nccl needs one GPU per replica \(NCCL refuses two ranks on one GPU, and has no CPU "
              r"path\); use ipc \(weights exchange\) or gloo$")
IPC_ONE_HOST = r"^parallel.transport=ipc works between replicas of one host; use nccl or gloo$"
IPC_DISTINCT = (r"^parallel.transport=ipc across distinct GPUs would open a CUDA context on every peer's GPU \(0.3-0.5 "
                r"GB each\) and copy the peers' buffers one after another; use nccl \(what auto picks when every "
                r"replica has its own GPU\) or gloo$")
# placement: {(transport, exchange): the transport, or the refusal's words}, written from DESIGN.md's
# "Transports": NCCL when every replica has its own GPU; ipc for the weights exchange when all replicas share
# one GPU or run on CPUs of one host; gloo otherwise; an explicit choice that cannot work is refused.
TRANSPORTS = {
    CPU2: {("auto", "weights"): "ipc", ("auto", "gradients"): "gloo", ("nccl", "weights"): NCCL_NEEDS,
           ("ipc", "weights"): "ipc", ("gloo", "weights"): "gloo", ("gloo", "gradients"): "gloo"},
    CPU2_HOSTS: {("auto", "weights"): "gloo", ("auto", "gradients"): "gloo", ("ipc", "weights"): IPC_ONE_HOST,
                 ("nccl", "gradients"): NCCL_NEEDS},
    OWN: {("auto", "weights"): "nccl", ("auto", "gradients"): "nccl", ("ipc", "weights"): IPC_DISTINCT,
          ("nccl", "weights"): "nccl", ("gloo", "gradients"): "gloo"},
    SHARED: {("auto", "weights"): "ipc", ("auto", "gradients"): "gloo", ("nccl", "gradients"): NCCL_NEEDS,
             ("ipc", "weights"): "ipc"},
    MIXED: {("auto", "weights"): "gloo", ("auto", "gradients"): "gloo", ("ipc", "weights"): IPC_DISTINCT,
            ("nccl", "weights"): NCCL_NEEDS},
    OWN_HOSTS: {("auto", "weights"): "nccl", ("ipc", "weights"): IPC_ONE_HOST, ("nccl", "gradients"): "nccl"},
    SHARED_HOSTS: {("auto", "weights"): "gloo", ("nccl", "weights"): NCCL_NEEDS, ("ipc", "weights"): IPC_ONE_HOST},
}


@pytest.mark.parametrize("placement, transport, exchange", [(p, t, e) for p, cases in TRANSPORTS.items()
                                                             for t, e in cases])
def test_the_transport_of_each_placement(placement, transport, exchange):
    want = TRANSPORTS[placement][(transport, exchange)]
    p = ParallelConfig(transport=transport, exchange=exchange)
    if want in ("ipc", "gloo", "nccl"):
        assert resolve_transport(p, placement) == want
    else:
        with pytest.raises(ConfigError, match=want.replace("=", "=")):
            resolve_transport(p, placement)


@pytest.mark.parametrize("placement, single_host, gpu_each, one_gpu", [
    (CPU2, True, False, False), (CPU2_HOSTS, False, False, False), (OWN, True, True, False),
    (SHARED, True, False, True), (MIXED, True, False, False), (OWN_HOSTS, False, True, False),
    (Placement(("h",), ("GPU-1",)), True, True, True), (Placement(("h", "h"), ("GPU-1", None)), True, False, False),
])
def test_placement_properties(placement, single_host, gpu_each, one_gpu):
    assert (placement.single_host, placement.gpu_each, placement.one_gpu) == (single_host, gpu_each, one_gpu)


def test_the_placement_goes_through_the_store():
    """Every rank writes its machine and GPU; each reads them all in rank order."""
    store, got = dist.HashStore(), {}
    devices = [torch.device("cpu")] * 3

    def rank_main(rank):
        got[rank] = exchange_placement(store, rank, 3, devices[rank])
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got[0] == got[1] == got[2]
    assert len(got[0].hosts) == 3 and got[0].single_host and got[0].gpus == (None, None, None)


@pytest.mark.parametrize("devices, fallback, local_rank, want", [
    (["cuda:0", "cuda:1"], "cpu", 0, "cuda:0"), (["cuda:0", "cuda:1"], "cpu", 3, "cuda:1"),
    (["cpu"], "cuda", 5, "cpu"), ([], "cpu", 2, "cpu"), ([], "auto", 0, "auto"),
])
def test_a_replicas_device_name(devices, fallback, local_rank, want):
    assert replica_device_name(devices, fallback, local_rank) == want


def test_devices_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for("cpu") == torch.device("cpu") and device_for("auto", 3) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device 'cuda:1' requested but CUDA is not available"):
        device_for("cuda:1")
    with pytest.raises(ConfigError, match=r"device 'gpu0' is not a device \(cpu, cuda, cuda:N, auto\)"):
        device_for("gpu0")


def test_devices_on_a_machine_with_two_gpus(monkeypatch):
    """The local rank's GPU for cuda and auto; an index past the GPUs is refused (no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_for("cuda", 3) == torch.device("cuda", 1) and device_for("auto", 2) == torch.device("cuda", 0)
    assert device_for("cuda") == torch.device("cuda", 0)  # local rank 0 unless told
    assert device_for("cuda:1", 0) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="device 'cuda:2': only 2 GPU"):
        device_for("cuda:2")


def test_rank_lists_in_messages():
    assert _ranks({3, 1, 2}) == "1, 2, 3"
    assert _ranks(set(range(13))) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 3 more"
    assert _first_line(RuntimeError("\n  first line\nsecond  ")) == "first line"
    assert _first_line(RuntimeError("")) == "RuntimeError"
    assert _first_line(RuntimeError("x" * 400)) == "x" * 300


def test_attempt_store_names_the_ranks_that_never_joined():
    with pytest.raises(StartError) as e:
        attempt_store(dist.HashStore(), 0, 3, 0.3)
    assert str(e.value) == ("rank 0: rank(s) 1, 2 did not join within 0.3 s (parallel.timeout): not started, or "
                            "stopped at start-up")


def test_the_group_of_one_does_nothing():
    comm = alone()
    t = torch.arange(3.0)
    comm.all_reduce(t)
    comm.broadcast(t, 0)
    comm.barrier(timeout=1)
    assert t.tolist() == [0.0, 1.0, 2.0] and comm.all_gather(t) == [t] and comm.sent == [0]
    assert comm.all_gather_object("x") == ["x"] and comm.gather_object("y") == ["y"]
    assert comm.broadcast_object("z") == "z" and comm.reduce_scatter([t]) is t
    assert (comm.rank, comm.size, comm.ranks) == (0, 1, (0,))


def test_slow_barrier_and_teardown_outside_a_distributed_run_do_nothing():
    info = DistInfo()
    slow_barrier(info, 1.0)
    teardown(info, 1.0)


def test_slow_barrier_meets_every_rank_in_the_slow_group():
    world = SimWorld(3)
    infos = sim_infos(world, 1)
    assert world.run(lambda rank: slow_barrier(infos[rank], 5.0)) == [None] * 3
    world = SimWorld(2)  # a rank that never comes: the barrier is not passed
    infos = sim_infos(world, 1)
    with pytest.raises(Exception, match="barrier of group \\(0, 1\\)"):
        world.run(lambda rank: slow_barrier(infos[rank], 5.0) if rank == 0 else None)


def test_print0_prints_on_rank_0_only_and_flushes(capsys):
    print0(DistInfo(rank=0, world=2), "a", "b", sep="-")
    print0(DistInfo(rank=1, world=2), "not me")
    assert capsys.readouterr().out == "a-b\n"

    class Sink(list):
        flushes = 0

        def write(self, text):
            self.append(text)

        def flush(self):
            Sink.flushes += 1
    sink = Sink()
    print0(DistInfo(rank=0, world=2), "x", file=sink)  # a pipe to a launcher or a log: seen at once
    assert "".join(sink) == "x\n" and Sink.flushes == 1


def test_slow_barrier_waits_for_the_others_as_long_as_it_is_told():
    """rank 0 waits `seconds` for the others at the slow group's barrier (a monitored barrier on processes)."""
    from layers.collectives import Comm

    class Recorder(Comm):
        timeouts: list = []

        def with_before(self, before):
            return self

        def barrier(self, timeout=None):
            Recorder.timeouts.append(timeout)
        _all_reduce = _all_gather = _reduce_scatter = _broadcast = all_gather_object = gather_object = None
        broadcast_object = None
    slow_barrier(DistInfo(rank=1, world=2, slow=Recorder(1, (0, 1))), 7.5)
    assert Recorder.timeouts == [7.5]


@pytest.mark.parametrize("n, suffix", [(10, ""), (11, " and 1 more")])
def test_rank_lists_are_cut_after_ten(n, suffix):
    assert _ranks(set(range(n))) == ", ".join(map(str, range(10))) + suffix


def test_a_rank_whose_rank_0_never_answers_says_what_the_store_said():
    with pytest.raises(StartError) as e:
        attempt_store(dist.HashStore(), 1, 2, timeout=0.2)
    detail = str(e.value).rsplit("is it running? (", 1)[1]
    assert detail.rstrip(")") not in ("", "None") and "timeout" in detail.lower(), str(e.value)
