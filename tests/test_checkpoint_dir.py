"""alexnet/checkpoint.py's CheckpointDir: file names, last/best as links to the epoch files, keep_last
pruning, the resume candidates and their order, falling back past unreadable files."""
from __future__ import annotations

import os

import pytest
import torch

from alexnet import checkpoint
from alexnet.checkpoint import CheckpointDir, CheckpointError


def state(epoch: int, value: float = 0.0) -> dict:
    return {"epoch": epoch, "model": {"w": torch.full((2,), value)}, "optimizer": {"state": {}}}


def value_in(path) -> float:
    return float(torch.load(path, weights_only=True)["model"]["w"][0])


def same_file(a, b) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_epoch_saves_link_last_and_best_and_keep_the_newest_epochs(tmp_path):
    d = CheckpointDir(tmp_path / "ck", keep_last=2)
    assert d.last == tmp_path / "ck" / "last.pt" and d.best == tmp_path / "ck" / "best.pt"
    assert not d.exists() and d.candidates() == []
    assert d.save(state(1, 1.0), epoch_done=True, is_best=True) == d.last
    assert d.exists()
    assert names(d.root) == ["best.pt", "epoch_001.pt", "last.pt"]
    assert same_file(d.last, d.root / "epoch_001.pt") and same_file(d.best, d.last)
    d.save(state(2, 2.0), epoch_done=True, is_best=False)
    d.save(state(3, 3.0), epoch_done=True, is_best=False)
    assert names(d.root) == ["best.pt", "epoch_002.pt", "epoch_003.pt", "last.pt"]  # epoch 1 pruned
    assert same_file(d.last, d.root / "epoch_003.pt")
    assert value_in(d.best) == 1.0 and value_in(d.last) == 3.0 and value_in(d.root / "epoch_002.pt") == 2.0


def test_mid_epoch_save_replaces_last_only(tmp_path):
    d = CheckpointDir(tmp_path, keep_last=3)
    d.save(state(1, 1.0), epoch_done=True, is_best=False)
    d.save(state(1, 1.5), epoch_done=False, is_best=True)
    assert value_in(d.root / "epoch_001.pt") == 1.0  # the epoch file is not written through its link
    assert value_in(d.last) == 1.5 and same_file(d.best, d.last)
    assert not same_file(d.last, d.root / "epoch_001.pt")
    assert names(d.root) == ["best.pt", "epoch_001.pt", "last.pt"]


@pytest.mark.parametrize("keep, left", [(0, []), (1, ["epoch_012.pt"]), (5, ["epoch_009.pt", "epoch_010.pt",
                                                                            "epoch_011.pt", "epoch_012.pt"])])
def test_keep_last_counts_epoch_files_only(tmp_path, keep, left):
    d = CheckpointDir(tmp_path, keep_last=keep)
    for epoch in (9, 10, 11, 12):  # 3-digit names sort by number
        d.save(state(epoch), epoch_done=True, is_best=epoch == 9)
    assert names(tmp_path) == sorted(["best.pt", "last.pt", *left])


def test_non_finite_weights_write_nothing(tmp_path):
    d = CheckpointDir(tmp_path / "ck")
    bad = state(1)
    bad["optimizer"] = {"state": {0: {"velocity": torch.tensor([float("nan")])}}}
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.0\.velocity holds NaN"):
        d.save(bad, epoch_done=True, is_best=True)
    assert not (tmp_path / "ck").exists()
    bad = state(1)
    bad["model"]["w"][1] = float("inf")
    with pytest.raises(CheckpointError, match=r"model\.w holds NaN or inf"):
        d.save(bad, epoch_done=False, is_best=False)
    assert not (tmp_path / "ck").exists()


def test_default_keeps_three_epochs_and_folders_are_made(tmp_path):
    d = CheckpointDir(tmp_path / "run" / "checkpoints")
    for epoch in range(1, 6):
        d.save(state(epoch), epoch_done=True, is_best=False)
    assert names(d.root) == ["epoch_003.pt", "epoch_004.pt", "epoch_005.pt", "last.pt"]
    d.last.unlink()  # a missing last.pt: the epoch files are still candidates
    assert d.candidates() == [d.root / "epoch_005.pt", d.root / "epoch_004.pt", d.root / "epoch_003.pt"]


def test_a_stale_temporary_link_name_is_replaced(tmp_path):
    d = CheckpointDir(tmp_path)
    (tmp_path / f".last.pt.{os.getpid()}.tmp").write_bytes(b"left by a crash")
    d.save(state(1), epoch_done=True, is_best=False)
    assert same_file(d.last, tmp_path / "epoch_001.pt")
    assert names(tmp_path) == ["epoch_001.pt", "last.pt"]


def test_without_hard_links_last_and_best_are_copies(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError("hard links not supported")
    monkeypatch.setattr(os, "link", no_links)
    d = CheckpointDir(tmp_path)
    d.save(state(4, 4.0), epoch_done=True, is_best=True)
    assert not same_file(d.last, tmp_path / "epoch_004.pt")
    assert value_in(d.last) == 4.0 and value_in(d.best) == 4.0
    assert names(tmp_path) == ["best.pt", "epoch_004.pt", "last.pt"]


def test_candidates_newest_first_and_links_listed_once(tmp_path):
    d = CheckpointDir(tmp_path, keep_last=5)
    for epoch in (1, 2, 3):
        d.save(state(epoch), epoch_done=True, is_best=epoch == 1)
    d.save(state(3, 3.5), epoch_done=False, is_best=False)  # last.pt is its own file now
    (tmp_path / "epoch_x.pt").write_bytes(b"not an epoch file")
    assert d.candidates() == [d.last, tmp_path / "epoch_003.pt", tmp_path / "epoch_002.pt",
                              tmp_path / "epoch_001.pt"]  # best.pt is epoch_001.pt: listed once
    os.unlink(tmp_path / "epoch_001.pt")
    assert d.candidates()[-1] == d.best


def test_load_newest_skips_unreadable_files_and_says_so(tmp_path):
    d = CheckpointDir(tmp_path, keep_last=5)
    for epoch in (1, 2):
        d.save(state(epoch, float(epoch)), epoch_done=True, is_best=False)
    d.save(state(2, 2.5), epoch_done=False, is_best=False)
    d.last.write_bytes(b"truncated")
    (tmp_path / "epoch_002.pt").write_bytes(b"")
    warnings = []
    got, path = d.load_newest(warn=warnings.append)
    assert path == tmp_path / "epoch_001.pt" and got["model"]["w"][0] == 1.0
    assert len(warnings) == 2 and all(w.startswith("warning: ") for w in warnings)
    assert str(d.last) in warnings[0] and str(tmp_path / "epoch_002.pt") in warnings[1]
    assert all(w.endswith(f"; resuming from {path} instead") for w in warnings)


def test_load_newest_with_nothing_loadable_names_every_file(tmp_path):
    d = CheckpointDir(tmp_path)
    d.last.write_bytes(b"bad")
    d.best.write_bytes(b"worse")
    with pytest.raises(CheckpointError) as e:
        d.load_newest(warn=pytest.fail)
    msg = str(e.value)
    assert msg.startswith(f"no checkpoint of {tmp_path} can be loaded: {d.last}: cannot be loaded")
    assert f"; {d.best}: cannot be loaded" in msg and msg.endswith("or set run.dir)")
    with pytest.raises(CheckpointError, match="can be loaded: "):
        CheckpointDir(tmp_path / "none").load_newest()


def test_epoch_file_pattern():
    assert checkpoint.EPOCH_FILE.match("epoch_007.pt") and checkpoint.EPOCH_FILE.match("epoch_1234.pt")
    assert not checkpoint.EPOCH_FILE.match("epoch_.pt") and not checkpoint.EPOCH_FILE.match("xepoch_001.pt")


@pytest.mark.parametrize("cut_after", ["epoch file", "last.pt"])
def test_complete_links_best_that_a_killed_save_left_behind(tmp_path, monkeypatch, cut_after):
    """A save writes the epoch file, links last.pt, then best.pt; killed before best.pt, the state the run
    resumes from says it was the best and complete() links it; a state that was not the best changes nothing."""
    d = CheckpointDir(tmp_path, keep_last=5)
    d.save(state(1, 1.0), epoch_done=True, is_best=True)
    real = checkpoint._link_atomic
    links = []

    def killed(src, dst):  # the save dies at its first link (last.pt) or at its second (best.pt)
        links.append(dst.name)
        if dst.name == "best.pt" or cut_after == "epoch file":
            raise KeyboardInterrupt
        real(src, dst)
    monkeypatch.setattr(checkpoint, "_link_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        d.save(state(2, 2.0), epoch_done=True, is_best=True)
    monkeypatch.setattr(checkpoint, "_link_atomic", real)
    assert value_in(tmp_path / "best.pt") == 1.0
    loaded, path = d.load_newest()
    resumed = 2 if cut_after == "last.pt" else 1
    assert value_in(path) == resumed and loaded["is_best"] is True
    said = d.complete(loaded, path)
    assert same_file(tmp_path / "best.pt", path) and value_in(tmp_path / "best.pt") == resumed
    assert said == ([] if resumed == 1 else [f"{tmp_path / 'best.pt'} now holds last.pt's state (epoch 2), the best "
                                             "so far; the save that should have linked it was cut short"])
    assert d.complete(loaded, path) == []  # done once


def test_complete_leaves_best_of_a_state_that_was_not_the_best(tmp_path):
    d = CheckpointDir(tmp_path)
    d.save(state(1, 1.0), epoch_done=True, is_best=True)
    d.save(state(2, 2.0), epoch_done=True, is_best=False)
    loaded, path = d.load_newest()
    assert loaded["is_best"] is False and d.complete(loaded, path) == []
    assert value_in(tmp_path / "best.pt") == 1.0
    assert d.complete({"epoch": 2}, path) == []  # a checkpoint older than is_best: nothing to go by


def test_complete_links_a_missing_best(tmp_path):
    """best.pt gone (deleted, or never linked) and the resumed state the best: complete() links it."""
    d = CheckpointDir(tmp_path)
    d.save(state(1, 1.0), epoch_done=True, is_best=True)
    (tmp_path / "best.pt").unlink()
    loaded, path = d.load_newest()
    assert d.complete(loaded, path) and same_file(tmp_path / "best.pt", path)


def test_a_legacy_format_file_loads_when_mapping_is_asked_for(tmp_path):
    """torch's legacy (non-zip) format cannot be memory-mapped: load(mmap=True) reads it the plain way."""
    import torch

    from alexnet.checkpoint import load
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(6.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load(path, mmap=True)["w"], torch.arange(6.0))
