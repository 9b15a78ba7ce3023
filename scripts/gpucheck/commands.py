"""The commands a step runs: each one's output in logs/<step>/<label>.log, each bounded by the step's
deadline, and killed with everything it started when that passes."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data.procs import child_pids, watched_env  # light: no torch

from .context import Ctx, StepFailed, StepTimedOut

REPO = Path(__file__).resolve().parents[2]
STEP_MARGIN = 4.0       # a step's commands stop this much before the runner kills the step
POLL = 0.02             # seconds between looks at metrics.jsonl while waiting to interrupt
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
# A warning from torch's C++ side ("[W1127 22:53:19.866 CudaIPCTypes.cpp:16] Producer process has been
# terminated before all shared CUDA tensors released"): something was left to the interpreter's exit.
CPP_WARNING = re.compile(r"^\[W\d{4} \d\d:\d\d:\d\d\.\d+ [^\]]*\].*$", re.M)
# --inject-failure STEP[:MODE] swaps the step's first command for one of these
INJECTED = {"fail": "import sys; sys.exit('gpu_check: injected failure (--inject-failure)')",
            "slow": "import time; time.sleep(3600)  # gpu_check: injected overrun (--inject-failure STEP:slow)"}


@dataclass
class Done:
    rc: int
    output: str
    seconds: float


def clean_env() -> dict:
    """This environment without torch.distributed's variables (train.py would think it is a replica), for a
    child that ends with this process (its own session is out of reach of a kill of this one's group)."""
    return watched_env({**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, "PYTHONUNBUFFERED": "1"})


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


def start(ctx: Ctx, label: str, cmd: list[str]) -> tuple[subprocess.Popen, Path]:
    """Start one command of the step, output to logs/<step>/<label>.log; --inject-failure swaps the
    step's first command for one that fails or never ends."""
    mode = ctx.inject.get(ctx.step)
    if mode in INJECTED and not ctx.injected:
        ctx.injected = True
        cmd = [sys.executable, "-c", INJECTED[mode]]
    log = ctx.logs / ctx.step / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {shlex.join(cmd)}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True)
    return proc, log


def finish(ctx: Ctx, proc: subprocess.Popen, log: Path, label: str, began: float) -> Done:
    """Wait for `proc` until the step's deadline; past it, kill its tree and raise StepTimedOut."""
    try:
        rc = proc.wait(timeout=max(ctx.left() - STEP_MARGIN, 1.0))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise StepTimedOut(f"{label} was stopped after {time.monotonic() - began:.0f} s at the step's time limit; "
                           f"see {log.relative_to(ctx.out)}") from None
    done = Done(rc, log.read_text(errors="replace"), time.monotonic() - began)
    print(f"  -> exit {rc} in {done.seconds:.1f} s" + (f"\n{tail(done.output)}" if rc else ""), flush=True)
    return done


def run_cmd(ctx: Ctx, label: str, cmd: list[str]) -> Done:
    began = time.monotonic()
    proc, log = start(ctx, label, cmd)
    return finish(ctx, proc, log, label, began)


def check(ctx: Ctx, label: str, cmd: list[str]) -> Done:
    """run_cmd, failing the step unless the command exits 0 without a warning of torch's C++ side."""
    done = run_cmd(ctx, label, cmd)
    if done.rc != 0:
        raise StepFailed(f"{label} exited with code {done.rc}: {last_line(done.output)}")
    warned = CPP_WARNING.search(done.output)
    if warned:
        raise StepFailed(f"{label} exited 0 but printed a warning of torch's C++ side: {warned.group(0)[:300]}")
    return done


def has_train_record(metrics: Path) -> bool:
    try:
        return '"split": "train"' in metrics.read_text()
    except OSError:
        return False


def run_interrupted(ctx: Ctx, label: str, cmd: list[str], run_dir: Path) -> tuple[Done, str]:
    """Start a training run and send it SIGINT once it has written its first train record (or, as a
    fallback, after a third of the time left); returns its result and when the signal went."""
    began = time.monotonic()
    proc, log = start(ctx, label, cmd)
    fallback = began + max(ctx.left() - STEP_MARGIN, 3.0) / 3
    while proc.poll() is None and time.monotonic() < fallback and not has_train_record(run_dir / "metrics.jsonl"):
        time.sleep(POLL)
    when = "after its first train record" if has_train_record(run_dir / "metrics.jsonl") else (
        f"after a fallback wait of {time.monotonic() - began:.0f} s, before any train record")
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        print(f"  SIGINT sent {when}", flush=True)
    else:
        when = "never sent: the run ended first"
    return finish(ctx, proc, log, label, began), when
