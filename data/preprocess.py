"""Preprocess an ImageNet JPEG tree into batch files, a mean image, meta.json and report.json.

The library side of ``scripts/preprocess.py``. One task writes one batch file; tasks run in a pool of
worker processes. The run is planned first (which source goes into which file), the plan is recorded
in ``plan.json``, and a re-run with the same arguments skips every finished file, so an interrupted
run (Ctrl-C, kill -9, a dead worker, a full disk) resumes where it stopped. ``meta.json`` is written
last and marks the output finished.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import io
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .batchfile import (
    FORMAT_VERSION,
    BatchFileError,
    atomic_write_bytes,
    atomic_write_json,
    batch_file_name,
    read_file_attrs,
    write_batch_file,
)
from .decode import RESIZE_MODES, load_image
from .layouts import DataError, Item, Split, find_classes, scan_folders, scan_val
from .procs import die_with_parent

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Options:
    """What determines the output; a re-run must match these (workers and progress do not count)."""

    size: int = 256
    per_file: int = 256
    resize: str = "short"
    seed: int = 1


@dataclass(frozen=True)
class Task:
    """Write one batch file from `items` (paths relative to `src`)."""

    split: str
    index: int
    items: tuple[Item, ...]
    src: str
    dst: str
    size: int
    resize: str


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


def _tick() -> None:
    if _progress is not None:
        with _progress.get_lock():
            _progress.value += 1


def process_task(task: Task) -> int:
    """Decode, resize and write one batch file; returns the number of images written."""
    n = len(task.items)
    images = np.empty((n, task.size, task.size, 3), dtype=np.uint8)
    labels, names, skipped = [], [], []
    for item in task.items:
        try:
            images[len(names)] = load_image(os.path.join(task.src, item.path), task.size, task.resize)
        except Exception as e:  # any decoder failure means this one image is skipped, and said so
            skipped.append({"path": f"{task.split}/{item.path}", "reason": f"{type(e).__name__}: {e}"})
        else:
            labels.append(item.label)
            names.append(item.path)
        _tick()
    images = images[:len(names)]
    pixel_sum = images.sum(axis=0, dtype=np.uint64) if task.split == "train" else None
    write_batch_file(task.dst, images, np.asarray(labels, np.int64), names, split=task.split,
                     index=task.index, skipped=skipped, pixel_sum=pixel_sum)
    return len(names)


# -- parent side ---------------------------------------------------------------------------------

def _scan(train_dir, val_dir, val_labels) -> tuple[list[str], dict[str, Split]]:
    classes = find_classes(train_dir)
    splits = {"train": scan_folders(train_dir, classes, "train dir")}
    if val_dir is not None:
        splits["val"] = scan_val(val_dir, val_labels, classes)
    elif val_labels is not None:
        raise DataError("--val-labels given without --val-dir")
    for name, split in splits.items():
        if not split.items:
            raise DataError(f"{name} dir {split.root} holds no image files")
    return classes, splits


def _plan_record(opts: Options, classes: list[str], splits: dict[str, Split]) -> dict:
    return {"format_version": FORMAT_VERSION, **asdict(opts),
            "classes": sources_digest([Item(c, i) for i, c in enumerate(classes)]),
            "splits": {k: {"sources": sources_digest(s.items), "images": len(s.items)}
                       for k, s in splits.items()}}


def _check_plan(out: Path, record: dict) -> None:
    """Refuse to resume into an output made with other arguments or other sources."""
    path = out / "plan.json"
    if not path.exists():
        atomic_write_json(path, record)
        return
    old = json.loads(path.read_text())
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


@contextmanager
def exclusive(out: Path):
    """One writer per output folder (preprocess or upgrade): a second concurrent run would corrupt the first."""
    import fcntl
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"another preprocess or upgrade run is writing to {out}") from None
        yield


def _is_done(path: Path) -> bool:
    try:
        read_file_attrs(path)
        return True
    except BatchFileError:
        return False


def _tasks(out: Path, opts: Options, splits: dict[str, Split]) -> list[Task]:
    tasks = []
    for name, split in splits.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        for stale in (out / name).glob(".*.tmp"):
            stale.unlink()  # a half-written file of an interrupted run
        for i, items in enumerate(plan_files(name, split.items, opts)):
            tasks.append(Task(name, i, items, str(split.root), str(out / name / batch_file_name(i)),
                              opts.size, opts.resize))
    return tasks


def _run_pool(todo: list[Task], workers: int, quiet: bool) -> None:
    """Run the tasks with a progress bar (images/s, ETA); a dead worker or Ctrl-C stops cleanly."""
    from tqdm import tqdm
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    counter = ctx.Value("q", 0)
    total = sum(len(t.items) for t in todo)
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                initargs=(counter,)) as pool:
        # Submitting forks every worker; the progress bar (and its monitor thread) comes after, so
        # the forks happen while this process is still single-threaded.
        pending = {pool.submit(process_task, t) for t in todo}
        bar = tqdm(total=total, unit="img", desc="preprocess", disable=quiet, smoothing=0.05)
        try:
            while pending:
                done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    fut.result()  # re-raises a worker's error (disk full, ...) or BrokenProcessPool
                bar.update(counter.value - bar.n)
                bar.set_postfix(files=f"{len(todo) - len(pending)}/{len(todo)}", refresh=False)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        finally:
            bar.close()


def _finalize(out: Path, classes: list[str], opts: Options, splits: dict[str, Split], tasks: list[Task],
              run_info: dict) -> dict:
    """meta.json, mean.npy and report.json from the finished files (the files are the truth)."""
    meta_splits, skipped, total_sum, n_train, versions = {}, [], None, 0, {FORMAT_VERSION}
    for name in splits:
        files = []
        for path in (Path(t.dst) for t in tasks if t.split == name):
            attrs = read_file_attrs(path)
            versions.add(attrs["format_version"])
            files.append({"name": path.name, "count": attrs["count"]})
            skipped.extend(attrs["skipped"])
            if name == "train":
                s = attrs["pixel_sum"].astype(np.uint64)
                total_sum = s if total_sum is None else total_sum + s
                n_train += attrs["count"]
        meta_splits[name] = {"count": sum(f["count"] for f in files), "files": files}
    if n_train == 0:
        raise DataError("no training image could be decoded; see report.json")
    mean = (total_sum.astype(np.float64) / n_train).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, mean)
    atomic_write_bytes(out / "mean.npy", buf.getvalue())
    ignored = [{"path": f"{k}/{d['path']}", "reason": d["reason"]} for k, s in splits.items() for d in s.ignored]
    counts = {k: {"sources": len(s.items), "written": meta_splits[k]["count"],
                  "skipped": sum(1 for d in skipped if d["path"].startswith(k + "/"))}
              for k, s in splits.items()}
    atomic_write_json(out / "report.json", {"counts": counts, "skipped": skipped, "ignored": ignored,
                                            "last_run": run_info})
    # The oldest format present: what the reader's upgrade notice and scripts/upgrade_data.py go by.
    meta = {"format_version": min(versions), "classes": classes, "num_classes": len(classes),
            "image_size": opts.size, "resize": opts.resize, "per_file": opts.per_file, "seed": opts.seed,
            "splits": meta_splits, "mean": "mean.npy"}
    atomic_write_json(out / "meta.json", meta)
    return {"meta": meta, "counts": counts, "skipped": skipped, "ignored": ignored}


def preprocess(train_dir, out, val_dir=None, val_labels=None, opts: Options = Options(),
               workers: int | None = None, quiet: bool = False) -> dict:
    """Run (or resume) the whole preprocessing; returns a summary of what was written."""
    if opts.size < 1 or opts.per_file < 1:
        raise DataError(f"--size and --per-file must be positive (got {opts.size}, {opts.per_file})")
    if opts.resize not in RESIZE_MODES:
        raise DataError(f"--resize {opts.resize!r} is not one of {', '.join(RESIZE_MODES)}")
    classes, splits = _scan(train_dir, val_dir, val_labels)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):
        _check_plan(out, _plan_record(opts, classes, splits))
        tasks = _tasks(out, opts, splits)
        todo = [t for t in tasks if not _is_done(Path(t.dst))]
        workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(todo) or 1))
        if not quiet:
            print(f"preprocess: {len(classes)} classes, "
                  + ", ".join(f"{k} {len(s.items)} images" for k, s in splits.items())
                  + f"; {len(tasks) - len(todo)} of {len(tasks)} files already done; {workers} workers",
                  file=sys.stderr)
        start = time.perf_counter()
        if todo:
            _run_pool(todo, workers, quiet)
        seconds = time.perf_counter() - start
        images = sum(len(t.items) for t in todo)
        run_info = {"seconds": round(seconds, 3), "images": images, "workers": workers,
                    "images_per_s": round(images / seconds, 1) if images and seconds > 0 else None}
        return _finalize(out, classes, opts, splits, tasks, run_info)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess.py", description=__doc__.splitlines()[0],
        epilog="Re-run the same command to resume an interrupted run. See README.md for ImageNet.")
    p.add_argument("--train-dir", required=True, help="ILSVRC2012 train folder: <wnid>/<image>")
    p.add_argument("--val-dir", help="val folder: <wnid>/<image>, or flat with --val-labels")
    p.add_argument("--val-labels", help="LOC_val_solution.csv (Kaggle) or val.txt (Caffe) for a flat val")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--size", type=int, default=256, help="output side in pixels (default 256)")
    p.add_argument("--per-file", type=int, default=256, help="images per batch file (default 256)")
    p.add_argument("--resize", choices=RESIZE_MODES, default="short",
                   help="short: shorter side to --size then central crop (default); warp: straight resize")
    p.add_argument("--seed", type=int, default=1, help="seed of the training-order shuffle (default 1)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = Options(args.size, args.per_file, args.resize, args.seed)
    # SIGTERM stops like Ctrl-C: finished files are kept and a re-run resumes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        summary = preprocess(args.train_dir, args.out, args.val_dir, args.val_labels, opts,
                             args.workers, args.quiet)
    except DataError as e:
        print(f"preprocess: error: {e}", file=sys.stderr)
        return 2
    except cf.process.BrokenProcessPool:
        print("preprocess: error: a worker process died (killed or out of memory); finished files "
              "are kept: re-run the same command to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("preprocess: interrupted; finished files are kept: re-run the same command to resume",
              file=sys.stderr)
        return 130
    _print_summary(Path(args.out), summary)
    return 0


def _print_summary(out: Path, summary: dict) -> None:
    for k, c in summary["counts"].items():
        print(f"{k}: {c['written']} images written to {out / k} ({len(summary['meta']['splits'][k]['files'])}"
              f" files), {c['skipped']} skipped")
    print(f"mean image: {out / 'mean.npy'}; meta: {out / 'meta.json'}")
    if summary["skipped"] or summary["ignored"]:
        print(f"{len(summary['skipped'])} unreadable and {len(summary['ignored'])} non-image files are listed "
              f"with the reason in {out / 'report.json'}")
