"""The speed options, a few training steps each; and whether torch.compile can build here at all."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path

from .commands import check
from .context import Ctx, Outcome, StepFailed
from .runs import records, train_cmd

CANNOT = "torch.compile cannot build here"


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


def c_compiler(path: str | None = None) -> str | None:
    """The C compiler Triton builds its kernel launchers with: $CC, else gcc, else clang (None: none).
    `path` replaces $PATH in the lookup."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"], path=path)
    return shutil.which("gcc", path=path) or shutil.which("clang", path=path)


def python_include() -> Path:
    """Where Triton looks for Python.h (Debian's posix_local scheme read as posix_prefix, as Triton does)."""
    scheme = sysconfig.get_default_scheme()
    return Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])


def compile_blocker(path: str | None = None, include: Path | None = None, has_triton: bool | None = None) -> str:
    """Why torch.compile cannot build its GPU kernels here ('' if it can): Triton compiles a C launcher
    against Python.h at the first call, so a missing compiler or header is this machine's lack, not a
    defect. The arguments replace $PATH, the header folder and the triton lookup (for tests)."""
    cc = c_compiler(path)
    if cc is None:
        return f"{CANNOT}: no C compiler on PATH ($CC, gcc or clang; Triton builds its launchers with it)"
    include = include or python_include()
    if not (include / "Python.h").is_file():
        return f"{CANNOT}: no Python.h in {include} (the Python headers, e.g. the python3-dev package)"
    try:
        r = subprocess.run([cc, "-fsyntax-only", "-x", "c", f"-I{include}", "-"], input="#include <Python.h>\n",
                           capture_output=True, text=True, timeout=30)
        failed = r.returncode != 0 and (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        failed = f"{type(e).__name__}: {e}"
    if failed:
        return f"{CANNOT}: {cc} cannot compile against {include / 'Python.h'}: {str(failed)[:200]}"
    if not (has_triton if has_triton is not None else importlib.util.find_spec("triton") is not None):
        return f"{CANNOT}: triton is not installed (torch.compile's GPU kernels are Triton kernels)"
    return ""
