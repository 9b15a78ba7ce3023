#!/usr/bin/env python3
"""Benchmarks, each measured side by side in one run and reported as a table (and JSON with --json).

    python scripts/benchmark.py preprocess [--images 600] [--workers N]
    python scripts/benchmark.py train [--batch-size 256] [--arch alexnet] [--device auto]
    python scripts/benchmark.py loading [--batch-size 256] [--data DIR] [--device auto]

preprocess: JPEG decode-to-256 images/s per worker with and without Pillow's draft mode (same files,
same process), then the whole preprocessing pipeline with 1 worker and with all workers, on a
generated tree whose image sizes follow ImageNet's (shorter side 333-800 pixels).

train: training img/s of the model fed one constant on-device batch (no data loading), for each
precision (fp32, tf32, bf16) x channels_last off/on, with the time per 20 iterations (the paper's
Table 1 unit). Warm-up steps first; the median of --repeat timed runs of --steps steps.

loading: the paper's "parallel loading yes/no" comparison on the device present: training time per 20
iterations and img/s with data.loading process / thread / inline, against the same model fed one
constant on-device batch (the upper bound), and the loader alone (no trainer). Without --data it
writes a random-image dataset in the batch-file format (page-cached after the first epoch).
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
    for r in rows:
        r["img_per_s_per_worker"] = round(r["img_per_s"] / r["workers"], 1)
        r["img_per_s"] = round(r["img_per_s"], 1)
    return {"benchmark": "preprocess", "images": len(files), "cpu_count": len(os.sched_getaffinity(0)),
            "draft_speedup": round(rows[0]["img_per_s"] / rows[1]["img_per_s"], 2), "rows": rows}


def _timed_steps(step, steps: int, device, repeat: int) -> float:
    """Median seconds for `steps` calls of step(), device work included."""
    import statistics

    import torch
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
    from alexnet.trainer import autocast_for, configure_backends, sgd_step
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
            for _ in range(args.warmup):
                step()
            seconds = _timed_steps(step, args.steps, device, args.repeat)
            rows.append({"precision": precision, "channels_last": cl,
                         "img_per_s": round(args.batch_size * args.steps / seconds, 1),
                         "s_per_20_iter": round(seconds * 20 / args.steps, 3)})
    base = rows[0]["img_per_s"]
    for r in rows:
        r["vs_fp32"] = round(r["img_per_s"] / base, 2)
    return {"benchmark": "train", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "compile": args.compile, "rows": rows}


def make_random_dataset(root: Path, n_images: int, size: int = 256, per_file: int = 256, classes: int = 1000) -> Path:
    """A preprocessed-format folder of random images (for loader speed, where content does not matter)."""
    import numpy as np

    from data.batchfile import atomic_write_json, batch_file_name, write_batch_file
    rng = np.random.default_rng(0)
    files = []
    (root / "train").mkdir(parents=True, exist_ok=True)
    for i, lo in enumerate(range(0, n_images, per_file)):
        n = min(per_file, n_images - lo)
        images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        write_batch_file(root / "train" / batch_file_name(i), images, rng.integers(0, classes, n), ["x"] * n,
                         split="train", index=i)
        files.append({"name": batch_file_name(i), "count": n})
    np.save(root / "mean.npy", np.full((size, size, 3), 127.5, np.float32))
    atomic_write_json(root / "meta.json", {"format_version": 1, "classes": [f"c{i}" for i in range(classes)],
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
    for _ in range(warmup):
        one()
    return _timed_steps(one, steps, device, repeat)


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
        for _ in range(args.warmup):
            step()
        add("constant on-device batch (upper bound)", _timed_steps(step, args.steps, device, args.repeat))
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
    return {"benchmark": "loading", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "precision": args.precision,
            "channels_last": args.channels_last, "data": args.data or "random batch files", "rows": rows}


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
    for s in (pt, pl):
        s.add_argument("--device", default="auto")
        s.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
        s.add_argument("--warmup", type=int, default=5)
        s.add_argument("--repeat", type=int, default=3)
    for s in (pp, pt, pl):
        s.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    result = {"preprocess": bench_preprocess, "train": bench_train, "loading": bench_loading}[args.what](args)
    print(_table(result["rows"], list(result["rows"][0].keys())))
    print({k: v for k, v in result.items() if k != "rows"})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
