"""Preprocess ImageNet (folders or the archives as downloaded) into batch files, a mean image, meta.json
and report.json.

The library side of ``scripts/preprocess.py`` (its command line: :mod:`data.preprocess_cli`). One task
writes one batch file; tasks run in a pool of worker processes. The run is planned first (which source
goes into which file), the plan is recorded in ``plan.json``, and a re-run with the same arguments skips
every finished file, so an interrupted run (Ctrl-C, kill -9, a dead worker, a full disk) resumes where
it stopped. ``meta.json`` is written last and marks the output finished. The inputs are listed by
:mod:`data.sources`: images in uncompressed tars are read in place by the workers; those in gzip shards
are streamed by the parent in windows of batch files that fit a memory budget, and handed to the
workers as bytes.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gc
import hashlib
import io
import json
import multiprocessing as mp
import os
import secrets
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .archives import INDEX_NAME, INDEX_START, ShardMember, TarMember, collect, read_member, with_stop
from .batchfile import (
    BATCH_FILE_SUFFIX,
    FORMAT_VERSION,
    BatchFileError,
    atomic_write_bytes,
    atomic_write_json,
    batch_file_name,
    read_file_attrs,
    write_batch_file,
)
from .decode import RESIZE_MODES, load_image
from .domains import Earlier, OutputPath, json_holding, starting_with
from .fsutil import exclusive_dir, remove_stale_temps
from .layouts import DataError, Item, RawName, printable
from .procs import die_with_parent, run_all, stops_between_calls
from .sources import Sources, as_paths, gather

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Options:
    """What determines the output; a re-run must match these (workers and progress do not count)."""

    size: int = 256
    per_file: int = 256
    resize: str = "short"
    seed: int = 1
    class_subset: str | None = None  # --classes: N (a seeded choice) or a file of wnids
    train_per_class: int | None = None


@dataclass(frozen=True)
class Task:
    """Write one batch file from `items`: files below `src`, members of tars (checked against `stamps`,
    archive -> (size, mtime_ns, inode, ctime_ns) when indexed, and each against its tar header), or bytes
    streamed from shards (`payload`)."""

    split: str
    index: int
    items: tuple[Item, ...]
    src: str
    dst: str
    size: int
    resize: str
    stamps: dict | None = None
    payload: tuple[bytes, ...] | None = None
    dataset: str | None = None  # the output's identity (plan.json's), recorded in the file


def plan_files(split: str, items: list[Item], opts: Options) -> list[tuple[Item, ...]]:
    """Cut a split into per-file groups; train is shuffled (seeded) so file order is already random."""
    if split == "train":
        order = np.random.default_rng(opts.seed).permutation(len(items))
        items = [items[i] for i in order]
    return [tuple(items[i:i + opts.per_file]) for i in range(0, len(items), opts.per_file)]


def sources_digest(items: list[Item]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(f"{it.path}\t{it.label}\n".encode())
    return h.hexdigest()[:32]


# -- worker side ---------------------------------------------------------------------------------

_progress = None  # the shared image counter, set once per worker process by _init_worker


def _init_worker(counter) -> None:
    global _progress
    _progress = counter
    die_with_parent()
    # Ctrl-C is handled by the parent, which lets in-flight files finish; a worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook


# After a write failed (a full disk), h5py's objects fail to flush again as they are freed, and Cython
# prints each failure (through sys.excepthook, then sys.unraisablehook): a dozen tracebacks for an error
# that already stops the run with one line naming the file. Those two reports only are dropped.

def _h5py_dealloc(tb) -> bool:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith("_objects.pyx")


def _quiet_excepthook(kind, value, tb) -> None:
    if not (isinstance(value, (OSError, RuntimeError)) and _h5py_dealloc(tb)):
        sys.__excepthook__(kind, value, tb)


def _quiet_unraisablehook(u) -> None:
    h5py_dealloc = isinstance(u.object, str) and u.object.startswith("h5py._objects.")
    if not (h5py_dealloc and isinstance(u.exc_value, (OSError, RuntimeError))):
        sys.__unraisablehook__(u)


def _tick() -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress.value += 1


def _source(task: Task, i: int):
    """Image `i` of a task as Pillow opens it: a path, or the member's bytes (ArchiveError stops the run)."""
    loc = task.items[i].loc
    if loc is None:
        return os.path.join(task.src, task.items[i].path)
    if isinstance(loc, RawName):
        return os.path.join(task.src, loc.path)
    if isinstance(loc, TarMember):
        return io.BytesIO(read_member(loc, task.stamps[loc.archive]))
    return io.BytesIO(task.payload[i])


def process_task(task: Task) -> int:
    """Decode, resize and write one batch file; returns the number of images written."""
    n = len(task.items)
    images = np.empty((n, task.size, task.size, 3), dtype=np.uint8)
    labels, names, skipped = [], [], []
    for i, item in enumerate(task.items):
        source = _source(task, i)
        try:
            images[len(names)] = load_image(source, task.size, task.resize)
        except Exception as e:  # any decoder failure means this one image is skipped, and said so
            where = item.loc.display() if item.loc is not None else f"{task.split}/{item.path}"
            # Pillow names a file object by its repr (a memory address): name the member instead
            reason = str(e).replace(repr(source), f"'{where}'") if item.loc is not None else str(e)
            skipped.append({"path": where, "reason": printable(f"{type(e).__name__}: {reason}")})
        else:
            labels.append(item.label)
            names.append(item.path)
        _tick()
    images = images[:len(names)]
    pixel_sum = images.sum(axis=0, dtype=np.uint64) if task.split == "train" else None
    write_batch_file(task.dst, images, np.asarray(labels, np.int64), names, split=task.split,
                     index=task.index, skipped=skipped, pixel_sum=pixel_sum, dataset=task.dataset)
    return len(names)


# -- parent side ---------------------------------------------------------------------------------

def _plan_record(opts: Options, src: Sources) -> dict:
    record = {"format_version": FORMAT_VERSION, **asdict(opts),
              "classes": sources_digest([Item(c, i) for i, c in enumerate(src.classes)]),
              "splits": {k: {"sources": sources_digest(s.items), "images": len(s.items)}
                         for k, s in src.splits.items()}}
    # which classes a file names is in the classes digest; the file's own path may change between runs
    if opts.class_subset is not None:
        spec = str(opts.class_subset)
        record["class_subset"] = str(int(spec)) if spec.isdigit() else "listed"
    return record


def _check_plan(out: Path, record: dict) -> str | None:
    """Refuse to resume into an output made with other arguments or other sources; the output's identity
    (drawn when its plan is first written; None for an output begun before outputs had one)."""
    path = out / "plan.json"
    if not path.exists():
        record = {**record, "dataset": secrets.token_hex(16)}
        atomic_write_json(path, record)
        return record["dataset"]
    old = _read_plan(path)
    # Not format_version: readers take both formats, even mixed in one folder, so a run started by an
    # older version may be finished by this one (scripts/upgrade_data.py converts the old files).
    diffs = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in record.items()
             if k not in ("splits", "format_version") and old.get(k) != v]
    for split in sorted(set(old.get("splits", {})) | set(record["splits"])):
        was, now = old.get("splits", {}).get(split), record["splits"].get(split)
        if was is None or now is None:
            diffs.append(f"{split} split: {'absent' if was is None else 'present'} there, "
                         f"{'absent' if now is None else 'present'} now")
        elif was != now:
            diffs.append(f"{split} sources: {was['images']} images there, {now['images']} now (or other files)")
    if diffs:
        raise DataError(f"{out} holds a preprocessing run with different arguments or sources "
                        f"({'; '.join(diffs)}); use another --out, or delete {out} to start over")
    dataset = old.get("dataset")
    return dataset if isinstance(dataset, str) else None


def _read_plan(path: Path) -> dict:
    """plan.json of an earlier run; damaged (not what this code writes) is an error naming it."""
    try:
        plan = json.loads(path.read_bytes())
        if not isinstance(plan, dict) or not all(isinstance(v, dict) and isinstance(v.get("images"), int)
                                                 for v in plan.get("splits", {}).values()):
            raise ValueError("not a plan of scripts/preprocess.py")
    except (ValueError, AttributeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DataError(f"{path} is damaged ({e}); delete {path.parent} to start over") from None
    return plan


@contextmanager
def exclusive(out: Path):
    """One writer per output folder (preprocess or upgrade): a second concurrent run would corrupt the first."""
    with exclusive_dir(out, "preprocess or upgrade run"):
        yield


def _is_done(task: Task) -> bool:
    """Whether the task's file is finished: it opens cleanly and records this task's place (a file of
    another place under its name, a link or a copy, is done again, not taken)."""
    try:
        read_file_attrs(task.dst, split=task.split, index=task.index, dataset=task.dataset)
        return True
    except BatchFileError:
        return False


def _tasks(out: Path, opts: Options, src: Sources, dataset: str | None) -> list[Task]:
    tasks = []
    for name, split in src.splits.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        for stale in (out / name).glob(".*.tmp"):
            stale.unlink()  # a half-written file of an interrupted run
        for i, items in enumerate(plan_files(name, split.items, opts)):
            tasks.append(Task(name, i, items, str(split.root), str(out / name / batch_file_name(i)),
                              opts.size, opts.resize, src.stamps, dataset=dataset))
    return tasks


# -- gzip shards: windows of batch files streamed in passes --------------------------------------------

def _streamed(task: Task) -> bool:
    return any(isinstance(it.loc, ShardMember) for it in task.items)


def stages(todo: list[Task], budget: int) -> list[list[Task]]:
    """The tasks in stages: first all that read files or tars, then windows of shard tasks whose compressed
    images fit `budget` bytes (each window costs one streaming pass over the shards it needs)."""
    plain = [t for t in todo if not _streamed(t)]
    windows, used = [], 0
    for t in (t for t in todo if _streamed(t)):
        size = sum(it.loc.size for it in t.items)
        if not windows or (used + size > budget and windows[-1]):
            windows.append([])
            used = 0
        windows[-1].append(t)
        used += size
    return ([plain] if plain else []) + windows


def fill(window: list[Task], threads: int) -> list[Task]:
    """The window's tasks with their images' bytes, from one pass over each shard they need (in parallel)."""
    wanted: dict[str, dict[str, tuple[int, int]]] = {}  # shard -> member -> indexed (offset, size), checked
    for t in window:
        for it in t.items:
            wanted.setdefault(it.loc.archive, {})[it.loc.name] = (it.loc.offset, it.loc.size)
    got = dict(zip(wanted, with_stop(lambda shard, stop: collect(shard, wanted[shard], stop), list(wanted),
                                     threads)))
    return [dataclasses.replace(t, payload=tuple(got[it.loc.archive][it.loc.name] for it in t.items))
            for t in window]


def default_shard_memory() -> int:
    """Half the memory available now (MemAvailable), or 4 GiB where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // 2
    except (OSError, StopIteration, ValueError):
        return 4 << 30


class _Progress:
    """The progress bar (images/s, ETA, files), made after the first submit: submitting forks the workers,
    which should happen while this process is still single-threaded (tqdm starts a monitor thread)."""

    def __init__(self, quiet: bool, images: int, files: int, counter):
        self.quiet, self.images, self.files, self.counter = quiet, images, files, counter
        self.bar, self.files_done = None, 0

    def start(self) -> None:
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=self.images, unit="img", desc="preprocess", disable=self.quiet, smoothing=0.05)
        self.bar.set_description("preprocess")

    def say(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what)
        elif not self.quiet:
            print(f"preprocess: {what}", file=sys.stderr)

    def update(self, files_of_part: int) -> None:
        self.bar.update(self.counter.value - self.bar.n)
        self.bar.set_postfix(files=f"{self.files_done + files_of_part}/{self.files}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_part(pool: cf.ProcessPoolExecutor, part: list[Task], progress: _Progress, check) -> None:
    progress.start()
    run_all(pool, [(process_task, (t,)) for t in part], check,
            lambda finished, left: progress.update(len(part) - left))
    progress.files_done += len(part)


def _run_pool(todo: list[Task], workers: int, quiet: bool, budget: int) -> None:
    """Run the tasks with a progress bar; a dead worker, a bad archive or Ctrl-C stops cleanly."""
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    counter = ctx.Value("q", 0)
    parts = stages(todo, budget)
    passes = [k for k, part in enumerate(parts) if _streamed(part[0])]
    progress = _Progress(quiet, sum(len(t.items) for t in todo), len(todo), counter)
    # The plan (1.28 M items for ImageNet) stays in the parent: frozen, the workers' garbage collector
    # never walks it, so their forked copies of its pages stay shared instead of being copied. What was
    # frozen before (the script's imports, startup.imported) stays frozen after.
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        with stops_between_calls() as check, cf.ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_init_worker, initargs=(counter,)) as pool:
            for k, part in enumerate(parts):
                if k in passes:
                    progress.say(f"streaming shards, pass {passes.index(k) + 1}/{len(passes)}")
                    part = fill(part, workers)
                _run_part(pool, part, progress, check)
    finally:
        if not frozen_before:
            gc.unfreeze()
        progress.close()


# -- finishing -------------------------------------------------------------------------------------

def _split_files(name: str, tasks: list[Task], versions: set[int]) -> tuple[list[dict], list[dict], np.ndarray | None]:
    """The files of one split as meta.json lists them, their skipped sources, and their pixel sum; adds
    their format versions to `versions`."""
    files, skipped, total = [], [], None
    for t in (t for t in tasks if t.split == name):
        path = Path(t.dst)
        attrs = read_file_attrs(path, split=t.split, index=t.index, dataset=t.dataset)
        versions.add(attrs["format_version"])
        files.append({"name": path.name, "count": attrs["count"]})
        skipped.extend(attrs["skipped"])
        if attrs["pixel_sum"] is not None:
            s = attrs["pixel_sum"].astype(np.uint64)
            total = s if total is None else total + s
    return files, skipped, total


def _finalize(out: Path, opts: Options, src: Sources, tasks: list[Task], run_info: dict,
              dataset: str | None) -> dict:
    """meta.json, mean.npy and report.json from the finished files (the files are the truth)."""
    meta_splits, skipped, counts, versions, total_sum = {}, [], {}, {FORMAT_VERSION}, None
    for name, split in src.splits.items():
        files, split_skipped, pixel_sum = _split_files(name, tasks, versions)
        meta_splits[name] = {"count": sum(f["count"] for f in files), "files": files}
        skipped += split_skipped
        counts[name] = {"sources": len(split.items), "written": meta_splits[name]["count"],
                        "skipped": len(split_skipped)}
        if name == "train":
            total_sum = pixel_sum
    n_train = meta_splits["train"]["count"]
    if n_train == 0:
        raise DataError("no training image could be decoded; see report.json")
    mean = (total_sum.astype(np.float64) / n_train).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, mean)
    atomic_write_bytes(out / "mean.npy", buf.getvalue())
    ignored = [d for s in src.splits.values() for d in s.ignored]
    atomic_write_json(out / "report.json", {"counts": counts, "skipped": skipped, "ignored": ignored,
                                            "last_run": run_info})
    # The oldest format present: what the reader's upgrade notice and scripts/upgrade_data.py go by.
    meta = {"format_version": min(versions), "classes": src.classes, "num_classes": len(src.classes),
            "image_size": opts.size, "resize": opts.resize, "per_file": opts.per_file, "seed": opts.seed,
            "splits": meta_splits, "mean": "mean.npy",
            "mean_sha256": hashlib.sha256(buf.getvalue()).hexdigest()}  # ties mean.npy to this output
    if dataset is not None:  # every file records it: a file of another output is refused where it is read
        meta["dataset"] = dataset
    if src.class_names is not None:
        meta["class_names"] = src.class_names
    if src.subset is not None:
        meta["subset"] = src.subset
    atomic_write_json(out / "meta.json", meta)
    return {"meta": meta, "counts": counts, "skipped": skipped, "ignored": ignored}


def preprocess(train_dir, out, val_dir=None, val_labels=None, opts: Options = Options(),
               workers: int | None = None, quiet: bool = False, class_names=None,
               shard_memory: int | None = None, allow_empty_classes: bool = False,
               allow_one_class: bool = False) -> dict:
    """Run (or resume) the whole preprocessing; returns a summary of what was written.

    train_dir, val_dir: a folder, or one or more archives (a path or a list); val_labels: a label file,
    the devkit, or [meta.mat, ground truth]; shard_memory: bytes of compressed images held per pass
    over gzip shards (default: half the available memory); allow_empty_classes: keep a class folder
    without images as a class (else an error); allow_one_class: accept one class, or a class named like a
    split (else an error). OSError when --out cannot be written (disk full, ...).
    """
    if opts.size < 1 or opts.per_file < 1:
        raise DataError(f"--size and --per-file must be positive (got {opts.size}, {opts.per_file})")
    if opts.resize not in RESIZE_MODES:
        raise DataError(f"--resize {opts.resize!r} is not one of {', '.join(RESIZE_MODES)}")
    # Before anything is written: a value refused later would leave a plan.json that blocks the right command.
    if opts.seed < 0:
        raise DataError(f"--seed must not be negative (got {opts.seed})")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be positive (got {workers})")
    out = Path(out)
    check_out(out, {"train dir": as_paths(train_dir), "val dir": as_paths(val_dir)})
    cores = len(os.sched_getaffinity(0))
    src = gather(train_dir, val_dir, val_labels, class_names, opts, out, workers or cores, quiet,
                 allow_empty_classes, allow_one_class)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        remove_stale_temps(out)  # meta.json's or report.json's write cut short by a kill
        dataset = _check_plan(out, _plan_record(opts, src))
        tasks = _tasks(out, opts, src, dataset)
        todo = [t for t in tasks if not _is_done(t)]
        workers = max(1, min(workers or cores, len(todo) or 1))
        budget = shard_memory or default_shard_memory()
        if not quiet:
            _print_start(src, tasks, todo, workers, budget)
        start = time.perf_counter()
        try:
            if todo:
                _run_pool(todo, workers, quiet, budget)
        finally:  # a killed worker's unfinished file (the pool is shut down by now)
            for name in src.splits:
                remove_stale_temps(out / name)
        seconds = time.perf_counter() - start
        images = sum(len(t.items) for t in todo)
        run_info = {"seconds": round(seconds, 3), "images": images, "workers": workers,
                    "images_per_s": round(images / seconds, 1) if images and seconds > 0 else None}
        return _finalize(out, opts, src, tasks, run_info, dataset)


def check_out(out: Path, inputs: dict[str, list[str]]) -> None:
    """Refuse, before any listing, an --out that is a file, cannot be written, lies inside an input
    folder (its files would become input) or would write its split folders over one."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder")
    base = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not base.is_dir():
        raise DataError(f"--out {out}: {base} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=base).close()  # a file can be made there
    except OSError as e:  # read-only, not ours, full: name the folder asked for, not the probe
        raise OSError(e.errno, os.strerror(e.errno) if e.errno else str(e), str(out)) from None
    foreign = _not_written_here(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataError(f"--out {out} holds files preprocess did not write ({shown}): name a new or empty folder "
                        "(an output of an earlier run, even one cut short, is resumed)")
    real_out = os.path.realpath(out)
    for what, paths in inputs.items():
        for path in (p for p in paths if Path(p).is_dir()):
            real = os.path.realpath(path)
            if _within(real_out, real):
                raise DataError(f"--out {out} is inside the {what} {path}: its files would be read as input")
            if any(_within(real, os.path.join(real_out, split)) for split in SPLITS):
                raise DataError(f"the {what} {path} is where --out {out} writes its batch files; use another --out")


# What preprocess writes into --out (and upgrade_data into an output); dotfiles are its lock and temporaries.
OWN_NAMES = ("plan.json", "meta.json", "report.json", "mean.npy", INDEX_NAME, *SPLITS)


def _batch_folder(path: Path) -> bool:
    """A split folder that preprocess wrote: its batch files (NNNNN.h5) and hidden temporaries, nothing else."""
    return path.is_dir() and all(e.name.startswith(".") or (e.name.endswith(BATCH_FILE_SUFFIX) and not e.is_dir())
                                 for e in os.scandir(path))


# Its own names known by what they hold: a raw dataset's train/ and val/ (class folders of images) are not
# split folders of batch files, and the user's meta.json is not preprocess's (both were written among); a
# user's sources_index.json was read as "no index yet" and replaced.
# plan.json is judged where it is read, naming what is wrong with it (_read_plan, _check_plan).
OWN_KNOWN = {**{split: Earlier("a folder of preprocess's batch files (NNNNN.h5) only", _batch_folder)
                for split in SPLITS},
             "meta.json": json_holding("an earlier preprocess output's meta.json", ("classes", "splits")),
             "report.json": json_holding("an earlier preprocess run's report", ("counts", "skipped")),
             "mean.npy": starting_with("a mean image preprocess wrote (.npy)", b"\x93NUMPY"),
             # by its first bytes: ImageNet's index is some 80 MB, read again only when archives are listed
             INDEX_NAME: starting_with("the archive index an earlier preprocess run wrote", INDEX_START)}
OUTPUT = OutputPath("folder", own=OWN_NAMES, known=OWN_KNOWN)


def _not_written_here(out: Path) -> list[str]:
    """The entries of an existing --out that are not this tool's: none for a new, empty or earlier output
    (the rule of --out's declared domain, for callers of preprocess() that parse no command line)."""
    return OUTPUT.foreign(out) + [name for name, _ in OUTPUT.unknown(out)] if out.is_dir() else []


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _print_start(src: Sources, tasks: list[Task], todo: list[Task], workers: int, budget: int) -> None:
    passes = sum(1 for part in stages(todo, budget) if _streamed(part[0]))
    print(f"preprocess: {len(src.classes)} classes"
          + (f" (of {len(src.all_classes)})" if len(src.classes) != len(src.all_classes) else "") + ", "
          + ", ".join(f"{k} {len(s.items)} images" for k, s in src.splits.items())
          + f"; {len(tasks) - len(todo)} of {len(tasks)} files already done; {workers} workers"
          + (f"; gzip shards: {passes} streaming pass(es) of <= {budget / 2**30:.1f} GiB" if passes else ""),
          file=sys.stderr)
