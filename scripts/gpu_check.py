#!/usr/bin/env python3
"""Prove every GPU path with one command and write a report; with --device cpu, the CPU twin (CI).

    python scripts/gpu_check.py --out gpu_check                # a GPU machine: at most --budget 600 s
    python scripts/gpu_check.py --device cpu --out /tmp/check  # no GPU: the same steps at tiny sizes

Each step runs in its own subprocess with its own timeout: a failure or a timeout is recorded and the
others go on. A step starts only if a third of its time limit is left of --budget (else it is skipped
"out of time"), and is killed, with everything it started, when its limit or the budget runs out.

  data                  scripts/make_synthetic.py + scripts/preprocess.py: every other step's input
  pytest-gpu            python -m pytest -q -m gpu (skipped without CUDA, as every test would skip,
                        or without pytest)
  resume-sigint         a run with a loader process, SIGINT once it has written a train record, the
                        same command again (resume), against an uninterrupted run: exit 130, then
                        weights within a relative difference of 1e-4, the same records (split, epoch,
                        iter)
  resume-sigint-deterministic   the same with train.deterministic=true: bitwise weights and
                        velocities, identical metrics apart from time and img_per_s
  replicas-ipc, replicas-gloo-gradients   2 replicas sharing one GPU against 1 replica with twice
                        the batch (weights' relative difference <= 1e-4, dropout off)
  multi-nccl-weights, multi-ddp-nccl, multi-torchrun   the same on 2 GPUs (skipped with fewer)
  model-parallel        parallel.model_size=2, columns then fc, against 1 process with the same
                        global batch (2 GPUs: NCCL; one: both processes on it, gloo)
  evaluate              scripts/evaluate.py, 1 and 10 crops: n = the validation count, top-1/top-5
                        error within one image of --device cpu
  speed-*               bf16, tf32, channels_last, compile, slices=2: exit 0 and a finite loss
  bench-*               scripts/benchmark.py train / loading / exchange (full size on a GPU); their
                        --json figures go into the report

The CPU twin (--device cpu) runs the same sequence on the CPU with tiny data, model.width 0.125 and
a few steps; it skips pytest-gpu (no CUDA), the 2-GPU steps and speed-compile (torch.compile takes
over a minute on 2 cores). It proves the script, not the GPU.

Output under --out: gpu_check.md (a table, one row per step, and the benchmark figures),
gpu_check.json (the same, machine readable), logs/<step>.log (what the step ran) and
logs/<step>/<command>.log (each command's output). Exit codes: 0 nothing failed (skips are fine),
1 a step failed, 2 bad arguments (e.g. no CUDA without --device cpu).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.procs import child_pids  # noqa: E402  (light: no torch)

REL_TOL = 1e-4          # cuDNN may pick other algorithms from run to run
INTERRUPTED = "interrupted (Ctrl-C); the steps after it did not run"
HANG_TIMEOUT = 8.0      # the time limit of a step given --inject-failure STEP:hang
STEP_MARGIN = 4.0       # a step's commands stop this much before the runner kills the step
POLL = 0.02             # seconds between looks at metrics.jsonl while waiting to interrupt
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


# -- sizes ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Profile:
    """Sizes for one device: meaningful but quick on a GPU, tiny on the CPU twin."""

    classes: int
    train_per_class: int
    val_per_class: int
    min_side: int
    max_side: int
    size: int                   # preprocessed image side
    per_file: int
    crop: int
    width: float
    batch: int                  # per replica; the references use twice this
    log_every: int
    loading: str                # data.loading outside the SIGINT steps (which always use process)
    speed_steps: int            # train.max_steps of each speed option
    bench: dict[str, list[str]] = field(default_factory=dict)  # benchmark.py flags per subcommand


TINY_BENCH = ["--width", "0.125", "--crop", "67", "--batch-size", "8", "--steps", "2", "--warmup", "1",
              "--repeat", "1"]
PROFILES = {
    "cuda": Profile(classes=10, train_per_class=96, val_per_class=10, min_side=128, max_side=256, size=128,
                    per_file=64, crop=112, width=0.5, batch=32, log_every=2, loading="process", speed_steps=10,
                    bench={"train": ["--batch-size", "256"],
                           # the loader alone on the CPU at full size is no GPU path: not worth the budget
                           "loading": ["--batch-size", "256", "--no-cpu-full-size"], "exchange": []}),
    "cpu": Profile(classes=4, train_per_class=12, val_per_class=4, min_side=48, max_side=160, size=72,
                   per_file=16, crop=67, width=0.125, batch=8, log_every=2, loading="inline", speed_steps=2,
                   bench={"train": TINY_BENCH, "loading": [*TINY_BENCH, "--files-per-epoch", "2",
                                                           "--no-cpu-full-size"],
                          "exchange": ["--width", "0.125", "--batch-size", "8", "--warmup", "1", "--repeat", "1"]}),
}


# -- what a step sees ----------------------------------------------------------------------------------

class StepFailed(Exception):
    """The step ran and found something wrong; the message is the report's reason."""


@dataclass
class Ctx:
    """One step's view: where to write, which device, its deadline, what to inject."""

    out: Path
    device: str                  # cuda | cpu
    gpus: int                    # GPUs usable by this run (0 for the CPU twin)
    step: str = ""
    deadline: float = math.inf   # time.time() by which the step's commands must have ended
    inject: dict[str, str] = field(default_factory=dict)
    injected: bool = False

    @property
    def profile(self) -> Profile:
        return PROFILES[self.device]

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    def left(self) -> float:
        return self.deadline - time.time()


@dataclass
class Outcome:
    """What a passed step reports: one line for the table, figures for the JSON."""

    detail: str
    figures: dict = field(default_factory=dict)


@dataclass
class Done:
    rc: int
    output: str
    seconds: float


def clean_env() -> dict:
    """This environment without torch.distributed's variables (train.py would think it is a replica)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, "PYTHONUNBUFFERED": "1"}


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant. Replicas run in sessions of their own, so killing a
    process group would miss them; each process is stopped as it is found, so none can fork away."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        found.append(p)
        todo += child_pids(p)
    for p in found:
        with contextlib.suppress(ProcessLookupError):  # it may have exited since it was found
            os.kill(p, signal.SIGKILL)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def last_line(text: str) -> str:
    """The line that says what went wrong: the last naming an error (a launcher's closing summary
    follows its replica's traceback), else the last line."""
    lines = [s.strip() for s in text.strip().splitlines() if s.strip()]
    errors = [s for s in lines if re.search(r"\w(Error|Exception)\b|error:", s)]
    return (errors or lines or ["(no output)"])[-1][:300]


def _start(ctx: Ctx, label: str, cmd: list[str]) -> tuple[subprocess.Popen, Path]:
    """Start one command of the step, output to logs/<step>/<label>.log; --inject-failure swaps the
    step's first command for one that fails."""
    if ctx.inject.get(ctx.step) == "fail" and not ctx.injected:
        ctx.injected = True
        cmd = [sys.executable, "-c", "import sys; sys.exit('gpu_check: injected failure (--inject-failure)')"]
    log = ctx.logs / ctx.step / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {shlex.join(cmd)}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True)
    return proc, log


def _finish(ctx: Ctx, proc: subprocess.Popen, log: Path, label: str, start: float) -> Done:
    """Wait for `proc` until the step's deadline; a timeout kills its tree and fails the step."""
    try:
        rc = proc.wait(timeout=max(ctx.left() - STEP_MARGIN, 1.0))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise StepFailed(f"{label} timed out after {time.monotonic() - start:.0f} s (the step's time limit); "
                         f"see {log.relative_to(ctx.out)}") from None
    done = Done(rc, log.read_text(errors="replace"), time.monotonic() - start)
    print(f"  -> exit {rc} in {done.seconds:.1f} s" + (f"\n{tail(done.output)}" if rc else ""), flush=True)
    return done


def run_cmd(ctx: Ctx, label: str, cmd: list[str]) -> Done:
    start = time.monotonic()
    proc, log = _start(ctx, label, cmd)
    return _finish(ctx, proc, log, label, start)


def check(ctx: Ctx, label: str, cmd: list[str]) -> Done:
    """run_cmd, failing the step unless the command exits 0."""
    done = run_cmd(ctx, label, cmd)
    if done.rc != 0:
        raise StepFailed(f"{label} exited with code {done.rc}: {last_line(done.output)}")
    return done


def has_train_record(metrics: Path) -> bool:
    try:
        return '"split": "train"' in metrics.read_text()
    except OSError:
        return False


def run_interrupted(ctx: Ctx, label: str, cmd: list[str], run_dir: Path) -> tuple[Done, str]:
    """Start a training run and send it SIGINT once it has written its first train record (or, as a
    fallback, after a third of the time left); returns its result and when the signal went."""
    start = time.monotonic()
    proc, log = _start(ctx, label, cmd)
    fallback = start + max(ctx.left() - STEP_MARGIN, 3.0) / 3
    while proc.poll() is None and time.monotonic() < fallback and not has_train_record(run_dir / "metrics.jsonl"):
        time.sleep(POLL)
    when = "after its first train record" if has_train_record(run_dir / "metrics.jsonl") else (
        f"after a fallback wait of {time.monotonic() - start:.0f} s, before any train record")
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        print(f"  SIGINT sent {when}", flush=True)
    else:
        when = "never sent: the run ended first"
    return _finish(ctx, proc, log, label, start), when


# -- training runs and their comparison ----------------------------------------------------------------

def train_cmd(ctx: Ctx, run_dir: Path, extra: dict | None = None, launcher: list[str] | None = None) -> list[str]:
    """train.py with configs/demo.yaml and this device's small sizes; `extra` overrides win."""
    p = ctx.profile
    over = {"data.root": ctx.data, "data.crop": p.crop, "data.loading": p.loading, "model.width": p.width,
            "model.init": "torch", "train.batch_size": p.batch, "train.epochs": 2, "train.log_every": p.log_every,
            "train.lr_steps": "[1]", "run.dir": run_dir, "run.device": ctx.device, "run.progress": "false",
            "run.tensorboard": "false", "run.keep_last": 1, **(extra or {})}
    return [*(launcher or [sys.executable]), "train.py", "configs/demo.yaml", *(f"{k}={v}" for k, v in over.items())]


def records(run_dir: Path) -> list[dict]:
    from alexnet.metrics import read_metrics
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def stable(recs: list[dict]) -> list[dict]:
    from alexnet.metrics import without_wall_clock
    return without_wall_clock(recs)


def positions(recs: list[dict]) -> list[tuple]:
    return [(r["split"], r["epoch"], r["iter"]) for r in recs]


def compare_weights(a: Path, b: Path) -> dict:
    """Two runs' last checkpoints: rel_diff (weights: the tolerance applies to them), rel_diff_velocities
    and bitwise (alexnet.checkpoint.compare_checkpoints)."""
    from alexnet.checkpoint import compare_checkpoints
    try:
        c = compare_checkpoints(a / "checkpoints" / "last.pt", b / "checkpoints" / "last.pt")
    except ValueError as e:
        raise StepFailed(str(e)) from None
    return {"rel_diff": c["weights"], "rel_diff_velocities": c["velocities"], "bitwise": c["bitwise"]}


def checkpoint_position(run_dir: Path) -> dict:
    from alexnet.checkpoint import load
    state = load(run_dir / "checkpoints" / "last.pt")
    return {k: int(state[k]) for k in ("epoch", "step", "global_step")}


# -- the steps -----------------------------------------------------------------------------------------

def step_data(ctx: Ctx) -> Outcome:
    """A synthetic ImageNet-format tree (with its file quirks), preprocessed; every other step's input."""
    p, src = ctx.profile, ctx.work / "src"
    check(ctx, "make_synthetic", [sys.executable, "scripts/make_synthetic.py", "--out", str(src), "--classes",
                                  str(p.classes), "--train-per-class", str(p.train_per_class), "--val-per-class",
                                  str(p.val_per_class), "--min-side", str(p.min_side), "--max-side", str(p.max_side)])
    check(ctx, "preprocess", [sys.executable, "scripts/preprocess.py", "--train-dir", str(src / "train"),
                              "--val-dir", str(src / "val"), "--val-labels", str(src / "LOC_val_solution.csv"),
                              "--out", str(ctx.data), "--size", str(p.size), "--per-file", str(p.per_file),
                              "--quiet"])
    counts = {s: v["count"] for s, v in json.loads((ctx.data / "meta.json").read_text())["splits"].items()}
    return Outcome(f"{counts['train']} train, {counts['val']} val images of {p.size} px, {p.classes} classes",
                   {"counts": counts, "image_size": p.size, "classes": p.classes})


def pytest_counts(output: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 1, ...} from pytest's final summary line ({} if there is none)."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b", line)
        if found and (" in " in line or "no tests ran" in line):
            return {("error" if kind.startswith("error") else kind): int(n) for n, kind in found}
    return {}


def step_pytest(ctx: Ctx) -> Outcome:
    """The gpu-marked tests (tests/test_gpu.py and the cuda:0 twins of tests/test_loader.py)."""
    done = run_cmd(ctx, "pytest", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"])
    counts = pytest_counts(done.output)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or last_line(done.output)
    if done.rc != 0 or counts.get("failed") or counts.get("error"):
        raise StepFailed(f"pytest exited with code {done.rc}: {summary}")
    if not counts.get("passed"):
        raise StepFailed(f"no gpu-marked test passed ({summary})")
    return Outcome(summary, counts)


def resume_check(ctx: Ctx, extra: dict, exact: bool) -> Outcome:
    """Uninterrupted run vs SIGINT mid-epoch + the same command again, with a loader process."""
    straight, split = ctx.work / ctx.step / "straight", ctx.work / ctx.step / "interrupted"
    over = {"data.loading": "process", **extra}
    check(ctx, "straight", train_cmd(ctx, straight, over))
    cmd = train_cmd(ctx, split, over)
    done, when = run_interrupted(ctx, "interrupted", cmd, split)
    if done.rc != 130:
        raise StepFailed(f"the interrupted run exited with code {done.rc}, not 130 (SIGINT sent {when}): "
                         f"{last_line(done.output)}")
    at = checkpoint_position(split)
    resumed = check(ctx, "resumed", cmd)
    if "resumed from" not in resumed.output:
        raise StepFailed("the second run did not say 'resumed from': it started afresh")
    figures = compare_weights(split, straight)
    rel, same = figures["rel_diff"], figures["bitwise"]
    a, b = records(split), records(straight)
    figures.update(records=len(b), checkpoint=at, sigint=when,
                   max_loss_diff=max((abs(x["loss"] - y["loss"]) for x, y in zip(a, b)), default=None))
    where = f"SIGINT {when}: exit 130 at epoch {at['epoch'] + 1}, step {at['step']}"
    if exact:
        if not same:
            raise StepFailed(f"{where}; resumed weights/velocities not bitwise equal (rel diff {rel:.2e})")
        if stable(a) != stable(b):
            raise StepFailed(f"{where}; metrics differ: {len(a)} records vs {len(b)} uninterrupted")
        return Outcome(f"{where}; resumed: weights and velocities bitwise equal, {len(b)} records identical",
                       figures)
    if rel > REL_TOL or positions(a) != positions(b):
        raise StepFailed(f"{where}; resumed: weights rel diff {rel:.2e} (limit {REL_TOL:g}), records "
                         f"{'match' if positions(a) == positions(b) else 'differ'} ({len(a)} vs {len(b)})")
    return Outcome(f"{where}; resumed: weights rel diff {rel:.1e} <= {REL_TOL:g} (velocities "
                   f"{figures['rel_diff_velocities']:.1e}), {len(b)} records match", figures)


def step_resume(ctx: Ctx) -> Outcome:
    return resume_check(ctx, {}, exact=False)


def step_resume_deterministic(ctx: Ctx) -> Outcome:
    return resume_check(ctx, {"train.deterministic": "true"}, exact=True)


# Dropout draws differ per replica; without it N replicas x B follow 1 replica x N*B exactly.
SAME_UPDATE = {"model.dropout": 0.0}


def reference_run(ctx: Ctx) -> Path:
    """1 replica with twice the batch, shared by the replica steps (a second call finds it finished)."""
    ref = ctx.work / "reference-2x-batch"
    extra = {**SAME_UPDATE, "train.batch_size": 2 * ctx.profile.batch}
    if ctx.device == "cuda":
        extra["run.device"] = "cuda:0"
    check(ctx, "reference", train_cmd(ctx, ref, extra))
    return ref


def replicas_check(ctx: Ctx, extra: dict, expect: str, launcher: list[str] | None = None) -> Outcome:
    """2 replicas of batch B (train.py's launcher, or `launcher`) against 1 replica of batch 2B."""
    ref, run = reference_run(ctx), ctx.work / ctx.step
    over = {**SAME_UPDATE, **({} if launcher else {"parallel.replicas": 2}), **extra}
    done = check(ctx, "replicas", train_cmd(ctx, run, over, launcher))
    if expect not in done.output:
        raise StepFailed(f"the run did not report '{expect}': {last_line(done.output)}")
    figures = compare_weights(run, ref)
    rel, same = figures["rel_diff"], positions(records(run)) == positions(records(ref))
    figures.update(records_match=same, records=len(records(ref)))
    if rel > REL_TOL or not same:
        raise StepFailed(f"{expect}: weights rel diff {rel:.2e} against 1 replica x 2B (limit {REL_TOL:g}), "
                         f"records {'match' if same else 'differ'}")
    return Outcome(f"{expect}: weights rel diff {rel:.1e} <= {REL_TOL:g} (velocities "
                   f"{figures['rel_diff_velocities']:.1e}) against 1 replica x 2B, records match", figures)


def one_gpu(ctx: Ctx) -> dict:
    return {"parallel.devices": "[cuda:0,cuda:0]"} if ctx.device == "cuda" else {}


def step_replicas_ipc(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**one_gpu(ctx), "parallel.exchange": "weights", "parallel.transport": "ipc"},
                          "exchange weights via ipc")


def step_replicas_gloo(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**one_gpu(ctx), "parallel.exchange": "gradients", "parallel.transport": "gloo"},
                          "exchange gradients via gloo")


TWO_GPUS = {"parallel.devices": "[cuda:0,cuda:1]"}


def step_multi_nccl_weights(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**TWO_GPUS, "parallel.exchange": "weights", "parallel.transport": "nccl"},
                          "exchange weights via nccl")


def step_multi_ddp(ctx: Ctx) -> Outcome:
    return replicas_check(ctx, {**TWO_GPUS, "parallel.exchange": "gradients", "parallel.transport": "nccl"},
                          "exchange gradients via nccl")


def step_multi_torchrun(ctx: Ctx) -> Outcome:
    from alexnet.launch import free_port
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                f"--master-port={free_port()}"]
    return replicas_check(ctx, {"run.device": "cuda", "parallel.exchange": "gradients"},
                          "exchange gradients via nccl", launcher)


def step_model_parallel(ctx: Ctx) -> Outcome:
    """Model parallelism in 2 processes (columns, then fc) against 1 replica with the same global batch:
    on 2 GPUs over NCCL, else both on cuda:0 over gloo (NCCL refuses two ranks on one GPU)."""
    ref, b = reference_run(ctx), ctx.profile.batch
    devices = ({} if ctx.device == "cpu" else TWO_GPUS if ctx.gpus > 1 else one_gpu(ctx))
    details, figures = [], {}
    for mode, batch in (("columns", 2 * b), ("fc", b)):  # columns share a batch, fc splits it
        run = ctx.work / ctx.step / mode
        over = {**SAME_UPDATE, **devices, "parallel.model_size": 2, "parallel.model": mode,
                "parallel.exchange": "gradients", "train.batch_size": batch}
        done = check(ctx, mode, train_cmd(ctx, run, over))
        if f"({mode} model parallel)" not in done.output:
            raise StepFailed(f"{mode}: the run did not report its model-parallel layout")
        fig = compare_weights(run, ref)
        same = positions(records(run)) == positions(records(ref))
        if fig["rel_diff"] > REL_TOL or not same:
            raise StepFailed(f"{mode}: weights rel diff {fig['rel_diff']:.2e} against 1 replica (limit {REL_TOL:g}), "
                             f"records {'match' if same else 'differ'}")
        figures[mode] = fig
        details.append(f"{mode} {fig['rel_diff']:.1e}")
    where = "2 GPUs" if ctx.gpus > 1 else "one device"
    return Outcome(f"{where}, weights rel diff against 1 process: {', '.join(details)} <= {REL_TOL:g}", figures)


def eval_checkpoint(ctx: Ctx) -> Path:
    """resume-sigint's checkpoint, else a short run of this step's own."""
    ckpt = ctx.work / "resume-sigint" / "straight" / "checkpoints" / "last.pt"
    if ckpt.exists():
        return ckpt
    run = ctx.work / ctx.step / "run"
    check(ctx, "train", train_cmd(ctx, run, {"train.epochs": 1}))
    return run / "checkpoints" / "last.pt"


def step_evaluate(ctx: Ctx) -> Outcome:
    """1 and 10 crops on the device and on the CPU: n = the val count, errors within one image."""
    weights, n_val = eval_checkpoint(ctx), json.loads((ctx.data / "meta.json").read_text())["splits"]["val"]["count"]
    got = {}
    for device in dict.fromkeys([ctx.device, "cpu"]):
        for crops in (1, 10):
            out = ctx.work / ctx.step / f"{device}-{crops}crop.json"
            check(ctx, f"{device}-{crops}crop", [sys.executable, "scripts/evaluate.py", "--data", str(ctx.data),
                                                 "--weights", str(weights), "--crops", str(crops), "--device",
                                                 device, "--json", str(out), "--no-progress"])
            if not out.exists():
                raise StepFailed(f"evaluate.py --device {device} --crops {crops} wrote no {out.name}")
            got[f"{device}-{crops}crop"] = rec = json.loads(out.read_text())
            if rec["n"] != n_val:
                raise StepFailed(f"--device {device} --crops {crops}: n = {rec['n']}, the val split has {n_val}")
    for crops in (1, 10):
        dev, cpu = got[f"{ctx.device}-{crops}crop"], got[f"cpu-{crops}crop"]
        for key in ("top1_err", "top5_err"):
            if abs(dev[key] - cpu[key]) * n_val > 1 + 1e-6:
                raise StepFailed(f"{crops} crop(s): {key} {dev[key]:.4f} on {ctx.device}, {cpu[key]:.4f} on the "
                                 f"CPU: more than one image apart")
    figures = {k: {m: v[m] for m in ("top1_err", "top5_err", "n")} for k, v in got.items()}
    one, ten = got[f"{ctx.device}-1crop"], got[f"{ctx.device}-10crop"]
    agree = "the CPU twin: nothing to compare with" if ctx.device == "cpu" else "cuda and cpu within one image"
    return Outcome(f"n = {n_val}; top-1 error {one['top1_err']:.3f} (1 crop), {ten['top1_err']:.3f} (10 crops); "
                   f"{agree}", figures)


def speed_step(key: str, value: str) -> Callable[[Ctx], Outcome]:
    """A step training a few steps with one speed option: exit 0 and finite losses."""
    def step(ctx: Ctx) -> Outcome:
        run = ctx.work / ctx.step
        check(ctx, "train", train_cmd(ctx, run, {key: value, "train.epochs": 1, "train.log_every": 1,
                                                 "train.max_steps": ctx.profile.speed_steps}))
        losses = [r["loss"] for r in records(run) if r["split"] == "train"]
        if not losses or not all(math.isfinite(x) for x in losses):
            raise StepFailed(f"{key}={value}: train losses {losses} (expected {ctx.profile.speed_steps} finite)")
        return Outcome(f"{key}={value}: {len(losses)} steps, last loss {losses[-1]:.4f}", {"losses": losses})
    step.__doc__ = f"train.py with {key}={value} for a few steps"
    return step


def bench_args(ctx: Ctx, kind: str) -> list[str]:
    flags = list(ctx.profile.bench[kind])
    if kind == "exchange":  # 2 replicas: on 2 GPUs if there are, else sharing the one (or the CPU)
        devices = ["cpu", "cpu"] if ctx.device == "cpu" else ["cuda:0", "cuda:1" if ctx.gpus > 1 else "cuda:0"]
        return [*flags, "--replicas", "2", "--devices", *devices]
    return [*flags, "--device", ctx.device]


def bench_step(kind: str) -> Callable[[Ctx], Outcome]:
    """A step running `scripts/benchmark.py kind` and keeping its --json figures."""
    def step(ctx: Ctx) -> Outcome:
        out = ctx.work / ctx.step / f"{kind}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        check(ctx, kind, [sys.executable, "scripts/benchmark.py", kind, *bench_args(ctx, kind), "--json", str(out)])
        result = json.loads(out.read_text())
        return Outcome(bench_summary(result), result)
    step.__doc__ = f"scripts/benchmark.py {kind}"
    return step


def bench_summary(result: dict) -> str:
    """One line of a benchmark's figures for the steps table (the full tables follow it)."""
    rows = result["rows"]
    if result["benchmark"] == "train":
        best = max(rows, key=lambda r: r["img_per_s"])
        return (f"fp32 {rows[0]['img_per_s']} img/s; best {best['precision']}"
                f"{' channels_last' if best['channels_last'] else ''} {best['img_per_s']} img/s "
                f"({best['vs_fp32']}x), batch {result['batch_size']}")
    if result["benchmark"] == "loading":
        return "; ".join(f"{r['what'].replace('data.loading=', '')} {r['vs_upper_bound']}" for r in rows[1:4]) + \
            " of the upper bound"
    return "; ".join(f"{r['what']} {r['ms']} ms" for r in rows)


# -- the table of steps --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    name: str
    what: str                   # the path it proves, for the report
    run: Callable[[Ctx], Outcome]
    limit: tuple[float, float]  # time limit in seconds: (CUDA, CPU twin)
    needs: tuple[str, ...] = ("data",)


STEPS = [
    Step("data", "synthetic ImageNet-format data, preprocessed", step_data, (120, 60), ()),
    Step("pytest-gpu", "python -m pytest -q -m gpu", step_pytest, (240, 60), ("cuda", "pytest")),
    Step("resume-sigint", "SIGINT mid-epoch (loader process), resume = uninterrupted (weights rel diff <= 1e-4)",
         step_resume, (120, 90)),
    Step("resume-sigint-deterministic", "the same with train.deterministic=true: bitwise",
         step_resume_deterministic, (120, 90)),
    Step("replicas-ipc", "2 replicas on one GPU, weights exchange via ipc = 1 replica x 2B", step_replicas_ipc,
         (120, 90)),
    Step("replicas-gloo-gradients", "2 replicas on one GPU, gradients via gloo = 1 replica x 2B",
         step_replicas_gloo, (90, 90)),
    Step("multi-nccl-weights", "2 GPUs, weights exchange via nccl = 1 replica x 2B", step_multi_nccl_weights,
         (90, 90), ("data", "2gpus")),
    Step("multi-ddp-nccl", "2 GPUs, DDP gradients via nccl = 1 replica x 2B", step_multi_ddp, (90, 90),
         ("data", "2gpus")),
    Step("multi-torchrun", "torchrun --nproc-per-node=2 (nccl) = 1 replica x 2B", step_multi_torchrun, (90, 90),
         ("data", "2gpus")),
    Step("model-parallel", "model parallel in 2 processes (columns, fc) = 1 process, same global batch",
         step_model_parallel, (120, 90)),
    Step("evaluate", "scripts/evaluate.py, 1 and 10 crops, against --device cpu", step_evaluate, (90, 60)),
    Step("speed-bf16", "train.precision=bf16", speed_step("train.precision", "bf16"), (60, 45)),
    Step("speed-tf32", "train.precision=tf32", speed_step("train.precision", "tf32"), (60, 45)),
    Step("speed-channels-last", "train.channels_last=true", speed_step("train.channels_last", "true"), (60, 45)),
    Step("speed-compile", "train.compile=true", speed_step("train.compile", "true"), (180, 120),
         ("data", "not-cpu-twin")),
    Step("speed-slices", "train.slices=2", speed_step("train.slices", "2"), (60, 45)),
    Step("bench-train", "scripts/benchmark.py train: precision x channels_last", bench_step("train"), (120, 60), ()),
    Step("bench-loading", "scripts/benchmark.py loading: process / thread / inline vs upper bound",
         bench_step("loading"), (150, 60), ()),
    Step("bench-exchange", "scripts/benchmark.py exchange: per transport, 2 replicas", bench_step("exchange"),
         (90, 60), ()),
]
BY_NAME = {s.name: s for s in STEPS}


# -- running one step (in its own process) --------------------------------------------------------------

def step_main(name: str, context: Path, deadline: float, result_file: Path) -> int:
    """The body of a step's subprocess: run it, write its result JSON for the runner."""
    c = json.loads(context.read_text())
    ctx = Ctx(Path(c["out"]), c["device"], c["gpus"], name, deadline, c["inject"])
    step, result = BY_NAME[name], {"status": "passed"}
    if ctx.inject.get(step.name) == "hang":
        time.sleep(3600)  # --inject-failure STEP:hang: the runner must kill this at its time limit
    try:
        outcome = step.run(ctx)
        result.update(detail=outcome.detail, figures=outcome.figures)
    except StepFailed as e:
        result = {"status": "failed", "reason": str(e)}
    except Exception as e:  # a bug or an unexpected state: report it as this step's failure, go on
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    print(f"{step.name}: {result['status']} {result.get('reason') or result.get('detail', '')}", flush=True)
    result_file.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


# -- the runner ----------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    what: str
    status: str                 # passed | failed | skipped
    seconds: float = 0.0
    reason: str = ""
    detail: str = ""
    figures: dict = field(default_factory=dict)
    log: str = ""
    log_tail: str = ""          # failed steps: the end of their log


def environment(device: str) -> dict:
    """What the report's header states: device, versions, GPU count."""
    import torch
    cuda = torch.cuda.is_available()
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": cuda, "gpus": torch.cuda.device_count() if cuda else 0, "device": device,
           "host": platform.node(), "cpu_cores": len(os.sched_getaffinity(0))}
    if cuda:
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(env["gpus"])]
    env["device_name"] = env["gpu_names"][0] if device == "cuda" else cpu_name()
    env["packages"] = packages()
    return env


def packages() -> dict[str, str | None]:
    """requirements.txt's packages -> the installed version (None: missing, the first thing to look at
    on a machine where nothing is installed)."""
    from importlib import metadata
    lines = (REPO / "requirements.txt").read_text().splitlines()
    names = [re.split(r"[<>=!~;\[ ]", s.strip(), maxsplit=1)[0] for s in lines if s.strip() and s[0] != "#"]
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((s.split(":", 1)[1].strip() for s in lines if s.startswith("model name")), platform.machine())


def unmet(need: str, ctx: Ctx, env: dict, done: dict[str, Result]) -> str:
    """Why a step cannot run here ('' if it can)."""
    twin = "" if ctx.device == "cuda" else " (--device cpu: the CPU twin)"
    if need == "data" and getattr(done.get("data"), "status", "") != "passed":
        return "no data: the data step did not pass"
    if need == "cuda" and ctx.device != "cuda":
        return "no CUDA: every gpu-marked test would skip" if not env["cuda_available"] else f"needs CUDA{twin}"
    if need == "pytest" and importlib.util.find_spec("pytest") is None:
        return "pytest is not installed"
    if need == "2gpus" and ctx.gpus < 2:
        return f"needs 2 GPUs, found {ctx.gpus}{twin}"
    if need == "not-cpu-twin" and ctx.device == "cpu":
        return "CPU twin: torch.compile takes over a minute on 2 cores; proven on CUDA"
    return ""


def run_step(ctx: Ctx, step: Step, limit: float, context: Path) -> Result:
    """One step in its own process (tree), killed at `limit` seconds; its result file read back."""
    result_file = ctx.work / "results" / f"{step.name}.json"
    log = ctx.logs / f"{step.name}.log"
    start, interrupted = time.monotonic(), False
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_step", step.name, "--_context", str(context),
           "--_deadline", str(time.time() + limit), "--_result", str(result_file)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            kill_tree(proc.pid)
            proc.wait()
            interrupted = isinstance(e, KeyboardInterrupt)
    res = Result(step.name, step.what, "failed", time.monotonic() - start, log=str(log.relative_to(ctx.out)))
    if interrupted:
        res.reason = INTERRUPTED
    elif result_file.exists():
        data = json.loads(result_file.read_text())
        res.status, res.reason = data["status"], data.get("reason", "")
        res.detail, res.figures = data.get("detail", ""), data.get("figures", {})
    elif proc.returncode < 0 or res.seconds >= limit:
        res.reason = f"timed out after {res.seconds:.0f} s (its time limit: {limit:.0f} s)"
    else:
        res.reason = f"the step's process exited with code {proc.returncode}: {last_line(log.read_text())}"
    if res.status == "failed":
        res.log_tail = tail(log.read_text(errors="replace"), 30)
    return res


def plan(ctx: Ctx, step: Step, env: dict, done: dict, left: float, selected: set[str] | None) -> tuple[str, float]:
    """(skip reason, time limit) of a step about to run."""
    if selected is not None and step.name not in selected:
        return "not selected (--steps)", 0
    for need in step.needs:
        if reason := unmet(need, ctx, env, done):
            return reason, 0
    limit = step.limit[0 if ctx.device == "cuda" else 1]
    if ctx.inject.get(step.name) == "hang":
        limit = HANG_TIMEOUT
    if left < min(limit, max(limit / 3, 10)):
        return f"out of time: {max(left, 0):.0f} s of the budget left, the step may take {limit:.0f} s", 0
    return "", min(limit, left)


def run_all(args: argparse.Namespace, env: dict) -> int:
    """Every step in order; the reports rewritten after each one."""
    out = Path(args.out).resolve()
    ctx = Ctx(out, env["device"], env["gpus"] if env["device"] == "cuda" else 0, inject=parse_inject(args))
    shutil.rmtree(ctx.work, ignore_errors=True)
    shutil.rmtree(ctx.logs, ignore_errors=True)
    (ctx.work / "results").mkdir(parents=True)
    ctx.logs.mkdir(parents=True)
    context = ctx.work / "context.json"
    context.write_text(json.dumps({"out": str(out), "device": ctx.device, "gpus": ctx.gpus, "inject": ctx.inject}))
    selected = set(args.steps.split(",")) | {"data"} if args.steps else None
    start, done = time.monotonic(), {}
    for i, step in enumerate(STEPS, 1):
        reason, limit = plan(ctx, step, env, done, args.budget - (time.monotonic() - start), selected)
        print(f"[{i:2}/{len(STEPS)}] {step.name:28} ", end="", flush=True)
        res = Result(step.name, step.what, "skipped", reason=reason) if reason else run_step(ctx, step, limit, context)
        done[step.name] = res
        print(f"{res.status:7} {res.seconds:6.1f} s  {res.reason or res.detail}", flush=True)
        write_reports(out, env, args, list(done.values()), time.monotonic() - start)
        if res.reason == INTERRUPTED:
            return 130
    if not args.keep_work:
        shutil.rmtree(ctx.work, ignore_errors=True)
    failed = [r.name for r in done.values() if r.status == "failed"]
    print(f"report: {out / 'gpu_check.md'}" + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"))
    return 1 if failed else 0


# -- reports -------------------------------------------------------------------------------------------

def md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(md_cell(r.get(c, "")) for c in cols) + " |" for r in rows]


def bench_section(res: Result) -> list[str]:
    fig = res.figures
    about = ", ".join(f"{k} {v}" for k, v in fig.items() if k not in ("rows", "table1", "benchmark"))
    lines = [f"### {res.name}: {res.what}", "", about, "", *md_table(fig["rows"]), ""]
    if fig.get("table1"):
        lines += ["Table 1 layout:", "", *md_table(fig["table1"]), ""]
    return lines


def render_md(env: dict, args: argparse.Namespace, results: list[Result], seconds: float) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")}
    versions = f"torch {env['torch']}, CUDA {env['cuda'] or '-'}, cuDNN {env.get('cudnn') or '-'}, " \
               f"Python {env['python']}"
    lines = ["# GPU check", "",
             f"- device: **{env['device']}**, {env['device_name']}; GPUs: {env['gpus']} "
             f"({', '.join(env.get('gpu_names', [])) or 'none'}); {env['cpu_cores']} CPU cores",
             f"- {versions}; packages missing from requirements.txt: "
             f"{', '.join(k for k, v in env['packages'].items() if v is None) or 'none'}",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}: {seconds:.0f} s of a {args.budget:.0f} s budget; "
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
             f"- command: `python scripts/gpu_check.py {shlex.join(sys.argv[1:])}`", ""]
    if env["device"] == "cpu":
        lines += ["CPU twin: the same steps at tiny sizes on the CPU; it proves this script, not the GPU.", ""]
    lines += ["| # | step | path | status | s | details |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        status = f"**{r.status}**" if r.status == "failed" else r.status
        lines.append(f"| {i} | {r.name} | {md_cell(r.what)} | {status} | {r.seconds:.1f} | "
                     f"{md_cell(r.reason or r.detail)} |")
    benches = [r for r in results if r.name.startswith("bench-") and r.status == "passed"]
    if benches:
        lines += ["", "## Benchmarks", ""]
        for r in benches:
            lines += bench_section(r)
    lines += ["", "Logs: `logs/<step>.log` (what each step ran), `logs/<step>/<command>.log` (each command's "
              "output)."]
    return "\n".join(lines) + "\n"


def write_reports(out: Path, env: dict, args: argparse.Namespace, results: list[Result], seconds: float) -> None:
    failed = any(r.status == "failed" for r in results)
    report = {"environment": env, "budget_s": args.budget, "seconds": round(seconds, 1),
              "exit_code": 1 if failed else 0,
              "steps": [{**asdict(r), "seconds": round(r.seconds, 1)} for r in results]}
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str) + "\n"),
                       ("gpu_check.md", render_md(env, args, results, seconds))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


# -- command line --------------------------------------------------------------------------------------

def parse_inject(args: argparse.Namespace) -> dict[str, str]:
    """--inject-failure STEP[:hang] -> {STEP: 'fail' | 'hang'}."""
    inject = {}
    for spec in args.inject_failure or []:
        name, _, mode = spec.partition(":")
        inject[name] = mode or "fail"
    return inject


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--out", help="report folder (gpu_check.md, gpu_check.json, logs/); its work/ is temporary")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda (auto's choice where CUDA is available) or cpu: the CPU twin")
    p.add_argument("--budget", type=float, default=600.0, help="seconds for the whole run (default 600)")
    p.add_argument("--steps", help=f"comma-separated steps to run (data is added): {', '.join(BY_NAME)}")
    p.add_argument("--keep-work", action="store_true", help="keep OUT/work (data, run folders, checkpoints)")
    # For tests of this script: make a step's first command fail (STEP) or the step hang (STEP:hang).
    p.add_argument("--inject-failure", action="append", metavar="STEP[:hang]", help=argparse.SUPPRESS)
    for internal in ("--_step", "--_context", "--_result"):  # a step's own process
        p.add_argument(internal, help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._step is None and not args.out:
        p.error("--out is required")
    unknown = {*(args.steps.split(",") if args.steps else []), *parse_inject(args)} - set(BY_NAME)
    if unknown:
        p.error(f"unknown step(s) {', '.join(sorted(unknown))}; the steps: {', '.join(BY_NAME)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._step:
        return step_main(args._step, Path(args._context), args._deadline, Path(args._result))
    import torch
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "")
    if not device or (device == "cuda" and not torch.cuda.is_available()):
        print("gpu_check.py: error: CUDA is not available here; --device cpu runs the CPU twin (which proves "
              "this script, not the GPU)", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return run_all(args, environment(device))


if __name__ == "__main__":
    sys.exit(main())
