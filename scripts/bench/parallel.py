"""parallel: Yadan et al. (2013)'s Table 1 layouts (1 device; 2 model parallel; 2 and 4 data parallel;
4 model + data) plus fc parallelism on 2 and 4, at one global batch, measured, and a cost model.

Each layout trains AlexNet for a few steps at one global batch (256 by default) with the repository's
own training step (alexnet/replica.py: the model part, the optimizer, the synchronisation), one
process per device, and reports the time per step, the bytes each process put on links per step
(counted where they are sent: activation gathers, gradient and weight all-reduces) and the parameter
bytes each process holds. The cost model gives the same layouts' bytes for full-size AlexNet on
2/4/8 GPUs, from formulas that mirror the code (checked against the counts in the tests), and the time
those bytes take over a link of a given bandwidth: a model, not a measurement.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from data.domains import COUNT, NON_NEGATIVE, POSITIVE

from .common import join_as, run_workers, subcommand, timed_steps

# name, replicas R, model size M, model parallelism, as Yadan et al.'s Table 1 plus fc-parallel.
LAYOUTS = (
    ("1 device", 1, 1, "fc"),
    ("2 model parallel (columns)", 1, 2, "columns"),
    ("2 data parallel", 2, 1, "fc"),
    ("4 data parallel", 4, 1, "fc"),
    ("4 model + data (2 x 2 columns)", 2, 2, "columns"),
    ("2 fc parallel", 1, 2, "fc"),
    ("4 fc parallel", 1, 4, "fc"),
)
# Yadan et al., Table 1 (4 Titan GPUs, 100 epochs): days for the layouts they ran.
YADAN_DAYS = {"1 device": 10.5, "2 model parallel (columns)": 6.6, "2 data parallel": 7.0, "4 data parallel": 7.2,
              "4 model + data (2 x 2 columns)": 4.8}
LINKS = (("PCIe 3.0 x16", 12e9), ("PCIe 4.0 x16", 25e9), ("NVLink (H100)", 400e9))


def per_process_batch(global_batch: int, replicas: int, model_size: int, mode: str) -> int:
    """Images each process reads: fc parallelism splits a replica's batch, columns share it."""
    share = replicas * (model_size if mode == "fc" else 1)
    if global_batch % share:
        raise ValueError(f"global batch {global_batch} does not split over {share} processes")
    return global_batch // share


# -- the measurement ------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """One process of a layout: time `steps` training steps after `warmup`; rank 0 writes the figures."""
    import torch

    from alexnet.config import Config, apply
    from alexnet.distributed import setup, teardown
    from alexnet.precision import autocast_for, configure_backends
    from alexnet.replica import Replica
    join_as(rank, world, port)
    cfg = Config()
    apply(cfg, spec["config"], "benchmark")
    info = setup(cfg)
    configure_backends(cfg.train.precision, info.device)
    replica = Replica(cfg, info, spec["classes"])
    g = torch.Generator().manual_seed(rank)
    b, crop = replica.layout.reader_batch, cfg.data.crop
    x = torch.randn(b, 3, crop, crop, generator=g).to(info.device)
    y = torch.randint(0, spec["classes"], (b,), generator=g).to(info.device)
    numbers = itertools.count(1)  # the step numbers, warm-up included

    def step() -> None:
        replica.step(x, y, next(numbers), lambda: autocast_for(cfg.train.precision, info.device))
    barrier = info.comm.barrier
    timed_steps(step, spec["warmup"], info.device, 1, barrier=barrier)
    sent0 = replica.sent_bytes()
    n = spec["steps"]
    mine = {"s_per_step": timed_steps(step, n, info.device, spec["repeat"], barrier=barrier) / n,
            "sent_per_step": (replica.sent_bytes() - sent0) / (n * spec["repeat"]),
            "param_bytes": replica.parameter_bytes()}
    everyone = info.comm.all_gather_object(mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    teardown(info)


def measure(name: str, replicas: int, model_size: int, mode: str, args, devices: list[str]) -> dict:
    """Run one layout in `replicas x model_size` processes; its row of the table (or the reason not)."""
    world = replicas * model_size
    if len(devices) < world:
        return {"layout": name, "status": f"skipped: needs {world} devices, {len(devices)} present"}
    batch = per_process_batch(args.batch_size, replicas, model_size, mode)
    config = {"model": {"arch": "alexnet", "width": args.width, "dropout": 0.5},
              "data": {"crop": 227, "root": "unused"},
              "train": {"batch_size": args.batch_size // replicas, "precision": args.precision},  # a replica's
              "parallel": {"replicas": replicas, "model_size": model_size, "model": mode, "exchange": "gradients",
                           "devices": devices[:world], "timeout": 600.0}}
    spec = {"config": config, "classes": 1000, "warmup": args.warmup, "steps": args.steps, "repeat": args.repeat}
    ranks = run_workers(_worker, world, spec)
    step = max(r["s_per_step"] for r in ranks)  # the slowest process sets the pace
    return {"layout": name, "processes": world, "batch_per_process": batch,
            "ms_per_step": round(1e3 * step, 1), "img_per_s": round(args.batch_size / step, 1),
            "MB_sent_per_step": round(max(r["sent_per_step"] for r in ranks) / 1e6, 2),
            "MB_params_per_process": round(max(r["param_bytes"] for r in ranks) / 1e6, 1)}


# -- the cost model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """The activation and parameter sizes of AlexNet (alexnet arch, crop 227) that cross links."""

    params: int        # parameter elements
    conv_params: int   # of which in the conv layers
    norm_sides: tuple[int, int]  # spatial sides of the activations LRN normalises (block 1, block 2)
    c2: int            # conv2 output channels (conv3's input)
    pool5: int         # fc6's input features
    hidden: int        # fc6/fc7 units
    classes: int


def alexnet_shapes(width: float = 1.0, classes: int = 1000) -> Shapes:
    import torch

    from alexnet.models import build_model
    with torch.device("meta"):
        m = build_model("alexnet", classes, width, 0.5, 227, "torch")
    convs = [p.numel() for k, p in m.named_parameters() if k.startswith("features")]
    fc6 = m.classifier.fc6
    return Shapes(sum(p.numel() for p in m.parameters()), sum(convs), (55, 27), m.features.conv2.out_channels,
                  fc6.in_features, fc6.out_features, classes)


def bytes_per_step(s: Shapes, global_batch: int, replicas: int, model_size: int, mode: str,
                   nccl: bool = True) -> int:
    """Bytes one process sends per training step (fp32), mirroring the code's collectives.

    all-gather: (M-1) x own part; its backward reduce-scatter (NCCL): the same; gloo's backward
    all-reduces the whole gathered gradient instead: 2 (M-1)/M x all parts. all-reduce: 2 (N-1)/N x size.
    """
    m, r, b = model_size, replicas, per_process_batch(global_batch, replicas, model_size, mode)

    def gathered(own: int) -> int:  # bytes of one gather forward and its backward
        own *= 4
        return (m - 1) * own + ((m - 1) * own if nccl else 2 * (m - 1) * own)

    def all_reduce(n: int, elements: int) -> int:
        return 2 * (n - 1) * 4 * elements // n
    if m == 1:
        return all_reduce(r, s.params)
    if mode == "columns":
        halo = sum(4 * side * side * b for side in s.norm_sides)  # 2 edge channels each side, per LRN
        owns = [halo, s.c2 // m * 13 * 13 * b, s.pool5 // m * b, s.hidden // m * b, s.hidden // m * b,
                s.classes // m * b]
        local = s.params // m
        total = sum(gathered(own) for own in owns)
    else:
        rows = m * b  # the model group's images
        owns = [s.pool5 * b, s.hidden // m * rows, s.hidden // m * rows, s.classes // m * rows]
        local = s.conv_params + (s.params - s.conv_params) // m
        total = sum(gathered(own) for own in owns) + all_reduce(m, s.conv_params)
    return total + all_reduce(r, local)


def cost_model(step_ms: float, global_batch: int = 256) -> list[dict]:
    """Full-size AlexNet on 2/4/8 GPUs over each link: MB per step and ms per step of communication."""
    s = alexnet_shapes()
    rows = []
    for n in (2, 4, 8):
        for name, r, m, mode in ((f"{n} data parallel", n, 1, "fc"), (f"{n} fc parallel", 1, n, "fc"),
                                 (f"{n} = {n // 2} x 2 columns", n // 2, 2, "columns")):
            sent = bytes_per_step(s, global_batch, r, m, mode)
            row = {"layout": name, "MB_per_step": round(sent / 1e6, 1)}
            for link, bandwidth in LINKS:
                ms = 1e3 * sent / bandwidth
                row[f"{link} ms"] = round(ms, 2)
                row[f"{link} vs step"] = round(ms / step_ms, 3)
            rows.append(row)
    return rows


def run(args) -> dict:
    import torch
    if args.device == "cpu" or not torch.cuda.is_available():
        devices = ["cpu"] * 8
        device = "cpu"
    else:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        device = torch.cuda.get_device_name(0)
    rows = [measure(name, r, m, mode, args, devices) for name, r, m, mode in LAYOUTS]
    base = next((row["ms_per_step"] for row in rows if "ms_per_step" in row), None)
    for row in rows:
        if "ms_per_step" in row:
            row["speedup"] = round(base / row["ms_per_step"], 2)
        if row["layout"] in YADAN_DAYS:
            row["yadan_speedup"] = round(YADAN_DAYS["1 device"] / YADAN_DAYS[row["layout"]], 2)
    return {"benchmark": "parallel", "device": device, "width": args.width, "global_batch": args.batch_size,
            "precision": args.precision, "rows": rows,
            "cost_model": {"assumed_step_ms": args.step_ms, "rows": cost_model(args.step_ms, 256)}}


def add_parser(sub):
    p = subcommand(sub, "parallel", "Yadan et al.'s Table 1 layouts (model, data, hybrid, fc) + cost model", run,
                   tables=(("cost_model", "cost model (full-size AlexNet, global batch 256; a model, not a "
                                          "measurement)"),))
    p.add_argument("--batch-size", type=COUNT, default=256, help="global batch (default 256)")
    p.add_argument("--width", type=POSITIVE, default=1.0)
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="auto (every GPU present, else the CPU) | cpu")
    p.add_argument("--steps", type=COUNT, default=3)
    p.add_argument("--warmup", type=NON_NEGATIVE, default=1)
    p.add_argument("--repeat", type=COUNT, default=1)
    p.add_argument("--step-ms", type=POSITIVE, default=1640.0,
                   help="the step time the cost model compares against (default: the paper's 1-GPU step, Titan "
                        "Black, batch 256)")
    return p
