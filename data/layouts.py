"""ImageNet source layouts: class discovery and the three validation label formats.

Train is always ``<wnid>/<image>`` folders. Validation is either the same folder layout, or a flat
folder of images plus a label file: Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString``
with the wnid first) or a Caffe-style ``val.txt`` (``<file> <label index>`` per line). Classes are the
sorted wnids and a label is the index in that order (the torchvision/Caffe convention).

Everything here only lists files; nothing is decoded. Problems that would make the whole run wrong
(missing folders, no classes, label files naming unknown files or classes) raise :class:`DataError`
before any work; single odd files are returned as ``ignored`` with the reason, never dropped silently.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTS = frozenset({".jpeg", ".jpg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"})


class DataError(ValueError):
    """Input that cannot be used: names the file, key or value at fault."""


@dataclass(frozen=True)
class Item:
    """One source image: its path relative to the split folder ('/'-separated) and its label."""

    path: str
    label: int


@dataclass
class Split:
    """The images of one split, in a defined order, plus the files that were passed over."""

    root: Path
    items: list[Item]
    ignored: list[dict] = field(default_factory=list)  # {path, reason}


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _require_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {p} does not exist")
    if not p.is_dir():
        raise DataError(f"{what} {p} is not a directory")
    return p


def _class_dirs(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def find_classes(train_dir: str | os.PathLike) -> list[str]:
    """The sorted class folder names (wnids) of a train folder."""
    root = _require_dir(train_dir, "train dir")
    classes = _class_dirs(root)
    if not classes:
        raise DataError(f"train dir {root} has no class folders (expected <wnid>/<image> folders)")
    return classes


def _walk_files(folder: Path) -> list[str]:
    """All files below `folder`, as sorted '/'-separated paths relative to it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(folder)
        out.extend((rel / f).as_posix() for f in filenames)
    return sorted(out)


def scan_folders(split_dir: str | os.PathLike, classes: list[str], what: str) -> Split:
    """A ``<wnid>/<image>`` split; every folder must be one of `classes`."""
    root = _require_dir(split_dir, what)
    present = _class_dirs(root)
    if not present:
        raise DataError(f"{what} {root} has no class folders (expected <wnid>/<image> folders)")
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise DataError(f"{what} {root} has class folders not in the train classes: "
                        f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    index = {c: i for i, c in enumerate(classes)}
    items, ignored = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_file():
            ignored.append({"path": entry.name, "reason": "file outside any class folder"})
    for wnid in present:
        for rel in _walk_files(root / wnid):
            path = f"{wnid}/{rel}"
            if is_image_name(rel):
                items.append(Item(path, index[wnid]))
            else:
                ignored.append({"path": path, "reason": "not an image file (by extension)"})
    return Split(root, items, ignored)


def _read_kaggle_csv(path: Path, index: dict[str, int]) -> dict[str, int]:
    """ImageId (no extension) -> label, from LOC_val_solution.csv."""
    labels: dict[str, int] = {}
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise DataError(f"{path}: expected the header 'ImageId,PredictionString', got {header}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) < 2 or not row[1].split():
                raise DataError(f"{path}:{lineno}: expected 'ImageId,<wnid> ...', got {row}")
            image_id, wnid = row[0].strip(), row[1].split()[0]
            if wnid not in index:
                raise DataError(f"{path}:{lineno}: class {wnid!r} is not one of the train classes")
            if image_id in labels:
                raise DataError(f"{path}:{lineno}: {image_id!r} is listed twice")
            labels[image_id] = index[wnid]
    return labels


def _read_caffe_txt(path: Path, num_classes: int) -> dict[str, int]:
    """File name -> label, from a Caffe-style val.txt."""
    labels: dict[str, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise DataError(f"{path}:{lineno}: expected '<file> <label index>', got {line.strip()!r}")
            name, label = parts[0], int(parts[1])
            if not 0 <= label < num_classes:
                raise DataError(f"{path}:{lineno}: label {label} is outside 0..{num_classes - 1} "
                                f"(the {num_classes} train classes)")
            if name in labels:
                raise DataError(f"{path}:{lineno}: {name!r} is listed twice")
            labels[name] = label
    return labels


def read_label_file(path: str | os.PathLike, classes: list[str]) -> tuple[dict[str, int], bool]:
    """Labels from a Kaggle CSV or a Caffe val.txt, and whether keys are extension-less stems."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"label file {p} does not exist")
    if p.suffix.lower() == ".csv":
        return _read_kaggle_csv(p, {c: i for i, c in enumerate(classes)}), True
    return _read_caffe_txt(p, len(classes)), False


def _examples(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def scan_flat(split_dir: str | os.PathLike, label_file: str | os.PathLike, classes: list[str],
              what: str) -> Split:
    """A flat split labelled by `label_file`; every listed file must exist and every image be listed."""
    root = _require_dir(split_dir, what)
    labels, by_stem = read_label_file(label_file, classes)
    items, ignored, unlabelled, seen = [], [], [], set()
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir():
            ignored.append({"path": entry.name + "/", "reason": "folder in a flat split"})
            continue
        if not is_image_name(entry.name):
            ignored.append({"path": entry.name, "reason": "not an image file (by extension)"})
            continue
        key = os.path.splitext(entry.name)[0] if by_stem else entry.name
        if key not in labels:
            unlabelled.append(entry.name)
            continue
        seen.add(key)
        items.append(Item(entry.name, labels[key]))
    missing = sorted(set(labels) - seen)
    if missing:
        raise DataError(f"label file {label_file} names {len(missing)} file(s) not found in {root}: "
                        f"{_examples(missing)}")
    if unlabelled:
        raise DataError(f"{len(unlabelled)} image(s) in {root} have no label in {label_file}: "
                        f"{_examples(unlabelled)}")
    return Split(root, items, ignored)


def scan_val(val_dir: str | os.PathLike, val_labels: str | os.PathLike | None,
             classes: list[str]) -> Split:
    """Validation split: flat with a label file, or class folders when no label file is given."""
    if val_labels is not None:
        return scan_flat(val_dir, val_labels, classes, "val dir")
    root = _require_dir(val_dir, "val dir")
    if not _class_dirs(root):
        raise DataError(f"val dir {root} has no class folders; for a flat val folder pass "
                        "--val-labels LOC_val_solution.csv (Kaggle) or val.txt (Caffe)")
    return scan_folders(root, classes, "val dir")
