"""Convert a preprocessed folder's batch files to the current format, in place, one file at a time.

    python scripts/upgrade_data.py imagenet256

Each format-1 file is read whole (every image's Fletcher-32 checksum verified), written as format 2
under a temporary name, fsynced and renamed over the old file: at every moment each file is complete
in one format or the other, and the reader takes both, so the folder stays usable (even by a running
training) while it is converted. An interrupted run (Ctrl-C, kill -9, a full disk) is resumed by the
same command: converted files are skipped, stale temporary files removed. Files that cannot be
converted (missing, truncated, an image failing its checksum) are listed with the reason at the end
and left as they are; meta.json's format_version is updated last, to the oldest format left. An output
written before meta.json recorded its mean image's SHA-256 (mean_sha256) gets it, once the file reads as a
mean image of the output's size: from then on a mean.npy of another output is refused.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

from .batchfile import (
    FORMAT_VERSION,
    UPGRADE_COMMAND,
    BatchFileError,
    atomic_write_json,
    place_index,
    read_batch_file,
    read_file_attrs,
    write_batch_file,
)
from .domains import COUNT, InputPath, OneLineParser
from .fsutil import special_entries_words
from .layouts import DataError
from .meta import read_mean
from .preprocess import SPLITS, exclusive
from .procs import die_with_parent, run_all, stops_between_calls


def batch_files(root: Path) -> list[Path]:
    """The batch files of a folder: those meta.json lists (missing ones included), else those present."""
    meta_path = root / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{meta_path}: not valid JSON ({e})") from None
        return [root / split / f["name"] for split, s in meta["splits"].items() for f in s["files"]]
    # An unfinished preprocessing output: convert what is there; preprocess writes the rest.
    return sorted(p for split in SPLITS for p in (root / split).glob("[0-9]*.h5"))


def convert_file(path: Path, version: int = FORMAT_VERSION, place: tuple[str, int, int | None] | None = None) -> bool:
    """Rewrite one file in format `version` (atomically); False if it already was in it.

    Any version the reader takes can be written, so tests (and anyone going back to older code) can
    also make format-1 files. With `place` (split, index, count or None), a file that records another
    place (a link to or a copy of another batch file) is a BatchFileError, left as it is.
    """
    split, index, count = place if place is not None else (None, None, None)
    attrs = read_file_attrs(path, split=split, index=index, count=count)
    if attrs["format_version"] == version:
        return False
    images, labels, names = read_batch_file(path)  # verifies every image: never convert a corrupt one
    write_batch_file(path, images, labels, names, split=attrs["split"], index=attrs["index"],
                     skipped=attrs["skipped"], pixel_sum=attrs["pixel_sum"], version=version,
                     dataset=attrs["dataset"])
    return True


def _remove_stale_temps(root: Path) -> None:
    for split in SPLITS:
        for stale in (root / split).glob(".*.tmp"):
            stale.unlink()  # a half-written file of an interrupted run (we hold the folder's lock)


def _finish_meta(root: Path, versions: list[int]) -> None:
    """meta.json's format_version: the oldest format left (the reader's upgrade notice goes by it)."""
    path = root / "meta.json"
    if path.is_file() and versions:
        meta = json.loads(path.read_text())
        if meta.get("format_version") != min(versions):
            meta["format_version"] = min(versions)
            atomic_write_json(path, meta)


def _record_mean_digest(root: Path) -> tuple[str, dict | None]:
    """meta.json's mean_sha256 where it has none: ("recorded" | "already" | "no meta.json", None), or
    ("not recorded", a problem) where the mean image does not read as one of this output's size."""
    path = root / "meta.json"
    if not path.is_file():
        return "no meta.json", None
    meta = json.loads(path.read_text())
    if "mean_sha256" in meta:
        return "already", None
    mean = root / meta.get("mean", "mean.npy")
    try:
        digest = hashlib.sha256(mean.read_bytes()).hexdigest()
        read_mean(mean, meta["image_size"], digest)  # the bytes digested are the bytes checked
    except OSError as e:
        return "not recorded", {"path": str(mean), "reason": f"{mean}: cannot read the mean image ({e.strerror or e})"}
    except DataError as e:
        return "not recorded", {"path": str(mean), "reason": str(e)}
    meta["mean_sha256"] = digest
    atomic_write_json(path, meta)
    return "recorded", None


def _place(path: Path, count: int | None) -> tuple[str, int, int | None] | None:
    """What a file must record: its split folder, the index its name carries, meta.json's count (if listed)."""
    index = place_index(path.name, -1)
    return (path.parent.name, index, count) if index >= 0 else None


def _listed_counts(root: Path) -> dict[str, int]:
    """path -> count of every file meta.json lists (none without a meta.json)."""
    try:
        splits = json.loads((root / "meta.json").read_text())["splits"]
        return {str(root / k / f["name"]): int(f["count"]) for k, s in splits.items() for f in s["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _convert_task(path: str, count: int | None = None) -> tuple[int, int, str | None]:
    """(converted?, images, problem) for one file; a bad file is a finding, not a crash."""
    try:
        converted = convert_file(Path(path), place=_place(Path(path), count))
        return int(converted), read_file_attrs(path)["count"] if converted else 0, None
    except BatchFileError as e:
        return 0, 0, str(e)


def _init_worker() -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool; files in flight finish
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _convert_all(files: list[Path], workers: int, quiet: bool,
                 counts: dict[str, int]) -> list[tuple[int, int, str | None]]:
    """_convert_task of every file, in `workers` processes (in this one if 1), with a progress bar."""
    from tqdm import tqdm
    bar = tqdm(total=len(files), unit="file", desc="upgrade", disable=quiet)
    if workers <= 1:
        results = []
        for path in files:
            results.append(_convert_task(str(path), counts.get(str(path))))
            bar.update()
        bar.close()
        return results
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with stops_between_calls() as check, cf.ProcessPoolExecutor(workers, mp_context=ctx,
                                                                initializer=_init_worker) as pool:
        try:
            futures = run_all(pool, [(_convert_task, (str(path), counts.get(str(path)))) for path in files], check,
                              lambda finished, left: bar.update(len(finished)))
        finally:
            bar.close()
        return [fut.result() for fut in futures]


def upgrade(root: str | Path, quiet: bool = False, workers: int = 1) -> dict:
    """Convert every old-format batch file of `root`; returns counts, the problems and images/s."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root} does not exist (give a folder written by scripts/preprocess.py)")
    special = special_entries_words(root, str(root))
    if special:
        raise DataError(special)
    with exclusive(root):
        _remove_stale_temps(root)
        files = batch_files(root)
        if not files:
            raise DataError(f"{root} holds no batch files (no meta.json and no */NNNNN.h5)")
        start = time.perf_counter()
        results = _convert_all(files, max(1, min(workers, len(files))), quiet, _listed_counts(root))
        seconds = time.perf_counter() - start
        problems = [{"path": str(path), "reason": why} for path, (_, _, why) in zip(files, results) if why]
        failed = len(problems)
        mean_digest, problem = _record_mean_digest(root)
        problems += [problem] if problem else []
        _finish_meta(root, [_version_or_old(path) if why else FORMAT_VERSION
                            for path, (_, _, why) in zip(files, results)])
    converted, images = sum(r[0] for r in results), sum(r[1] for r in results)
    return {"files": len(files), "converted": converted, "mean_sha256": mean_digest,
            "already": len(files) - converted - failed, "failed": failed,
            "problems": problems, "images": images, "seconds": round(seconds, 3),
            "images_per_s": round(images / seconds, 1) if images and seconds > 0 else None}


def _version_or_old(path: Path) -> int:
    try:
        return read_file_attrs(path)["format_version"]
    except BatchFileError:
        return 1  # unreadable: counts as not converted


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="upgrade_data.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Re-run the same command to resume an interrupted run.\n\n"
                                       "example: python scripts/upgrade_data.py imagenet256")
    p.add_argument("root", type=InputPath("folder"), help="a folder written by scripts/preprocess.py")
    p.add_argument("--workers", type=COUNT, default=None,
                   help="processes converting files in parallel (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: converted files stay
    try:
        result = upgrade(args.root, args.quiet, args.workers or len(os.sched_getaffinity(0)))
    except DataError as e:
        print(f"upgrade: error: {e}", file=sys.stderr)
        return 2
    except cf.process.BrokenProcessPool:
        print(f"upgrade: error: a worker process died (killed or out of memory); converted files are kept: "
              f"re-run `{UPGRADE_COMMAND} {args.root}` to finish", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"upgrade: interrupted; converted files are kept: re-run `{UPGRADE_COMMAND} {args.root}` to "
              "finish", file=sys.stderr)
        return 130
    rate = f" ({result['images_per_s']} images/s)" if result["images_per_s"] else ""
    print(f"{args.root}: {result['converted']} files converted to format {FORMAT_VERSION}{rate}, "
          f"{result['already']} already were, {result['failed']} could not be converted")
    if result["mean_sha256"] == "recorded":
        print(f"{args.root}: meta.json now records the mean image's SHA-256 (mean_sha256): a mean image of another "
              "output is refused from now on")
    if result["problems"]:
        for prob in result["problems"]:
            print(f"  {prob['reason']}", file=sys.stderr)
        print("upgrade: restore these files from a copy, or delete them and re-run scripts/preprocess.py with "
              f"the original arguments (it rewrites missing files), then run `{UPGRADE_COMMAND} {args.root}` "
              "again", file=sys.stderr)
        return 1
    return 0
