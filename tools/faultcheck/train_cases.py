"""Faults and bad input for train.py: config values, the data folder, the run directory, the disk, signals."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from .core import READ_ONLY, REPO, Case, Work, environment, inject, must, restamp_mean, train_args, wait_for

FILE = "00001.h5"  # a training batch file of the shared data (16 images)


def tr(work: Work, *extra: str, data: Path | None = None, run: Path | None = None, **over) -> list[str]:
    """train.py at the tiniest size on `data` (default: the shared data) into `run` (default: w/run)."""
    return train_args(data or work.ctx.data(), run or work.w / "run", *extra, **over)


def no_checkpoint(work: Work) -> str | None:
    found = sorted((work.w / "run" / "checkpoints").glob("*.pt"))
    return f"wrote {found[0].name} for a run that should not have started" if found else None


def nothing_trained(work: Work) -> str | None:
    metrics = work.w / "run" / "metrics.jsonl"
    return "trained before refusing (metrics.jsonl has records)" if metrics.exists() and metrics.read_text() \
        else no_checkpoint(work)


def finite_checkpoints(work: Work) -> str | None:
    """Every checkpoint left behind holds finite weights (loaded in a child: torch stays out of this process)."""
    code = ("import sys, torch; bad = [p for p in sys.argv[1:] if not all(torch.isfinite(t).all() for t in "
            "torch.load(p, weights_only=True)['model'].values() if t.is_floating_point())]; print(*bad)")
    paths = [str(p) for p in (work.w / "run" / "checkpoints").glob("*.pt")]
    if not paths:
        return None
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, cwd=REPO,
                       env=environment())
    return f"non-finite weights written to {r.stdout.strip()}" if r.stdout.strip() else None


def no_temporaries(work: Work) -> str | None:
    left = list(work.w.rglob(".*.tmp"))
    return f"{len(left)} temporary file(s) left behind, e.g. {left[0].name}" if left else None


# -- setups ----------------------------------------------------------------------------------------

def _config(text: str, **over):
    def setup(work: Work) -> list[str]:
        (work.w / "config.yaml").write_text(text)
        return tr(work, config=str(work.w / "config.yaml"), **over)
    return setup


def _first_run_holding_the_lock(work: Work) -> list[str]:
    first = subprocess.Popen([sys.executable, *tr(work, train__epochs=1000)], cwd=REPO, env=environment(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    work.stack.callback(_stop, first)
    lock = work.w / "run" / ".lock"
    wait_for(lambda: lock.exists() and lock.read_text().strip() != "", first)
    return tr(work, train__max_steps=1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _data(damage):
    """A copy of the shared data, damaged by `damage(folder)`; train.py on it."""
    def setup(work: Work) -> list[str]:
        data = work.copy(work.ctx.data(), "data")
        damage(data)
        return tr(work, data=data)
    return setup


def _edit_meta(edit):
    def damage(data: Path) -> None:
        path = data / "meta.json"
        meta = json.loads(path.read_text())
        path.write_text(json.dumps(edit(meta)))
    return damage


def _truncate(data: Path) -> None:
    path = data / "train" / FILE
    path.write_bytes(path.read_bytes()[:1000])


def _flip_a_pixel(data: Path) -> None:
    import h5py
    for path in sorted((data / "train").glob("*.h5")):
        with h5py.File(path, "r") as f:
            offset = f["images"].id.get_offset()
        with open(path, "r+b") as f:
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))


def _mean(array):
    def damage(data: Path) -> None:
        restamp_mean(data, array)
    return damage


def _foreign(work: Work) -> list[str]:
    data = work.copy(work.ctx.data(), "data")
    (data / "train" / FILE).write_bytes((work.ctx.data(64) / "train" / FILE).read_bytes())
    return tr(work, data=data)


def _resume(data_of=None, *extra: str, **over):
    """A copy of the finished one-epoch run, resumed (on other data when `data_of(ctx)` is given)."""
    def setup(work: Work) -> list[str]:
        run = work.copy(work.ctx.run, "run")
        return tr(work, *extra, data=data_of(work.ctx) if data_of else None, run=run, **over)
    return setup


def _changed_config_kept(work: Work) -> str | None:
    return None if (work.w / "run" / "config.prev-1.yaml").exists() else "the earlier config.yaml was not kept"


def _stale_temporary(work: Work) -> list[str]:
    run = work.copy(work.ctx.run, "run")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid: a process that no longer exists
    (run / "checkpoints" / f".last.pt.{dead.pid}.tmp").write_bytes(b"\0" * 100_000)
    return tr(work, run=run)


def _temporary_removed(work: Work) -> str | None:
    left = list((work.w / "run" / "checkpoints").glob(".*.tmp"))
    return f"{left[0].name} is still there" if left else None


def _on_tmpfs(options: str, fill: bool = False, **over):
    def setup(work: Work) -> list[str]:
        disk = work.mount("disk", options)
        if fill:
            _fill(disk / "filler")
        return tr(work, run=disk / "run", **over)
    return setup


def _fill(path: Path) -> None:
    """Write zeros into `path` until the file system refuses: full is the point, so that OSError is the end."""
    with contextlib.suppress(OSError), open(path, "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def _last_pt_truncated(work: Work) -> list[str]:
    run = work.copy(work.ctx.run, "run")
    last = run / "checkpoints" / "last.pt"
    data = last.read_bytes()
    last.unlink()  # last, best and epoch_001 may be hard links of one file
    last.write_bytes(data[: len(data) // 2])
    return tr(work, run=run, train__epochs=2)


def _interrupt_after_a_record(work: Work, proc: subprocess.Popen) -> None:
    metrics = work.w / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(signal.SIGINT)


def _checkpoint_written(work: Work) -> str | None:
    return None if (work.w / "run" / "checkpoints" / "last.pt").exists() else "no last.pt after Ctrl-C"


RUN = "{w}/run"

def _owt_weights(classes: int, **over):
    """run.resume_from=a torchvision-format file (arch owt) of `classes` classes, made in a child."""
    def setup(work: Work) -> list[str]:
        path = work.w / f"tv{classes}.pth"
        must(["-c", f"import torch; from alexnet.models import build_model; torch.save(build_model('owt', "
                    f"num_classes={classes}, width=0.125, crop=224, init='torch').state_dict(), {str(path)!r})"])
        return tr(work, run__resume_from=path, **over)
    return setup


def _damaged_caffemodel(work: Work) -> list[str]:
    (work.w / "bad.caffemodel").write_bytes(np.random.default_rng(0).bytes(3000))
    return tr(work, run__resume_from=work.w / "bad.caffemodel")


def _published_offline(work: Work) -> list[str]:
    """run.resume_from=bvlc_alexnet with an empty hub cache and nothing listening where it is fetched."""
    code = (f"import os; os.environ['TORCH_HOME'] = {str(work.w / 'torch_home')!r}; "
            "os.environ['ALEXNET_WEIGHTS_MIRROR'] = 'http://127.0.0.1:9'")
    return inject(code, *tr(work, run__resume_from="bvlc_alexnet"))


CASES = [
    Case("train-lr-nan", "silent", "train.lr=.nan", 2, ("train.lr",), lambda w: tr(w, train__lr=".nan"),
         no_checkpoint, listed=True),
    Case("train-lr-inf", "silent", "train.lr=.inf", 2, ("train.lr",), lambda w: tr(w, train__lr=".inf"),
         no_checkpoint, listed=True),
    Case("train-momentum-5", "silent", "train.momentum=5", 2, ("train.momentum",),
         lambda w: tr(w, train__momentum=5), no_checkpoint, listed=True),
    Case("train-batch-size-zero", "silent", "train.batch_size=0", 2, ("train.batch_size",),
         lambda w: tr(w, train__batch_size=0), no_checkpoint),
    Case("train-unknown-key", "silent", "train.lrr=0.1 (a typo)", 2, ("train.lrr",),
         lambda w: tr(w, "train.lrr=0.1"), no_checkpoint),
    Case("train-crop-too-large", "silent", "data.crop=80 on 72-pixel images", 2, ("data.crop",),
         lambda w: tr(w, data__crop=80), no_checkpoint),
    Case("train-two-runs-one-dir", "silent", "a second run into the run.dir of a running one", 2, (RUN, "pid"),
         _first_run_holding_the_lock, listed=True, timeout=180),
    Case("train-yaml-1e-3", "accepted", "train: {lr: 1e-3} in the YAML file", 0, ("lr 0.001",),
         _config("train:\n  lr: 1e-3\n", train__max_steps=1), line="lr 0.001", listed=True),
    Case("train-yaml-duplicate-key", "silent", "train.lr given twice in one YAML mapping", 2, ("lr", "config.yaml"),
         _config("train:\n  lr: 0.01\n  lr: 0.02\n"), no_checkpoint, listed=True),
    Case("train-yaml-syntax", "traceback", "a YAML file that does not parse", 2, ("{w}/config.yaml",),
         _config("train: [lr: 0.01\n")),
    Case("train-config-missing", "traceback", "a config file that does not exist", 2, ("{w}/nope.yaml",),
         lambda w: tr(w, config=str(w.w / "nope.yaml"))),
    Case("train-data-root-missing", "traceback", "data.root that does not exist", 2, ("{w}/nope",),
         lambda w: tr(w, data=w.w / "nope")),
    Case("train-meta-no-classes", "lost", "meta.json without 'classes'", 2, ("meta.json", "classes"),
         _data(_edit_meta(lambda m: {k: v for k, v in m.items() if k != "classes"})), nothing_trained, listed=True),
    Case("train-meta-binary", "traceback", "meta.json holding binary bytes", 2, ("{w}/data/meta.json",),
         _data(lambda d: (d / "meta.json").write_bytes(b"\x89\xff\x00binary")), nothing_trained, listed=True),
    Case("train-meta-list", "traceback", "meta.json holding a JSON list", 2, ("{w}/data/meta.json",),
         _data(lambda d: (d / "meta.json").write_text("[1, 2, 3]")), nothing_trained, listed=True),
    Case("train-batch-truncated", "lost", f"train/{FILE} cut to 1000 bytes", 2, (f"{{w}}/data/train/{FILE}",),
         _data(_truncate), nothing_trained, listed=True),
    Case("train-batch-missing", "lost", f"train/{FILE} deleted", 2, (f"{{w}}/data/train/{FILE}",),
         _data(lambda d: (d / "train" / FILE).unlink()), nothing_trained, listed=True),
    Case("train-batch-foreign", "lost", f"train/{FILE} from a 64-pixel preprocessing", 2,
         (f"{{w}}/data/train/{FILE}",), _foreign, nothing_trained, listed=True),
    Case("train-batch-flipped-byte", "silent", "one flipped pixel byte in each training batch file", 2,
         ("{w}/data/train/", "checksum"), _data(_flip_a_pixel), no_checkpoint),
    Case("train-mean-wrong-shape", "lost", "mean.npy of 64x64x3 for 72-pixel images", 2, ("mean.npy",),
         _data(_mean(np.zeros((64, 64, 3), np.float32))), nothing_trained, listed=True),
    Case("train-mean-nan", "silent", "mean.npy holding NaN", 2, ("mean.npy",),
         _data(_mean(np.full((72, 72, 3), np.nan, np.float32))), nothing_trained),
    Case("train-resume-other-size", "silent", "resume on 76-pixel data (72 before)", 2, ("72", "76"),
         _resume(lambda ctx: ctx.data(76), train__epochs=2), listed=True),
    Case("train-resume-other-classes", "silent", "resume on data of 3 of the 4 classes", 2, ("classes",),
         _resume(lambda ctx: ctx.data(72, classes=3), train__epochs=2), listed=True),
    Case("train-resume-changed-key", "accepted", "resume with train.lr=0.02 (0.01 before)", 0,
         ("train.lr", "0.01", "0.02"), _resume(None, train__epochs=2, train__lr=0.02, train__max_steps=7),
         _changed_config_kept, line="changed on resume: train.lr", listed=True),
    Case("train-stale-temporary", "lost", "a dead process's .last.pt.<pid>.tmp in checkpoints/", 0,
         (".last.pt.",), _stale_temporary, _temporary_removed, line=r"removed .*\.tmp", listed=True),
    Case("train-last-pt-truncated", "lost", "resume from a last.pt cut in half (epoch_001.pt intact)", 0,
         ("last.pt", "epoch_001.pt"), _last_pt_truncated, line="last.pt: cannot be loaded"),
    Case("train-resume-from-missing", "traceback", "run.resume_from naming no file", 2, ("{w}/nope.pt",),
         lambda w: tr(w, run__resume_from=w.w / "nope.pt"), no_checkpoint),
    Case("train-start-weights-other-arch", "misleading", "run.resume_from=torchvision-format weights (owt) with "
         "the demo's alexnet", 2, ("model.arch=owt", "data.mean=channel"), _owt_weights(4), no_checkpoint),
    Case("train-start-weights-other-classes", "misleading", "run.resume_from=weights of 10 classes, data of 4", 2,
         ("10 classes", "has 4"), _owt_weights(10, model__arch="owt", data__mean="channel"), no_checkpoint),
    Case("train-start-damaged-caffemodel", "misleading", "run.resume_from=a .caffemodel of random bytes", 2,
         ("{w}/bad.caffemodel",), _damaged_caffemodel, no_checkpoint),
    Case("train-start-published-offline", "misleading", "run.resume_from=bvlc_alexnet, nothing listening", 1,
         ("http://127.0.0.1:9/bvlc_alexnet.caffemodel", "by hand"), _published_offline, no_checkpoint),
    Case("train-loss-nan", "silent", "train.lr=1e30: the loss becomes NaN", 1, ("NaN",),
         lambda w: tr(w, train__lr="1e30", train__epochs=2), finite_checkpoints),
    Case("train-disk-full-at-save", "traceback", "run.dir on a 4 MiB tmpfs: room for one checkpoint, not two", 1,
         ("{w}/disk/run/checkpoints/", "disk full"), _on_tmpfs("size=4m", train__epochs=2), no_temporaries,
         listed=True),
    Case("train-disk-full-at-start", "traceback", "run.dir on a full tmpfs", 1, ("{w}/disk/run", "disk full"),
         _on_tmpfs("size=1m", fill=True), listed=True),
    Case("train-disk-too-small", "traceback", "run.dir on a 1 MiB tmpfs (a checkpoint needs 2.5 MiB)", 1,
         ("{w}/disk/run", "disk full"), _on_tmpfs("size=1m")),
    Case("train-run-dir-read-only", "traceback", "run.dir on a read-only tmpfs", 2, ("{w}/disk/run", READ_ONLY),
         _on_tmpfs("size=1m,ro"), listed=True),
    Case("train-ctrl-c", "lost", "Ctrl-C once a train record is written", 130, ("SIGINT",),
         lambda w: tr(w, train__epochs=50), _checkpoint_written, during=_interrupt_after_a_record),
    Case("train-replicas-6", "misleading", "parallel.replicas=6 with fewer images than 6 x 9", 2,
         ("parallel.replicas",), lambda w: tr(w, parallel__replicas=6, train__batch_size=9), listed=True),
    Case("train-replicas-100", "misleading", "parallel.replicas=100 on this machine", 2, ("parallel.replicas",),
         lambda w: tr(w, parallel__replicas=100), listed=True, timeout=90),
]
