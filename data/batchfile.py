"""The batch-file format: HDF5 files of uint8 images, written atomically, checksummed per image.

One file ``<out>/<split>/NNNNN.h5`` holds

- ``images``: uint8, N x H x W x 3, RGB. Format 2 (written now): one contiguous, unfiltered dataset
  (its data aligned to 4 KiB in the file), so a reader can fetch image r with one ``pread`` at
  ``ds.id.get_offset() + r * H*W*3`` without going through HDF5 (see :mod:`data.fastread`).
  Format 1 (older outputs, still read): chunked one image per chunk with HDF5's Fletcher-32 filter;
- ``checksums`` (format 2): uint64, N: the xxh3_64 hash of each image's bytes (attribute
  ``algorithm``), checked on every read, so a corrupted image is an error naming the file and the
  image, not silent garbage. ``labels``, ``checksums`` and ``pixel_sum`` carry HDF5's Fletcher-32;
- ``labels``: int64, N;
- ``names``: UTF-8 strings, N: the source path relative to its split folder;
- train files also ``pixel_sum``: uint32, H x W x 3, the exact per-pixel sum of the file's images
  (the mean image is their total, so it needs no second read and survives a resumed run);
- attributes ``format_version``, ``split``, ``index``, ``count``, ``image_size`` and ``skipped``
  (JSON list of ``{path, reason}`` for the sources of this file that could not be decoded).

Files are written under a temporary name, fsynced, then renamed, so a reader never accepts a
half-written file. A finished output has ``meta.json`` (written last); see :mod:`data.reader`.
Format-1 folders are converted in place by ``scripts/upgrade_data.py`` (:mod:`data.upgrade`).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from .fsutil import commit, temp_path
from .xxh3 import xxh3_64

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
BATCH_FILE_SUFFIX = ".h5"
CHECKSUM = "xxh3_64"
UPGRADE_COMMAND = "python scripts/upgrade_data.py"
# Image data starts on a 4 KiB boundary: with 256x256x3 images (48 pages each) every image is
# page-aligned, which O_DIRECT readers need and page-cache reads like.
_ALIGN = {"alignment_threshold": 64 * 1024, "alignment_interval": 4096}


class BatchFileError(OSError):
    """A batch file that is missing, truncated, corrupt or not what meta.json says; names the file."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)


def batch_file_name(index: int) -> str:
    return f"{index:05d}{BATCH_FILE_SUFFIX}"


@contextmanager
def _writing(tmp: Path, path: Path) -> Iterator[None]:
    """The write of `tmp` (renamed to `path` after): if it fails, the temporary is removed, and the
    operating system's refusal names `path` (a full disk's write() or HDF5's error names no file)."""
    try:
        yield
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        code = _errno_of(e)
        if code:
            raise OSError(code, os.strerror(code), str(path)) from None
        raise


def _errno_of(e: BaseException) -> int | None:
    """The system's error number behind a failed write; HDF5's failures at close (RuntimeError) carry it
    only in their text ('... errno = 28, error message = 'No space left on device' ...')."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    found = re.search(r"\berrno = (\d+)", str(e)) if isinstance(e, (OSError, RuntimeError)) else None
    return int(found.group(1)) if found else None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either the old or the new content, never a mix."""
    path = Path(path)
    tmp = temp_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # made now, with the result: not before the work
    with _writing(tmp, path):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def image_checksum(image) -> int:
    """xxh3_64 of one image's bytes (C-contiguous array or buffer); ~5 us for 256x256x3 in cache."""
    return xxh3_64(image)


def image_checksums(images: np.ndarray) -> np.ndarray:
    return np.fromiter((image_checksum(im) for im in images), np.uint64, len(images))


def write_batch_file(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray, names: list[str],
                     *, split: str, index: int, skipped: list[dict] | None = None,
                     pixel_sum: np.ndarray | None = None, version: int = FORMAT_VERSION,
                     dataset: str | None = None) -> None:
    """Write one batch file atomically (temporary name, fsync, rename); `version` 1 only for tests/tools;
    `dataset`: the identity of the output it belongs to (meta.json's ``dataset``)."""
    path = Path(path)
    n = len(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise ValueError(f"{path}: images must be uint8 N x H x W x 3, got {images.dtype} {images.shape}")
    if len(labels) != n or len(names) != n:
        raise ValueError(f"{path}: {n} images but {len(labels)} labels and {len(names)} names")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: cannot write format_version {version}")
    images = np.ascontiguousarray(images)
    tmp = temp_path(path)
    with _writing(tmp, path):
        with h5py.File(tmp, "w", **(_ALIGN if version >= 2 else {})) as f:
            # Fletcher-32 on the small datasets: read once per file, so its cost does not matter.
            small = {"chunks": True, "fletcher32": True} if n and version >= 2 else {}
            if version == 1:
                f.create_dataset("images", data=images, chunks=(1,) + images.shape[1:] if n else None,
                                 fletcher32=bool(n))
            else:
                _write_contiguous(f, "images", images)  # contiguous, unfiltered: read with pread
                f.create_dataset("checksums", data=image_checksums(images), **small)
                f["checksums"].attrs["algorithm"] = CHECKSUM
            f.create_dataset("labels", data=np.asarray(labels, dtype=np.int64), **small)
            f.create_dataset("names", data=np.array(names, dtype=object), dtype=h5py.string_dtype())
            if pixel_sum is not None:
                f.create_dataset("pixel_sum", data=pixel_sum.astype(np.uint32), compression="gzip",
                                 compression_opts=1, fletcher32=version >= 2)
            f.attrs.update(format_version=version, split=split, index=index, count=n,
                           image_size=images.shape[1], skipped=json.dumps(skipped or []))
            if dataset is not None:
                f.attrs["dataset"] = dataset
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        commit(tmp, path)


_WRITE_PIECE = 1 << 20  # bytes per write() of image data


def _write_contiguous(f: h5py.File, name: str, data: np.ndarray) -> None:
    """A contiguous dataset, allocated at creation and never pre-filled, written in pieces of <= 1 MB.

    Why pieces: once dirty pages pile up, the kernel throttles large single writes. On the 2-core VM,
    300 images (59 MB) took 160-260 ms written at once or in 4 MB pieces, 17-26 ms in 1 MB or per-image
    pieces (format 1's chunks were per image, hence its speed).
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dataset = h5py.Dataset(h5py.h5d.create(f.id, name.encode(), h5py.h5t.STD_U8LE,
                                           h5py.h5s.create_simple(data.shape), dcpl=dcpl))
    step = max(1, _WRITE_PIECE // max(1, data[0].nbytes if len(data) else 1))
    for lo in range(0, len(data), step):
        dataset[lo:lo + step] = data[lo:lo + step]


def place_index(name: str, position: int) -> int:
    """The index a batch file listed as `name` at `position` of its split must record: the number its
    name carries (``NNNNN.h5``, as written), else its position in meta.json's list."""
    stem = name[:-len(BATCH_FILE_SUFFIX)] if name.endswith(BATCH_FILE_SUFFIX) else ""
    return int(stem) if stem.isdigit() else position


def open_batch_file(path: str | os.PathLike, expect_count: int | None = None,
                    expect_size: int | None = None, *, split: str | None = None,
                    index: int | None = None, dataset: str | None = None) -> h5py.File:
    """Open a batch file (either format) for reading and check its structure; BatchFileError names the file.

    With `split` and `index` (its place in meta.json), the file must also record that place (and
    `expect_count` images in its ``count``), and with `dataset` (meta.json's) that output: a file is trusted
    by what it holds, not by its name.
    """
    path = Path(path)
    if not path.is_file():
        raise BatchFileError(path, "batch file is missing")
    try:
        f = h5py.File(path, "r")
    except OSError as e:  # HDF5 says why in its text: the system's errno (permission denied), or the format
        code = _errno_of(e)
        reason = f"cannot be read ({os.strerror(code)})" if code else f"corrupt or truncated batch file ({e})"
        raise BatchFileError(path, reason) from None
    try:
        _check_structure(f, path, expect_count, expect_size)
        if split is not None and index is not None:
            check_place(f, path, split, index, expect_count)
        if dataset is not None:
            check_dataset(f, path, dataset)
    except BaseException:
        f.close()
        raise
    return f


def check_place(f: h5py.File, path: Path, split: str, index: int, count: int | None) -> None:
    """The split, index and count a file records must be those of its place: a link to another batch
    file, or a file copied from another split or output, holds other images under the same name."""
    found = _recorded(f)
    want = (split, index, count if count is not None else found[2])
    if found != want:
        raise BatchFileError(path, f"records split {found[0]!r}, index {found[1]}, count {found[2]}, but meta.json "
                                   f"lists it as split {want[0]!r}, index {want[1]}, count {want[2]}: another batch "
                                   "file under this name (a link or a copy?); restore the right file, or delete it "
                                   "and re-run scripts/preprocess.py to rewrite it")


def check_dataset(f: h5py.File, path: Path, dataset: str) -> None:
    """The output a file records must be its folder's: another preprocessing's file of the same place and
    shape (copied in, or left by an earlier plan) holds other images under the same name and place. A file
    that records none (written before outputs had an identity, or by a tool) is taken."""
    found = f.attrs.get("dataset")
    found = found.decode(errors="replace") if isinstance(found, bytes) else found
    if found is not None and found != dataset:  # none recorded: written before outputs had an identity
        raise BatchFileError(path, f"belongs to another preprocessed output (dataset {found}; its folder's "
                                   f"meta.json says {dataset}): restore this output's file, or delete it and "
                                   "re-run scripts/preprocess.py to rewrite it")


def _recorded(f: h5py.File) -> tuple[str | None, int | None, int | None]:
    """(split, index, count) as the file's attributes hold them (None where missing or not that type)."""
    split, index, count = (f.attrs.get(k) for k in ("split", "index", "count"))
    split = split.decode(errors="replace") if isinstance(split, bytes) else split
    return (split if isinstance(split, str) else None,
            int(index) if isinstance(index, (int, np.integer)) else None,
            int(count) if isinstance(count, (int, np.integer)) else None)


def file_version(f: h5py.File) -> int:
    """format_version of an open batch file (checked by open_batch_file)."""
    return int(f.attrs["format_version"])


def _check_structure(f: h5py.File, path: Path, expect_count: int | None, expect_size: int | None) -> None:
    for key in ("images", "labels", "names"):
        if key not in f:
            raise BatchFileError(path, f"dataset {key!r} is missing (not a batch file?)")
    version = f.attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise BatchFileError(path, f"format_version {version}, this code reads "
                                   f"{' and '.join(map(str, READABLE_VERSIONS))}")
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
    if version >= 2:
        _check_v2(f, path, n)


def _check_v2(f: h5py.File, path: Path, n: int) -> None:
    """Format 2: per-image checksums, and images stored where a pread can find them."""
    if "checksums" not in f:
        raise BatchFileError(path, "dataset 'checksums' is missing (format_version 2 needs it)")
    sums = f["checksums"]
    if sums.shape != (n,) or sums.dtype != np.uint64:
        raise BatchFileError(path, f"checksums are {sums.dtype} {sums.shape}, expected uint64 ({n},)")
    algorithm = sums.attrs.get("algorithm")
    algorithm = algorithm.decode() if isinstance(algorithm, bytes) else algorithm
    if algorithm != CHECKSUM:
        raise BatchFileError(path, f"checksums algorithm {algorithm!r}, this code checks {CHECKSUM!r}")
    plist = f["images"].id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count():
        raise BatchFileError(path, "images are not one contiguous unfiltered dataset (format_version 2 needs it)")


def decode_names(raw) -> list[str]:
    return [s.decode() if isinstance(s, bytes) else s for s in raw]


def image_name(path: str | os.PathLike, row: int) -> str:
    """The source name of image `row` of a batch file, for error messages ('?' if unreadable)."""
    try:
        with h5py.File(path, "r") as f:
            return decode_names([f["names"][row]])[0]
    except (OSError, KeyError, IndexError, ValueError):
        return "?"


def checksum_error(path: str | os.PathLike, row: int, stored: int, got: int) -> BatchFileError:
    """The error for an image whose bytes do not hash to its stored checksum; names file, row, source."""
    return BatchFileError(path, f"image {row} ({image_name(path, row)}) fails its {CHECKSUM} checksum "
                                f"(stored {stored:016x}, read {got:016x}): the file is corrupt; delete it "
                                "and re-run the same scripts/preprocess.py command to rewrite it")


def verify_images(path: str | os.PathLike, images: np.ndarray, rows, checksums: np.ndarray) -> None:
    """Check images (rows `rows` of the file at `path`) against their stored checksums."""
    for image, row, stored in zip(images, rows, checksums):
        got = image_checksum(image)
        if got != int(stored):
            raise checksum_error(path, int(row), int(stored), got)


def find_bad_chunk(path: str | os.PathLike, ds: h5py.Dataset) -> BatchFileError | None:
    """Format 1: after a failed read, the first image whose Fletcher-32 check fails, as an error."""
    buf = np.empty(ds.shape[1:], ds.dtype)
    for row in range(ds.shape[0]):
        try:
            ds.read_direct(buf, np.s_[row])
        except OSError:
            return BatchFileError(path, f"image {row} ({image_name(path, row)}) fails its Fletcher-32 checksum: "
                                        "the file is corrupt; delete it and re-run the same "
                                        "scripts/preprocess.py command to rewrite it")
    return None


def _read_images(f: h5py.File, path: Path) -> np.ndarray:
    """All images of an open file, every image's checksum verified (either format)."""
    ds = f["images"]
    try:
        images = ds[...]
    except OSError as e:
        raise find_bad_chunk(path, ds) or BatchFileError(path, f"corrupt batch file, read failed ({e})") from None
    if file_version(f) >= 2:
        verify_images(path, images, range(len(images)), f["checksums"][...])
    return images


def read_batch_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The whole content of one batch file: images, labels, names (every image's checksum verified)."""
    path = Path(path)
    with open_batch_file(path) as f:
        images = _read_images(f, path)
        try:
            labels = f["labels"][...]
            names = decode_names(f["names"][...])
        except OSError as e:
            raise BatchFileError(path, f"corrupt batch file, read failed ({e})") from None
    return images, labels, names


def read_file_attrs(path: str | os.PathLike, *, split: str | None = None, index: int | None = None,
                    count: int | None = None, dataset: str | None = None) -> dict:
    """The attributes and pixel_sum of a finished batch file (cheap: no image is read); with `split` and
    `index`, BatchFileError unless the file records that place (and `count`, if given), and that output
    with `dataset`."""
    with open_batch_file(path, count, split=split, index=index, dataset=dataset) as f:
        out = {k: f.attrs[k] for k in ("split", "index", "count", "image_size")}
        out["count"], out["index"], out["image_size"] = int(out["count"]), int(out["index"]), int(out["image_size"])
        out["format_version"] = file_version(f)
        out["skipped"] = json.loads(f.attrs["skipped"])
        found = f.attrs.get("dataset")
        out["dataset"] = found.decode(errors="replace") if isinstance(found, bytes) else found
        try:
            out["pixel_sum"] = f["pixel_sum"][...] if "pixel_sum" in f else None
        except OSError as e:
            raise BatchFileError(path, f"pixel_sum is corrupt ({e})") from None
    return out
