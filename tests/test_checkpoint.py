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

SLOW_DISK = """
import sys, time
sys.path.insert(0, {repo!r})
import alexnet.checkpoint as ck
_save = ck.save_atomic
def slow_save(obj, path):
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
    with pytest.raises(CheckpointError, match="writing a checkpoint failed: OSError.*No space left"):
        writer.wait()
    writer.wait()  # reported once


def test_failed_checkpoint_write_stops_the_run(train_data, tmp_path, monkeypatch, capsys):
    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ck, "save_atomic", full_disk)
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, tmp_path / "run")]) == 1
    assert "writing a checkpoint failed" in capsys.readouterr().err


def test_slow_checkpoint_write_does_not_trip_the_collective_timeout(train_data, tmp_path):
    """Rank 0 writes for 3 x parallel.timeout; the others train on, then wait at the long-timeout barrier."""
    hook = tmp_path / "hook"
    hook.mkdir()
    from tests.conftest import REPO
    (hook / "sitecustomize.py").write_text(SLOW_DISK.format(repo=str(REPO), delay=12))
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = {**DETERMINISTIC, "train.batch_size": 8, "parallel.replicas": 2, "parallel.exchange": "gradients",
              "train.epochs": 3, "train.log_every": 1}
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, ref, **common), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{
        **common, "parallel.timeout": 4}), timeout=300, env={"PYTHONPATH": str(hook)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert rel_diff(run, ref) == 0 and load(run / "checkpoints" / "last.pt")["epoch"] == 3
