#!/usr/bin/env python3
"""Benchmarks, each measured side by side in one run and reported as a table (and JSON with --json).

    python scripts/benchmark.py preprocess [--images 600] [--workers N]
    python scripts/benchmark.py train [--batch-size 256] [--arch alexnet] [--device auto]
    python scripts/benchmark.py loading [--batch-size 256] [--data DIR] [--device auto]
    python scripts/benchmark.py exchange [--replicas 2] [--devices cuda:0 cuda:1] [--table1]

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

exchange: with --replicas processes on --devices (default: one per GPU, or the CPU), the time of one
weights exchange (parameters and momentum, one flat buffer) per transport and of one gradient
all-reduce (parameters' size), against the time of one training step of one replica. --table1 adds
the paper's Table 1 layout: time per 20 iterations for 1 and 2 replicas x parallel loading yes/no,
measured by running train.py itself on random batch files.
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
            seconds = _timed_steps(step, args.steps, device, args.repeat, args.warmup)
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
    return {"benchmark": "loading", "device": _device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "precision": args.precision,
            "channels_last": args.channels_last, "data": args.data or "random batch files", "rows": rows}


def _exchange_worker(rank: int, world: int, port: int, args, out: str) -> None:
    """One replica of the exchange benchmark: times every feasible transport, rank 0 writes JSON."""
    import statistics

    import torch
    import torch.distributed as dist

    from alexnet.config import ParallelConfig, TrainConfig
    from alexnet.distributed import DistInfo, device_for, resolve_transport
    from alexnet.exchange import AllReduceAverage, IpcAverage, flat_size
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    names = args.devices or (["cuda"] if torch.cuda.is_available() else ["cpu"])
    devices = [device_for(names[r % len(names)], r) for r in range(world)]
    device = devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shared = device.type == "cuda" and len(set(devices)) < world
    allreduce = resolve_transport(ParallelConfig(transport="auto", exchange="gradients"), device.type, True, shared)
    allreduce = "nccl" if allreduce == "nccl" else "gloo"
    dist.init_process_group(allreduce, rank=rank, world_size=world)
    cpu = dist.new_group(backend="gloo") if allreduce == "nccl" else dist.group.WORLD
    crop = 224 if args.arch == "owt" else 227
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
            dist.barrier(group=cpu)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    rows = []
    for transport in ("ipc", allreduce):
        info = DistInfo(rank, world, rank, world, device, transport, cpu)
        impl = (IpcAverage if transport == "ipc" else AllReduceAverage)(flat_size(tensors), device, info)
        rows.append({"what": f"weights exchange via {transport}", "mbytes": round(flat_size(tensors) * 4 / 1e6, 1),
                     "ms": round(1e3 * timed(lambda impl=impl: impl.average(tensors)), 2)})
        impl.close()
    flat = torch.empty(flat_size(grads), device=device)
    info = DistInfo(rank, world, rank, world, device, allreduce, cpu)
    grad_avg = AllReduceAverage(flat_size(grads), device, info)
    rows.append({"what": f"gradient all-reduce via {allreduce}", "mbytes": round(flat.numel() * 4 / 1e6, 1),
                 "ms": round(1e3 * timed(lambda: grad_avg.average(grads)), 2)})
    if rank == 0:
        step = constant_batch_step(args.arch, args.width, crop, args.batch_size, "fp32", False, device)
        rows.append({"what": f"one training step, 1 replica, batch {args.batch_size}", "mbytes": "",
                     "ms": round(1e3 * _timed_steps(step, 1, device, args.repeat, args.warmup), 2)})
        Path(out).write_text(json.dumps({"rows": rows, "devices": [str(d) for d in devices],
                                         "device": _device_name(device)}))
    dist.barrier(group=cpu)
    dist.destroy_process_group()


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
    for s in (pp, pt, pl, pe):
        s.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    benches = {"preprocess": bench_preprocess, "train": bench_train, "loading": bench_loading,
               "exchange": bench_exchange}
    result = benches[args.what](args)
    print(_table(result["rows"], list(result["rows"][0].keys())))
    if "table1" in result:
        print("\nTable 1 layout (time per 20 iterations):")
        print(_table(result["table1"], list(result["table1"][0].keys())))
    print({k: v for k, v in result.items() if k not in ("rows", "table1")})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
