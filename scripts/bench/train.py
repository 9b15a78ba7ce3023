"""train: training img/s of the model fed one constant on-device batch (no data loading), for each
precision (fp32, tf32, bf16) x channels_last off/on, with the time per 20 iterations (the paper's
Table 1 unit). Warm-up steps first; the median of --repeat timed runs of --steps steps.
"""
from __future__ import annotations

from alexnet.evaluation import PRECISIONS
from data.domains import COUNT

from .common import add_model_args, add_timing_args, default_crop, device_name, subcommand, timed_steps
from .workload import constant_batch_step


def add_parser(sub):
    p = subcommand(sub, "train", "training img/s on a constant on-device batch, precision x channels_last", run)
    add_model_args(p, crop=True)
    p.add_argument("--batch-size", type=COUNT, default=256)
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    add_timing_args(p)
    return p


def run(args) -> dict:
    from alexnet.distributed import pick_device
    device = pick_device(args.device)
    crop = default_crop(args.arch, args.crop)
    rows = []
    for precision in args.precisions:
        for cl in (False, True):
            step = constant_batch_step(args.arch, args.width, crop, args.batch_size, precision, cl, device,
                                       args.compile)
            seconds = timed_steps(step, args.steps, device, args.repeat, args.warmup)
            rows.append({"precision": precision, "channels_last": cl,
                         "img_per_s": round(args.batch_size * args.steps / seconds, 1),
                         "s_per_20_iter": round(seconds * 20 / args.steps, 3)})
    base = rows[0]["img_per_s"]
    for r in rows:
        r["vs_fp32"] = round(r["img_per_s"] / base, 2)
    return {"benchmark": "train", "device": device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "compile": args.compile, "rows": rows}
