"""Running a sequence of steps: each in its own process (tree) under a time limit, the limits planned
within the budget, the verdicts (a cut for lack of budget is `skipped`, a defect or a hang `failed`),
and the reports rewritten after every step."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .budget import Budget
from .commands import REPO, clean_env, kill_tree, last_line, tail
from .context import Ctx, StepFailed, StepTimedOut
from .report import Result, write_reports
from .speed import compile_blocker
from .table import BY_NAME, SEQUENCES, Step

ENTRY = REPO / "scripts" / "gpu_check.py"
INTERRUPTED = "interrupted (Ctrl-C); the steps after it did not run"
HANG_TIMEOUT = 8.0      # the own time limit of a step given --inject-failure STEP:hang
# The end of the budget kept for the clean-up after the last step (removing work/: GBs of checkpoints
# on a GPU, a few MB on the CPU twin) and the last report.
RESERVE = {"cuda": 10.0, "cpu": 2.0}


# -- in the step's own process -------------------------------------------------------------------------

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
        result = {"status": "failed", "reason": str(e), "timed_out": isinstance(e, StepTimedOut)}
    except Exception as e:  # a bug or an unexpected state: report it as this step's failure, go on
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    print(f"{step.name}: {result['status']} {result.get('reason') or result.get('detail', '')}", flush=True)
    result_file.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


# -- in the runner -------------------------------------------------------------------------------------

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
    if need == "compiler":
        return compile_blocker()
    return ""


def own_limit(ctx: Ctx, step: Step) -> float:
    return HANG_TIMEOUT if ctx.inject.get(step.name) == "hang" else step.limit[0 if ctx.device == "cuda" else 1]


def plan(ctx: Ctx, step: Step, env: dict, done: dict, left: Callable[[], float],
         selected: set[str] | None) -> tuple[str, float]:
    """(skip reason, time limit) of a step about to run: its own limit, cut to the `left()` seconds of
    the budget (asked after the checks of what it needs, which may take a while: the compile precheck);
    not started unless a third of its own limit (at least 10 s) is left."""
    if selected is not None and step.name not in selected:
        return "not selected (--steps)", 0
    for need in step.needs:
        if reason := unmet(need, ctx, env, done):
            return reason, 0
    own, seconds = own_limit(ctx, step), left()
    if seconds < min(own, max(own / 3, 10)):
        return f"out of time: {max(seconds, 0):.0f} s of the budget left, the step's own limit is {own:.0f} s", 0
    return "", min(own, seconds)


def timed_out(seconds: float, limit: float, own: float, why: str) -> tuple[str, str]:
    """(status, reason) of a step stopped at its time limit: the budget's cut is no defect, its own
    limit is (a hang, or far slower than planned)."""
    if limit < own:
        return "skipped", f"cut short by the budget after {seconds:.0f} s (it had {limit:.0f} of its own {own:.0f} s)"
    return "failed", f"timed out after {seconds:.0f} s at its own time limit of {own:.0f} s: a hang? {why}".rstrip()


def run_step(ctx: Ctx, step: Step, limit: float, context: Path) -> Result:
    """One step in its own process (tree), killed at `limit` seconds; its result file read back."""
    result_file = ctx.work / "results" / f"{step.name}.json"
    log = ctx.logs / f"{step.name}.log"
    began, killed, interrupted = time.monotonic(), False, False
    cmd = [sys.executable, str(ENTRY), "--_step", step.name, "--_context", str(context),
           "--_deadline", str(time.time() + limit), "--_result", str(result_file)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=step_env(ctx),
                                start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            kill_tree(proc.pid)
            proc.wait()
            killed, interrupted = True, isinstance(e, KeyboardInterrupt)
    res = Result(step.name, step.what, "failed", time.monotonic() - began, log=str(log.relative_to(ctx.out)),
                 limit_s=limit, own_limit_s=own_limit(ctx, step))
    data = json.loads(result_file.read_text()) if result_file.exists() and not interrupted else {}
    if interrupted:
        res.reason = INTERRUPTED
    elif data.get("timed_out") or (killed and not data):
        res.status, res.reason = timed_out(res.seconds, limit, res.own_limit_s, data.get("reason", ""))
    elif data:
        res.status, res.reason = data["status"], data.get("reason", "")
        res.detail, res.figures = data.get("detail", ""), data.get("figures", {})
    else:
        res.reason = f"the step's process exited with code {proc.returncode}: {last_line(log.read_text())}"
    if res.status == "failed":
        res.log_tail = tail(log.read_text(errors="replace"), 30)
    return res


def step_env(ctx: Ctx) -> dict:
    """A step's environment, which its commands inherit: the temporary directory is work/tmp, so that what a
    step or a tool it runs leaves there (torchrun's log folder, a killed benchmark's data) goes with work/."""
    return {**clean_env(), "TMPDIR": str(ctx.work / "tmp")}


def prepare(ctx: Ctx) -> Path:
    """Fresh work/ and logs/ folders and the context file every step's process reads."""
    shutil.rmtree(ctx.work, ignore_errors=True)
    shutil.rmtree(ctx.logs, ignore_errors=True)
    (ctx.work / "results").mkdir(parents=True)
    (ctx.work / "tmp").mkdir()
    ctx.logs.mkdir(parents=True)
    context = ctx.work / "context.json"
    context.write_text(json.dumps({"out": str(ctx.out), "device": ctx.device, "gpus": ctx.gpus,
                                   "inject": ctx.inject}))
    return context


def run_all(args, env: dict, budget: Budget) -> int:
    """Every step of the sequence in order, the reports rewritten after each one; work/ removed within
    the budget."""
    out = Path(args.out).resolve()
    ctx = Ctx(out, env["device"], env["gpus"] if env["device"] == "cuda" else 0, inject=args.inject)
    context, sequence = prepare(ctx), [BY_NAME[n] for n in SEQUENCES[args.sequence]]
    selected = set(args.steps.split(",")) | {"data"} if args.steps else None
    done: dict[str, Result] = {}
    for i, step in enumerate(sequence, 1):
        reason, limit = plan(ctx, step, env, done, budget.left, selected)
        print(f"[{i:2}/{len(sequence)}] {step.name:28} ", end="", flush=True)
        res = (Result(step.name, step.what, "skipped", reason=reason, own_limit_s=own_limit(ctx, step)) if reason
               else run_step(ctx, step, limit, context))
        done[step.name] = res
        print(f"{res.status:7} {res.seconds:6.1f} s  {res.reason or res.detail}", flush=True)
        write_reports(out, env, args, list(done.values()), budget)
        if res.reason == INTERRUPTED:
            return 130
    if not args.keep_work:
        shutil.rmtree(ctx.work, ignore_errors=True)
    write_reports(out, env, args, list(done.values()), budget)  # its time now includes the clean-up
    failed = [r.name for r in done.values() if r.status == "failed"]
    print(f"report: {out / 'gpu_check.md'} after {budget.spent():.0f} s of the {budget.total:.0f} s budget"
          + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"))
    return 1 if failed else 0
