"""The parallel loader: identical batches in every mode, slot protocol, failure and lifecycle."""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from alexnet.metrics import read_metrics
from data.batchfile import BatchFileError
from data.loader import InlineLoader, LoaderSpec
from data.procs import child_pids
from data.slot_loader import LoaderError, SlotLoader
from tests import children
from tests.conftest import REPO, tiny_overrides
from tests.test_train import assert_same_weights, stable

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]  # the CPU test and its CUDA twin


def spec_for(root, **kw) -> LoaderSpec:
    base = {"root": str(root), "batch_size": 8, "val_batch_size": 5, "crop": 67, "seed": 3}
    base.update(kw)
    return LoaderSpec(**base)


def collect(loader, split, epoch, start=0):
    return [(b.step, b.x.clone(), b.y.clone()) for b in loader.batches(split, epoch, start)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["thread", "process", "process, spawned"])
def test_same_batches_as_inline(train_data, mode, device):
    """A loader process is forked on the CPU and spawned for a GPU (CUDA cannot fork); spawned on the CPU too,
    it is the GPU's way of starting, the CPU twin of it."""
    spec = spec_for(train_data, channels_last=mode == "thread", device=device)
    spawned = mode.endswith("spawned")
    inline, slot = InlineLoader(spec), SlotLoader(spec, mode.split(",")[0], k=2, start="spawn" if spawned else None)
    if mode != "thread":
        started = "spawn" if spawned or device.startswith("cuda") else "fork"
        assert type(slot.worker).__name__ == {"spawn": "SpawnProcess", "fork": "ForkProcess"}[started]
    try:
        for split, epoch, start in (("train", 0, 0), ("val", 0, 0), ("train", 1, 2), ("train", 1, 0)):
            want, got = collect(inline, split, epoch, start), collect(slot, split, epoch, start)
            assert [w[0] for w in want] == [g[0] for g in got] and want
            for (_, wx, wy), (_, gx, gy) in zip(want, got):
                assert gx.device == torch.device(device) and torch.equal(wx, gx) and torch.equal(wy, gy)
    finally:
        slot.close()


def test_slots_hold_val_batches_larger_than_train_ones_and_empty_ones_are_kept_when_asked(train_data):
    """16 validation images: in batches of 12 (larger than the training batch of 8), 12 then 4 rows, as
    inline; as rank 7 of 8 with batches of 3 (one step of 24), no row: a batch of 0 rows where keep_empty
    asks for it (every member of an fc model group takes part in every step), none otherwise."""
    big = spec_for(train_data, val_batch_size=12)
    inline, slot = InlineLoader(big), SlotLoader(big, "thread", k=2)
    try:
        want, got = collect(inline, "val", 0), collect(slot, "val", 0)
    finally:
        slot.close()
    assert [len(y) for _, _, y in got] == [12, 4]
    for (ws, wx, wy), (gs, gx, gy) in zip(want, got, strict=True):
        assert ws == gs and torch.equal(wx, gx) and torch.equal(wy, gy)
    for keep in (True, False):
        spec = spec_for(train_data, val_batch_size=3, rank=7, world=8, keep_empty=keep, splits=("val",))
        slot = SlotLoader(spec, "thread", k=2)
        try:
            steps = [(b.step, b.n) for b in slot.batches("val", 0)]
        finally:
            slot.close()
        assert steps == ([(0, 0)] if keep else [])
        assert [(b.step, b.n) for b in InlineLoader(spec).batches("val", 0)] == steps


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_stopping_early_then_a_new_job(train_data, mode):
    loader = SlotLoader(spec_for(train_data), mode, k=3)
    try:
        first = next(iter(loader.batches("train", 0)))  # the consumer leaves after one batch
        assert first.step == 0
        it = loader.batches("train", 0, 4)
        assert next(it).step == 4
        it.close()
        assert [b.step for b in loader.batches("val", 0)] == list(range(loader.steps("val")))
    finally:
        loader.close()
    assert not loader.worker.is_alive()


def test_close_orders_the_trainer_stream_after_the_loader_thread(train_data):
    """A thread writes the trainer's slots on its own stream: once close() returns, the trainer may free
    and reuse that memory, so its stream must first wait for the loader's (issue 14; CUDA twin in
    tests/test_gpu.py)."""
    loader = SlotLoader(spec_for(train_data), "thread", k=2)
    waits = []

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def wait_stream(self, other) -> None:
            waits.append((self.name, other.name, loader.worker.is_alive()))

    loader.home_stream, loader.loader_stream = Stream("trainer"), Stream("loader")
    loader.close()
    assert waits == [("trainer", "loader", False)]  # after the thread is gone: it queues nothing later


def test_a_quitting_loader_finishes_its_stream_first(train_data):
    """A loader process's pending writes into the trainer's slots must not outlive its join."""
    from data.slot_loader import _Worker, allocate_slots
    spec, events = spec_for(train_data), []

    class Stream:
        def synchronize(self) -> None:
            events.append("synchronize")

    class Conn:
        def recv(self):
            events.append("quit")
            return ("quit",)

    _Worker(spec, allocate_slots(spec, 2, shared=False), None, None, Conn(), Stream()).serve()
    assert events == ["quit", "synchronize"]


def test_a_bad_batch_file_is_the_readers_error_not_a_loader_failure(train_data, tmp_path):
    """The loader process passes the reader's BatchFileError on (bad data: train.py exits 2 naming the
    file), not a LoaderError with the loader's traceback (a failure: exit 1)."""
    root = tmp_path / "data"
    shutil.copytree(train_data, root)
    victim = root / "train" / "00001.h5"
    victim.write_bytes(victim.read_bytes()[:2000])
    loader = SlotLoader(spec_for(root, shuffle=False), "process", k=2)
    try:
        with pytest.raises(BatchFileError) as err:
            collections.deque(loader.batches("train", 0), maxlen=0)  # consume every batch
        assert err.value.path == str(victim)
        assert str(err.value).startswith(f"{victim}: corrupt or truncated batch file (") and "Traceback" not in str(
            err.value)
    finally:
        loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_gets_an_error_when_the_loader_is_killed(train_data, device):
    loader = SlotLoader(spec_for(train_data, device=device), "process", k=2)
    try:
        it = loader.batches("train", 0)
        next(it)
        os.kill(loader.worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(LoaderError, match=r"killed by signal 9"):
            collections.deque(it, maxlen=0)
        assert time.monotonic() - start < 10
    finally:
        loader.close()


@pytest.fixture(scope="module")
def inline_run(train_data, tmp_path_factory):
    """The reference of the loading modes: a tiny run with data.loading=inline."""
    ref = tmp_path_factory.mktemp("inline")
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, ref, **{"data.loading": "inline"})]) == 0
    return ref


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_training_identical_in_every_mode(train_data, tmp_path, inline_run, mode):
    ref, run = inline_run, tmp_path / mode
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **{"data.loading": mode})]) == 0
    assert_same_weights(ref / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    assert stable(read_metrics(ref / "metrics.jsonl")) == stable(read_metrics(run / "metrics.jsonl"))


def _start_training(train_data, run, *extra) -> subprocess.Popen:
    args = tiny_overrides(train_data, run, **{"train.epochs": 50, "data.loading": "process"})
    return subprocess.Popen([sys.executable, "train.py", "configs/demo.yaml", *args, *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_loader(proc: subprocess.Popen, run) -> int:
    """The loader's pid, once training is under way (metrics written)."""
    def loader() -> int:
        kids = [p for p in child_pids(proc.pid) if "resource_tracker" not in _cmdline(p)]
        return kids[0] if kids and (run / "metrics.jsonl").exists() else 0
    return children.wait_until(loader, proc, cpu_s=60, what="training did not start")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True  # a zombie holds no memory; its parent is gone or will reap it
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_killed_loader_ends_the_run(train_data, tmp_path):
    proc = _start_training(train_data, tmp_path / "run")
    loader = _wait_for_loader(proc, tmp_path / "run")
    os.kill(loader, signal.SIGKILL)
    start = time.monotonic()
    _, err = children.communicate(proc, cpu_s=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, err
    assert "loader process alexnet-loader-0" in err and f"pid {loader}" in err and "signal 9" in err


def test_killed_trainer_leaves_no_loader(train_data, tmp_path):
    proc = _start_training(train_data, tmp_path / "run")
    loader = _wait_for_loader(proc, tmp_path / "run")
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(loader, 15), f"loader {loader} outlived its trainer"
    proc.communicate()


def test_sigint_stops_both_cleanly(train_data, tmp_path):
    run = tmp_path / "run"
    proc = _start_training(train_data, run)
    loader = _wait_for_loader(proc, run)
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
    out, err = children.communicate(proc, cpu_s=60)
    assert proc.returncode == 130, err
    assert "checkpoint at epoch" in out and (run / "checkpoints" / "last.pt").exists()
    assert _gone(loader, 15)
