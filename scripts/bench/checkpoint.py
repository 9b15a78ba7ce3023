"""checkpoint: what one checkpoint of the model with its momentum costs the step loop: written
synchronously (torch.save, fsync, rename), or as the trainer does, a host copy handed to a background
thread; --dir puts the files on the file system to measure (e.g. the run's network file system).
"""
from __future__ import annotations

import statistics
import tempfile
import time

from alexnet.cli import temporary_directory
from data.domains import COUNT, DEVICE, InputPath

from .common import add_model_args, default_crop, device_name, subcommand


def add_parser(sub):
    p = subcommand(sub, "checkpoint", "what a checkpoint costs the step loop: synchronous vs background", run)
    add_model_args(p)
    p.add_argument("--device", type=DEVICE, default="auto")
    p.add_argument("--dir", type=InputPath("folder"),
                   help="where to write (default: the temp folder); e.g. the run's file system")
    p.add_argument("--repeat", type=COUNT, default=3)
    return p


def run(args) -> dict:
    """What a checkpoint costs the step loop: written synchronously (torch.save + fsync + rename), or as
    the trainer does it, a host copy handed to a background thread (the loop waits for the copy only)."""
    from alexnet.checkpoint import BackgroundWriter, CheckpointDir, to_host
    from alexnet.config import TrainConfig
    from alexnet.distributed import pick_device
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    device = pick_device(args.device)
    model = build_model(args.arch, 1000, args.width, 0.5, default_crop(args.arch)).to(device)
    opt = build_optimizer(model, TrainConfig())
    opt.velocities()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "step": 0}
    mbytes = sum(t.numel() * t.element_size() for t in [*state["model"].values(), *opt.velocities()]) / 1e6
    sync, stall, background = [], [], []
    with temporary_directory(dir=args.dir) as tmp:
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
    return {"benchmark": "checkpoint", "device": device_name(device), "arch": args.arch, "width": args.width,
            "mbytes": round(mbytes, 1), "dir": args.dir or tempfile.gettempdir(), "rows": rows}
