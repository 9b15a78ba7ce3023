"""The run directory: one run at a time, nothing left over from dead runs, every config it ran with.

- ``run.dir/.lock`` is held (flock) for the whole run by the process that starts it: train.py's
  launcher (its replicas inherit the lock, so it stays held while any of them lives), a lone replica,
  or rank 0 under torchrun. A second run into the directory exits 2 at once, naming the holder.
- At start the holder removes the temporary files (``.NAME.<pid>.tmp``) of processes that died while
  writing, in run.dir and its checkpoints/ folder: a kill -9 during a save leaves a whole checkpoint.
- ``config.yaml`` is the config of the latest start; a different earlier one is kept beside it as
  ``config.prev-N.yaml`` (N = 1, 2, ... in order), so a resumed run keeps the record of what it ran with.
- run.dir is a new or empty folder (hidden names aside), or already a run's (it holds ``metrics.jsonl`` or
  ``checkpoints/``, or only its ``.lock`` and configs: a run that died as it started; a lock alone is any
  tool's, a preprocessed output's too): an empty value, ``/``, or a folder of other files
  (the working directory as ``run.dir=.``) is refused before anything is written, since the run would
  write its files among them and keep the user's own ``config.yaml`` as ``config.prev-1.yaml``.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data.batchfile import atomic_write_bytes
from data.fsutil import exclusive_dir, remove_stale_temps, special_entries_words

from .config import ConfigError
from .launch import ENV_LOCK_FD  # set for the replicas of train.py's launcher, which holds the lock

_PREVIOUS = re.compile(r"^config\.prev-(\d+)\.yaml$")
RUN_FILES = ("metrics.jsonl", "checkpoints")  # either: a run's folder (config.yaml alone is not)
# What a run writes before those, after taking its lock: a folder holding a lock and only these is a run's too
# (one that died early). A lock alone is not: every tool that writes a folder locks it (a preprocessed output).
FIRST_FILES = re.compile(r"^config(\.prev-\d+)?\.yaml$")


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """ConfigError (exit 2) unless `run_dir` is a new or empty folder or already a run's (module docstring)."""
    if not str(run_dir).strip():
        raise ConfigError("run.dir is empty: name the folder this run writes into (e.g. run.dir=runs/NAME)")
    path = Path(run_dir)
    if path.resolve() == Path(path.anchor or "/").resolve():
        raise ConfigError(f"run.dir={run_dir} is the file system's root: name a folder of its own for this run")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={run_dir} is not a folder (a file, a device or a pipe): name a folder for this run")
    if path.is_dir() and (special := special_entries_words(path, f"run.dir={run_dir}")):
        raise ConfigError(special)
    if not path.is_dir() or any((path / name).exists() for name in RUN_FILES):
        return
    others = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if (path / ".lock").exists() and all(FIRST_FILES.match(name) for name in others):
        return
    if others:
        where = " (the working directory)" if path.resolve() == Path.cwd().resolve() else ""
        raise ConfigError(f"run.dir={run_dir}{where} holds files that are not a training run's ({others[0]!r}"
                          f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}): a run writes "
                          "config.yaml, metrics.jsonl and checkpoints/ there; name a new or empty folder")


def lock_holder_here() -> bool:
    """Whether this process is the one to lock run.dir: not a replica of our launcher; alone, or rank 0."""
    return ENV_LOCK_FD not in os.environ and ("WORLD_SIZE" not in os.environ or os.environ.get("RANK") == "0")


@contextmanager
def hold(run_dir: str | os.PathLike) -> Iterator[int]:
    """Lock `run_dir` for this run and remove what dead processes left in it; yields the lock's fd
    (pass it to child processes to keep the lock held while they live). DirInUse if another run holds it.
    A start refused inside the block (bad data, Ctrl-C) before the run wrote anything leaves no trace: the
    folders the lock made are removed again."""
    check_run_dir(run_dir)
    run_dir = Path(run_dir)
    made, lock_made = _first_missing(run_dir), not (run_dir / ".lock").exists()
    with exclusive_dir(run_dir, "training run") as fd:
        for folder in (run_dir, run_dir / "checkpoints"):
            for path in remove_stale_temps(folder):
                print(f"removed {path}: an unfinished write of a process that died", flush=True)
        try:
            yield fd
        except BaseException:
            if lock_made:
                _unmake(made, run_dir)
            raise


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet."""
    missing = [p for p in (path, *path.absolute().parents) if not p.exists()]
    return missing[-1] if missing else None


def _unmake(made: Path | None, run_dir: Path) -> None:
    """Where run_dir holds its lock alone: remove it, and the folders from run_dir up to `made` (None: none
    was made), each only while empty (nothing of the run's, nor anyone else's, is removed)."""
    try:
        if [p.name for p in run_dir.iterdir()] != [".lock"]:
            return
        (run_dir / ".lock").unlink()
    except OSError:
        return
    for folder in (run_dir, *run_dir.absolute().parents) if made is not None else ():
        try:
            folder.rmdir()
        except OSError:  # not empty (another process wrote there meanwhile): kept
            return
        if folder.absolute() == made.absolute():
            return


def write_config(run_dir: Path, text: str) -> Path | None:
    """config.yaml := `text`; a different previous config.yaml is kept as config.prev-N.yaml (returned)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = None
    kept = None
    if old is not None and old != text.encode():
        numbers = [int(m.group(1)) for p in run_dir.iterdir() if (m := _PREVIOUS.match(p.name))]
        kept = run_dir / f"config.prev-{max(numbers, default=0) + 1}.yaml"
        atomic_write_bytes(kept, old)
    atomic_write_bytes(path, text.encode())
    return kept
