"""The ILSVRC2012 devkit's validation labels: meta.mat and the ground truth, mapped to sorted-wnid labels.

``ILSVRC2012_devkit_t12.tar.gz`` holds ``data/meta.mat`` (a struct array ``synsets``: ``ILSVRC2012_ID``,
``WNID``, ``words``, ``num_children``, ...; the 1,000 classes are the leaves, ``num_children == 0``; the
other entries are inner WordNet nodes) and ``data/ILSVRC2012_validation_ground_truth.txt`` (line k: the
ILSVRC2012_ID of ``ILSVRC2012_val_%08d.JPEG`` with number k). The devkit numbers the classes by
ILSVRC2012_ID, which is NOT the sorted-wnid order that training and every released weight file use: an
ID is mapped to its WNID here, and :mod:`data.layouts` maps the WNID to its sorted position.

``--val-labels`` takes the devkit archive, its extracted folder, or ``meta.mat`` and the ground-truth
file (either order); :mod:`data.val_labels` picks this route. scipy reads meta.mat (imported only here).
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

from .layouts import DataError, ValLabels

META = "meta.mat"
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"


def read_meta(data: bytes, where: str) -> tuple[dict[int, str], dict[str, str]]:
    """(ILSVRC2012_ID -> WNID, WNID -> words) of the leaf synsets of a meta.mat's bytes."""
    import scipy.io  # a real dependency, but only the devkit route needs it
    try:
        synsets = scipy.io.loadmat(io.BytesIO(data), squeeze_me=True, struct_as_record=False)["synsets"]
        leaves = [(int(s.ILSVRC2012_ID), str(s.WNID), str(s.words)) for s in synsets.ravel()
                  if int(s.num_children) == 0]
    except (KeyError, AttributeError, ValueError, TypeError) as e:
        raise DataError(f"{where} is not the devkit's meta.mat (a struct array 'synsets' with ILSVRC2012_ID, "
                        f"WNID, words, num_children): {type(e).__name__}: {e}") from None
    ids = {i: w for i, w, _ in leaves}
    if len(ids) != len(leaves):
        raise DataError(f"{where}: an ILSVRC2012_ID is used by two leaf synsets")
    return ids, {w: words for _, w, words in leaves}


def read_ground_truth(text: str, where: str, ids: dict[int, str]) -> dict[str, str]:
    """'ILSVRC2012_val_%08d' -> WNID from the ground truth's lines (one ILSVRC2012_ID per line)."""
    labels = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        value = line.strip()
        if not value.isdigit() or int(value) not in ids:
            raise DataError(f"{where}:{lineno}: expected the ILSVRC2012_ID of a leaf class (one of "
                            f"{len(ids)} in meta.mat), got {value!r}")
        labels[f"ILSVRC2012_val_{lineno:08d}"] = ids[int(value)]
    if not labels:
        raise DataError(f"{where} is empty")
    return labels


def _from_archive(path: Path) -> dict[str, tuple[bytes, str]]:
    """meta.mat and the ground truth inside a devkit .tar.gz, by base name (found wherever they lie)."""
    found = {}
    try:
        with tarfile.open(path, "r:*") as tf:
            for ti in tf:
                base = ti.name.rsplit("/", 1)[-1]
                if ti.isfile() and base in (META, GROUND_TRUTH):
                    found[base] = (tf.extractfile(ti).read(), f"{path}:{ti.name}")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"devkit archive {path} is unreadable or truncated ({e})") from None
    return found


def _from_folder(path: Path) -> dict[str, tuple[bytes, str]]:
    found = {}
    for base in (META, GROUND_TRUTH):
        for candidate in (path / "data" / base, path / base):
            if candidate.is_file():
                found[base] = (candidate.read_bytes(), str(candidate))
                break
    return found


def _devkit_files(spec: list[Path]) -> dict[str, tuple[bytes, str]]:
    """{META: (bytes, where), GROUND_TRUTH: ...} from an archive, a folder, or the two files."""
    if len(spec) == 2:
        mats = [p for p in spec if p.suffix.lower() == ".mat"]
        if len(mats) != 1:
            raise DataError(f"two --val-labels files must be the devkit's meta.mat and its ground truth, got "
                            f"{', '.join(map(str, spec))}")
        for p in spec:
            if not p.is_file():
                raise DataError(f"label file {p} does not exist")
        gt = spec[1] if spec[0] == mats[0] else spec[0]
        return {META: (mats[0].read_bytes(), str(mats[0])), GROUND_TRUTH: (gt.read_bytes(), str(gt))}
    return _from_folder(spec[0]) if spec[0].is_dir() else _from_archive(spec[0])


def devkit_labels(spec: list[Path]) -> ValLabels:
    """Validation labels (stem -> WNID) and class words from the devkit."""
    files = _devkit_files(spec)
    for base in (META, GROUND_TRUTH):
        if base not in files:
            raise DataError(f"{' '.join(map(str, spec))} holds no {base} (expected the ILSVRC2012 devkit: "
                            f"data/{META} and data/{GROUND_TRUTH})")
    ids, words = read_meta(*files[META])
    gt, where = files[GROUND_TRUTH]
    return ValLabels(where, read_ground_truth(gt.decode(errors="replace"), where, ids), True, words,
                     files[META][1])


def devkit_words(path: Path) -> dict[str, str]:
    """WNID -> words of the leaf classes, from a meta.mat or a devkit archive or folder."""
    if path.suffix.lower() == ".mat":
        return read_meta(path.read_bytes(), str(path))[1]
    files = _from_folder(path) if path.is_dir() else _from_archive(path)
    if META not in files:
        raise DataError(f"{path} holds no {META} (expected the ILSVRC2012 devkit)")
    return read_meta(*files[META])[1]
