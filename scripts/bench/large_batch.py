"""large-batch: a CPU proxy of You, Gitman & Ginsburg 2017's question: does a 16x larger batch, trained
the same number of epochs, lose accuracy, and how much of the loss do LARS and LAMB win back?

A small AlexNet and AlexNet-BN (width 0.25, 67-pixel crops) on generated data (data/synthetic.py's shape x
colour classes, preprocessed by data/preprocess.py, as `make demo` does) are trained by train.py itself
(the poly lr policy with power 2, warmup, momentum 0.9, weight decay 5e-4, train.optimizer) with a small
batch B and with 16 x B: SGD at B; at 16 x B, SGD with Goyal et al.'s linear scaling (train.lr_scaling
linear: lr x 16, reached by a warmup from the lr at B) and SGD from half that lr (a tuned baseline, as the
paper's), LARS and LAMB (warmup from 0). The result of a run is its last validation's top-1 error (center
crops), for each of --seeds. Each run is one train.py process with one torch thread, --jobs at a time, so
its numbers do not depend on what runs beside it (its wall time does).

The gap is err(best SGD at 16 x B) - err(SGD at B), over the seeds' means; "closed" is the share of it an
optimizer at 16 x B wins back: (err(best SGD at 16B) - err(opt at 16B)) / gap (1: as good as the small
batch; 0: no better than SGD; below 0: worse).

The lrs of LARS and LAMB (MAIN_LRS, the same for both archs) were chosen on a one-seed sweep, which
--sweep repeats (on by default): seed 0, at 16 x B, LARS and LAMB over global lrs and LARS over warmup
lengths; every point is in the result, not only the best. LARS's trust coefficient is not swept apart
from its lr: in scale mode (the paper's) a tensor's step is lr x eta x ratio, so eta x 2 is lr x 2.

Cost on a 2-core CPU: 46 train.py runs, ~19 min of CPU time (~10 min of wall time with 2 jobs on an idle
machine; more where other work shares it); --no-sweep keeps the table's 30, --seeds 0 10 of those 30.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from alexnet.cli import temporary_directory
from data.domains import (
    COUNT,
    NON_NEGATIVE,
    NON_NEGATIVE_FLOAT,
    POSITIVE,
    Earlier,
    InputPath,
    OutputPath,
    output_of,
    text,
)
from data.procs import in_threads, watched_env

from .common import REPO, cpu_name, subcommand

ARCHS = ("alexnet", "alexnet_bn")
OPTIMIZERS = ("sgd", "lars", "lamb")
# What --keep holds: the generated images (src, beside data: make_data), their preprocessed data, the runs.
# A second run with the same --keep takes the folder as its own (it held "src" without naming it: refused);
# each of the three is known by its own tool's rule, so that the user's own data/ there is refused, not used.
KEPT = ("src", "data", "runs")


def _synthetic() -> OutputPath:
    from data.synthetic import OUTPUT
    return OUTPUT


def _preprocessed() -> OutputPath:
    from data.preprocess import OUTPUT
    return OUTPUT


def _runs(path: Path) -> bool:
    """runs/: folders of train.py runs only (alexnet.rundir's rule: a new or empty folder, or a run's)."""
    from alexnet.config import ConfigError
    from alexnet.rundir import check_run_dir
    try:
        return all(e.is_dir() and check_run_dir(e) is None for e in path.iterdir() if not e.name.startswith("."))
    except ConfigError:
        return False


KEPT_KNOWN = {"src": output_of("the generated images of an earlier large-batch run", _synthetic),
              "data": output_of("the preprocessed data of an earlier large-batch run", _preprocessed),
              "runs": Earlier("the training runs of an earlier large-batch run", _runs)}
# Global lrs at 16 x B: AlexNet's best of the sweep (seed 0; LARS's is also the paper's at 8K); AlexNet-BN's
# best were 20 and 0.05 on seed 0, barely ahead (see the sweep), so both archs share these. SGD's is its lr
# at B (x 16 at 16 x B, by linear scaling).
MAIN_LRS = {"alexnet": {"sgd": 0.01, "lars": 10.0, "lamb": 0.02},
            "alexnet_bn": {"sgd": 0.01, "lars": 10.0, "lamb": 0.02}}
SWEEP = {"lars": [2.0, 5.0, 20.0], "lamb": [0.005, 0.01, 0.05], "sgd": [], "lars_warmup": [0.0, 5.0]}
QUICK = {"classes": 3, "train_per_class": 16, "val_per_class": 4, "width": 0.125, "epochs": 2, "batch": 2,
         "scale": 4, "seeds": [0], "archs": ["alexnet_bn"], "sgd_factors": [1.0], "sweep_lars": [5.0],
         "sweep_lamb": [], "sweep_sgd": [], "sweep_lars_warmup": []}


def add_parser(sub):
    p = subcommand(sub, "large-batch", "CPU proxy of LARS/LAMB: batch B vs 16 x B, same epochs, validation error",
                   run, tables=(("gap", "the gap to batch B at 16 x B, and the share of it each optimizer closes "
                                        "(means over the seeds)"),
                                ("sweep", "the sweep at 16 x B (one seed; every point)")))
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--classes", type=COUNT, default=20)
    p.add_argument("--train-per-class", type=COUNT, default=160)
    p.add_argument("--val-per-class", type=COUNT, default=40)
    p.add_argument("--size", type=COUNT, default=72, help="preprocessed image side")
    p.add_argument("--crop", type=COUNT, default=67, help="training and validation crop (alexnet's smallest: 67)")
    p.add_argument("--width", type=POSITIVE, default=0.25)
    p.add_argument("--epochs", type=COUNT, default=10)
    p.add_argument("--batch", type=COUNT, default=16, help="the small batch B")
    p.add_argument("--scale", type=COUNT, default=16, help="the large batch is scale x B")
    p.add_argument("--warmup", type=NON_NEGATIVE_FLOAT, default=2.0,
                   help="warmup epochs at scale x B (every optimizer)")
    p.add_argument("--sgd-factors", type=POSITIVE, nargs="+", default=[1.0, 0.5],
                   help="SGD at scale x B: these fractions of the linearly scaled lr")
    p.add_argument("--lr", nargs=3, action="append", metavar=("ARCH", "OPTIMIZER", "LR"), default=[],
                   type=text("ARCH OPTIMIZER LR"),
                   help="replace a MAIN_LRS entry (sgd: its lr at B)")
    p.add_argument("--seeds", type=NON_NEGATIVE, nargs="+", default=[0, 1, 2])
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="also the one-seed sweep at scale x B (--sweep-* lists)")
    p.add_argument("--sweep-lars", type=POSITIVE, nargs="*", default=SWEEP["lars"], help="LARS global lrs")
    p.add_argument("--sweep-lamb", type=POSITIVE, nargs="*", default=SWEEP["lamb"], help="LAMB global lrs")
    p.add_argument("--sweep-sgd", type=POSITIVE, nargs="*", default=SWEEP["sgd"],
                   help="SGD lrs at B (x scale at scale x B)")
    p.add_argument("--sweep-lars-warmup", type=POSITIVE, nargs="*", default=SWEEP["lars_warmup"],
                   help="LARS warmup epochs")
    p.add_argument("--jobs", type=COUNT, default=len(os.sched_getaffinity(0)), help="train.py runs at a time")
    p.add_argument("--data", type=InputPath("folder"),
                   help="a preprocessed folder to use (default: generated in a temporary folder)")
    p.add_argument("--keep", type=OutputPath("folder", own=KEPT, known=KEPT_KNOWN),
                   help="keep the data and the run directories here (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke settings: 3 classes, width 0.125, "
                   "2 epochs, B 2 and 4 x B, AlexNet-BN, one seed, one sweep point")
    return p


def run(args) -> dict:
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    lrs = {arch: dict(MAIN_LRS[arch]) for arch in args.archs}
    for arch, opt, lr in args.lr:
        if arch not in lrs or opt not in OPTIMIZERS:
            raise SystemExit(f"benchmark.py large-batch: error: --lr {arch} {opt}: arch one of {args.archs}, "
                             f"optimizer one of {OPTIMIZERS}")
        lrs[arch][opt] = float(lr)
    start = time.perf_counter()
    with temporary_directory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = Path(args.data) if args.data else make_data(work / "data", args)
        runs = plan(args, lrs)
        results = train_all(runs, data, work / "runs", args)
    done = [r | res for r, res in zip(runs, results)]
    rows = table_rows([r for r in done if r["group"] == "main"])
    result = {"benchmark": "large-batch", "cpu": cpu_name(), "proxy": proxy_settings(args), "main_lrs": lrs,
              "rows": rows, "gap": gap_rows(rows, args)}
    if args.sweep:
        result["sweep"] = sweep_rows(done, args)
    result["runs"] = len(runs)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


# -- the data -------------------------------------------------------------------------------------------

def make_data(out: Path, args) -> Path:
    """Generated shape x colour classes (no file quirks), preprocessed at --size."""
    from data.preprocess import Options, preprocess
    from data.synthetic import generate
    src = out.parent / "src"
    generate(src, num_classes=args.classes, train_per_class=args.train_per_class, val_per_class=args.val_per_class,
             seed=0, quirks=False, min_side=64, max_side=128)
    preprocess(src / "train", out, src / "val", src / "LOC_val_solution.csv",
               Options(size=args.size, per_file=256), workers=2, quiet=True)
    return out


def proxy_settings(args) -> dict:
    return {"classes": args.classes, "train_images": args.classes * args.train_per_class,
            "val_images": args.classes * args.val_per_class, "image_size": args.size, "crop": args.crop,
            "width": args.width, "init": "torch", "epochs": args.epochs, "batch": args.batch,
            "large_batch": args.batch * args.scale, "lr_policy": "poly", "lr_power": 2.0, "momentum": 0.9,
            "weight_decay": 5e-4, "warmup_epochs": args.warmup, "trust_coefficient": 0.001,
            "sgd_factors": args.sgd_factors, "seeds": args.seeds}


# -- the runs -------------------------------------------------------------------------------------------

def spec(arch: str, optimizer: str, batch: int, lr: float, warmup: float, seed: int, group: str = "main") -> dict:
    """One train.py run; `lr` is the peak lr it trains at (SGD at 16 x B: already scaled)."""
    return {"group": group, "arch": arch, "optimizer": optimizer, "batch": batch, "lr": round(lr, 6),
            "warmup_epochs": warmup, "seed": seed}


def plan(args, lrs: dict) -> list[dict]:
    """Per arch and seed: SGD at B; at scale x B, SGD at each --sgd-factors of the linearly scaled lr, LARS
    and LAMB at MAIN_LRS; then the sweep (seed --seeds[0]), leaving out the points the grid has."""
    small, large, k = args.batch, args.batch * args.scale, args.scale
    runs = []
    for arch in args.archs:
        main = lrs[arch]
        for seed in args.seeds:
            runs.append(spec(arch, "sgd", small, main["sgd"], 0.0, seed))
            runs += [spec(arch, "sgd", large, main["sgd"] * k * f, args.warmup, seed) for f in args.sgd_factors]
            runs += [spec(arch, opt, large, main[opt], args.warmup, seed) for opt in ("lars", "lamb")]
    if args.sweep:
        seed = args.seeds[0]
        for arch in args.archs:
            points = [spec(arch, "sgd", large, lr * k, args.warmup, seed, "sweep") for lr in args.sweep_sgd]
            points += [spec(arch, "lars", large, lr, args.warmup, seed, "sweep") for lr in args.sweep_lars]
            points += [spec(arch, "lamb", large, lr, args.warmup, seed, "sweep") for lr in args.sweep_lamb]
            points += [spec(arch, "lars", large, lrs[arch]["lars"], w, seed, "sweep") for w in args.sweep_lars_warmup]
            have = {run_name(r) for r in runs}
            for r in points:
                if run_name(r) not in have:
                    runs.append(r)
                    have.add(run_name(r))
    return runs


def overrides(r: dict, data: Path, run_dir: Path, args) -> list[str]:
    """train.py's dotted overrides for one run (on configs/demo.yaml: only its data and run keys remain);
    validation after the last epoch only. SGD runs through train.lr_scaling=linear from B (the trainer's
    Goyal et al. path: lr at B x batch / B, warmup from the lr at B)."""
    o = {"data.root": str(data), "data.crop": args.crop, "data.loading": "inline",
         "model.arch": r["arch"], "model.width": args.width, "model.init": "torch",
         "train.epochs": args.epochs, "train.batch_size": r["batch"], "train.lr": r["lr"],
         "train.lr_policy": "poly", "train.lr_power": 2.0, "train.warmup_epochs": r["warmup_epochs"],
         "train.optimizer": r["optimizer"], "train.trust_coefficient": 0.001, "train.seed": r["seed"],
         "train.log_every": 10 ** 6, "run.dir": str(run_dir), "run.progress": False, "run.tensorboard": False,
         "run.keep_last": 0, "run.device": "cpu", "train.val_every": args.epochs}
    if r["optimizer"] == "sgd":
        o.update({"train.lr": f"{r['lr'] * args.batch / r['batch']:g}", "train.lr_scaling": "linear",
                  "train.lr_ref_batch": args.batch})
    return [f"{k}={v}" for k, v in o.items()]


def run_name(r: dict) -> str:
    return f"{r['arch']}-{r['optimizer']}-b{r['batch']}-lr{r['lr']:g}-w{r['warmup_epochs']:g}-s{r['seed']}"


def train_one(r: dict, data: Path, runs: Path, args) -> dict:
    """One train.py process (one torch thread): its last validation's errors; a run whose loss or weights
    became NaN or inf (train.py stops it, exit 1) counts as chance."""
    run_dir = runs / run_name(r)
    env = watched_env({**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})  # ends with the benchmark
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "demo.yaml"),
                           *overrides(r, data, run_dir, args)], cwd=REPO, env=env, capture_output=True, text=True)
    out = {"top1_err": None, "top5_err": None, "steps": None, "seconds": round(time.perf_counter() - start, 1),
           "status": "ok"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "NaN or inf" not in last:
            raise RuntimeError(f"large-batch: {run_name(r)} failed (exit {proc.returncode}): {last}")
        out.update(status="diverged", top1_err=round(1 - 1 / args.classes, 4),
                   top5_err=round(max(0.0, 1 - 5 / args.classes), 4))
        return out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in records if x["split"] == "val"][-1]
    out.update(top1_err=round(last["top1_err"], 4), top5_err=round(last["top5_err"], 4), steps=last["iter"])
    return out


def train_all(runs: list[dict], data: Path, root: Path, args) -> list[dict]:
    """Every run, --jobs at a time (the long small-batch runs first); results in the order of `runs`. A Ctrl-C
    starts no queued run (data.procs.in_threads): before, the pool's shutdown went on to train every one."""
    root.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(runs)), key=lambda i: runs[i]["batch"])
    n = 0

    def done(k: int, result: dict) -> None:
        nonlocal n
        n += 1
        print(f"  [{n}/{len(runs)}] {run_name(runs[order[k]])}: top-1 error {result['top1_err']} "
              f"({result['status']}, {result['seconds']} s)", file=sys.stderr, flush=True)
    finished = in_threads(lambda r: train_one(r, data, root, args), [runs[i] for i in order], args.jobs, done)
    results: list[dict] = [{}] * len(runs)
    for k, i in enumerate(order):
        results[i] = finished[k]
    return results


# -- the tables -----------------------------------------------------------------------------------------

def table_rows(done: list[dict]) -> list[dict]:
    """One row per (arch, optimizer, batch, lr) of the grid: the top-1 error's mean and range over the seeds."""
    rows: dict[tuple, dict] = {}
    for r in done:
        row = rows.setdefault((r["arch"], r["optimizer"], r["batch"], r["lr"]), {
            "arch": r["arch"], "optimizer": r["optimizer"], "batch": r["batch"], "lr": r["lr"],
            "warmup_epochs": r["warmup_epochs"], "steps": r["steps"], "top1_err": None, "top1_min": None,
            "top1_max": None, "top5_err": None, "per_seed": [], "diverged": 0, "seconds": 0.0, "_top5": []})
        row["per_seed"].append(r["top1_err"])
        row["_top5"].append(r["top5_err"])
        row["diverged"] += r["status"] != "ok"
        row["seconds"] = round(row["seconds"] + r["seconds"], 1)
        row["steps"] = row["steps"] or r["steps"]
    for row in rows.values():
        row.update(top1_err=round(statistics.fmean(row["per_seed"]), 4), top1_min=min(row["per_seed"]),
                   top1_max=max(row["per_seed"]), top5_err=round(statistics.fmean(row.pop("_top5")), 4))
    return list(rows.values())


def gap_rows(rows: list[dict], args) -> list[dict]:
    """Per arch: SGD at B, the best SGD at scale x B (over its lrs), the gap, and per optimizer at scale x B
    its error and the share of the gap it closes."""
    out = []
    for arch in args.archs:
        mine = [r for r in rows if r["arch"] == arch]
        small = next(r for r in mine if r["optimizer"] == "sgd" and r["batch"] == args.batch)
        large = [r for r in mine if r["batch"] == args.batch * args.scale]
        sgd = min((r for r in large if r["optimizer"] == "sgd"), key=lambda r: r["top1_err"])
        gap = round(sgd["top1_err"] - small["top1_err"], 4)
        for r in [sgd] + [r for r in large if r["optimizer"] != "sgd"]:
            out.append({"arch": arch, "optimizer": r["optimizer"], "lr": r["lr"], "top1_err": r["top1_err"],
                        "small_batch_sgd": small["top1_err"],
                        "vs_small_batch": round(r["top1_err"] - small["top1_err"], 4), "sgd_gap": gap,
                        "closed": round((sgd["top1_err"] - r["top1_err"]) / gap, 2) if gap > 0 else None})
    return out


def sweep_rows(done: list[dict], args) -> list[dict]:
    """Every run at scale x B of the sweep's seed: the sweep's own and the grid's (marked), by arch,
    optimizer, warmup and lr."""
    seed, large = args.seeds[0], args.batch * args.scale
    points = [r for r in done if r["batch"] == large and r["seed"] == seed]
    points.sort(key=lambda r: (args.archs.index(r["arch"]), OPTIMIZERS.index(r["optimizer"]), r["warmup_epochs"],
                               r["lr"]))
    return [{"arch": r["arch"], "optimizer": r["optimizer"], "lr": r["lr"], "warmup_epochs": r["warmup_epochs"],
             "seed": r["seed"], "top1_err": r["top1_err"], "top5_err": r["top5_err"], "status": r["status"],
             "in_grid": r["group"] == "main"} for r in points]
