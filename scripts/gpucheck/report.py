"""The report: gpu_check.md (a table, one row per step, and the benchmark figures) and gpu_check.json
(the same, machine readable, with the environment), rewritten atomically after every step."""
from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from data.fsutil import commit, temp_path

from .benchmarks import bench_section, md_cell
from .budget import Budget
from .commands import REPO


@dataclass
class Result:
    """One step's row: its verdict, time, figures, and the time limits it was planned with."""

    name: str
    what: str
    status: str                 # passed | failed | skipped
    seconds: float = 0.0
    reason: str = ""
    detail: str = ""
    figures: dict = field(default_factory=dict)
    log: str = ""
    log_tail: str = ""          # failed steps: the end of their log
    limit_s: float | None = None  # the time limit it ran under (None: not started)
    own_limit_s: float = 0.0    # its own on this device; limit_s is less where the budget cut it


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


def limit_cell(r: Result) -> str:
    """The limit it ran under, '/its own' where that differs (cut by the budget, or not started)."""
    own = f"{r.own_limit_s:.0f}"
    if r.limit_s is None:
        return f"-/{own}"
    return f"{r.limit_s:.0f}" if r.limit_s >= r.own_limit_s else f"{r.limit_s:.0f}/{own}"


def header(env: dict, args, results: list[Result], budget: Budget) -> list[str]:
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")}
    versions = f"torch {env['torch']}, CUDA {env['cuda'] or '-'}, cuDNN {env.get('cudnn') or '-'}, " \
               f"Python {env['python']}"
    lines = [f"# GPU check: {args.sequence}", "",
             f"- device: **{env['device']}**, {env['device_name']}; GPUs: {env['gpus']} "
             f"({', '.join(env.get('gpu_names', [])) or 'none'}); {env['cpu_cores']} CPU cores",
             f"- {versions}; packages missing from requirements.txt: "
             f"{', '.join(k for k, v in env['packages'].items() if v is None) or 'none'}",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}: {budget.spent():.0f} s of a {budget.total:.0f} s budget "
             f"(from the process's start, clean-up included); {counts['passed']} passed, {counts['failed']} "
             f"failed, {counts['skipped']} skipped",
             f"- command: `python scripts/gpu_check.py {shlex.join(sys.argv[1:])}`", ""]
    if env["device"] == "cpu":
        lines += ["CPU twin: the same steps at tiny sizes on the CPU; it proves this script, not the GPU.", ""]
    if env["device"] == "cuda" and env["gpus"] < 2:
        lines += ["One GPU runs no NCCL: the 2-GPU steps skip, and model parallelism runs over gloo.", ""]
    return lines


def render_md(env: dict, args, results: list[Result], budget: Budget) -> str:
    lines = [*header(env, args, results, budget),
             "| # | step | path | status | s | limit s | details |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        status = f"**{r.status}**" if r.status == "failed" else r.status
        lines.append(f"| {i} | {r.name} | {md_cell(r.what)} | {status} | {r.seconds:.1f} | {limit_cell(r)} | "
                     f"{md_cell(r.reason or r.detail)} |")
    lines += ["", "limit s: the time limit a step ran under; `a/b`: a of its own b s (cut by the budget), "
              "`-/b`: not started. A step stopped at its own limit failed (a hang); one the budget cut is "
              "skipped."]
    benches = [r for r in results if r.name.startswith("bench-") and r.status == "passed"]
    if benches:
        lines += ["", "## Benchmarks", ""]
        for r in benches:
            lines += bench_section(r.name, r.what, r.figures)
    lines += ["", "Logs: `logs/<step>.log` (what each step ran), `logs/<step>/<command>.log` (each command's "
              "output)."]
    return "\n".join(lines) + "\n"


def write_reports(out: Path, env: dict, args, results: list[Result], budget: Budget) -> None:
    failed = any(r.status == "failed" for r in results)
    report = {"environment": env, "sequence": args.sequence, "budget_s": budget.total,
              "reserve_s": budget.reserve, "started_at": round(budget.started_at(), 3),
              "seconds": round(budget.spent(), 1), "exit_code": 1 if failed else 0,
              "steps": [{**asdict(r), "seconds": round(r.seconds, 1)} for r in results]}
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str) + "\n"),
                       ("gpu_check.md", render_md(env, args, results, budget))):
        tmp = temp_path(out / name)
        tmp.write_text(text)
        commit(tmp, out / name)
