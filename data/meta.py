"""Everything a reader needs from a preprocessed folder, checked in one place before any training.

``read_meta`` parses and validates ``meta.json`` against its schema (any JSON value may be anywhere, and
any byte may be in the file): format version, classes, image size, splits with their files and counts.
``check_files`` then checks what meta.json lists: every batch file present, of at least the size its
count implies, a file of its own (no two listed names one file), holding images of the stated count and
size and recording its own split, index and count; the mean image's shape and values.
Every failure is one DataError naming the file and what is wrong.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .batchfile import READABLE_VERSIONS, BatchFileError, open_batch_file, place_index
from .fsutil import SPECIAL, is_special
from .layouts import DataError
from .text import shown

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file or split name: no path, no "..", no dotfile


class _Schema:
    """Checks on one parsed meta.json; each failure names the file and the key."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, what: str, value: Any) -> DataError:
        return DataError(f"{self.path}: {where} must be {what}, got {shown(value, 60)}")

    def int_at_least(self, value: Any, low: int, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self.fail(where, f"an integer >= {low}", value)
        return value

    def of_type(self, value: Any, kind: type, where: str, what: str) -> Any:
        if not isinstance(value, kind):
            raise self.fail(where, what, value)
        return value

    def name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not _PLAIN_NAME.match(value):
            raise self.fail(where, "a plain file name (letters, digits, _ . -)", value)
        return value

    def check(self, meta: Any) -> None:
        self.of_type(meta, dict, "the top level", "a JSON object")
        version = meta.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:  # not 2.0, not true
            raise DataError(f"{self.path}: format_version {shown(version, 60)}, this code reads "
                            f"{' and '.join(map(str, READABLE_VERSIONS))}")
        classes = self.of_type(meta.get("classes"), list, "classes", "a list of class names")
        for i, c in enumerate(classes):
            if not isinstance(c, str) or not c:
                raise self.fail(f"classes[{i}]", "a non-empty string", c)
        if len(set(classes)) != len(classes) or not classes:
            raise self.fail("classes", "a non-empty list without repeats", classes)
        if self.int_at_least(meta.get("num_classes"), 1, "num_classes") != len(classes):
            raise DataError(f"{self.path}: num_classes is {meta['num_classes']} but classes lists {len(classes)}")
        self.int_at_least(meta.get("image_size"), 1, "image_size")
        self.name(meta.get("mean", "mean.npy"), "mean")
        if "mean_sha256" in meta and not (isinstance(meta["mean_sha256"], str) and _SHA256.match(meta["mean_sha256"])):
            raise self.fail("mean_sha256", "the mean image's SHA-256 (64 hex digits)", meta["mean_sha256"])
        if "dataset" in meta:
            self.of_type(meta["dataset"], str, "dataset", "the output's identity, a string")
        splits = self.of_type(meta.get("splits"), dict, "splits", "an object of splits")
        for split, entry in splits.items():
            self.split(self.name(split, "a split name"), entry)

    def split(self, split: str, entry: Any) -> None:
        where = f"splits.{split}"
        self.of_type(entry, dict, where, "an object with count and files")
        files = self.of_type(entry.get("files"), list, f"{where}.files", "a list of files")
        names = set()
        for i, f in enumerate(files):
            self.of_type(f, dict, f"{where}.files[{i}]", "an object with name and count")
            names.add(self.name(f.get("name"), f"{where}.files[{i}].name"))
            self.int_at_least(f.get("count"), 0, f"{where}.files[{i}].count")
        if len(names) != len(files):
            raise DataError(f"{self.path}: {where}.files lists a file twice")
        total = sum(f["count"] for f in files)
        if self.int_at_least(entry.get("count"), 0, f"{where}.count") != total:
            raise DataError(f"{self.path}: {where}.count is {entry['count']} but its files hold {total} images")


def read_meta(root: str | os.PathLike) -> dict:
    """meta.json of a finished preprocessing output, validated; DataError naming the file otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data root {root} does not exist (set data.root to a preprocessed folder)")
    path = root / "meta.json"
    if is_special(path):
        raise DataError(f"{path}: {SPECIAL}")
    if not path.is_file():
        raise DataError(f"{root} is not a finished preprocessing output: {path} is missing "
                        "(run scripts/preprocess.py, or re-run it to finish)")
    try:
        raw = path.read_bytes()
        meta = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): damaged, "
                        "or not a meta.json") from None
    except (ValueError, RecursionError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    _Schema(path).check(meta)
    return meta


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def npy_error(e: Exception) -> str:
    """What np.load(allow_pickle=False) said of a file that is no plain .npy array, in one line, without
    numpy's advice to load it unsafely: a file given to the tools is never unpickled."""
    text = str(e).strip()
    if "pickled" in text:
        return "no .npy header: pickled objects or other bytes, refused (never unpickled)"
    return text.splitlines()[0][:200] if text else type(e).__name__


def read_mean(path: str | os.PathLike, size: int, sha256: str | None = None) -> np.ndarray:
    """A mean image .npy (size x size x 3, finite), as float32; DataError naming the file otherwise, and
    where `sha256` (meta.json's mean_sha256) is given, unless the file's bytes have that digest."""
    if is_special(path):
        raise DataError(f"{path}: {SPECIAL}")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the mean image ({e.strerror or e})") from None
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise DataError(f"{path}: not this output's mean image (its SHA-256 is not meta.json's mean_sha256): "
                        "a file of another preprocessing output, or changed since; run scripts/preprocess.py "
                        "again to remake it")
    try:
        mean = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise DataError(f"{path}: cannot read the mean image ({npy_error(e)})") from None
    if mean.shape != (size, size, 3) or mean.dtype.kind not in "fiu":
        raise DataError(f"{path}: {mean.dtype} {mean.shape}, expected numbers of shape {(size, size, 3)}")
    mean = mean.astype(np.float32)
    if not np.isfinite(mean).all():
        raise DataError(f"{path}: the mean image holds NaN or inf")
    return mean


def check_files(root: str | os.PathLike, meta: dict, splits: tuple[str, ...], mean: bool = True) -> None:
    """Check the batch files of `splits` (and the mean image if `mean`) against meta.json.

    Cheap: one stat and one HDF5 header per file and its labels, no image is read (their checksums are
    checked as they are read). Every label must name one of meta.json's classes: a label past them would
    stop training at its batch with an index error, or, below the model's own class count, train on it.
    """
    root, size = Path(root), meta["image_size"]
    for split in splits:
        if split not in meta["splits"]:
            raise DataError(f"{root} has no {split!r} split (has: {', '.join(meta['splits']) or 'none'})")
    listed = [(root / split / f["name"], split, place_index(f["name"], i), f["count"])
              for split in splits for i, f in enumerate(meta["splits"][split]["files"])]
    seen: dict[tuple[int, int], Path] = {}  # (device, inode) -> the listed file that is it
    for path, _, _, count in listed:  # every stat first: two names of one file are named as such
        _check_batch_file(path, count, size, seen)
    classes = len(meta["classes"])
    for path, split, index, count in listed:
        _check_place(path, split, index, count, size, classes, meta.get("dataset"))
    if mean:
        read_mean(root / meta.get("mean", "mean.npy"), size, meta.get("mean_sha256"))


def _check_batch_file(path: Path, count: int, size: int, seen: dict[tuple[int, int], Path]) -> None:
    """Present, long enough for its images, and not the same file as another listed one (the name at
    fault is the symbolic link, if one of the two is)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: batch file is missing (listed in meta.json)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    need = count * size * size * 3
    if st.st_size < need:
        raise DataError(f"{path}: {st.st_size} bytes, but {count} images of {size}x{size} need at least {need} "
                        "(truncated?)")
    other = seen.setdefault((st.st_dev, st.st_ino), path)
    if other != path:  # a symbolic or hard link: one file's images would be read twice, another's never
        if other.is_symlink() and not path.is_symlink():
            path, other = other, path
        raise DataError(f"{path}: the same file as {other} (device {st.st_dev}, inode {st.st_ino}: a symbolic or "
                        "hard link); each listed batch file must be a file of its own: restore it")


def _check_place(path: Path, split: str, index: int, count: int, size: int, classes: int,
                 dataset: str | None = None) -> None:
    """Its structure, the split, index and count it records (batchfile.check_place), the output it belongs
    to (meta.json's dataset, where the output has one), and its labels."""
    try:
        with open_batch_file(path, count, size, split=split, index=index, dataset=dataset) as f:
            labels = np.asarray(f["labels"][:count])
    except BatchFileError as e:
        raise DataError(str(e)) from None
    bad = np.flatnonzero((labels < 0) | (labels >= classes))
    if bad.size:
        row = int(bad[0])
        raise DataError(f"{path}: image {row} has label {int(labels[row])}, but meta.json lists {classes} classes "
                        f"(labels 0 to {classes - 1}; {bad.size} such image(s) in this file): the file is not this "
                        "output's; restore it, or delete it and re-run scripts/preprocess.py")


def class_difference(a: list[str], b: list[str]) -> str:
    """Where two class lists first differ, e.g. "at index 3: 'n01' vs 'n02'" (or their lengths)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    first = f"first at index {i}: {a[i] if i < len(a) else None!r} vs {b[i] if i < len(b) else None!r}"
    return f"{len(a)} and {len(b)} classes, {first}" if len(a) != len(b) else first
