"""loading: the paper's "parallel loading yes/no" comparison on the device present: training time per 20
iterations and img/s with data.loading process / thread / inline, against the same model fed one
constant on-device batch (the upper bound), and the loader alone (no trainer); then the loader process
alone on the CPU at full size (227 crops of 256x256 images, batch 256), whatever the other options.
Without --data it writes a random-image dataset in the batch-file format (page-cached after the first
epoch).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from alexnet.cli import temporary_directory
from data.domains import COUNT, InputPath

from .common import add_model_args, add_timing_args, default_crop, device_name, subcommand, timed_steps
from .workload import constant_batch_step, make_random_dataset, trainer_step

FULL_BATCH, FULL_SIZE, FULL_CROP = 256, 256, 227


def add_parser(sub):
    p = subcommand(sub, "loading", "parallel loading yes/no: process, thread, inline vs a constant batch", run)
    add_model_args(p, crop=True)
    p.add_argument("--batch-size", type=COUNT, default=256)
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--slots", type=COUNT, default=3)
    p.add_argument("--data", type=InputPath("folder"),
                   help="a preprocessed folder (default: random batch files in a temp folder)")
    p.add_argument("--files-per-epoch", type=COUNT, default=8, help="random dataset size, in batches")
    p.add_argument("--cpu-full-size", action=argparse.BooleanOptionalAction, default=True,
                   help="add the row: loader process alone on the CPU, 227 crops of 256px, batch 256")
    add_timing_args(p)
    return p


def run(args) -> dict:
    from alexnet.distributed import pick_device
    from data.loader import InlineLoader, LoaderSpec
    from data.slot_loader import SlotLoader
    device = pick_device(args.device)
    crop = default_crop(args.arch, args.crop)
    with temporary_directory() as tmp:
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
        add("constant on-device batch (upper bound)", timed_steps(step, args.steps, device, args.repeat,
                                                                  args.warmup))
        train_step = trainer_step(args.arch, args.width, crop, args.precision, args.channels_last, device,
                                  num_classes=classes)
        for mode in ("process", "thread", "inline"):
            loader = InlineLoader(spec) if mode == "inline" else SlotLoader(spec, mode, args.slots)
            add(f"data.loading={mode}", _loader_rate(loader, train_step, device, args))
        add("loader process alone (no training)", _loader_rate(SlotLoader(spec, "process", args.slots), None,
                                                               device, args))
    bound = rows[0]["img_per_s"]
    for r in rows:
        r["vs_upper_bound"] = round(r["img_per_s"] / bound, 3)
    if args.cpu_full_size:
        rows.append(_cpu_full_size_row(args))
    return {"benchmark": "loading", "device": device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "precision": args.precision,
            "channels_last": args.channels_last, "data": args.data or "random batch files", "rows": rows}


def _endless(loader):
    """Training batches across epoch boundaries, as a long run sees them."""
    epoch = 0
    while True:
        yield from loader.batches("train", epoch)
        epoch += 1


def _loader_rate(loader, step, device, args) -> float:
    """Median seconds per --steps steps fed by `loader` (step=None: the loader alone); closes the loader."""
    batches = _endless(loader)

    def one():
        b = next(batches)
        if step is not None:
            step(b.x, b.y)
    try:
        return timed_steps(one, args.steps, device, args.repeat, args.warmup)
    finally:
        loader.close()


def _cpu_full_size_row(args) -> dict:
    """The loader process alone on the CPU at ImageNet size: 227 crops of 256x256 images, batch 256.

    Whatever the other rows' --batch-size, --crop and --device: how many images/s one loader's host
    side (read, crop, flip, mean subtraction) can deliver, the figure a GPU's loader must beat.
    """
    import torch

    from data.loader import LoaderSpec
    from data.slot_loader import SlotLoader
    with temporary_directory() as tmp:
        root = Path(args.data) if args.data else make_random_dataset(
            Path(tmp), FULL_BATCH * args.files_per_epoch, size=FULL_SIZE, classes=1000)
        spec = LoaderSpec(root=str(root), batch_size=FULL_BATCH, val_batch_size=FULL_BATCH, crop=FULL_CROP,
                          device="cpu", splits=("train",))
        seconds = _loader_rate(SlotLoader(spec, "process", args.slots), None, torch.device("cpu"), args)
    return {"what": f"loader process alone, CPU, {FULL_CROP} crops of {FULL_SIZE}px, batch {FULL_BATCH}",
            "img_per_s": round(FULL_BATCH * args.steps / seconds, 1),
            "s_per_20_iter": round(seconds * 20 / args.steps, 3), "vs_upper_bound": ""}
