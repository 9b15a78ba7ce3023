"""--val-labels: the labels of flat validation images, from Kaggle's ``LOC_val_solution.csv`` (with the
words of ``LOC_synset_mapping.txt`` beside it), a Caffe-style ``val.txt`` (label = index into the sorted
train wnids), or the ILSVRC2012 devkit (:mod:`data.devkit`); every labeller gives a wnid per image.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from .classnames import read_synset_mapping  # Kaggle ships the words beside its CSV
from .devkit import GROUND_TRUTH, devkit_labels
from .layouts import DataError, ValLabels


def _read_kaggle_csv(path: Path, classes: set[str]) -> dict[str, str]:
    """ImageId (no extension) -> wnid, from LOC_val_solution.csv."""
    labels: dict[str, str] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the header
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
            if wnid not in classes:
                raise DataError(f"{path}:{lineno}: class {wnid!r} is not one of the train classes")
            if image_id in labels:
                raise DataError(f"{path}:{lineno}: {image_id!r} is listed twice")
            labels[image_id] = wnid
    return labels


def _read_caffe_txt(path: Path, classes: list[str]) -> dict[str, str]:
    """File name -> wnid, from a Caffe-style val.txt (label = index into the sorted train wnids)."""
    labels: dict[str, str] = {}
    n = len(classes)
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise DataError(f"{path}:{lineno}: expected '<file> <label index>', got {line.strip()!r}")
            name, label = parts[0], int(parts[1])
            if not 0 <= label < n:
                raise DataError(f"{path}:{lineno}: label {label} is outside 0..{n - 1} (the {n} train classes)")
            if name in labels:
                raise DataError(f"{path}:{lineno}: {name!r} is listed twice")
            labels[name] = classes[label]
    return labels


def read_label_file(path: str | os.PathLike, classes: list[str]) -> ValLabels:
    """Labels from a Kaggle CSV (with the words of LOC_synset_mapping.txt beside it) or a Caffe val.txt."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"label file {p} does not exist")
    try:
        if p.suffix.lower() != ".csv":
            return ValLabels(str(p), _read_caffe_txt(p, classes), False)
        labels = _read_kaggle_csv(p, set(classes))
    except UnicodeDecodeError as e:
        raise DataError(f"label file {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    mapping = p.with_name("LOC_synset_mapping.txt")
    names = read_synset_mapping(mapping) if mapping.is_file() else None
    return ValLabels(str(p), labels, True, names, str(mapping))


def read_val_labels(spec: list[str | os.PathLike], classes: list[str]) -> ValLabels:
    """--val-labels: a Kaggle CSV, a Caffe val.txt, the devkit archive or folder, or meta.mat + ground truth."""
    paths = [Path(p) for p in spec]
    if not 1 <= len(paths) <= 2:
        raise DataError(f"--val-labels takes one label file or devkit, or meta.mat and the ground truth; got "
                        f"{len(paths)} paths")
    first = paths[0]
    if len(paths) == 2 or first.is_dir() or first.name.lower().endswith((".tar.gz", ".tgz", ".tar")):
        if not all(p.exists() for p in paths):
            raise DataError(f"label file {next(p for p in paths if not p.exists())} does not exist")
        return devkit_labels(paths)
    if first.suffix.lower() == ".mat":
        raise DataError(f"{first}: meta.mat alone gives no labels; pass the ground truth too: "
                        f"--val-labels {first} {GROUND_TRUTH}")
    return read_label_file(first, classes)
