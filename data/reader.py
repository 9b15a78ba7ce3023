"""Read preprocessed batch files: a split as one indexable array, and a sharded, seeded batch order.

The order of one epoch is a pure function of (seed, epoch): every replica computes the same global
order and takes its own share of each step, so no coordination is needed, and starting at step k is
exactly the same as reading and dropping k steps (exact resume). Global step s covers the positions
``[s*W*B, (s+1)*W*B)`` of the epoch order (W replicas of batch B); replica r reads
``[s*W*B + r*B, s*W*B + (r+1)*B)``. With shuffling off the W shares of one step are therefore the very
images one replica with batch W*B would get, in the same order.

Shuffling permutes the file order every epoch and then the images inside windows of
``shuffle_window`` consecutive files (0: one global permutation). Since preprocessing already spread
the training images over the files at random, windows give well-mixed batches while reads stay
within a few files at a time.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np

from .batchfile import (
    FORMAT_VERSION,
    UPGRADE_COMMAND,
    BatchFileError,
    file_version,
    find_bad_chunk,
    open_batch_file,
    place_index,
)
from .fastread import BufferPool, FileLayout, PreadFile, ReadPlan, default_threads, file_ident, read_layout
from .layouts import DataError
from .meta import read_mean, read_meta

_noticed: set[str] = set()  # roots whose format-1 notice this process printed


def load_meta(root: str | os.PathLike) -> dict:
    """meta.json of a finished preprocessing output, validated (data.meta.read_meta)."""
    return read_meta(root)


def _old_format_notice(root: Path, version: int) -> None:
    if str(root) not in _noticed:
        _noticed.add(str(root))
        print(f"note: {root} holds format-{version} batch files (HDF5 Fletcher-32 chunks, read 5-8x slower); "
              f"`{UPGRADE_COMMAND} {root}` converts them in place to format {FORMAT_VERSION} "
              "(resumable; the data can stay in use)", file=sys.stderr)


class SplitData:
    """One split of a preprocessed folder, indexable by global image index (file order, row order).

    Format-2 files are read with one pread per image and a checksum check (:mod:`data.fastread`), on
    `threads` threads (default: :func:`data.fastread.default_threads`); format-1 files through h5py.
    Both can be mixed (a folder being upgraded in place). File handles are opened lazily and per
    process (a handle must not cross a fork), at most `max_open` kept between reads.
    """

    def __init__(self, root: str | os.PathLike, split: str, max_open: int = 64, threads: int | None = None):
        self.root = Path(root)
        self.split = split
        self.meta = load_meta(root)
        if split not in self.meta["splits"]:
            raise DataError(f"{self.root} has no {split!r} split (has: {', '.join(self.meta['splits'])})")
        files = self.meta["splits"][split]["files"]
        self.paths = [self.root / split / f["name"] for f in files]
        self.places = [place_index(f["name"], i) for i, f in enumerate(files)]  # the index each file must record
        self.counts = np.array([f["count"] for f in files], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.image_size = int(self.meta["image_size"])
        self.num_classes = int(self.meta["num_classes"])
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self._max_open = max_open
        self._reset()
        if self.meta["format_version"] < FORMAT_VERSION:
            _old_format_notice(self.root, self.meta["format_version"])

    def _reset(self) -> None:
        """Per-process state: open handles, format-2 layouts (small, kept for every file), threads."""
        self._open: OrderedDict[int, h5py.File | PreadFile] = OrderedDict()
        self._layouts: dict[int, FileLayout] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = BufferPool()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_open=OrderedDict(), _layouts={}, _pool=None, _buffers=BufferPool())
        return state

    def mean_image(self) -> np.ndarray:
        """The training mean image (float32, H x W x 3) written beside meta.json."""
        return read_mean(self.root / self.meta.get("mean", "mean.npy"), self.image_size, self.meta.get("mean_sha256"))

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's handles and threads are not ours
            for handle in self._open.values():
                if isinstance(handle, PreadFile):
                    handle.close()  # our copy of the descriptor; the parent's stays open
            self._reset()

    def _file(self, i: int) -> h5py.File | PreadFile:
        handle = self._open.get(i)
        if handle is None:
            handle = self._open[i] = self._open_file(i)
        else:
            self._open.move_to_end(i)
        return handle

    def _open_file(self, i: int) -> h5py.File | PreadFile:
        """A format-2 file as a descriptor + layout (the layout re-read only if the file changed); else h5py."""
        path = self.paths[i]
        for _ in range(3):  # a file replaced between our two opens (an upgrade in place): open it again
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise BatchFileError(path, "batch file is missing") from None
            try:
                handle = self._handle(i, fd)
            except BaseException:
                os.close(fd)
                raise
            if isinstance(handle, PreadFile):
                return handle
            os.close(fd)
            if handle is not None:
                return handle
        raise BatchFileError(path, "keeps being replaced while it is opened")

    def _handle(self, i: int, fd: int) -> h5py.File | PreadFile | None:
        """The handle of file `i` whose descriptor is `fd`; None if the name now points elsewhere."""
        path, ident = self.paths[i], file_ident(os.fstat(fd))
        layout = self._layouts.get(i)
        if layout is not None and layout.ident == ident:
            return PreadFile(path, fd, layout)
        # once per file and process: the file must record this split, index and count (not be a link to
        # or a copy of another batch file); the per-image path below checks nothing more
        f = open_batch_file(path, int(self.counts[i]), self.image_size, split=self.split, index=self.places[i],
                            dataset=self.meta.get("dataset"))
        if file_version(f) == 1:
            return f
        with f:
            if file_ident(os.stat(path)) != ident:
                return None
            layout = self._layouts[i] = read_layout(f, path, ident)
        return PreadFile(path, fd, layout)

    def _trim(self) -> None:
        """Close the least recently used handles beyond max_open (after a read, never during one)."""
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)[1].close()

    def close(self) -> None:
        self._check_process()
        for handle in self._open.values():
            handle.close()
        self._open.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _thread_pool(self) -> ThreadPoolExecutor | None:
        if self.threads > 1 and self._pool is None:
            # The calling thread reads one span itself, so threads - 1 helpers.
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="batch-read")
        return self._pool

    def read(self, indices: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Images (uint8 N x H x W x 3) and labels (int64 N) at global `indices`, in that order.

        Every image's checksum is verified; a corrupt one raises BatchFileError naming the file, the
        image's row and its source name. Without `out`, the array comes from a small pool of buffers
        that are reused only once nothing refers to them any more (see fastread.BufferPool).
        """
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"index out of range 0..{len(self) - 1} of {self.root / self.split}")
        self._check_process()
        s = self.image_size
        images = out[:len(indices)] if out is not None else self._buffers.take((len(indices), s, s, 3))
        labels = np.empty(len(indices), np.int64)
        file_of = np.searchsorted(self.offsets, indices, side="right") - 1
        plan = ReadPlan()
        try:
            for fi in np.unique(file_of).tolist():
                where = np.nonzero(file_of == fi)[0]
                rows = indices[where] - self.offsets[fi]
                handle = self._file(fi)
                if isinstance(handle, PreadFile):
                    labels[where] = handle.layout.labels[rows]
                    plan.add(handle, rows, where)
                else:
                    self._read_rows_v1(fi, handle, rows, where, images, labels)
            self._read_planned(plan, images)
        finally:
            self._trim()
        return images, labels

    def _read_planned(self, plan: ReadPlan, images: np.ndarray) -> None:
        if not len(plan):
            return
        if images.flags.c_contiguous:
            plan.run(images, self.threads, self._thread_pool())
            return
        staged = np.empty(images.shape, np.uint8)  # a strided `out`: read whole images, then copy
        plan.run(staged, self.threads, self._thread_pool())
        for _, _, where in plan.parts:
            images[where] = staged[where]

    def _read_rows_v1(self, fi: int, f: h5py.File, rows: np.ndarray, where: np.ndarray, images: np.ndarray,
                      labels: np.ndarray) -> None:
        """Format 1: rows `rows` of file `fi` into positions `where`, through h5py (Fletcher-32 checked)."""
        order = np.argsort(rows, kind="stable")
        rows, where = rows[order], where[order]
        ds = f["images"]
        try:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            run = bool(np.all(np.diff(rows) == 1))  # consecutive rows, none repeated (rows are sorted)
            if run and np.all(np.diff(where) == 1):  # one run, in order: read in place
                ds.read_direct(images, np.s_[lo:hi], np.s_[int(where[0]):int(where[0]) + hi - lo])
            elif run:
                images[where] = ds[lo:hi]
            else:
                for r, w in zip(rows.tolist(), where.tolist()):
                    ds.read_direct(images, np.s_[r], np.s_[w])
            labels[where] = f["labels"][...][rows]
        except OSError as e:
            raise find_bad_chunk(self.paths[fi], ds) or BatchFileError(
                self.paths[fi], f"corrupt batch file, read failed ({e})") from None


def epoch_order(counts: np.ndarray, epoch: int, seed: int, shuffle: bool, window: int) -> np.ndarray:
    """The global image order of one epoch (see the module docstring)."""
    n = int(counts.sum())
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if window <= 0:
        return rng.permutation(n).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    file_order = rng.permutation(len(counts))
    parts = []
    for start in range(0, len(file_order), window):
        group = file_order[start:start + window]
        idx = np.concatenate([np.arange(offsets[f], offsets[f + 1]) for f in group])
        parts.append(idx[rng.permutation(len(idx))])
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def epoch_steps(images: int, global_batch: int, drop_last: bool = True) -> int:
    """Steps of an epoch of `images` in global batches: the short last batch dropped (training) or kept."""
    return images // global_batch if drop_last else -(-images // global_batch)


class BatchReader:
    """Batches of one replica's share of a split, epoch by epoch.

    ``drop_last=True`` (training): every replica runs ``len(data) // (world*batch_size)`` steps per
    epoch, the remainder of the epoch order (fewer images than one global batch) is not used that
    epoch (with shuffling, a different remainder each epoch). ``drop_last=False`` (validation): the
    last global step is cut to what is left, so some replicas get a short or empty last batch and
    every image is read exactly once over all replicas.
    """

    def __init__(self, data: SplitData, batch_size: int, rank: int = 0, world: int = 1, shuffle: bool = True,
                 seed: int = 0, window: int = 16, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside 0..{world - 1}")
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world
        self.shuffle, self.seed, self.window, self.drop_last = shuffle, seed, window, drop_last
        self._cached: tuple[int, np.ndarray] | None = None
        if drop_last and self.steps_per_epoch() == 0:
            raise DataError(f"{data.root / data.split} holds {len(data)} images, fewer than one global batch "
                            f"({world} x {batch_size}); lower train.batch_size")

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size

    def steps_per_epoch(self) -> int:
        return epoch_steps(len(self.data), self.global_batch, self.drop_last)

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.data.counts, epoch, self.seed, self.shuffle, self.window))
        return self._cached[1]

    def positions(self, step: int) -> np.ndarray:
        """Positions in the epoch order of this replica's batch at `step` (may be empty at the end)."""
        lo = step * self.global_batch + self.rank * self.batch_size
        return np.arange(lo, min(lo + self.batch_size, len(self.data)), dtype=np.int64)

    def indices(self, epoch: int, step: int) -> np.ndarray:
        return self.order(epoch)[self.positions(step)]

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(images, labels) for steps start..end of `epoch`; empty batches are yielded too."""
        for step in range(start, self.steps_per_epoch()):
            yield self.data.read(self.indices(epoch, step))
