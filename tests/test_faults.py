"""Faults and bad input (issue 19): one clear line and the right exit code, nothing lost, nothing wrong.

One test per kind and, where cheap, per instance: silent wrong results (non-finite weights, two runs in
one run.dir), lost work (a damaged data folder found before the first step, resuming on other data,
temporaries of dead processes), tracebacks instead of one line (read-only or full disks, Ctrl-C) and
misleading failures (checks run once before the replicas start; a replica that dies is named).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from alexnet.checkpoint import load
from alexnet.config import ConfigError, load_config
from alexnet.launch import Launcher
from alexnet.metrics import read_metrics
from alexnet.models import build_model
from alexnet.preflight import check_run
from data.batchfile import write_batch_file
from data.fsutil import exclusive_dir, remove_stale_temps
from data.layouts import DataError
from tests.conftest import load_script, run_script, tiny_overrides
from tools.faultcheck.core import restamp_mean

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

FAST = {"data.loading": "inline", "train.epochs": 1}


def run_train(data: Path, run: Path, *extra: str, **over) -> int:
    return train.main(["configs/demo.yaml", *tiny_overrides(data, run, **{**FAST, **over}), *extra])


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def data_copy(train_data, tmp_path) -> Path:
    """A private copy of the 72x72 training data, to damage."""
    return Path(shutil.copytree(train_data, tmp_path / "data"))


@pytest.fixture(scope="module")
def finished_run(train_data, tmp_path_factory) -> Path:
    """A one-epoch run (checkpoints, config.yaml, metrics), copied by the tests that resume it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert run_train(train_data, run) == 0
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")


@pytest.fixture
def mounts():
    made: list[Path] = []

    def mount(where: Path, options: str) -> Path:
        mount_tmpfs(where, options)
        made.append(where)
        return where
    yield mount
    for where in reversed(made):
        subprocess.run(["umount", "-l", str(where)], check=False)


# -- 1. silent wrong results ----------------------------------------------------------------------------


def test_evaluate_refuses_non_finite_weights_naming_the_tensor(train_data, tmp_path, capsys):
    model = build_model("alexnet", num_classes=4, width=0.125, crop=67, init="torch")
    state = model.state_dict()
    state["classifier.fc7.weight"][3, 5] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save({"model": state}, path)
    js = tmp_path / "eval.json"
    code = load_script("evaluate").main(["--data", str(train_data), "--weights", str(path), "--arch", "alexnet",
                                         "--json", str(js), "--no-progress", "--device", "cpu"])
    assert code == 2 and not js.exists()
    assert one_line(capsys.readouterr().err) == (f"evaluate.py: error: {path}: classifier.fc7.weight holds NaN or "
                                                 "inf (the first tensor that does): these weights are not usable")


def poison_after_first_step(monkeypatch):
    """The weights become NaN in the first step, while its loss is still finite (a huge lr does that)."""
    import alexnet.trainer as tr
    real = tr.Trainer.train_step

    def step(self, x, y):
        real(self, x, y)
        if self.global_step == self.step_at_start:
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")
    monkeypatch.setattr(tr.Trainer, "train_step", step)
    real_resume = tr.Trainer.resume

    def resume(self):
        real_resume(self)
        self.step_at_start = self.global_step
    monkeypatch.setattr(tr.Trainer, "resume", resume)


def test_non_finite_weights_are_never_saved_and_no_checkpoint_is_named_that_does_not_exist(
        train_data, tmp_path, monkeypatch, capsys):
    poison_after_first_step(monkeypatch)
    run = tmp_path / "run"
    assert run_train(train_data, run, "train.max_steps=1") == 1
    err = one_line(capsys.readouterr().err)
    assert err == (f"train.py: error: the weights became NaN or inf by step 1 (epoch 1, iteration 1); stopped "
                   f"without saving, and {run / 'checkpoints'} holds no checkpoint (lower train.lr, or check the data)")
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


def test_non_finite_weights_name_the_checkpoint_that_exists(run_copy, train_data, monkeypatch, capsys):
    poison_after_first_step(monkeypatch)
    last = run_copy / "checkpoints" / "last.pt"
    before = last.read_bytes()
    steps = load(last)["global_step"]
    assert run_train(train_data, run_copy, f"train.max_steps={steps + 1}", **{"train.epochs": 2}) == 1
    err = capsys.readouterr().err
    assert f"the weights became NaN or inf by step {steps + 1} (epoch 2, iteration 1); stopped without saving, so " \
           f"{last} is the last good checkpoint" in err, err
    assert last.read_bytes() == before


def test_a_second_run_into_a_locked_run_dir_exits_2_at_once(run_copy, train_data, capsys):
    config_before = (run_copy / "config.yaml").read_bytes()
    metrics_before = (run_copy / "metrics.jsonl").read_bytes()
    with exclusive_dir(run_copy, "training run"):
        start = time.monotonic()
        assert run_train(train_data, run_copy, **{"train.epochs": 2}) == 2
        took = time.monotonic() - start
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"train.py: error: {run_copy} is in use by another training run (pid {os.getpid()} on "
                          f"{socket.gethostname()}; lock {run_copy / '.lock'})"), err
    assert took < 5, took
    assert (run_copy / "config.yaml").read_bytes() == config_before
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics_before


FAKE_REPLICA = """
import os, signal, struct, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
if mode == "exit":  # with the code given for this rank; rank 1 ends after rank 0
    time.sleep(0.3 * rank)
    sys.exit(int(sys.argv[2 + rank]))
def send(count, kind):  # the heartbeat record: rank, collectives entered, kind (0 progress, 1 alive, 2 gave up)
    os.write(int(os.environ["ALEXNET_HEARTBEAT_FD"]), struct.pack("<iqb", rank, count, kind))
if mode == "lock":
    # one write per line: print() may split it, and two replicas share the stdout pipe
    target = os.readlink(f"/proc/self/fd/{os.environ['ALEXNET_RUN_LOCK_FD']}")
    os.write(1, f"lock fd -> {target}\\n".encode())
    sys.exit(0)
if rank == 2:
    send(3, 0)
    time.sleep(0.5)
    if mode == "error":
        print("rank 2: its own error", file=sys.stderr, flush=True)
        sys.exit(1)
    if mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    send(3, 2)  # gave up: a collective failed
    sys.exit(1)
if mode == "gave_up":
    send(3 if rank == 0 else 1, 0)  # rank 1 stays behind: it is the one the others wait for
time.sleep(60)  # ranks 0 and 1 are still starting (no heartbeat yet): as with 100 replicas on 2 cores
"""


@pytest.mark.parametrize("mode, expect", [
    ("error", "replica rank 2 (pid {pid}) exited with code 1 (its own error, printed above); stopping the other"),
    ("killed", "replica rank 2 (pid {pid}) was killed by signal 9 (SIGKILL; if no one sent it, the kernel's "
               "out-of-memory killer did"),
    ("gave_up", "replica rank 1 stopped making progress (it never reached collective operation 2, where the "
                "others waited); replica rank 2 then gave up waiting"),
], ids=["own-error", "killed", "gave-up"])
def test_a_replica_that_fails_by_itself_is_named_not_its_slower_peers(tmp_path, capfd, mode, expect):
    """The launcher named the ranks still starting ("stopped making progress") for a replica that died
    of its own error or was killed (the out-of-memory killer, with 100 replicas on 2 cores)."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_REPLICA)
    launcher = Launcher(str(script), [mode], 3, timeout=30)
    start = time.monotonic()
    assert launcher.run() == 1
    assert time.monotonic() - start < 10
    err = capfd.readouterr().err
    assert expect.format(pid=launcher.procs[2].pid) in err, err
    if mode != "gave_up":
        assert "stopped making progress" not in err


def test_the_replicas_inherit_the_run_dir_lock(tmp_path, capfd):
    script = tmp_path / "fake.py"
    script.write_text(FAKE_REPLICA)
    with exclusive_dir(tmp_path / "run", "training run") as fd:
        assert Launcher(str(script), ["lock"], 2, timeout=30, lock_fd=fd).run() == 0
    out = capfd.readouterr().out
    assert out.count(f"lock fd -> {tmp_path / 'run' / '.lock'}") == 2, out


@pytest.mark.parametrize("codes, expect", [
    ((0, 0), 0), ((130, 130), 130), ((0, 130), 130), ((143, 0), 143), ((0, 3), 1),
], ids=["done", "ctrl-c", "one-interrupted", "one-terminated", "one-failed"])
def test_the_launcher_exits_with_the_replicas_code(tmp_path, codes, expect):
    """train.py's codes (0 done, 128+N stopped by signal N after a checkpoint, 1 failed) pass through."""
    script = tmp_path / "fake.py"
    script.write_text(FAKE_REPLICA)
    assert Launcher(str(script), ["exit", *map(str, codes)], 2, timeout=30).run() == expect


# -- 2. lost work: everything checked before the first step ------------------------------------------------


def _edit_meta(change):
    def edit(root: Path) -> None:
        meta = json.loads((root / "meta.json").read_text())
        change(meta)
        (root / "meta.json").write_text(json.dumps(meta))
    return edit


def _write(name: str, content: bytes):
    return lambda root: (root / name).write_bytes(content)


def _foreign_file(root: Path, index: int = 0) -> None:
    """Val file `index` replaced by one of 80x80 images where meta.json says 72x72 (another preprocessing's)."""
    entry = json.loads((root / "meta.json").read_text())["splits"]["val"]["files"][index]
    n = entry["count"]
    write_batch_file(root / "val" / entry["name"], np.zeros((n, 80, 80, 3), np.uint8), np.zeros(n), ["x"] * n,
                     split="val", index=index)


def _labels_past_the_classes(root: Path, split: str = "train", index: int = 1, label: int = 4) -> None:
    """A batch file of `split` whose images carry label `label` (the data has 4 classes: 0 to 3), otherwise whole:
    its images, count, split and index are those of its place."""
    from data.batchfile import open_batch_file
    entry = json.loads((root / "meta.json").read_text())["splits"][split]["files"][index]
    path = root / split / entry["name"]
    with open_batch_file(path) as f:
        images, names = np.asarray(f["images"]), [n.decode() if isinstance(n, bytes) else n for n in f["names"]]
    labels = np.zeros(len(images), np.int64)
    labels[2] = label
    write_batch_file(path, images, labels, names, split=split, index=index)


def _from_another_output(root: Path) -> None:
    """val/00000.h5 replaced by the val/00000.h5 of another preprocessing of the same images (same size, split,
    index and count: everything the file records about its place agrees; only its output differs)."""
    import h5py
    path = root / "val" / "00000.h5"
    with h5py.File(path, "r+") as f:
        f.attrs["dataset"] = "0123456789abcdef0123456789abcdef"


def _truncate(root: Path) -> None:
    path = root / "train" / "00001.h5"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


DAMAGE = {
    "no classes": (_edit_meta(lambda m: m.pop("classes")),
                   "meta.json: classes must be a list of class names, got None"),
    "a JSON list": (_write("meta.json", b"[1, 2]"), "meta.json: the top level must be a JSON object, got [1, 2]"),
    "binary bytes": (_write("meta.json", b'{"classes": "\xff\xfe"}'), "meta.json: not UTF-8 text (byte 0xff at "
                                                                       "offset 13)"),
    "a NaN": (_write("meta.json", b'{"image_size": NaN}'), "meta.json: not valid JSON (NaN is not a JSON number"),
    "a count as text": (_edit_meta(lambda m: m["splits"]["train"]["files"][0].update(count="14")),
                        "meta.json: splits.train.files[0].count must be an integer >= 0, got '14'"),
    "counts that disagree": (_edit_meta(lambda m: m["splits"]["train"].update(count=49)),
                             "meta.json: splits.train.count is 49 but its files hold 48 images"),
    "a path as a file name": (_edit_meta(lambda m: m["splits"]["val"]["files"][0].update(name="../x.h5")),
                              "splits.val.files[0].name must be a plain file name"),
    "image size true": (_edit_meta(lambda m: m.update(image_size=True)),
                        "image_size must be an integer >= 1, got True"),
    "a missing batch file": (lambda root: (root / "train" / "00002.h5").unlink(),
                             "train/00002.h5: batch file is missing (listed in meta.json)"),
    "a truncated batch file": (_truncate, "train/00001.h5: "),
    "a foreign batch file": (_foreign_file, "val/00000.h5: images are 80x80, meta.json says 72x72"),
    "a file of another output": (_from_another_output, "val/00000.h5: belongs to another preprocessed output "
                                                       "(dataset 0123456789abcdef0123456789abcdef; its folder's "
                                                       "meta.json says "),
    "a label past the classes": (_labels_past_the_classes,
                                 "train/00001.h5: image 2 has label 4, but meta.json lists 4 classes (labels 0 to 3"),
    "a negative label": (lambda root: _labels_past_the_classes(root, "val", 0, -1),
                         "val/00000.h5: image 2 has label -1, but meta.json lists 4 classes"),
    "a mean of another shape": (lambda root: restamp_mean(root, np.zeros((64, 64, 3), np.float32)),
                                "mean.npy: float32 (64, 64, 3), expected numbers of shape (72, 72, 3)"),
    "a mean holding NaN": (lambda root: restamp_mean(root, np.full((72, 72, 3), np.nan, np.float32)),
                           "mean.npy: the mean image holds NaN or inf"),
    "the mean of another output": (lambda root: np.save(root / "mean.npy", np.full((72, 72, 3), 120, np.float32)),
                                   "mean.npy: not this output's mean image (its SHA-256 is not meta.json's "
                                   "mean_sha256)"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_data_folder_exits_2_before_any_step(data_copy, tmp_path, capsys, case):
    """Found by the checks before start (not by a loader, minutes later, as a traceback)."""
    damage, expect = DAMAGE[case]
    damage(data_copy)
    run = tmp_path / "run"
    with pytest.raises(DataError, match=re.escape(expect)):
        check_run(load_config("configs/demo.yaml", tiny_overrides(data_copy, run)), world=1)
    assert run_train(data_copy, run) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"train.py: error: {data_copy}") and expect in err, err
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_evaluate_checks_the_split_before_reading_it(data_copy, finished_run, monkeypatch, capsys):
    import alexnet.evaluation as ev
    _foreign_file(data_copy, 1)  # the second file: the first would be read (and evaluated) before it
    calls = []
    monkeypatch.setattr(ev, "predict_log_probs", lambda *a, **k: calls.append(1))
    code = load_script("evaluate").main(["--data", str(data_copy), "--weights",
                                         str(finished_run / "checkpoints" / "last.pt"), "--batch-size", "4",
                                         "--no-progress"])
    assert code == 2 and not calls  # refused before any work
    assert "val/00001.h5: images are 80x80, meta.json says 72x72" in one_line(capsys.readouterr().err)


def test_a_damaged_data_folder_is_one_line_from_the_command_line(data_copy, tmp_path):
    (data_copy / "meta.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(data_copy, tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == (f"train.py: error: {data_copy / 'meta.json'}: not UTF-8 text (byte 0x89 at offset "
                                  "0): damaged, or not a meta.json")


@pytest.fixture(scope="module")
def data_76(synth, tmp_path_factory) -> Path:
    """The same classes as `train_data`, preprocessed at 76x76."""
    from data.preprocess import Options, preprocess
    root, _ = synth
    out = tmp_path_factory.mktemp("data_76")
    preprocess(root / "train", out, root / "val", root / "val.txt", Options(size=76, per_file=16), workers=1,
               quiet=True)
    return out


def test_resume_refuses_images_of_another_size(run_copy, data_76, capsys):
    config = (run_copy / "config.yaml").read_bytes()
    assert run_train(data_76, run_copy, **{"train.epochs": 2}) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{run_copy / 'checkpoints' / 'last.pt'} was trained on 72x72 images, {data_76} holds 76x76" in err, err
    assert (run_copy / "config.yaml").read_bytes() == config and not list(run_copy.glob("config.prev-*"))


def test_resume_refuses_other_classes(run_copy, data_copy, capsys):
    _edit_meta(lambda m: m["classes"].__setitem__(2, "n09999999"))(data_copy)
    assert run_train(data_copy, run_copy, **{"train.epochs": 2}) == 2
    err = one_line(capsys.readouterr().err)
    assert (f"was trained on other classes than those of {data_copy} (first at index 2: 'n01442764' vs "
            "'n09999999')") in err, err


def test_resume_logs_every_changed_key_and_keeps_the_earlier_config(run_copy, finished_run, train_data, capsys):
    old = (run_copy / "config.yaml").read_text()
    assert run_train(train_data, run_copy, "train.lr=0.02", **{"train.epochs": 2, "train.log_every": 3}) == 0
    out = capsys.readouterr().out
    for line in ("changed on resume: train.epochs 1 -> 2", "changed on resume: train.lr 0.01 -> 0.02",
                 "changed on resume: train.log_every 2 -> 3",
                 f"changed on resume: run.dir '{finished_run}' -> '{run_copy}'"):  # a copy of the run
        assert line in out.splitlines(), out
    assert out.count("changed on resume") == 4
    assert (run_copy / "config.prev-1.yaml").read_text() == old
    assert "lr: 0.02" in (run_copy / "config.yaml").read_text()


def test_a_resumed_run_continues_the_step_count(run_copy, train_data):
    """48 training images (4 classes x 12), batch 8: 6 steps an epoch, a record every 2 steps. Epoch 2,
    resumed from epoch 1's checkpoint, logs global steps 8, 10, 12 as an uninterrupted run would."""
    assert run_train(train_data, run_copy, **{"train.epochs": 2}) == 0
    records = read_metrics(run_copy / "metrics.jsonl")
    assert [r["iter"] for r in records if r["split"] == "train"] == [2, 4, 6, 8, 10, 12]
    assert [r["iter"] for r in records if r["split"] == "val"] == [6, 12]
    assert load(run_copy / "checkpoints" / "last.pt")["global_step"] == 12

def test_temporaries_of_dead_processes_are_removed_at_start(run_copy, train_data, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ckpts = run_copy / "checkpoints"
    stale = [ckpts / f".last.pt.{dead.pid}.tmp", ckpts / f".epoch_002.pt.{dead.pid}.tmp",
             run_copy / f".config.yaml.{dead.pid}.tmp"]
    live = ckpts / f".last.pt.{os.getpid()}.tmp"  # a writer that is still alive: kept
    for path in (*stale, live):
        path.write_bytes(b"PK half a checkpoint")
    assert run_train(train_data, run_copy) == 0  # finished already: no training, only the start
    assert not any(p.exists() for p in stale) and live.exists()
    out = capsys.readouterr().out
    assert all(f"removed {p}: an unfinished write of a process that died" in out for p in stale), out


def test_a_metrics_record_cut_short_is_dropped_on_resume(run_copy, train_data):
    """A kill -9 or a full disk in the middle of a metrics.jsonl write: the resume must not choke on it."""
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"split": "train", "epoch": 2, "it')
    assert run_train(train_data, run_copy, **{"train.epochs": 2}) == 0
    records = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "val"] == [1, 2]


def test_remove_stale_temps_keeps_other_files(tmp_path):
    for name in ("last.pt", ".lock", ".x.tmp", ".a.pt.1.tmp.bak", f".b.pt.{os.getpid()}.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert remove_stale_temps(tmp_path) == []
    assert remove_stale_temps(tmp_path / "missing") == []


# -- 3. the operating system's refusals: one line ----------------------------------------------------------


def test_read_only_run_dir_exits_2(train_data, tmp_path, mounts, capsys):
    ro = mounts(tmp_path / "ro", "ro,size=1m")
    assert run_train(train_data, ro / "run") == 2
    assert one_line(capsys.readouterr().err) == f"train.py: error: {ro / 'run'}: read-only file system"


def test_a_full_run_dir_exits_1_at_start(train_data, tmp_path, mounts, capsys):
    disk = mounts(tmp_path / "disk", "size=1m")
    with open(disk / "filler", "wb") as f:  # fill it up
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    assert full.value.errno == errno.ENOSPC
    assert run_train(train_data, disk / "run") == 1
    assert one_line(capsys.readouterr().err) == f"train.py: error: {disk / 'run' / '.lock'}: disk full (no space " \
                                                "left on device)"


def test_a_disk_too_small_for_one_checkpoint_exits_1_at_start(train_data, tmp_path, mounts, capsys):
    disk = mounts(tmp_path / "disk", "size=1m")  # the tiny model's checkpoint needs 2.5 MiB
    assert run_train(train_data, disk / "run") == 1
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"train.py: error: {disk / 'run'}: disk full: a checkpoint needs 2.5 MiB, "), err


def test_disk_full_during_a_checkpoint_save_exits_1_naming_the_file(train_data, tmp_path, mounts, capsys):
    """Room for one checkpoint (2.5 MiB) but not two: the second epoch's save fails; nothing half-written."""
    disk = mounts(tmp_path / "disk", "size=4m")
    run = disk / "run"
    assert run_train(train_data, run, **{"train.epochs": 2}) == 1
    err = capsys.readouterr().err
    assert one_line(err) == f"train.py: error: writing a checkpoint failed: {run / 'checkpoints' / 'epoch_002.pt'}: " \
                            "disk full (no space left on device)", err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "epoch_001.pt", "last.pt"]
    assert load(run / "checkpoints" / "last.pt")["epoch"] == 1


def test_evaluate_refuses_an_unwritable_json_path_before_evaluating(train_data, finished_run, tmp_path, mounts,
                                                                     capsys):
    ro = mounts(tmp_path / "ro", "ro,size=1m")
    code = load_script("evaluate").main(["--data", str(train_data), "--weights",
                                         str(finished_run / "checkpoints" / "last.pt"), "--json", str(ro / "e.json"),
                                         "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and "top-1 error" not in captured.out
    assert one_line(captured.err) == f"evaluate.py: error: {ro / 'e.json'}: read-only file system"


def test_ctrl_c_during_evaluate_is_one_line_and_keeps_earlier_outputs(train_data, finished_run, tmp_path,
                                                                       monkeypatch, capsys):
    import alexnet.evaluation as ev
    js, cs = tmp_path / "eval.json", tmp_path / "pred.csv"
    # earlier outputs of evaluate.py (anything else at --json or --csv is refused before it starts)
    earlier_json = '{"top1_err": 0.5, "top5_err": 0.25, "n": 4, "crops": 1}\n'
    earlier_csv = ",".join(ev.CSV_HEADER) + "\r\nimg,1\r\n"
    js.write_text(earlier_json)
    cs.write_bytes(earlier_csv.encode())
    calls, real = [], ev.predict_log_probs

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGINT raises, in the middle of the split
        return real(*a, **k)
    monkeypatch.setattr(ev, "predict_log_probs", interrupted)
    code = load_script("evaluate").main(["--data", str(train_data), "--weights",
                                         str(finished_run / "checkpoints" / "last.pt"), "--json", str(js),
                                         "--csv", str(cs), "--batch-size", "4", "--no-progress"])
    assert code == 128 + signal.SIGINT
    assert one_line(capsys.readouterr().err) == ("evaluate.py: interrupted; nothing written (earlier outputs are "
                                                 "unchanged)")
    assert js.read_text() == earlier_json and cs.read_bytes() == earlier_csv.encode()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# -- 4. misleading failures: rank-independent checks once, before any replica ---------------------------------


def test_too_few_images_for_the_replicas_is_one_error_before_any_replica_starts(train_data, tmp_path, capsys):
    assert run_train(train_data, tmp_path / "run", "parallel.replicas=7") == 2
    captured = capsys.readouterr()
    assert "starting" not in captured.out  # no process was started
    assert one_line(captured.err) == (f"train.py: error: {train_data / 'train'} holds 48 images, fewer than one "
                                      "global batch (56 = 7 x 8); lower train.batch_size or parallel.replicas")


@pytest.mark.parametrize("overrides, expect", [
    (["data.crop=60"], "data.crop=60 is too small for 'alexnet': the minimum is 67"),
    # a replica's batch of 12 splits over 3 fc processes; 512 units do not
    (["parallel.model_size=3", "train.batch_size=12"], "parallel.model_size=3 does not divide a layer of 512 units"),
])
def test_config_errors_that_only_the_model_finds_are_found_before_start(train_data, tmp_path, capsys, overrides,
                                                                        expect):
    with pytest.raises(ConfigError, match=re.escape(expect)):
        check_run(load_config("configs/demo.yaml", [*tiny_overrides(train_data, tmp_path / "run"), *overrides]), 3)
    assert run_train(train_data, tmp_path / "run", *overrides) == 2
    captured = capsys.readouterr()
    assert expect in one_line(captured.err) and "starting" not in captured.out
