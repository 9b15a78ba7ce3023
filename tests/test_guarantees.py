"""Promises of README.md and docs/DESIGN.md that no other test checked (issue 20), each against an
independent expectation: a hand computation, the file system, the wall clock, or the data itself."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest
import torch

import train
from alexnet.checkpoint import load
from alexnet.config import load_config
from alexnet.metrics import read_metrics
from alexnet.preflight import check_run
from tests import children
from tests.conftest import REPO, tiny_overrides

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

INLINE = {"data.loading": "inline"}
STEPS = 2  # per epoch in `small`: 16 training images, batch 8


@pytest.fixture(scope="module")
def small(train_data, tmp_path_factory) -> Path:
    """`train_data` cut to one training file of 16 images and one validation image: runs of a few steps."""
    root = tmp_path_factory.mktemp("small")
    shutil.copytree(train_data, root, dirs_exist_ok=True)
    meta = json.loads((root / "meta.json").read_text())
    for split, count in (("train", 16), ("val", 1)):
        keep = [f for f in meta["splits"][split]["files"] if f["name"] == "00001.h5"]
        assert keep == [{"name": "00001.h5", "count": count}]
        meta["splits"][split] = {"count": count, "files": keep}
        for other in (root / split).glob("*.h5"):
            if other.name != "00001.h5":
                other.unlink()
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def run_main(data: Path, run: Path, **extra) -> int:
    return train.main(["configs/demo.yaml", *tiny_overrides(data, run, **extra)])


# -- the loader --------------------------------------------------------------------------------------


def test_a_silent_loader_is_reported_as_a_hang(small, tmp_path, monkeypatch, capsys):
    """A loader that sends nothing for data.loader_timeout seconds: exit 1 with a line naming it and
    the key, long before the loader would have answered."""
    import data.slot_loader as sl
    release, calls = threading.Event(), []
    real_read, real_close = sl.BatchMaker.read, sl.SlotLoader.close

    def read(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # the 2nd batch never comes (a hung disk, a stuck network file system)
            release.wait(30)
        return real_read(self, *a, **k)

    def close(self):
        release.set()  # the stuck thread may go now, so that closing can join it
        real_close(self)

    monkeypatch.setattr(sl.BatchMaker, "read", read)
    monkeypatch.setattr(sl.SlotLoader, "close", close)
    start = time.monotonic()
    code = run_main(small, tmp_path / "run", **{"data.loading": "thread", "data.loader_timeout": 2,
                                                 "train.epochs": 1})
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1, err
    assert ("train.py: error: the loader thread alexnet-loader-0 sent nothing for 2 s while the trainer waited "
            "for train batch (data.loader_timeout)") in err, err
    assert took < 20  # not after the 30 s the loader would have taken
    assert "Traceback" not in err


def _corrupt_image(data: Path, name: str, row: int) -> Path:
    """Flip one byte of image `row` of train/<name> in place (the file's size and header stay valid)."""
    path = data / "train" / name
    with h5py.File(path, "r") as f:
        offset = f["images"].id.get_offset() + row * f["images"][0].nbytes
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)[0]
        f.seek(offset + 100)
        f.write(bytes([byte ^ 0xFF]))
    return path


@pytest.mark.parametrize("loading", ["inline", "process"])
def test_a_corrupt_batch_file_found_during_training_exits_2(small, tmp_path, capsys, loading):
    """Preflight passes (sizes and headers are fine); the bad image is found by the reader mid-epoch.
    Bad data is exit 2 with one line naming the file and the image, whichever loading mode read it."""
    data = tmp_path / "data"
    shutil.copytree(small, data)
    victim = _corrupt_image(data, "00001.h5", 9)  # unshuffled: read by the second step
    run = tmp_path / "run"
    code = run_main(data, run, **{"data.loading": loading, "data.shuffle": False, "train.log_every": 1})
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"train.py: error: {victim}: image 9 (" in err and "fails its xxh3_64 checksum" in err, err
    assert "Traceback" not in err
    assert [r["iter"] for r in read_metrics(run / "metrics.jsonl")] == [1]  # the first step was trained


# -- signals -----------------------------------------------------------------------------------------

SLOW_AFTER_CTRL_C = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
import alexnet.trainer as tr
from alexnet.checkpoint import CheckpointDir
slow = {slow!r}
_step, _save, _submit = tr.Trainer.train_step, CheckpointDir.save, tr.Trainer.save
def step(self, x, y):
    _step(self, x, y)
    if self.global_step == 0:
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: checkpoint after this step...
        if slow == "step":
            print("slow step", file=sys.stderr, flush=True)
            time.sleep(60)                   # ...which takes long: the user presses Ctrl-C again
            print("slow step done", file=sys.stderr, flush=True)
def save(self, *a, **k):
    if slow.startswith("checkpoint"):
        print("slow checkpoint", file=sys.stderr, flush=True)
        time.sleep(60)                       # ...on a slow disk: the user presses Ctrl-C again
        print("slow checkpoint done", file=sys.stderr, flush=True)
    return _save(self, *a, **k)
def submit(self, *a, **k):
    _submit(self, *a, **k)
    if slow == "checkpoint, Ctrl-C before the trainer waits":
        time.sleep(5)                        # the second Ctrl-C lands here, before the trainer waits
tr.Trainer.train_step, CheckpointDir.save, tr.Trainer.save = step, save, submit
import train
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("slow", ["step", "checkpoint", "checkpoint, Ctrl-C before the trainer waits"])
def test_a_second_ctrl_c_stops_at_once(small, tmp_path, slow):
    """The first Ctrl-C asks for a checkpoint; a second one while the step or the checkpoint's write
    takes long (60 s here) stops without waiting for it, exit 130, saying that no checkpoint was written.
    Waiting shows as the slow part's end ("slow ... done"), not as wall time: the run's own exit (unloading
    torch; and the 5 s that the last case sleeps before the trainer waits) took 10-14 s with 20 tasks
    runnable on 2 cores, against 60 s for the wait."""
    run = tmp_path / "run"
    args = ["configs/demo.yaml", *tiny_overrides(small, run, **INLINE)]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_AFTER_CTRL_C.format(repo=str(REPO), slow=slow), *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = children.read_until(proc, proc.stderr, lambda line: line.startswith("slow "), cpu_s=60)
        assert proc.poll() is None, "".join(seen)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, rest = children.communicate(proc, cpu_s=30)
    finally:
        proc.kill()
    waited = [x for x in ("slow step done", "slow checkpoint done") if x in rest]
    assert not waited, f"the second Ctrl-C waited {time.monotonic() - start:.0f} s for the {slow}: {rest}"
    assert proc.returncode == 130, rest
    assert "train.py: interrupted; stopped without writing a checkpoint" in rest, rest
    assert not (run / "checkpoints" / "last.pt").exists()


# -- checkpoints -------------------------------------------------------------------------------------


def test_keep_last_keeps_only_the_newest_epoch_files(small, tmp_path):
    """run.keep_last from the config reaches the run's checkpoint folder (CheckpointDir's pruning itself
    is tests/test_checkpoint.py's): the files are counted on disk."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    assert run_main(small, run, **INLINE, **{"train.epochs": 2, "run.keep_last": 1}) == 0
    assert sorted(os.listdir(ckpt)) == ["best.pt", "epoch_002.pt", "last.pt"]
    assert os.stat(ckpt / "last.pt").st_ino == os.stat(ckpt / "epoch_002.pt").st_ino
    # keep_last 0: no epoch file at all, last.pt and best.pt still there
    assert run_main(small, run, **INLINE, **{"train.epochs": 3, "run.keep_last": 0}) == 0
    assert sorted(os.listdir(ckpt)) == ["best.pt", "last.pt"]
    assert load(ckpt / "last.pt")["epoch"] == 3


def _by_name(state: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(weight, velocity) of every parameter; the optimizer's order is the weights (ndim > 1), then the
    biases, each in the model's order (alexnet/optim.py's param_groups)."""
    model, opt = state["model"], state["optimizer"]
    names = [k for k, v in model.items() if v.ndim > 1] + [k for k, v in model.items() if v.ndim == 1]
    indices = [i for group in opt["param_groups"] for i in group["params"]]
    return {name: (model[name], opt["state"][i]["velocity"]) for name, i in zip(names, indices, strict=True)}


def test_resume_takes_nesterov_from_the_config(small, tmp_path):
    """Epoch 1 without Nesterov, then one more step resumed with train.nesterov=true, momentum 0.5.

    By hand, for any gradient g' (decay included) and v1 = mu v0 - lr g':
    plain     w1 = w0 + v1
    Nesterov  w1 = w0 + mu v1 - lr g' = w0 + (1 + mu) v1 - mu v0
    """
    run, mu = tmp_path / "run", 0.5
    assert run_main(small, run, **INLINE, **{"train.epochs": 1}) == 0
    before = _by_name(load(run / "checkpoints" / "epoch_001.pt"))
    assert run_main(small, run, **INLINE, **{"train.nesterov": True, "train.momentum": mu,
                                             "train.max_steps": STEPS + 1}) == 0
    state = load(run / "checkpoints" / "last.pt")
    assert state["global_step"] == STEPS + 1
    assert all(g["nesterov"] and g["momentum"] == mu for g in state["optimizer"]["param_groups"])
    for name, (w1, v1) in _by_name(state).items():
        w0, v0 = before[name]
        assert not torch.allclose(v1, v0)
        torch.testing.assert_close(w1 - w0, (1 + mu) * v1 - mu * v0, rtol=1e-4, atol=1e-6, msg=name)


# -- the learning rate -------------------------------------------------------------------------------


def test_linear_scaling_and_warmup_by_hand(small, tmp_path, capsys):
    """lr 0.01 at lr_ref_batch 4 and batch 8: target 0.02; 1 warmup epoch of S steps from the unscaled
    0.01, so step s (0-based) trains at 0.01 + 0.01 s / S, then 0.02."""
    run, steps = tmp_path / "run", STEPS
    extra = {**INLINE, "train.lr": 0.01, "train.lr_policy": "constant", "train.lr_scaling": "linear",
             "train.lr_ref_batch": 4, "train.warmup_epochs": 1, "train.log_every": 1, "train.epochs": 2}
    assert run_main(small, run, **extra) == 0
    assert "global batch 8 (8 per replica), lr 0.02 (= 0.01 x 2, linear scaling), now 0.01" in capsys.readouterr().out
    train_records = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    assert [r["iter"] for r in train_records] == list(range(1, 2 * steps + 1))
    for r in train_records:
        s = r["iter"] - 1  # a record's lr is that of the step just taken
        want = 0.01 + 0.01 * s / steps if s < steps else 0.02
        assert r["lr"] == pytest.approx(want, rel=1e-9), r
    # an explicit warmup_start_factor is a fraction of the scaled lr: 0.25 x 0.02
    run2 = tmp_path / "run2"
    assert run_main(small, run2, **{**extra, "train.warmup_start_factor": 0.25, "train.max_steps": 2}) == 0
    lrs = [r["lr"] for r in read_metrics(run2 / "metrics.jsonl") if r["split"] == "train"]
    assert lrs == pytest.approx([0.005, 0.02 * (0.25 + 0.75 / steps)], rel=1e-9)


# -- refused before training -------------------------------------------------------------------------


def test_a_crop_larger_than_the_images_is_refused_naming_both(small, tmp_path, capsys):
    size = json.loads((small / "meta.json").read_text())["image_size"]
    run = tmp_path / "run"
    assert run_main(small, run, **{"data.crop": size + 1}) == 2
    err = capsys.readouterr().err
    assert f"train.py: error: data.crop={size + 1} is larger than the images of {small} ({size}x{size})" in err
    assert not run.exists() or not (run / "checkpoints").exists()
    check_run(load_config("configs/demo.yaml", tiny_overrides(small, run, **{"data.crop": size})), 1)  # fits


# -- TensorBoard -------------------------------------------------------------------------------------


def test_tensorboard_events_hold_the_scalars(small, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, steps = tmp_path / "run", STEPS
    assert run_main(small, run, **INLINE, **{"run.tensorboard": True, "train.epochs": 1,
                                                  "train.lr_policy": "constant"}) == 0
    assert list((run / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    keys = ("loss", "top1_err", "top5_err", "lr", "img_per_s")
    assert set(events.Tags()["scalars"]) == {f"{s}/{k}" for s in ("train", "val") for k in keys}
    logged = sorted({*range(2, steps + 1, 2), steps})  # log_every 2 and the epoch's last step
    assert [e.step for e in events.Scalars("train/lr")] == logged
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([0.01] * len(logged))
    assert [e.step for e in events.Scalars("val/top1_err")] == [steps]
    records = {(r["split"], r["iter"]): r for r in read_metrics(run / "metrics.jsonl")}
    for split in ("train", "val"):
        for e in events.Scalars(f"{split}/loss"):
            assert e.value == pytest.approx(records[split, e.step]["loss"], rel=1e-6)
