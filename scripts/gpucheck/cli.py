"""scripts/gpu_check.py's command line: which sequence, its budget, the steps selected, injections."""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from data.domains import (
    POSITIVE,
    Earlier,
    OneLineParser,
    OutputPath,
    json_holding,
    output_of,
    starting_with,
    text,
)

from .budget import Budget
from .report import environment
from .runner import RESERVE, run_all, step_main
from .table import BUDGETS, BY_NAME, SEQUENCES

# what gpu_check writes under --out, and the folders the docs give other runs of it there (gpu.md)
GPU_CHECK_OWN = ("gpu_check.md", "gpu_check.json", "logs", "work", "bench", "speed", "two-gpus", "two-gpus-bench")
CONTEXT_KEYS = ("out", "device", "gpus", "inject")  # work/context.json (runner.prepare)


def _own_work(path: Path) -> bool:
    """work/ of an earlier run (killed, or --keep-work): its context.json, or no more than the empty results/
    that runner.prepare makes first. A run removes its work/ at the start and the end."""
    context = path / "context.json"
    if context.is_file():
        return json_holding("", CONTEXT_KEYS)(context)
    return {e.name for e in path.iterdir()} <= {"results"} and not any((path / "results").glob("*"))


def _own_logs(path: Path) -> bool:
    """logs/ of an earlier run: STEP.log files and STEP/ folders of LABEL.log files (runner, commands), steps of
    the table only. A run replaces its logs/ at the start."""
    def log(entry: Path) -> bool:
        return entry.is_file() and entry.suffix == ".log"
    return all((log(e) and e.stem in BY_NAME) or (e.is_dir() and e.name in BY_NAME and all(map(log, e.iterdir())))
               for e in path.iterdir())


# What it writes there, known by what it holds: its two reports (report.write_reports), and the folders a run
# replaces whole (work/, logs/: an earlier run's, never the user's folder of that name) or are other runs' --out
GPU_CHECK_KNOWN = {
    "gpu_check.json": json_holding("an earlier gpu_check.py report", ("environment", "sequence", "steps")),
    "gpu_check.md": starting_with("an earlier gpu_check.py report", b"# GPU check: "),
    "work": Earlier("the work folder of an earlier gpu_check.py run (work/context.json)", _own_work),
    "logs": Earlier("the logs of an earlier gpu_check.py run (STEP.log, STEP/LABEL.log)", _own_logs),
    # bench/, speed/, ...: the --out of other gpu_check runs (the docs put them there), by the same rule
    **{name: output_of("the --out of another gpu_check.py run", lambda: OUT)
       for name in ("bench", "speed", "two-gpus", "two-gpus-bench")}}
OUT = OutputPath("folder", own=GPU_CHECK_OWN, known=GPU_CHECK_KNOWN)
INJECT_MODES = ("fail", "hang", "slow")


def parse_inject(specs: list[str] | None) -> dict[str, str]:
    """--inject-failure STEP[:MODE] -> {STEP: 'fail' | 'hang' | 'slow'}."""
    inject = {}
    for spec in specs or []:
        name, _, mode = spec.partition(":")
        inject[name] = mode or "fail"
    return inject


def parser(doc: str) -> argparse.ArgumentParser:
    p = OneLineParser(prog="gpu_check.py", description=doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(doc.splitlines()[2:]))
    p.add_argument("--out", type=OUT,
                   help="report folder (gpu_check.md, gpu_check.json, logs/); its work/ is temporary")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda (auto's choice where CUDA is available) or cpu: the CPU twin")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_const", dest="sequence", const="quick",
                       help=f"only the core: {', '.join(SEQUENCES['quick'])} (budget {BUDGETS['quick']:.0f} s)")
    which.add_argument("--bench", action="store_const", dest="sequence", const="bench",
                       help=f"the full-size benchmarks: {', '.join(SEQUENCES['bench'])}")
    p.add_argument("--budget", type=POSITIVE, help="seconds for the whole run, counted from the process's start, "
                   f"clean-up included (default {BUDGETS['check']:.0f}; --quick {BUDGETS['quick']:.0f})")
    p.add_argument("--steps", type=text("comma-separated step names"),
                   help="comma-separated steps of the sequence to run (data is added): "
                   + "; ".join(f"{k}: {', '.join(v)}" for k, v in SEQUENCES.items() if k != "quick"))
    p.add_argument("--keep-work", action="store_true", help="keep OUT/work (data, run folders, checkpoints)")
    # For tests of this script: a step's first command fails (STEP), never ends (STEP:slow: a budget
    # overrun), or the step hangs at once under a short limit of its own (STEP:hang).
    p.add_argument("--inject-failure", action="append", metavar="STEP[:hang|slow]", help=argparse.SUPPRESS)
    for internal in ("--_step", "--_context", "--_result"):  # a step's own process
        p.add_argument(internal, help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    p = parser(doc)
    args = p.parse_args(argv)
    args.sequence = args.sequence or "check"
    args.budget = BUDGETS[args.sequence] if args.budget is None else args.budget
    args.inject = parse_inject(args.inject_failure)
    if args._step is not None:
        return args
    if not args.out:
        p.error("--out is required")
    if not args.budget > 0:
        p.error("--budget must be positive")
    named = {*(args.steps.split(",") if args.steps else []), *args.inject}
    if unknown := named - set(BY_NAME):
        p.error(f"unknown step(s) {', '.join(sorted(unknown))}; the steps: {', '.join(BY_NAME)}")
    if elsewhere := named - set(SEQUENCES[args.sequence]):
        p.error(f"step(s) {', '.join(sorted(elsewhere))} not in the {args.sequence} sequence: "
                f"{', '.join(SEQUENCES[args.sequence])}")
    if bad := {m for m in args.inject.values() if m not in INJECT_MODES}:
        p.error(f"--inject-failure mode(s) {', '.join(sorted(bad))}: use {', '.join(INJECT_MODES)}")
    return args


def main(argv: list[str] | None = None, doc: str = "", start: float | None = None) -> int:
    """`start`: time.monotonic() at the process's start, from which the budget counts."""
    start = time.monotonic() if start is None else start
    args = parse_args(argv, doc or (__doc__ or ""))
    if args._step:
        return step_main(args._step, Path(args._context), args._deadline, Path(args._result))
    import torch
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "")
    if not device or (device == "cuda" and not torch.cuda.is_available()):
        print("gpu_check.py: error: CUDA is not available here; --device cpu runs the CPU twin (which proves "
              "this script, not the GPU)", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return run_all(args, environment(device), Budget(args.budget, start, RESERVE[device]))
