"""Write an extracted ImageNet-format tree in the forms ImageNet is distributed in (test fixtures, demos).

- image-net.org: a train tar of per-class tars (``<wnid>.tar`` of ``<file>``), a flat val tar, and a
  devkit ``.tar.gz`` whose ``meta.mat`` (written with scipy.io.savemat, inner WordNet nodes included)
  numbers the classes by ILSVRC2012_ID in an order that is NOT the sorted-wnid order (no class keeps
  its sorted position, so labels taken from the IDs would all be wrong), and its ground truth;
- Hugging Face ``imagenet-1k``: gzip shards of ``<stem>_<wnid>.JPEG`` members;
- Kaggle: ``LOC_synset_mapping.txt`` (the folders and ``LOC_val_solution.csv`` are the tree itself).

Members are written in a shuffled order: the routes must not depend on the order inside an archive.
"""
from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEVKIT_DIR = "ILSVRC2012_devkit_t12"


@dataclass
class Tree:
    """An extracted tree: train ``<wnid>/<file>`` folders, a flat val folder, its labels and class words."""

    train: Path
    val: Path
    val_labels: dict[str, str]  # val file name -> wnid
    words: dict[str, str]  # wnid -> words


def _files(folder: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        out += [(Path(dirpath) / f).relative_to(folder).as_posix() for f in filenames]
    return sorted(out)


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1_300_000_000, 0o644
    tf.addfile(info, io.BytesIO(data))


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            _add(tf, name, data)
    return buf.getvalue()


def _shuffled(items: list, rng: np.random.Generator) -> list:
    return [items[i] for i in rng.permutation(len(items))]


def write_train_tar(train: Path, path: Path, seed: int = 0) -> Path:
    """ILSVRC2012_img_train.tar's form: one ``<wnid>.tar`` per class folder; files outside any class
    folder (strays) are kept as plain members."""
    rng = np.random.default_rng(seed)
    classes = sorted(e.name for e in os.scandir(train) if e.is_dir())
    members = [(f"{c}.tar", _tar_bytes(_shuffled([(f, (train / c / f).read_bytes()) for f in _files(train / c)], rng)))
               for c in classes]
    members += [(e.name, Path(e.path).read_bytes()) for e in os.scandir(train) if e.is_file()]
    path.write_bytes(_tar_bytes(_shuffled(members, rng)))
    return path


def write_val_tar(val: Path, path: Path, seed: int = 0) -> Path:
    """ILSVRC2012_img_val.tar's form: the flat files."""
    rng = np.random.default_rng(seed)
    path.write_bytes(_tar_bytes(_shuffled([(f, (val / f).read_bytes()) for f in _files(val)], rng)))
    return path


def _derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation that moves every element (n >= 2)."""
    while True:
        p = rng.permutation(n)
        if n < 2 or not np.any(p == np.arange(n)):
            return p


def _synsets(classes: list[str], words: dict[str, str], rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """meta.mat's struct array: the leaves with IDs 1..K in a deranged order, two inner nodes listed first."""
    ids = {c: int(i) + 1 for c, i in zip(classes, _derangement(len(classes), rng))}
    half = len(classes) // 2
    inner = [(len(classes) + 1, "n00001740", "entity", [ids[c] for c in classes[:half]] + [len(classes) + 2]),
             (len(classes) + 2, "n00002137", "abstraction, abstract entity", [ids[c] for c in classes[half:]])]
    rows = [(i, w, text, len(kids), np.array(kids, dtype=np.uint16), 3) for i, w, text, kids in inner]
    rows += [(ids[c], c, words.get(c, c), 0, np.zeros(0, dtype=np.uint16), 0) for c in classes]
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    synsets = np.zeros((len(rows), 1), dtype=[(f, object) for f in fields])
    for k, (i, w, text, n_kids, kids, height) in enumerate(rows):
        synsets[k, 0] = (np.uint16(i), w, text, f"gloss of {w}", np.uint16(n_kids), kids, np.uint8(height),
                         np.uint16(0 if n_kids else 1300))
    return synsets, ids


def write_devkit(tree: Tree, path: Path, seed: int = 0) -> tuple[Path, dict[str, int]]:
    """ILSVRC2012_devkit_t12.tar.gz: data/meta.mat and the ground truth; returns the path and wnid -> ID."""
    import scipy.io
    classes = sorted(e.name for e in os.scandir(tree.train) if e.is_dir())
    synsets, ids = _synsets(classes, tree.words, np.random.default_rng(seed))
    mat = io.BytesIO()
    scipy.io.savemat(mat, {"synsets": synsets})
    gt = "".join(f"{ids[tree.val_labels[name]]}\n" for name in _numbered(tree.val_labels))
    with tarfile.open(path, "w:gz") as tf:
        _add(tf, f"{DEVKIT_DIR}/COPYING", b"synthetic devkit for tests\n")
        _add(tf, f"{DEVKIT_DIR}/data/meta.mat", mat.getvalue())
        _add(tf, f"{DEVKIT_DIR}/data/ILSVRC2012_validation_ground_truth.txt", gt.encode())
    return path, ids


def _numbered(val_labels: dict[str, str]) -> list[str]:
    """The val files in ground-truth order: ILSVRC2012_val_00000001.JPEG, ... (all numbers present)."""
    names = sorted(val_labels)
    expected = [f"ILSVRC2012_val_{k:08d}" for k in range(1, len(names) + 1)]
    if [os.path.splitext(n)[0] for n in names] != expected:
        raise ValueError("the devkit's ground truth needs val files ILSVRC2012_val_00000001 ... numbered from 1")
    return names


def write_hf_shards(tree: Tree, folder: Path, shards: int = 2, seed: int = 0) -> tuple[list[Path], list[Path]]:
    """Hugging Face imagenet-1k's form: train_images_K.tar.gz (``<stem>_<wnid>.JPEG``, images dealt over
    the shards at random) and val_images.tar.gz (``ILSVRC2012_val_N_<wnid>.JPEG``)."""
    rng = np.random.default_rng(seed)
    train = []
    for rel in _files(tree.train):
        if "/" in rel:  # a class image (strays in class folders too: HF would name them the same way)
            wnid, name = rel.split("/", 1)
            stem, ext = os.path.splitext(name)
            train.append((f"{stem}_{wnid}{ext}", (tree.train / rel).read_bytes()))
    parts = [[] for _ in range(shards)]
    for member, k in zip(_shuffled(train, rng), rng.integers(0, shards, len(train))):
        parts[k].append(member)
    train_paths = [folder / f"train_images_{k}.tar.gz" for k in range(shards)]
    for p, members in zip(train_paths, parts):
        _write_gz(p, members)
    val = [(f"{os.path.splitext(n)[0]}_{w}{os.path.splitext(n)[1]}", (tree.val / n).read_bytes())
           for n, w in tree.val_labels.items()]
    _write_gz(folder / "val_images.tar.gz", sorted(val))
    return train_paths, [folder / "val_images.tar.gz"]


def _write_gz(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w:gz", compresslevel=1) as tf:
        for name, data in members:
            _add(tf, name, data)


def write_synset_mapping(words: dict[str, str], path: Path) -> Path:
    """Kaggle's LOC_synset_mapping.txt: '<wnid> <words>' per line, sorted by wnid."""
    path.write_text("".join(f"{w} {words[w]}\n" for w in sorted(words)))
    return path


def write_formats(tree: Tree, out: Path, seed: int = 0, shards: int = 2) -> dict:
    """Every distribution form of `tree` under `out`; returns their paths (and the devkit's wnid -> ID)."""
    out.mkdir(parents=True, exist_ok=True)
    devkit, ids = write_devkit(tree, out / f"{DEVKIT_DIR}.tar.gz", seed)
    hf_train, hf_val = write_hf_shards(tree, out, shards, seed)
    return {"train_tar": write_train_tar(tree.train, out / "ILSVRC2012_img_train.tar", seed),
            "val_tar": write_val_tar(tree.val, out / "ILSVRC2012_img_val.tar", seed),
            "devkit": devkit, "devkit_ids": ids, "hf_train": hf_train, "hf_val": hf_val,
            "synset_mapping": write_synset_mapping(tree.words, out / "LOC_synset_mapping.txt")}
