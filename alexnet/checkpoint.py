"""Checkpoints: atomic writes, last + best + the last N epochs, safe loading.

Every file is written under a temporary name, fsynced and renamed, so a crash (even kill -9) during a
write leaves the previous file intact. ``last.pt`` always names the newest checkpoint; per-epoch files
and ``best.pt`` are hard links to the same data where the filesystem allows (no extra space).
Loading always uses ``torch.load(weights_only=True)``: a checkpoint is data, never code.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import threading
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from data.fsutil import commit, os_error_in, os_error_message, temp_path

CHECKPOINT_KIND = "alexnet-checkpoint"  # the "kind" key of a training checkpoint
EPOCH_FILE = re.compile(r"^epoch_(\d+)\.pt$")
# torch.save stores tensors uncompressed: a zip whose members declare more than this many times the file's
# size (plus a MiB for tiny files) is not torch's, and torch.load would inflate it whole (2 MB -> 2.3 GB seen).
MAX_INFLATION = 10
# The weights-only unpickler's refusal; its text goes on to advise weights_only=False, never passed on.
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


class CheckpointError(RuntimeError):
    """A checkpoint or weights file that cannot be read; names the file."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj: dict, path: str | os.PathLike) -> None:
    """torch.save to a temporary file, fsync, then rename over `path`.

    A failed write leaves no temporary file and raises the OSError behind it, naming `path` (torch
    reports a full disk as "RuntimeError: ... unexpected pos", saying neither the file nor why).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    except (OSError, RuntimeError) as e:
        stop = _stop_behind(e)
        if stop is not None:
            raise stop from None
        cause = os_error_in(e) or _full_disk(path.parent)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from e
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _stop_behind(e: BaseException) -> KeyboardInterrupt | None:
    """A stop (Ctrl-C, or SIGTERM/SIGHUP raised as one: cli.Stopped) that landed in torch.save's writing: torch's
    zip writer then ends with its own RuntimeError ("unexpected pos"), the stop only its context."""
    while e is not None and not isinstance(e, KeyboardInterrupt):
        e = e.__context__
    return e


def _full_disk(folder: Path) -> OSError | None:
    """ENOSPC if `folder`'s file system has no space left (when torch hid the write's error)."""
    try:
        full = os.statvfs(folder).f_bavail == 0
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else None


def first_non_finite(tensors: Any, name: str = "") -> str | None:
    """The name of the first floating-point tensor holding NaN or inf in a nested dict/list of tensors
    (a state dict, a checkpoint), e.g. "model.conv1.weight"; None if all are finite."""
    if isinstance(tensors, torch.Tensor):
        bad = tensors.is_floating_point() and not bool(torch.isfinite(tensors).all())
        return (name or "tensor") if bad else None
    if isinstance(tensors, dict):
        items = tensors.items()
    elif isinstance(tensors, (list, tuple)):
        items = enumerate(tensors)
    else:
        return None
    for key, value in items:
        found = first_non_finite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def refuse_non_finite(tensors: Any, source: str | os.PathLike) -> None:
    """ValueError naming `source` and the first tensor of `tensors` that holds NaN or inf (see
    first_non_finite): such weights give meaningless predictions, or spread NaN into what is made of them."""
    bad = first_non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{source}: {bad} holds NaN or inf (the first tensor that does): these weights are "
                         "not usable")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _link_atomic(src: Path, dst: Path) -> None:
    """Make `dst` name the same data as `src` (hard link, else copy), atomically."""
    tmp = temp_path(dst)
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil
        shutil.copyfile(src, tmp)
    commit(tmp, dst)


def load(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict:
    """Load a checkpoint or state dict safely: CheckpointError names the file if it is not one (damaged,
    another format, code or objects in it, a zip that would inflate far past its size); the OSError of a
    file that cannot be read (permission denied, I/O error), naming it. `mmap`: tensors memory-mapped,
    not read, where the file allows it (a few small entries of a large file)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint or weights file")
    try:
        check_inflation(path)
        with warnings.catch_warnings():  # torch's notes on a file's pickle protocol: not for the user
            warnings.simplefilter("ignore")
            obj = _torch_load(path, map_location, mmap)
    except OSError as e:  # the operating system's refusal: not the file's fault
        raise OSError(e.errno, e.strerror, str(path)) from None
    except CheckpointError:
        raise
    except Exception as e:  # truncated zip, pickle with code in it, wrong format: all mean "unusable"
        raise CheckpointError(_unusable(path, e)) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict (checkpoint or state_dict), got {type(obj).__name__}")
    return obj


def _torch_load(path: Path, map_location, mmap: bool):
    if mmap:
        with contextlib.suppress(RuntimeError):  # a file of torch's legacy (non-zip) format cannot be mapped
            return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    return torch.load(path, map_location=map_location, weights_only=True)


def check_inflation(path: Path) -> None:
    """CheckpointError if `path` is a zip whose members declare more than MAX_INFLATION x its size (read
    from its central directory: nothing is inflated)."""
    try:
        with zipfile.ZipFile(path) as z:
            declared = sum(info.file_size for info in z.infolist())
    except (zipfile.BadZipFile, ValueError, EOFError, RuntimeError):  # not a zip: torch's legacy format, or junk
        return
    size = path.stat().st_size
    if declared > MAX_INFLATION * size + 2**20:
        raise CheckpointError(f"{path}: a zip of {size} bytes whose members would inflate to {declared} bytes, "
                              f"over {MAX_INFLATION} times its size: not a file torch.save wrote (it stores tensors "
                              "uncompressed); refused before inflating it")


def _unusable(path: Path, e: Exception) -> str:
    """Why torch.load refused `path`, in one line; never torch's advice to retry with weights_only=False
    (which would run whatever code the file holds)."""
    text = str(e)
    if "weights_only" in text or isinstance(e, pickle.UnpicklingError):
        found = _REFUSED_GLOBAL.search(text)
        what = f" (it names {found.group(1)})" if found else ""
        return (f"{path}: cannot be loaded as weights: it holds code or objects that are not plain weights{what}, "
                "or is not a weights file at all; refused (a weights file is never unpickled)")
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{path}: cannot be loaded as weights ({type(e).__name__}: {first[:200]})"


def compare_checkpoints(a: str | os.PathLike, b: str | os.PathLike) -> dict:
    """Two training checkpoints' weights and optimizer states: {"weights", "velocities"}: the max over
    tensors of ||a - b|| / ||b|| (in float64), "state": that max per state key, and "bitwise": whether
    every tensor is equal.

    "velocities" covers every per-parameter optimizer state tensor, whatever the optimizer: SGD's and
    LARS's velocity, LAMB's moments (exp_avg, exp_avg_sq) and step count. A velocity is a small
    difference of large terms, so its relative difference shows the weights' float noise magnified.
    ValueError if the two hold different tensors.
    """
    def tensors(path) -> dict:
        state = load(path)
        return {**{("weights", k): v for k, v in state["model"].items()},
                **{("velocities", k, name): t for k, per in state["optimizer"]["state"].items()
                   for name, t in per.items() if isinstance(t, torch.Tensor)}}
    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys() or not ta:
        raise ValueError(f"{a} and {b} hold different tensors ({len(ta)} and {len(tb)})")
    out, per_key = {"weights": 0.0, "velocities": 0.0}, {}
    for key, want in tb.items():
        want = want.double()
        rel = float((ta[key].double() - want).norm() / want.norm().clamp_min(1e-12))
        out[key[0]] = max(out[key[0]], rel)
        if key[0] == "velocities":
            per_key[key[2]] = max(per_key.get(key[2], 0.0), rel)
    return {**out, "state": per_key, "bitwise": all(ta[k].equal(tb[k]) for k in tb)}


class CheckpointDir:
    """``<run.dir>/checkpoints``: last.pt, best.pt, epoch_NNN.pt (the newest `keep_last` kept)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        self.root = Path(root)
        self.keep_last = keep_last

    @property
    def last(self) -> Path:
        return self.root / "last.pt"

    @property
    def best(self) -> Path:
        return self.root / "best.pt"

    def exists(self) -> bool:
        return bool(self.candidates())

    def candidates(self) -> list[Path]:
        """Files a run can resume from, newest first: last.pt, the epoch files, best.pt.

        Hard links to one file are listed once (a corrupt last.pt is then not read twice as its
        epoch file).
        """
        if not self.root.is_dir():
            return []
        epochs = sorted((p for p in self.root.iterdir() if EPOCH_FILE.match(p.name)), reverse=True)
        out, seen = [], set()
        for path in (self.last, *epochs, self.best):
            try:
                st = path.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                out.append(path)
        return out

    def load_newest(self, warn=print) -> tuple[dict, Path]:
        """The newest checkpoint that loads, and its path; `warn` is told about each one skipped.

        CheckpointError (naming every file tried) when none loads.
        """
        failures = []
        for path in self.candidates():
            try:
                state = load(path)
            except CheckpointError as e:
                failures.append(str(e))
                continue
            for failure in failures:
                warn(f"warning: {failure}; resuming from {path} instead")
            return state, path
        raise CheckpointError("no checkpoint of " + str(self.root) + " can be loaded: " + "; ".join(failures)
                              + " (move the run directory away to start afresh, or set run.dir)")

    def save(self, state: dict, epoch_done: bool, is_best: bool) -> Path:
        """Write `state` as last.pt; also as epoch_NNN.pt at an epoch end and as best.pt if best.

        Never weights that are not finite: a resume would start from them (the trainer stops before).
        """
        bad = first_non_finite({k: state[k] for k in ("model", "optimizer") if k in state})
        if bad is not None:
            raise CheckpointError(f"not writing a checkpoint to {self.root}: {bad} holds NaN or inf")
        self.root.mkdir(parents=True, exist_ok=True)
        state = {**state, "is_best": is_best}  # what complete() needs if this save is cut short
        if epoch_done:
            path = self.root / f"epoch_{state['epoch']:03d}.pt"
            save_atomic(state, path)
            _link_atomic(path, self.last)
        else:
            save_atomic(state, self.last)
        if is_best:
            _link_atomic(self.last, self.best)
        self._prune()
        return self.last

    def complete(self, state: dict, path: Path) -> list[str]:
        """Finish what a save killed halfway left undone, for the state a run resumes from (`path`): a
        best state (is_best) that best.pt does not hold yet is linked as best.pt. Returns what was done.

        A save writes the state, then links last.pt, then best.pt; killed between, the rerun would
        resume (or find the run finished) with best.pt still an older epoch's.
        """
        if not state.get("is_best") or _same_file(path, self.best):
            return []
        _link_atomic(path, self.best)
        return [f"{self.best} now holds {path.name}'s state (epoch {state['epoch']}), the best so far; the save "
                "that should have linked it was cut short"]

    def _prune(self) -> None:
        epochs = sorted(p for p in self.root.iterdir() if EPOCH_FILE.match(p.name))
        for old in epochs[:max(0, len(epochs) - self.keep_last)]:
            old.unlink()


def to_host(obj):
    """A copy of a (nested) checkpoint whose tensors are CPU copies, detached from the live training
    state: the step loop may change the weights again while a background thread writes the copy."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread, so that the step loop does not wait for disks.

    A failed write is raised (as CheckpointError) by the next wait(), which also waits for the write
    in progress; the trainer waits before each checkpoint and before it stops.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], object]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # reported by the next wait(), in the trainer's thread
                self._error = e
        # A daemon: the trainer waits for every write itself, so only a stop at once (a second Ctrl-C)
        # leaves one behind, which the interpreter must not wait for at exit (its temporary file is
        # removed at the next start).
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, beat: Callable[[], None] | None = None) -> None:
        """Wait for the write in progress; `beat` is called every second meanwhile (liveness)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(1.0)
            if beat is not None:
                beat()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            what = os_error_message(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
            raise CheckpointError(f"writing a checkpoint failed: {what}") from error
