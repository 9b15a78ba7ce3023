"""read: images/s and GB/s of reading shuffled training batches (data.shuffle_window 16) from the page
cache: format-1 files through h5py (the old path) and their raw chunks, format-2 files through the new
path (pread + xxh3_64 check, 1 and N threads, batch 256 and 128) and without the check, against the
memory bound (numpy.copyto of the same images from RAM, same order). The rows take turns pass by
pass and each reports its best pass (shared machines). Without --data it writes --files x --per-file
random images in both formats to a temp folder (2 x 2 GB by default).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from alexnet.cli import temporary_directory
from data.domains import COUNT, NON_NEGATIVE, InputPath

from .common import cpu_name, subcommand
from .workload import make_random_dataset


def add_parser(sub):
    p = subcommand(sub, "read", "batch-file read paths (old, new, raw) against the memory bound", run)
    p.add_argument("--data", type=InputPath("folder"),
                   help="a preprocessed folder, its first --files files read (default: random files "
                   "of both formats in a temp folder)")
    p.add_argument("--files", type=COUNT, default=40, help="random dataset: batch files (default 40)")
    p.add_argument("--per-file", type=COUNT, default=256, help="random dataset: images per file (default 256)")
    p.add_argument("--size", type=COUNT, default=256, help="random dataset: image side (default 256)")
    p.add_argument("--batch-sizes", type=COUNT, nargs="+", default=[256, 128])
    p.add_argument("--window", type=NON_NEGATIVE, default=16, help="data.shuffle_window (default 16)")
    p.add_argument("--threads", type=NON_NEGATIVE, default=0, help="reader threads (default: data.fastread's)")
    p.add_argument("--repeat", type=COUNT, default=5, help="timed passes over the epoch, rows in turn (best)")
    return p


def run(args) -> dict:
    """Images/s of each read path over the same shuffled epoch (as training reads), against the memory bound."""
    import numpy as np

    from data.batchfile import read_batch_file
    from data.fastread import default_threads
    from data.reader import SplitData, epoch_order
    threads = args.threads or default_threads()
    with temporary_directory() as tmp:
        roots = {v: Path(tmp) / f"v{v}" for v in (1, 2)}
        if args.data:
            version = json.loads((Path(args.data) / "meta.json").read_text())["format_version"]
            roots = {version: Path(args.data)}
        else:
            for v, root in roots.items():
                make_random_dataset(root, args.files * args.per_file, size=args.size, per_file=args.per_file,
                                    classes=1000, version=v)
        any_data = SplitData(next(iter(roots.values())), "train")
        paths, counts = any_data.paths[:args.files], any_data.counts[:args.files]  # the first --files files
        for root in roots.values():
            _warm_page_cache([root / "train" / p.name for p in paths])
        order = epoch_order(counts, 0, seed=0, shuffle=True, window=args.window)
        images = np.concatenate([read_batch_file(p)[0] for p in paths])
        rows = _read_rows(roots, threads, args.batch_sizes, images)
        rates = _interleaved_rates([(read, batch) for _, batch, read in rows], order, args.repeat)
        del images
    table = rate_table([(what, batch) for what, batch, _ in rows], rates, any_data.image_size ** 2 * 3)
    return {"benchmark": "read", "cpu": cpu_name(), "images": len(order), "image_size": any_data.image_size,
            "files": len(counts), "shuffle_window": args.window, "threads": threads, "repeat": args.repeat,
            "data": args.data or "random batch files (both formats), page cache warm", "rows": table}


def rate_table(rows: list[tuple[str, int]], rates: list[float], nbytes: int) -> list[dict]:
    """One row per read path; the share of the memory bound to 3 significant figures (3 decimals showed a
    slow path's 0.0004 as 0.0 on a loaded machine)."""
    bound = max(rate for (what, _), rate in zip(rows, rates) if what.startswith("memory bound"))
    return [{"what": what, "batch": batch, "img_per_s": round(rate), "GB_per_s": round(rate * nbytes / 1e9, 2),
             "vs_memory_bound": float(f"{rate / bound:.3g}")} for (what, batch), rate in zip(rows, rates)]


def _warm_page_cache(paths: list[Path]) -> None:
    """Read every file once, so that every row measures reads from the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            for _ in iter(lambda f=f: f.read(1 << 24), b""):
                continue  # the read itself is the point: it leaves the file in the page cache


def _interleaved_rates(readers: list, order, repeat: int) -> list[float]:
    """Images/s of each (read_batch, batch) over the batches of `order`: best of `repeat` passes.

    The rows take turns pass by pass, so a burst of load from elsewhere on a shared machine hits
    them alike; the best pass is each one's speed with the least interference.
    """
    plans = []
    for read_batch, batch in readers:
        batches = [order[s * batch:(s + 1) * batch] for s in range(len(order) // batch)]
        read_batch(batches[0])  # warm-up: handles opened, layouts read, buffers faulted in
        plans.append((read_batch, batches))
    best = [float("inf")] * len(plans)
    for _ in range(repeat):
        for i, (read_batch, batches) in enumerate(plans):
            start = time.perf_counter()
            for b in batches:
                read_batch(b)
            best[i] = min(best[i], time.perf_counter() - start)
    return [len(batches) * len(batches[0]) / t for (_, batches), t in zip(plans, best)]


def _split_reader(root: Path, threads: int, fresh_out: bool, batch: int):
    """read_batch(indices) through SplitData.read, into one reused output (or a new one per batch)."""
    import numpy as np

    from data.reader import SplitData
    data = SplitData(root, "train", threads=threads)
    out = np.empty((batch, data.image_size, data.image_size, 3), np.uint8)
    return data, (lambda idx: data.read(idx)) if fresh_out else (lambda idx: data.read(idx, out=out))


def _raw_pread_reader(data, batch: int):
    """Format 2 without checks: one pread per image at its offset, no checksum (the same bytes moved)."""
    import numpy as np
    data.read(np.arange(min(len(data), 1)))  # opens a file: layouts come from the reader's own cache
    out = np.empty((batch, data.image_size, data.image_size, 3), np.uint8)
    buf = memoryview(out).cast("B")
    nbytes = out[0].nbytes

    def read(idx):
        file_of = np.searchsorted(data.offsets, idx, side="right") - 1
        for w, (fi, i) in enumerate(zip(file_of.tolist(), idx.tolist())):
            handle = data._file(fi)
            os.preadv(handle.fd, (buf[w * nbytes:(w + 1) * nbytes],), handle.layout.offset
                      + (i - int(data.offsets[fi])) * nbytes)
    return read


def _raw_chunk_reader(data, batch: int):
    """Format 1 without the filter: h5py read_direct_chunk per image (chunk = image + 4 checksum bytes)."""
    import numpy as np
    out = np.empty((batch, data.image_size, data.image_size, 3), np.uint8)
    nbytes = out[0].nbytes
    scratch = np.empty(nbytes + 4, np.uint8)

    def read(idx):
        file_of = np.searchsorted(data.offsets, idx, side="right") - 1
        for w, (fi, i) in enumerate(zip(file_of.tolist(), idx.tolist())):
            ds = data._file(fi)["images"]
            ds.id.read_direct_chunk((i - int(data.offsets[fi]), 0, 0, 0), out=scratch)
            out[w].reshape(-1)[...] = scratch[:nbytes]
    return read


def _memory_reader(images, batch: int, threads: int):
    """numpy.copyto of the same images from RAM in the same order: the bound a reader cannot beat."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    out = np.empty((batch,) + images.shape[1:], np.uint8)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def span(idx, lo, hi):
        for w in range(lo, hi):
            np.copyto(out[w], images[idx[w]])

    def read(idx):
        idx = idx.tolist()
        if pool is None:
            return span(idx, 0, len(idx))
        bounds = [len(idx) * t // threads for t in range(threads + 1)]
        list(pool.map(lambda t: span(idx, bounds[t], bounds[t + 1]), range(threads)))
    return read


def _read_rows(roots: dict, threads: int, batch_sizes: list[int], images) -> list[tuple[str, int, object]]:
    """(what, batch, read_batch) of every read path that applies to the folders in `roots`."""
    big, rows = max(batch_sizes), []
    s = "s" if threads > 1 else ""
    if 1 in roots:
        data, read = _split_reader(roots[1], 1, False, big)
        rows += [("format 1 via h5py (old path)", big, read),
                 ("format 1 raw chunks (read_direct_chunk, no filter)", big, _raw_chunk_reader(data, big))]
    if 2 in roots:
        for batch in batch_sizes:
            for t in sorted({1, threads}):
                rows.append((f"format 2 pread+xxh3 (new path), {t} thread{'s' * (t > 1)}", batch,
                             _split_reader(roots[2], t, False, batch)[1]))
        data, read = _split_reader(roots[2], threads, True, big)
        rows += [(f"format 2 new path, {threads} thread{s}, read(indices) without out= (as data/loader.py)", big,
                  read), ("format 2 raw pread, no checksum, 1 thread", big, _raw_pread_reader(data, big))]
    for t in sorted({1, threads}):
        rows.append((f"memory bound: numpy.copyto of the same images, {t} thread{'s' * (t > 1)}", big,
                     _memory_reader(images, big, t)))
    return rows
