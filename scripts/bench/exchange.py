"""exchange: with --replicas processes on --devices (default: one per GPU, or the CPU), the time of one
weights exchange (parameters and momentum, one flat buffer) per transport and of one gradient
all-reduce (parameters' size), against the time of one training step of one replica. --table1 adds
the paper's Table 1 layout: time per 20 iterations for 1 and 2 replicas x parallel loading yes/no,
measured by running train.py itself on random batch files.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from alexnet.cli import temporary_directory
from data.domains import COUNT, NON_NEGATIVE, device
from data.procs import watched_env

from .common import REPO, add_model_args, default_crop, device_name, join_as, run_workers, subcommand, timed_steps
from .workload import constant_batch_step, make_random_dataset


def add_parser(sub):
    p = subcommand(sub, "exchange", "weights exchange and gradient all-reduce time vs step time", run,
                   tables=(("table1", "Table 1 layout (time per 20 iterations)"),))
    p.add_argument("--replicas", type=COUNT, default=2)
    p.add_argument("--devices", nargs="*", type=device(auto=False), default=None,
                   help="e.g. cuda:0 cuda:1 (default: cuda, else cpu)")
    add_model_args(p)
    p.add_argument("--batch-size", type=COUNT, default=128, help="per replica (the paper: 128 on each of 2)")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=2)
    p.add_argument("--repeat", type=COUNT, default=5)
    p.add_argument("--table1", action="store_true", help="also 1 vs 2 replicas x loading yes/no via train.py")
    p.add_argument("--table1-steps", type=COUNT, default=20, help="iterations per timed window")
    return p


def run(args) -> dict:
    result = run_workers(_worker, args.replicas, args)
    step_ms = result["rows"][-1]["ms"]
    for r in result["rows"][:-1]:
        r["vs_step"] = round(r["ms"] / step_ms, 3)
    out = {"benchmark": "exchange", "replicas": args.replicas, "arch": args.arch, "width": args.width,
           **{k: v for k, v in result.items() if k != "rows"}, "rows": result["rows"]}
    if args.table1:
        out["table1"] = _table1(args)
    return out


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    """One replica of the exchange benchmark: times every feasible transport, rank 0 writes JSON."""
    import torch

    from alexnet.config import Config, TrainConfig
    from alexnet.distributed import setup, teardown
    from alexnet.exchange import AllReduceAverage, IpcAverage, flat_size
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    join_as(rank, world, port)
    cfg = Config()
    cfg.parallel.devices = args.devices or []
    info = setup(cfg)  # the training's own initialisation: transport auto for the weights exchange
    device, peers = info.device, info.data_peers
    crop = default_crop(args.arch)
    torch.manual_seed(0)
    model = build_model(args.arch, 1000, args.width, 0.5, crop).to(device)
    opt = build_optimizer(model, TrainConfig())
    tensors = [p.data for p in model.parameters()] + opt.velocities()
    grads = [p.data.clone() for p in model.parameters()]

    def timed(fn) -> float:
        return timed_steps(fn, 1, device, args.repeat, args.warmup, info.comm.barrier)
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
                     "ms": round(1e3 * timed_steps(step, 1, device, args.repeat, args.warmup), 2)})
        Path(out).write_text(json.dumps({"rows": rows, "device": device_name(device)}))
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
    ddp = wrap_gradients(model, info.device, 25.0)
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
    rows = []
    with temporary_directory() as tmp:
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
                r = subprocess.run([sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "alexnet_1gpu.yaml"),
                                    *over], capture_output=True, text=True, env=watched_env())
                if r.returncode != 0:
                    raise RuntimeError(f"train.py failed for {replicas} replicas, {loading}:\n{r.stderr[-2000:]}")
                rec = [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                       if x["split"] == "train"][-1]  # the second window: start-up excluded
                rows.append({"replicas": replicas, "parallel_loading": loading != "inline",
                             "batch_per_replica": args.batch_size, "img_per_s": round(rec["img_per_s"], 1),
                             "s_per_20_iter": round(20 * args.batch_size * replicas / rec["img_per_s"], 3)})
    return rows
