"""Joining the other processes: each attempt of a job gets a store namespace of its own, whatever an earlier
attempt left in the shared store; a rank that never comes is named; a start-up that hangs is cut short."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch.distributed as dist

from alexnet.distributed import StartError, attempt_store
from tests import children
from tests.conftest import REPO


def attempt(store, world: int, late: dict[int, float] | None = None, timeout: float = 20) -> dict:
    """Every rank of one attempt joins (rank r after `late[r]` seconds); {rank: its store, or the error}."""
    got: dict = {}

    def rank_main(rank: int) -> None:
        time.sleep((late or {}).get(rank, 0))
        try:
            got[rank] = attempt_store(store, rank, world, timeout)
        except StartError as e:
            got[rank] = e
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_a_restart_never_reads_what_the_killed_attempt_wrote():
    store = dist.HashStore()  # the store every attempt of a torchrun job shares
    first = attempt(store, 3)
    first[0].set("gloo/address/0", "the killed worker's port")
    first[1].set("placement/1", "old")
    # The restarted rank 0 comes last: the other ranks must wait for it, not take the old answer.
    second = attempt(store, 3, late={0: 0.5})
    assert not second[1].check(["gloo/address/0"]) and not second[2].check(["placement/1"])
    second[2].set("agreed", "yes")
    assert second[0].get("agreed") == b"yes" and second[1].get("agreed") == b"yes"  # one namespace, shared
    third = attempt(store, 3, late={1: 0.3, 2: 0.6})  # and again, with the other ranks late
    third[0].set("x", "3")
    assert third[2].get("x") == b"3" and not third[1].check(["agreed"])


def test_rank_0_names_the_rank_that_never_came():
    got = {}

    def rank_0() -> None:
        try:
            attempt_store(dist.HashStore(), 0, 3, timeout=0.5)
        except StartError as e:
            got[0] = str(e)
    t = threading.Thread(target=rank_0)
    t.start()
    t.join(30)
    assert "rank(s) 1, 2 did not join within 0.5 s" in got[0]


def test_a_rank_gives_up_on_a_rank_0_that_never_answers():
    with pytest.raises(StartError, match="rank 0 did not answer within 0.5 s"):
        attempt_store(dist.HashStore(), 1, 2, timeout=0.5)


@pytest.mark.processes
@pytest.mark.real_group
def test_a_start_up_that_hangs_ends_with_one_line():
    """A join stuck past its limit (as gloo's connect to a vanished peer was seen to be) ends the process."""
    code = ("import time\nfrom alexnet import distributed\n"
            "with distributed._finished_within(0.5, 'rank 3: joining the other processes'):\n    time.sleep(60)\n")
    start = time.monotonic()
    r = children.run([sys.executable, "-c", code], cwd=REPO, cpu_s=60)
    assert r.returncode == 1 and time.monotonic() - start < 30
    assert r.stderr.strip().splitlines() == [
        "train.py: error: rank 3: joining the other processes did not finish within 0.5 s (parallel.timeout + 60 s): "
        "a peer died or never came; stopping"]


def _leaver(rank: int, port: int, out: str, together: bool) -> None:
    """Rank 0 (which hosts the store) has nothing left to do; ranks 1 and 2 make a group of their own (gloo
    connects its members through the store) a moment later, as test_exchange's pair group did."""
    import os

    import torch

    from alexnet.distributed import leave_together
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    if rank:
        time.sleep(1.0)  # ranks 1 and 2 come to the pair group late; rank 0, not in it, passes at once
    pair = dist.new_group([1, 2])
    if rank:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=pair)
        torch.save(x, f"{out}/pair{rank}.pt")
    if together:
        leave_together(rank, 3)
    else:  # what the suite's fixtures did: destroy and go
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.processes
@pytest.mark.real_group
def test_the_store_host_leaves_last(tmp_path, together=True):
    """With together=False (each member destroys its group and goes, as the suite's fixtures did) ranks 1
    and 2 fail in new_group every time: seen, and kept out of the suite for its time."""
    import torch
    import torch.multiprocessing as mp

    from alexnet.launch import free_port
    ctx = mp.start_processes(_leaver, args=(free_port(), str(tmp_path), together), nprocs=3, start_method="fork",
                             join=False)
    watch, failed = children.Watch([p.pid for p in ctx.processes], "3 spawned members", cpu_s=120), ""
    try:
        while not ctx.join(timeout=children.POLL_S):
            watch.check()
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        failed = str(e)
    done = [(tmp_path / f"pair{r}.pt").exists() for r in (1, 2)]
    if together:
        assert not failed and done == [True, True] and torch.load(tmp_path / "pair1.pt").item() == 3.0
    else:  # the early leaver breaks its peers: the test can tell (the old fixtures' race, made certain)
        assert "new_group" in failed and done != [True, True]
