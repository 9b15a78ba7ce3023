#!/usr/bin/env python3
"""Benchmarks, each measured side by side in one run and reported as a table (and JSON with --json).

    python scripts/benchmark.py preprocess [--images 600] [--workers N]
    python scripts/benchmark.py train [--batch-size 256] [--arch alexnet] [--device auto]
    python scripts/benchmark.py loading [--batch-size 256] [--data DIR] [--device auto]
    python scripts/benchmark.py exchange [--replicas 2] [--devices cuda:0 cuda:1] [--table1]
    python scripts/benchmark.py read [--files 40] [--batch-sizes 256 128] [--threads N] [--data DIR]
    python scripts/benchmark.py checkpoint [--dir DIR] [--device auto]
    python scripts/benchmark.py parallel [--batch-size 256] [--width 1.0] [--device auto]

preprocess: JPEG decode-to-256 images/s per worker with and without Pillow's draft mode (same files,
same process), then the whole preprocessing pipeline with 1 worker and with all workers, on a
generated tree whose image sizes follow ImageNet's (shorter side 333-800 pixels).

train: training img/s of the model fed one constant on-device batch (no data loading), for each
precision (fp32, tf32, bf16) x channels_last off/on, with the time per 20 iterations (the paper's
Table 1 unit). Warm-up steps first; the median of --repeat timed runs of --steps steps.

loading: the paper's "parallel loading yes/no" comparison on the device present: training time per 20
iterations and img/s with data.loading process / thread / inline, against the same model fed one
constant on-device batch (the upper bound), and the loader alone (no trainer); then the loader process
alone on the CPU at full size (227 crops of 256x256 images, batch 256), whatever the other options.
Without --data it writes a random-image dataset in the batch-file format (page-cached after the first
epoch).

exchange: with --replicas processes on --devices (default: one per GPU, or the CPU), the time of one
weights exchange (parameters and momentum, one flat buffer) per transport and of one gradient
all-reduce (parameters' size), against the time of one training step of one replica. --table1 adds
the paper's Table 1 layout: time per 20 iterations for 1 and 2 replicas x parallel loading yes/no,
measured by running train.py itself on random batch files.

read: images/s and GB/s of reading shuffled training batches (data.shuffle_window 16) from the page
cache: format-1 files through h5py (the old path) and their raw chunks, format-2 files through the new
path (pread + xxh3_64 check, 1 and N threads, batch 256 and 128) and without the check, against the
memory bound (numpy.copyto of the same images from RAM, same order). The rows take turns pass by
pass and each reports its best pass (shared machines). Without --data it writes --files x --per-file
random images in both formats to a temp folder (2 x 2 GB by default).

checkpoint: what one checkpoint of the model with its momentum costs the step loop: written
synchronously (torch.save, fsync, rename), or as the trainer does, a host copy handed to a background
thread; --dir puts the files on the file system to measure (e.g. the run's network file system).

parallel: Yadan et al.'s Table 1 layouts (1 device; 2 model parallel; 2 and 4 data parallel; 4 model +
data) plus fc parallelism on 2 and 4, at one global batch: time per step, bytes sent per step and
parameter bytes per process, and a cost model of the same on 2/4/8 GPUs (scripts/bench_parallel.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_parallel  # noqa: E402  (scripts/bench_parallel.py: the parallel subcommand)

from data.decode import load_image  # noqa: E402
from data.layouts import is_image_name  # noqa: E402
from data.preprocess import Options, preprocess  # noqa: E402
from data.synthetic import generate  # noqa: E402


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line([r.get(c, "") for c in cols])
                                                                      for r in rows])


def _decode_rate(files: list[str], draft: bool, repeat: int = 2) -> float:
    """Images per second of load_image on one core (best of `repeat` passes, page cache warm)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for f in files:
            load_image(f, 256, "short", draft=draft)
        best = min(best, time.perf_counter() - start)
    return len(files) / best


def bench_preprocess(args) -> dict:
    workers = args.workers or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        per_class = max(1, args.images // 10)
        generate(src, num_classes=10, train_per_class=per_class, val_per_class=1, seed=0, quirks=False,
                 min_side=333, max_side=800)
        files = sorted(str(p) for p in (src / "train").rglob("*") if p.is_file() and is_image_name(p.name))
        rows = [{"what": "decode+resize, draft mode", "workers": 1, "img_per_s": _decode_rate(files, True)},
                {"what": "decode+resize, full decode", "workers": 1, "img_per_s": _decode_rate(files, False)}]
        for w in sorted({1, workers}):
            out = Path(tmp) / f"out{w}"
            info = preprocess(src / "train", out, opts=Options(), workers=w, quiet=True)
            rows.append({"what": "preprocess pipeline", "workers": w,
                         "img_per_s": info["counts"]["train"]["written"] / _last_seconds(out)})
        rows += _format_rows(src / "train", files[:300], Path(tmp))
    for r in rows:
        r["img_per_s_per_worker"] = round(r["img_per_s"] / r["workers"], 1)
        r["img_per_s"] = round(r["img_per_s"], 1)
    return {"benchmark": "preprocess", "images": len(files), "cpu_count": len(os.sched_getaffinity(0)),
            "draft_speedup": round(rows[0]["img_per_s"] / rows[1]["img_per_s"], 2), "rows": rows}


def _format_rows(src: Path, files: list[str], tmp: Path, repeat: int = 4) -> list[dict]:
    """One batch file's whole task (decode, resize, checksums, write, fsync) writing format 1 and format
    2 in turn (the order alternating), in this process: what the file format costs preprocessing (best
    of `repeat`; fsync times vary a lot on shared disks)."""
    from functools import partial

    import data.preprocess as pp
    from data.batchfile import write_batch_file
    from data.layouts import Item
    items = tuple(Item(str(Path(f).relative_to(src)), 0) for f in files)
    best = {1: 0.0, 2: 0.0}
    try:
        for r in range(repeat):
            for version in (1, 2) if r % 2 == 0 else (2, 1):
                pp.write_batch_file = partial(write_batch_file, version=version)
                task = pp.Task("train", 0, items, str(src), str(tmp / f"format{version}.h5"), 256, "short")
                start = time.perf_counter()
                best[version] = max(best[version], pp.process_task(task) / (time.perf_counter() - start))
    finally:
        pp.write_batch_file = write_batch_file
    return [{"what": f"one batch-file task writing format {v}", "workers": 1, "img_per_s": rate}
            for v, rate in best.items()]


def _timed_steps(step, steps: int, device, repeat: int, warmup: int = 0) -> float:
    """Median seconds for `steps` calls of step(), device work included, after `warmup` calls."""
    import statistics

    import torch
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainer_step(arch: str, width: float, crop: int, precision: str, channels_last: bool, device,
                 compile_model: bool = False, num_classes: int = 1000):
    """step(x, y): one training step of a fresh model (the code path of alexnet.trainer)."""
    import torch

    from alexnet.config import TrainConfig
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    from alexnet.precision import autocast_for, configure_backends
    from alexnet.replica import sgd_step
    torch.manual_seed(0)
    configure_backends(precision, device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(arch, num_classes, width, 0.5, crop).to(device).to(memory_format=fmt)
    opt = build_optimizer(model, TrainConfig())
    forward = torch.compile(model) if compile_model else model
    return lambda x, y: sgd_step(forward, opt, x, y, lambda: autocast_for(precision, device))


def constant_batch_step(arch: str, width: float, crop: int, batch: int, precision: str, channels_last: bool,
                        device, compile_model: bool = False, num_classes: int = 1000):
    """A closure running one training step on a fixed random batch already on `device`."""
    import torch
    step = trainer_step(arch, width, crop, precision, channels_last, device, compile_model, num_classes)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 3, crop, crop, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch,), device=device)
    return lambda: step(x, y)


def bench_train(args) -> dict:
    from alexnet.distributed import pick_device
    device = pick_device(args.device)
    crop = args.crop or (224 if args.arch == "owt" else 227)
    rows = []
    for precision in args.precisions:
        for cl in (False, True):
            step = constant_batch_step(args.arch, args.width, crop, args.batch_size, precision, cl, device,
                                       args.compile)
            seconds = _timed_steps(step, args.steps, device, args.repeat, args.warmup)
            rows.append({"precision": precision, "channels_last": cl,
                         "img_per_s": round(args.batch_size * args.steps / seconds, 1),
                         "s_per_20_iter": round(seconds * 20 / args.steps, 3)})
    base = rows[0]["img_per_s"]
    for r in rows:
        r["vs_fp32"] = round(r["img_per_s"] / base, 2)
    return {"benchmark": "train", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "compile": args.compile, "rows": rows}


def make_random_dataset(root: Path, n_images: int, size: int = 256, per_file: int = 256, classes: int = 1000,
                        version: int | None = None) -> Path:
    """A preprocessed-format folder of random images (for loader speed, where content does not matter)."""
    import numpy as np

    from data.batchfile import FORMAT_VERSION, atomic_write_json, batch_file_name, write_batch_file
    version = version or FORMAT_VERSION
    rng = np.random.default_rng(0)
    files = []
    (root / "train").mkdir(parents=True, exist_ok=True)
    for i, lo in enumerate(range(0, n_images, per_file)):
        n = min(per_file, n_images - lo)
        images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        write_batch_file(root / "train" / batch_file_name(i), images, rng.integers(0, classes, n),
                         [f"c{i}/x{j}.JPEG" for j in range(n)], split="train", index=i, version=version)
        files.append({"name": batch_file_name(i), "count": n})
    np.save(root / "mean.npy", np.full((size, size, 3), 127.5, np.float32))
    atomic_write_json(root / "meta.json", {"format_version": version, "classes": [f"c{i}" for i in range(classes)],
                                           "num_classes": classes, "image_size": size, "mean": "mean.npy",
                                           "splits": {"train": {"count": n_images, "files": files}}})
    return root


def _endless(loader):
    """Training batches across epoch boundaries, as a long run sees them."""
    epoch = 0
    while True:
        yield from loader.batches("train", epoch)
        epoch += 1


def _loader_rate(loader, step, device, warmup: int, steps: int, repeat: int) -> float:
    """Median seconds per `steps` steps fed by `loader` (step=None: the loader alone)."""
    batches = _endless(loader)

    def one():
        b = next(batches)
        if step is not None:
            step(b.x, b.y)
    return _timed_steps(one, steps, device, repeat, warmup)


def bench_loading(args) -> dict:
    from alexnet.distributed import pick_device
    from data.loader import InlineLoader, LoaderSpec
    from data.slot_loader import SlotLoader
    device = pick_device(args.device)
    crop = args.crop or (224 if args.arch == "owt" else 227)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else make_random_dataset(
            Path(tmp), args.batch_size * args.files_per_epoch, classes=1000)
        spec = LoaderSpec(root=str(root), batch_size=args.batch_size, val_batch_size=args.batch_size, crop=crop,
                          device=str(device), channels_last=args.channels_last, splits=("train",))
        classes = json.loads((root / "meta.json").read_text())["num_classes"]
        rows = []

        def add(what: str, seconds: float) -> None:
            rows.append({"what": what, "img_per_s": round(args.batch_size * args.steps / seconds, 1),
                         "s_per_20_iter": round(seconds * 20 / args.steps, 3)})
        step = constant_batch_step(args.arch, args.width, crop, args.batch_size, args.precision,
                                   args.channels_last, device, num_classes=classes)
        add("constant on-device batch (upper bound)", _timed_steps(step, args.steps, device, args.repeat,
                                                                   args.warmup))
        train_step = trainer_step(args.arch, args.width, crop, args.precision, args.channels_last, device,
                                  num_classes=classes)
        for mode in ("process", "thread", "inline"):
            loader = InlineLoader(spec) if mode == "inline" else SlotLoader(spec, mode, args.slots)
            try:
                add(f"data.loading={mode}", _loader_rate(loader, train_step, device, args.warmup, args.steps,
                                                         args.repeat))
            finally:
                loader.close()
        loader = SlotLoader(spec, "process", args.slots)
        try:
            add("loader process alone (no training)", _loader_rate(loader, None, device, args.warmup,
                                                                   args.steps, args.repeat))
        finally:
            loader.close()
    bound = rows[0]["img_per_s"]
    for r in rows:
        r["vs_upper_bound"] = round(r["img_per_s"] / bound, 3)
    if args.cpu_full_size:
        rows.append(_cpu_full_size_row(args))
    return {"benchmark": "loading", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "precision": args.precision,
            "channels_last": args.channels_last, "data": args.data or "random batch files", "rows": rows}


# -- read: the batch-file read paths against the memory bound ---------------------------------------

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


def bench_read(args) -> dict:
    """Images/s of each read path over the same shuffled epoch (as training reads), against the memory bound."""
    import numpy as np

    from data.batchfile import read_batch_file
    from data.fastread import default_threads
    from data.reader import SplitData, epoch_order
    threads = args.threads or default_threads()
    with tempfile.TemporaryDirectory() as tmp:
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
    nbytes = any_data.image_size ** 2 * 3
    bound = max(rate for (what, _, _), rate in zip(rows, rates) if what.startswith("memory bound"))
    table = [{"what": what, "batch": batch, "img_per_s": round(rate), "GB_per_s": round(rate * nbytes / 1e9, 2),
              "vs_memory_bound": round(rate / bound, 3)} for (what, batch, _), rate in zip(rows, rates)]
    return {"benchmark": "read", "cpu": _device_name_cpu(), "images": len(order), "image_size": any_data.image_size,
            "files": len(counts), "shuffle_window": args.window, "threads": threads, "repeat": args.repeat,
            "data": args.data or "random batch files (both formats), page cache warm", "rows": table}


def _device_name_cpu() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "cpu") if Path("/proc/cpuinfo").exists() else "cpu"
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


FULL_BATCH, FULL_SIZE, FULL_CROP = 256, 256, 227


def _cpu_full_size_row(args) -> dict:
    """The loader process alone on the CPU at ImageNet size: 227 crops of 256x256 images, batch 256.

    Whatever the other rows' --batch-size, --crop and --device: how many images/s one loader's host
    side (read, crop, flip, mean subtraction) can deliver, the figure a GPU's loader must beat.
    """
    import torch

    from data.loader import LoaderSpec
    from data.slot_loader import SlotLoader
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else make_random_dataset(
            Path(tmp), FULL_BATCH * args.files_per_epoch, size=FULL_SIZE, classes=1000)
        spec = LoaderSpec(root=str(root), batch_size=FULL_BATCH, val_batch_size=FULL_BATCH, crop=FULL_CROP,
                          device="cpu", splits=("train",))
        loader = SlotLoader(spec, "process", args.slots)
        try:
            seconds = _loader_rate(loader, None, torch.device("cpu"), args.warmup, args.steps, args.repeat)
        finally:
            loader.close()
    return {"what": f"loader process alone, CPU, {FULL_CROP} crops of {FULL_SIZE}px, batch {FULL_BATCH}",
            "img_per_s": round(FULL_BATCH * args.steps / seconds, 1),
            "s_per_20_iter": round(seconds * 20 / args.steps, 3), "vs_upper_bound": ""}


def _exchange_worker(rank: int, world: int, port: int, args, out: str) -> None:
    """One replica of the exchange benchmark: times every feasible transport, rank 0 writes JSON."""
    import statistics

    import torch
    import torch.distributed as dist

    from alexnet.config import Config, TrainConfig
    from alexnet.distributed import setup, teardown
    from alexnet.exchange import AllReduceAverage, IpcAverage, flat_size
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = Config()
    cfg.parallel.devices = args.devices or []
    info = setup(cfg)  # the training's own initialisation: transport auto for the weights exchange
    device, peers = info.device, info.data_peers
    crop = 224 if args.arch == "owt" else 227
    torch.manual_seed(0)
    model = build_model(args.arch, 1000, args.width, 0.5, crop).to(device)
    opt = build_optimizer(model, TrainConfig())
    tensors = [p.data for p in model.parameters()] + opt.velocities()
    grads = [p.data.clone() for p in model.parameters()]

    def timed(fn) -> float:
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=info.cpu_group)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    allreduce = "nccl" if info.transport == "nccl" else "gloo"
    rows = []
    for transport in (["ipc"] if info.transport == "ipc" else []) + [allreduce]:  # ipc: one GPU or the CPU
        impl = (IpcAverage if transport == "ipc" else AllReduceAverage)(flat_size(tensors), device, peers)
        rows.append({"what": f"weights exchange via {transport}", "mbytes": round(flat_size(tensors) * 4 / 1e6, 1),
                     "ms": round(1e3 * timed(lambda impl=impl: impl.average(tensors)), 2)})
        impl.close()
    grad_avg = AllReduceAverage(flat_size(grads), device, peers)
    rows.append({"what": f"gradient all-reduce via {allreduce}", "mbytes": round(flat_size(grads) * 4 / 1e6, 1),
                 "ms": round(1e3 * timed(lambda: grad_avg.average(grads)), 2)})
    rows += _ddp_rows(model, info, args, crop, timed)
    if rank == 0:
        step = constant_batch_step(args.arch, args.width, crop, args.batch_size, "fp32", False, device)
        rows.append({"what": f"one training step, 1 replica, batch {args.batch_size}", "mbytes": "",
                     "ms": round(1e3 * _timed_steps(step, 1, device, args.repeat, args.warmup), 2)})
        Path(out).write_text(json.dumps({"rows": rows, "device": _device_name(device)}))
    teardown(info)


def _ddp_rows(model, info, args, crop: int, timed) -> list[dict]:
    """A DDP training step with the gradients dropped after each update (set_to_none) or kept as
    DDP's bucket views (what the trainer does): the first re-allocates them and copies them into the
    buckets every step."""
    import torch

    from alexnet.config import TrainConfig
    from alexnet.exchange import wrap_gradients
    from alexnet.optim import build_optimizer
    from alexnet.replica import sgd_step
    ddp = wrap_gradients(model, info, 25.0)
    opt = build_optimizer(model, TrainConfig())
    x = torch.randn(args.batch_size, 3, crop, crop, device=info.device)
    y = torch.randint(0, 1000, (args.batch_size,), device=info.device)
    nothing = lambda: torch.autocast(info.device.type, enabled=False)  # noqa: E731
    rows = []
    for keep in (False, True):
        ms = 1e3 * timed(lambda keep=keep: sgd_step(ddp, opt, x, y, nothing, keep_grads=keep))
        rows.append({"what": f"DDP step, batch {args.batch_size}, gradients {'kept' if keep else 'set to None'}",
                     "mbytes": "", "ms": round(ms, 2)})
    return rows


def _table1(args) -> list[dict]:
    """Time per 20 iterations of train.py itself: 1 and 2 replicas x parallel loading yes/no."""
    import subprocess
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = make_random_dataset(Path(tmp) / "data", args.batch_size * 2 * 4, classes=1000)
        for replicas in (1, 2):
            for loading in ("process", "inline"):
                run = Path(tmp) / f"run{replicas}{loading}"
                steps = args.table1_steps
                over = [f"data.root={data}", f"run.dir={run}", "run.progress=false", "run.tensorboard=false",
                        f"model.arch={args.arch}", f"model.width={args.width}", f"train.batch_size={args.batch_size}",
                        f"train.max_steps={2 * steps}", f"train.log_every={steps}", f"data.loading={loading}",
                        f"parallel.replicas={replicas}", "train.epochs=1000"]
                if args.devices:
                    over.append(f"parallel.devices=[{','.join(args.devices)}]")
                r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "train.py"),
                                    str(Path(__file__).parents[1] / "configs" / "alexnet_1gpu.yaml"), *over],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"train.py failed for {replicas} replicas, {loading}:\n{r.stderr[-2000:]}")
                rec = [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                       if x["split"] == "train"][-1]  # the second window: start-up excluded
                rows.append({"replicas": replicas, "parallel_loading": loading != "inline",
                             "batch_per_replica": args.batch_size, "img_per_s": round(rec["img_per_s"], 1),
                             "s_per_20_iter": round(20 * args.batch_size * replicas / rec["img_per_s"], 3)})
    return rows


def bench_exchange(args) -> dict:
    import torch.multiprocessing as mp

    from alexnet.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.start_processes(_exchange_worker, args=(args.replicas, free_port(), args, str(out)),
                           nprocs=args.replicas, start_method="spawn")
        result = json.loads(out.read_text())
    step_ms = result["rows"][-1]["ms"]
    for r in result["rows"][:-1]:
        r["vs_step"] = round(r["ms"] / step_ms, 3)
    out = {"benchmark": "exchange", "replicas": args.replicas, "arch": args.arch, "width": args.width,
           **{k: v for k, v in result.items() if k != "rows"}, "rows": result["rows"]}
    if args.table1:
        out["table1"] = _table1(args)
    return out


def bench_checkpoint(args) -> dict:
    """What a checkpoint costs the step loop: written synchronously (torch.save + fsync + rename), or as
    the trainer does it, a host copy handed to a background thread (the loop waits for the copy only)."""
    import statistics

    from alexnet.checkpoint import BackgroundWriter, CheckpointDir, to_host
    from alexnet.config import TrainConfig
    from alexnet.distributed import pick_device
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    device = pick_device(args.device)
    model = build_model(args.arch, 1000, args.width, 0.5, 224 if args.arch == "owt" else 227).to(device)
    opt = build_optimizer(model, TrainConfig())
    opt.velocities()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "step": 0}
    mbytes = sum(t.numel() * t.element_size() for t in [*state["model"].values(), *opt.velocities()]) / 1e6
    sync, stall, background = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt, writer = CheckpointDir(tmp), BackgroundWriter()
        for _ in range(args.repeat):
            start = time.perf_counter()
            ckpt.save(to_host(state), epoch_done=False, is_best=False)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            host = to_host(state)
            writer.submit(lambda host=host: ckpt.save(host, epoch_done=False, is_best=False))
            stall.append(time.perf_counter() - start)
            writer.wait()
            background.append(time.perf_counter() - start)
    ms = lambda xs: round(1e3 * statistics.median(xs), 1)  # noqa: E731
    rows = [{"what": "synchronous write: the step loop waits for the disk", "step_loop_ms": ms(sync),
             "write_ms": ms(sync)},
            {"what": "background write (the trainer): the loop waits for the host copy", "step_loop_ms": ms(stall),
             "write_ms": ms(background)}]
    rows[1]["vs_synchronous"] = round(rows[1]["step_loop_ms"] / rows[0]["step_loop_ms"], 3)
    return {"benchmark": "checkpoint", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "mbytes": round(mbytes, 1), "dir": args.dir or tempfile.gettempdir(), "rows": rows}


def _device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({len(os.sched_getaffinity(0))} cores, torch {torch.__version__})"


def _last_seconds(out: Path) -> float:
    return json.loads((out / "report.json").read_text())["last_run"]["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("preprocess", help="JPEG decode and batch-file writing speed")
    pp.add_argument("--images", type=int, default=600, help="training images to generate (default 600)")
    pp.add_argument("--workers", type=int, default=None, help="pool size of the 'all workers' row")
    pt = sub.add_parser("train", help="training img/s on a constant on-device batch, precision x channels_last")
    pt.add_argument("--arch", default="alexnet", choices=("alexnet", "caffenet", "owt"))
    pt.add_argument("--width", type=float, default=1.0)
    pt.add_argument("--crop", type=int, default=0, help="default: 227 (224 for owt)")
    pt.add_argument("--batch-size", type=int, default=256)
    pt.add_argument("--precisions", nargs="+", default=["fp32", "tf32", "bf16"])
    pt.add_argument("--compile", action="store_true", help="torch.compile the model")
    pl = sub.add_parser("loading", help="parallel loading yes/no: process, thread, inline vs a constant batch")
    pl.add_argument("--arch", default="alexnet", choices=("alexnet", "caffenet", "owt"))
    pl.add_argument("--width", type=float, default=1.0)
    pl.add_argument("--crop", type=int, default=0, help="default: 227 (224 for owt)")
    pl.add_argument("--batch-size", type=int, default=256)
    pl.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    pl.add_argument("--channels-last", action="store_true")
    pl.add_argument("--slots", type=int, default=3)
    pl.add_argument("--data", help="a preprocessed folder (default: random batch files in a temp folder)")
    pl.add_argument("--files-per-epoch", type=int, default=8, help="random dataset size, in batches")
    pl.add_argument("--cpu-full-size", action=argparse.BooleanOptionalAction, default=True,
                    help="add the row: loader process alone on the CPU, 227 crops of 256px, batch 256")
    pr = sub.add_parser("read", help="batch-file read paths (old, new, raw) against the memory bound")
    pr.add_argument("--data", help="a preprocessed folder, its first --files files read (default: random files "
                    "of both formats in a temp folder)")
    pr.add_argument("--files", type=int, default=40, help="random dataset: batch files (default 40)")
    pr.add_argument("--per-file", type=int, default=256, help="random dataset: images per file (default 256)")
    pr.add_argument("--size", type=int, default=256, help="random dataset: image side (default 256)")
    pr.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 128])
    pr.add_argument("--window", type=int, default=16, help="data.shuffle_window (default 16)")
    pr.add_argument("--threads", type=int, default=0, help="reader threads (default: data.fastread's)")
    pr.add_argument("--repeat", type=int, default=5, help="timed passes over the epoch, rows in turn (best)")
    pe = sub.add_parser("exchange", help="weights exchange and gradient all-reduce time vs step time")
    pe.add_argument("--replicas", type=int, default=2)
    pe.add_argument("--devices", nargs="*", default=None, help="e.g. cuda:0 cuda:1 (default: cuda, else cpu)")
    pe.add_argument("--arch", default="alexnet", choices=("alexnet", "caffenet", "owt"))
    pe.add_argument("--width", type=float, default=1.0)
    pe.add_argument("--batch-size", type=int, default=128, help="per replica (the paper: 128 on each of 2)")
    pe.add_argument("--warmup", type=int, default=2)
    pe.add_argument("--repeat", type=int, default=5)
    pe.add_argument("--table1", action="store_true", help="also 1 vs 2 replicas x loading yes/no via train.py")
    pe.add_argument("--table1-steps", type=int, default=20, help="iterations per timed window")
    for s in (pt, pl):
        s.add_argument("--device", default="auto")
        s.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
        s.add_argument("--warmup", type=int, default=5)
        s.add_argument("--repeat", type=int, default=3)
    pc = sub.add_parser("checkpoint", help="what a checkpoint costs the step loop: synchronous vs background")
    pc.add_argument("--arch", default="alexnet", choices=("alexnet", "caffenet", "owt"))
    pc.add_argument("--width", type=float, default=1.0)
    pc.add_argument("--device", default="auto")
    pc.add_argument("--dir", help="where to write (default: the temp folder); e.g. the run's file system")
    pc.add_argument("--repeat", type=int, default=3)
    bench_parallel.add_parser(sub)
    for s in (pp, pt, pl, pe, pr, pc, sub.choices["parallel"]):
        s.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    benches = {"preprocess": bench_preprocess, "train": bench_train, "loading": bench_loading,
               "exchange": bench_exchange, "read": bench_read, "checkpoint": bench_checkpoint,
               "parallel": bench_parallel.bench_parallel}
    result = benches[args.what](args)
    print(_table(result["rows"], list(dict.fromkeys(k for r in result["rows"] for k in r))))
    for key, title in (("table1", "Table 1 layout (time per 20 iterations)"),
                       ("cost_model", "cost model (full-size AlexNet, global batch 256; a model, not a measurement)")):
        if key in result:
            rows = result[key]["rows"] if isinstance(result[key], dict) else result[key]
            print(f"\n{title}:")
            print(_table(rows, list(rows[0].keys())))
    print({k: v for k, v in result.items() if k not in ("rows", "table1", "cost_model")})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
