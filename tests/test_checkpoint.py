"""Checkpoints written in the background: the step loop and the other replicas do not wait for disks."""
from __future__ import annotations

import errno
import time

import pytest
import torch

import alexnet.checkpoint as ck
import train
from alexnet.checkpoint import BackgroundWriter, CheckpointError, load, to_host
from tests.conftest import run_script, tiny_overrides
from tests.test_parallel import DETERMINISTIC, rel_diff

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

SLOW_DISK = """
import sys, time
sys.path.insert(0, {repo!r})
import alexnet.checkpoint as ck
_save, _slowed = ck.save_atomic, []
def slow_save(obj, path):
    if not _slowed:   # the first checkpoint only: one write past the timeout is the case; more add only time
        _slowed.append(path)
        time.sleep({delay})   # a network file system on a bad day
    return _save(obj, path)
ck.save_atomic = slow_save
"""


def test_host_copy_is_detached_from_training():
    w = torch.ones(3)
    state = {"model": {"w": w}, "rng": [{"cpu": torch.zeros(2, dtype=torch.uint8)}], "epoch": 1}
    host = to_host(state)
    w.add_(1)  # training goes on while the copy is written
    assert torch.equal(host["model"]["w"], torch.ones(3)) and host["epoch"] == 1
    assert isinstance(host["rng"], list) and host["rng"][0]["cpu"].dtype == torch.uint8


def test_writer_runs_in_background_and_reports_failures():
    writer, done = BackgroundWriter(), []
    writer.submit(lambda: (time.sleep(0.5), done.append(1)))
    assert writer.busy and not done  # submit returned at once
    writer.wait()
    assert done == [1] and not writer.busy

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")
    writer.submit(fail)
    with pytest.raises(CheckpointError, match=r"writing a checkpoint failed: disk full \(no space left on device\)"):
        writer.wait()
    writer.wait()  # reported once


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped elsewhere): a disk that fills up for real."""
    import subprocess
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_during_a_save_names_the_file_and_says_disk_full(tiny_disk):
    """torch.save's own error ("unexpected pos") says neither; nothing half-written is left behind."""
    path = tiny_disk / "last.pt"
    ck.save_atomic({"w": torch.zeros(10)}, path)
    before = path.read_bytes()
    with pytest.raises(OSError) as err:
        ck.save_atomic({"w": torch.zeros(1_000_000)}, path)  # 4 MB on a 1 MB disk
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_bytes() == before and sorted(p.name for p in tiny_disk.iterdir()) == ["last.pt"]
    from data.fsutil import os_error_exit_code, os_error_message
    assert os_error_message(err.value) == f"{path}: disk full (no space left on device)"
    assert os_error_exit_code(err.value) == 1  # the machine's failure, not a bad input


def test_torch_save_error_is_traced_to_its_os_error(tmp_path, monkeypatch):
    """Where torch wraps the write's OSError in a RuntimeError, the OSError is what is raised."""
    def failing_save(obj, f):
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    monkeypatch.setattr(ck.torch, "save", failing_save)
    with pytest.raises(OSError) as err:
        ck.save_atomic({}, tmp_path / "x.pt")
    assert err.value.errno == errno.EIO and err.value.filename == str(tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


def test_non_finite_weights_are_found_and_never_saved(tmp_path):
    good = {"model": {"a.weight": torch.ones(2), "a.bias": torch.zeros(2)},
            "optimizer": {"state": {0: {"velocity": torch.ones(2)}}}, "epoch": 1}
    assert ck.first_non_finite(good) is None
    bad = {**good, "model": {"a.weight": torch.ones(2), "a.bias": torch.tensor([0.0, float("inf")])}}
    assert ck.first_non_finite(bad) == "model.a.bias"
    assert ck.first_non_finite({"x": [torch.arange(3), torch.tensor([float("nan")])]}) == "x.1"
    with pytest.raises(CheckpointError, match="model.a.bias holds NaN or inf"):
        ck.CheckpointDir(tmp_path).save(bad, epoch_done=True, is_best=True)
    assert list(tmp_path.iterdir()) == []


def test_failed_checkpoint_write_stops_the_run(train_data, tmp_path, monkeypatch, capsys):
    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ck, "save_atomic", full_disk)
    over = tiny_overrides(train_data, tmp_path / "run", **{"train.epochs": 1, "data.loading": "inline"})
    assert train.main(["configs/demo.yaml", *over]) == 1
    assert "writing a checkpoint failed" in capsys.readouterr().err


def test_slow_checkpoint_write_does_not_trip_the_collective_timeout(train_data, tmp_path):
    """Rank 0 writes its first checkpoint for 2.25 x parallel.timeout; the others train on, then wait at the
    long-timeout barrier."""
    hook = tmp_path / "hook"
    hook.mkdir()
    from tests.conftest import REPO
    (hook / "sitecustomize.py").write_text(SLOW_DISK.format(repo=str(REPO), delay=9))
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = {**DETERMINISTIC, "train.batch_size": 8, "parallel.replicas": 2, "parallel.exchange": "gradients",
              "train.epochs": 2, "train.log_every": 1}
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, ref, **common), cpu_s=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{
        **common, "parallel.timeout": 4}), cpu_s=300, env={"PYTHONPATH": str(hook)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert rel_diff(run, ref) == 0 and load(run / "checkpoints" / "last.pt")["epoch"] == 2


def _state(epoch: int, value: float) -> dict:
    return {"model": {"w": torch.full((256,), value)}, "optimizer": {}, "epoch": epoch}


def test_a_mid_epoch_save_leaves_the_epoch_file_alone(tmp_path):
    """last.pt is a hard link to epoch_001.pt; a mid-epoch save replaces last.pt by a new file, it must not
    write through the link (that would silently put the mid-epoch state into epoch_001.pt)."""
    d = ck.CheckpointDir(tmp_path, keep_last=3)
    d.save(_state(1, 1.0), epoch_done=True, is_best=True)
    epoch_file = tmp_path / "epoch_001.pt"
    before = epoch_file.read_bytes()
    d.save(_state(1, 2.0), epoch_done=False, is_best=False)
    assert epoch_file.read_bytes() == before
    assert torch.equal(load(epoch_file)["model"]["w"], torch.full((256,), 1.0))
    assert torch.equal(load(tmp_path / "last.pt")["model"]["w"], torch.full((256,), 2.0))
    assert torch.equal(load(tmp_path / "best.pt")["model"]["w"], torch.full((256,), 1.0))


def test_keep_last_keeps_the_newest_epoch_files_and_best(tmp_path):
    """keep_last=2 after 4 epochs: epoch_003 and epoch_004 remain; best.pt stays the best epoch's (2)."""
    d = ck.CheckpointDir(tmp_path, keep_last=2)
    for epoch in range(1, 5):
        d.save(_state(epoch, float(epoch)), epoch_done=True, is_best=epoch == 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "epoch_003.pt", "epoch_004.pt", "last.pt"]
    assert load(tmp_path / "best.pt")["epoch"] == 2 and load(tmp_path / "last.pt")["epoch"] == 4
    assert load(tmp_path / "epoch_003.pt")["epoch"] == 3
