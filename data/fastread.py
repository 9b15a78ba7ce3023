"""The fast read path of format-2 batch files: a pread per image, its checksum checked right after.

Each image of a format-2 file lies at ``offset + row * image_bytes`` of the file (one contiguous,
unfiltered HDF5 dataset), so it is fetched with one ``os.preadv`` straight into the output batch and
its xxh3_64 is computed at once, while its bytes are still in the CPU cache: the check costs ~5 us of
the ~30 us an image takes. HDF5 is used once per file and process, to check the structure and read
the labels, the checksums and the offset; the images never go through it (its filter pipeline and
per-call overhead were ~85 % of the format-1 read time, and its global lock serialises threads).

A batch is split into a few contiguous spans read by different threads: ``os.preadv`` and xxhash
release the GIL, so the spans run in parallel where cores are free.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from .batchfile import BatchFileError, checksum_error
from .procs import stops_between_calls
from .xxh3 import xxh3_64

MIN_IMAGES_PER_THREAD = 16  # below this a thread hand-off costs more than it saves
THREADS_ENV = "ALEXNET_READ_THREADS"


def default_threads() -> int:
    """Reader threads per loader: $ALEXNET_READ_THREADS, else the usable cores, at most 4.

    Two threads nearly reach the memory bandwidth one loader can use on the 2-core machine this was
    measured on; beyond 4 the gain is below the noise while the trainer needs the cores.
    """
    value = os.environ.get(THREADS_ENV)
    if value:
        try:
            threads = int(value)
        except ValueError:
            raise ValueError(f"${THREADS_ENV}={value!r} is not an integer") from None
        if threads < 1:
            raise ValueError(f"${THREADS_ENV}={value!r} must be at least 1")
        return threads
    return max(1, min(4, len(os.sched_getaffinity(0))))


def file_ident(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one file from its replacement under the same name (an in-place upgrade)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class FileLayout:
    """A format-2 file's byte layout (where its images lie) and its labels and checksums, read once through HDF5."""

    ident: tuple[int, int, int, int]
    offset: int  # byte offset of image 0 in the file
    image_bytes: int
    labels: np.ndarray
    checksums: np.ndarray


def read_layout(f: h5py.File, path: Path, ident: tuple[int, int, int, int]) -> FileLayout:
    """The layout of an open, structure-checked format-2 file whose stat identity is `ident`."""
    ds = f["images"]
    n, image_bytes = ds.shape[0], int(np.prod(ds.shape[1:]))
    offset = ds.id.get_offset() if n else 0
    if offset is None:
        raise BatchFileError(path, "images have no storage in the file (corrupt batch file)")
    end, size = offset + n * image_bytes, ident[2]
    if end > size:
        raise BatchFileError(path, f"truncated: the images end at byte {end}, the file has {size} bytes")
    try:
        labels, checksums = f["labels"][...], f["checksums"][...]
    except OSError as e:
        raise BatchFileError(path, f"labels or checksums are corrupt ({e})") from None
    return FileLayout(ident, int(offset), image_bytes, labels, checksums)


class PreadFile:
    """An open format-2 file: a descriptor and its layout."""

    version = 2

    def __init__(self, path: Path, fd: int, layout: FileLayout):
        self.path, self.fd, self.layout = path, fd, layout

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class ReadPlan:
    """The images of one batch to fetch with pread: for each, its file, row and output position."""

    files: list[PreadFile] = field(default_factory=list)
    parts: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)

    def add(self, handle: PreadFile, rows: np.ndarray, where: np.ndarray) -> None:
        self.parts.append((len(self.files), rows, where))
        self.files.append(handle)

    def __len__(self) -> int:
        return sum(len(rows) for _, rows, _ in self.parts)

    def run(self, out: np.ndarray, threads: int, pool: cf.ThreadPoolExecutor | None) -> None:
        """Read every planned image into `out` (C-contiguous uint8 N x H x W x 3), checking each."""
        if not len(self):
            return
        nbytes = self.files[0].layout.image_bytes
        if out.dtype != np.uint8 or not out.flags.c_contiguous or out[0].nbytes != nbytes:
            raise ValueError(f"output batch must be C-contiguous uint8 rows of {nbytes} bytes, got "
                             f"{out.dtype} {out.shape}")
        job = _Job.build(self, memoryview(out).cast("B"), nbytes)
        n = len(job.fds)
        spans = max(1, min(threads, n // MIN_IMAGES_PER_THREAD)) if pool is not None else 1
        bounds = [n * i // spans for i in range(spans + 1)]
        futures_to_come = spans > 1
        # a stop signal is handled after the wait (data.procs.stops_between_calls): raised inside it, it
        # could leave a future's lock held and the reader's threads blocked for good
        with stops_between_calls() if futures_to_come else nullcontext():
            futures = [pool.submit(job.read_span, bounds[i], bounds[i + 1]) for i in range(1, spans)]
            try:
                failures = [job.read_span(bounds[0], bounds[1])]
            finally:
                cf.wait(futures)  # every thread is done writing into `out` before anything is raised
            failures += [f.result() for f in futures]
        for failure in failures:
            if failure is not None:
                raise self._error(job, *failure)

    def _error(self, job: _Job, k: int, kind: str, value) -> BatchFileError:
        handle = self.files[job.file_of[k]]
        row = (job.offsets[k] - handle.layout.offset) // job.nbytes
        if kind == "short":
            return BatchFileError(handle.path, f"truncated: image {row} ends past the end of the file "
                                               f"({value} of {job.nbytes} bytes read)")
        if kind == "error":
            return BatchFileError(handle.path, f"reading image {row} failed ({value})")
        return checksum_error(handle.path, row, job.sums[k], value)


@dataclass
class _Job:
    """A plan flattened into Python lists, the cheapest thing to index in the hot loop."""

    fds: list[int]
    offsets: list[int]
    sums: list[int]
    dst: list[int]
    file_of: list[int]
    buf: memoryview
    nbytes: int

    @classmethod
    def build(cls, plan: ReadPlan, buf: memoryview, nbytes: int) -> _Job:
        fds, offsets, sums, dst, file_of = [], [], [], [], []
        for fi, rows, where in plan.parts:
            layout = plan.files[fi].layout
            fds += [plan.files[fi].fd] * len(rows)
            offsets += (layout.offset + rows * nbytes).tolist()
            sums += layout.checksums[rows].tolist()
            dst += (where * nbytes).tolist()
            file_of += [fi] * len(rows)
        return cls(fds, offsets, sums, dst, file_of, buf, nbytes)

    def read_span(self, lo: int, hi: int) -> tuple[int, str, object] | None:
        """Images lo..hi-1; the first failure as (k, "checksum" | "short" | "error", what was found)."""
        pread, digest, nbytes, buf = os.preadv, xxh3_64, self.nbytes, self.buf
        for k in range(lo, hi):
            view = buf[self.dst[k]:self.dst[k] + nbytes]
            try:
                got = pread(self.fds[k], (view,), self.offsets[k])
                if got != nbytes:
                    got = _finish_read(self.fds[k], view, self.offsets[k], got)
            except OSError as e:  # EIO from a failing disk: named like any other bad image
                return k, "error", e
            if got != nbytes:
                return k, "short", got
            h = digest(view)
            if h != self.sums[k]:
                return k, "checksum", h
        return None


def _finish_read(fd: int, view: memoryview, offset: int, got: int) -> int:
    """A short pread is legal; go on until the image is complete or the file ends."""
    while got < len(view):
        more = os.preadv(fd, (view[got:],), offset + got)
        if more == 0:
            break
        got += more
    return got


class BufferPool:
    """Output batches for ``SplitData.read(out=None)``, reused once nothing refers to them any more.

    A fresh 50 MB array costs ~12,800 page faults and the kernel's zeroing of every page, which took
    longer than reading the images into it (7,400 against 25,000 images/s on the 2-core machine).
    Every numpy view (and a torch tensor made by from_numpy) keeps a reference to its base array,
    so a base whose only references are the pool's own is safe to hand out again.
    """

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._bufs: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous uint8 array of `shape` that nobody else holds."""
        for i in range(len(self._bufs)):
            if _refs(self._bufs[i]) <= _POOL_ONLY and self._bufs[i].shape[1:] == shape[1:] \
                    and len(self._bufs[i]) >= shape[0]:
                return self._bufs[i][:shape[0]]
        buf = np.empty(shape, np.uint8)
        if len(self._bufs) < self.keep:
            self._bufs.append(buf)
        else:  # all held by the caller: replace the smallest, so the pool follows the batch size
            self._bufs[min(range(len(self._bufs)), key=lambda j: len(self._bufs[j]))] = buf
        return buf[:shape[0]]


def _refs(buf: np.ndarray) -> int:
    """The references to `buf` that getrefcount sees from inside this call."""
    return sys.getrefcount(buf)


def _refs_held_by_a_list() -> int:
    """What _refs counts for an array that only a list holds."""
    bufs = [np.empty(0, np.uint8)]
    return _refs(bufs[0])  # called as BufferPool.take calls it


# What _refs counts for an array only the pool's list holds: 3 on Python 3.11+ (the list, the argument,
# getrefcount's own), 4 on 3.10, whose calls also keep the caller's stack reference; measured, not assumed.
_POOL_ONLY = _refs_held_by_a_list()
