"""The batch-file format: HDF5 files of uint8 images, written atomically, checksummed per image.

One file ``<out>/<split>/NNNNN.h5`` holds

- ``images``: uint8, N x H x W x 3, RGB, chunked one image per chunk with HDF5's Fletcher-32 filter,
  so every read verifies its bytes and a corrupted image is an error, not silent garbage;
- ``labels``: int64, N;
- ``names``: UTF-8 strings, N: the source path relative to its split folder;
- train files also ``pixel_sum``: uint32, H x W x 3, the exact per-pixel sum of the file's images
  (the mean image is their total, so it needs no second read and survives a resumed run);
- attributes ``format_version``, ``split``, ``index``, ``count``, ``image_size`` and ``skipped``
  (JSON list of ``{path, reason}`` for the sources of this file that could not be decoded).

Files are written under a temporary name, fsynced, then renamed, so a reader never accepts a
half-written file. A finished output has ``meta.json`` (written last); see :mod:`data.reader`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

FORMAT_VERSION = 1
BATCH_FILE_SUFFIX = ".h5"


class BatchFileError(OSError):
    """A batch file that is missing, truncated, corrupt or not what meta.json says; names the file."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)


def batch_file_name(index: int) -> str:
    return f"{index:05d}{BATCH_FILE_SUFFIX}"


def temp_path(path: Path) -> Path:
    """A per-process temporary name beside `path`: never matched by the reader's file names."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either the old or the new content, never a mix."""
    path = Path(path)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def write_batch_file(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray, names: list[str],
                     *, split: str, index: int, skipped: list[dict] | None = None,
                     pixel_sum: np.ndarray | None = None) -> None:
    """Write one batch file atomically (temporary name, fsync, rename)."""
    path = Path(path)
    n = len(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise ValueError(f"{path}: images must be uint8 N x H x W x 3, got {images.dtype} {images.shape}")
    if len(labels) != n or len(names) != n:
        raise ValueError(f"{path}: {n} images but {len(labels)} labels and {len(names)} names")
    tmp = temp_path(path)
    with h5py.File(tmp, "w") as f:
        chunks = (1,) + images.shape[1:] if n else None
        f.create_dataset("images", data=images, chunks=chunks, fletcher32=bool(n))
        f.create_dataset("labels", data=np.asarray(labels, dtype=np.int64))
        f.create_dataset("names", data=np.array(names, dtype=object), dtype=h5py.string_dtype())
        if pixel_sum is not None:
            f.create_dataset("pixel_sum", data=pixel_sum.astype(np.uint32), compression="gzip",
                             compression_opts=1)
        f.attrs.update(format_version=FORMAT_VERSION, split=split, index=index, count=n,
                       image_size=images.shape[1], skipped=json.dumps(skipped or []))
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def open_batch_file(path: str | os.PathLike, expect_count: int | None = None,
                    expect_size: int | None = None) -> h5py.File:
    """Open a batch file for reading and check its structure; BatchFileError names the file."""
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(path, "batch file is missing")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise BatchFileError(path, f"corrupt or truncated batch file ({e})") from None
    try:
        _check_structure(f, path, expect_count, expect_size)
    except BaseException:
        f.close()
        raise
    return f


def _check_structure(f: h5py.File, path: Path, expect_count: int | None, expect_size: int | None) -> None:
    for key in ("images", "labels", "names"):
        if key not in f:
            raise BatchFileError(path, f"dataset {key!r} is missing (not a batch file?)")
    version = f.attrs.get("format_version")
    if version != FORMAT_VERSION:
        raise BatchFileError(path, f"format_version {version}, this code reads {FORMAT_VERSION}")
    images, n = f["images"], f["images"].shape[0]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise BatchFileError(path, f"images are {images.dtype} {images.shape}, expected uint8 N x H x W x 3")
    if f["labels"].shape != (n,) or f["names"].shape != (n,):
        raise BatchFileError(path, f"{n} images but {f['labels'].shape[0]} labels, {f['names'].shape[0]} names")
    if expect_count is not None and n != expect_count:
        raise BatchFileError(path, f"holds {n} images, meta.json says {expect_count}")
    if expect_size is not None and images.shape[1:3] != (expect_size, expect_size):
        raise BatchFileError(path, f"images are {images.shape[1]}x{images.shape[2]}, meta.json says "
                                   f"{expect_size}x{expect_size}")


def read_batch_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The whole content of one batch file: images, labels, names (every image's checksum verified)."""
    with open_batch_file(path) as f:
        try:
            images = f["images"][...]
            labels = f["labels"][...]
            names = [s.decode() if isinstance(s, bytes) else s for s in f["names"][...]]
        except OSError as e:
            raise BatchFileError(path, f"corrupt batch file, read failed ({e})") from None
    return images, labels, names


def read_file_attrs(path: str | os.PathLike) -> dict:
    """The attributes and pixel_sum of a finished batch file (cheap: no image is read)."""
    with open_batch_file(path) as f:
        out = {k: f.attrs[k] for k in ("split", "index", "count", "image_size")}
        out["count"], out["index"], out["image_size"] = int(out["count"]), int(out["index"]), int(out["image_size"])
        out["skipped"] = json.loads(f.attrs["skipped"])
        out["pixel_sum"] = f["pixel_sum"][...] if "pixel_sum" in f else None
    return out
