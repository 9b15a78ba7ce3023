"""A fault case, the inputs the cases share, running one case, and its verdict.

A case prepares its own folder (copies of the shared inputs, then the damage), names the command to
run, and says what must come out: the exit code, and what the first line of the message (stderr, else
stdout; for a run that must succeed, the first line matching `line`) must name. Verdicts:

- OK: the expected exit code, every name in the message's line, no traceback anywhere, and nothing
  wrong left behind (the case's `check`);
- DEFECT: a traceback, an exit 0 where an error was due (or an error where success was), death by a
  signal, a hang past the case's limit, something wrong left behind, or a setup that failed;
- WEAK: the wrong non-zero exit code, or a message that does not name what it should;
- SKIP: the case cannot run here (a tmpfs needs root), with the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from data.procs import watched_env

REPO = Path(__file__).resolve().parents[2]
KINDS = {"silent": "silent wrong result", "lost": "lost work", "traceback": "traceback, not one line",
         "misleading": "misleading failure", "accepted": "good input accepted", "hang": "hangs, no answer"}
TRACEBACK = "Traceback (most recent call last)"
READ_ONLY = "read-only file system"  # the reason as the tools word it (data.fsutil), not Python's "[Errno 30] ..."
# What every training case shares: the demo config at the tiniest size, one epoch, no loader process.
TINY = {"data.crop": 67, "model.width": 0.125, "model.init": "torch", "train.batch_size": 8, "train.epochs": 1,
        "train.log_every": 2, "train.lr_steps": "[1]", "data.loading": "inline", "run.progress": "false",
        "run.tensorboard": "false"}
# Runs a tool as __main__ after some injected code (a fault the machine cannot be asked for, e.g. EACCES as root).
_INJECT = """import runpy, sys
sys.path.insert(0, {repo!r})
{code}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Skip(Exception):
    """The case cannot run here; the message says why."""


@dataclass(frozen=True)
class Case:
    """One fault: `setup(work)` prepares work.w and returns the command (arguments after python)."""

    name: str
    kind: str  # a key of KINDS
    what: str  # the fault, in a few words
    expect: int  # the exit code a right tool gives
    names: tuple[str, ...]  # what the message must name; "{w}" is the case's folder
    setup: Callable[[Work], list[str]]
    check: Callable[[Work], str | None] | None = None  # after the run: what is wrong, or None
    during: Callable[[Work, subprocess.Popen], None] | None = None  # while it runs (a signal, ...)
    line: str = ""  # a regex choosing the message line (runs that must succeed)
    listed: bool = False  # an instance issue 19 lists
    timeout: float = 120.0


@dataclass
class Outcome:
    case: Case
    code: int | None
    message: str
    verdict: str
    reason: str
    seconds: float


class Ctx:
    """The work folder, and the inputs the cases share, each made once, when a case first needs it."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.RLock()
        self._made: dict[str, Path] = {}

    def once(self, key: str, make: Callable[[Path], None]) -> Path:
        """root/_shared/<key>, made by `make(path)` the first time; an error names the failed command."""
        with self._lock:
            if key not in self._made:
                path = self.root / "_shared" / key
                shutil.rmtree(path, ignore_errors=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                make(path)
                self._made[key] = path
            return self._made[key]

    @property
    def src(self) -> Path:
        """The synthetic ImageNet tree: 4 classes x 12 train images (quirks included), flat val with val.txt."""
        return self.once("src", lambda p: must(["scripts/make_synthetic.py", "--out", str(p), "--classes", "4",
                                                "--train-per-class", "12", "--val-per-class", "4",
                                                "--min-side", "48", "--max-side", "96"]))

    def data(self, size: int = 72, classes: int | None = None) -> Path:
        """src preprocessed at `size` (72: crop 67 fits), 16 images per file; `classes`: a subset."""
        subset = ["--classes", str(classes)] if classes else []
        return self.once(f"data{size}" + (f"-c{classes}" if classes else ""), lambda p: must(
            ["scripts/preprocess.py", "--train-dir", str(self.src / "train"), "--val-dir", str(self.src / "val"),
             "--val-labels", str(self.src / "val.txt"), "--out", str(p), "--size", str(size), "--per-file", "16",
             "--workers", "2", "--quiet", *subset]))

    @property
    def run(self) -> Path:
        """A finished one-epoch run on data(): config.yaml, metrics.jsonl, last/best/epoch_001.pt."""
        return self.once("run", lambda p: must(train_args(self.data(), p)))

    def nan_copy(self, source: Path, key: str) -> Path:
        """A copy of the checkpoint `source` with every floating-point weight NaN."""
        def make(path: Path) -> None:
            path.mkdir()
            must(["-c", "import sys, torch; c = torch.load(sys.argv[1], weights_only=True); "
                        "[t.fill_(float('nan')) for t in c['model'].values() if t.is_floating_point()]; "
                        "torch.save(c, sys.argv[2])", str(source), str(path / "nan.pt")])
        return self.once(key, make) / "nan.pt"


@dataclass
class Work:
    """What a case works with: the shared inputs, its own folder, and what to undo after it."""

    ctx: Ctx
    w: Path
    stack: ExitStack = field(default_factory=ExitStack)

    def __enter__(self) -> Work:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def copy(self, src: Path, name: str) -> Path:
        return Path(shutil.copytree(src, self.w / name, symlinks=True))

    def mount(self, name: str, options: str) -> Path:
        """A tmpfs at w/name (unmounted after the case); Skip where mounting is not allowed."""
        where = self.w / name
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode:
            raise Skip(f"cannot mount a tmpfs ({(r.stderr or r.stdout).strip() or 'not root?'})")
        self.stack.callback(subprocess.run, ["umount", "-l", str(where)], capture_output=True)
        return where


def train_args(data: Path, run_dir: Path, *extra: str, config: str = "configs/demo.yaml", **over) -> list[str]:
    """train.py on `data` into `run_dir` at the tiniest size; `over`: more dotted keys (dots as __)."""
    keys = {"data.root": data, **TINY, "run.dir": run_dir, **{k.replace("__", "."): v for k, v in over.items()}}
    return ["train.py", config, *(f"{k}={v}" for k, v in keys.items()), *extra]


def inject(code: str, *command: str) -> list[str]:
    """Run `command` (a script and its arguments) after `code` in the same interpreter."""
    return ["-c", _INJECT.format(repo=str(REPO), code=code), *command]


def environment() -> dict[str, str]:
    # One thread per process: the cases share a small machine with whatever else runs on it.
    # And each ends with the table's process (procs.follow_parent), which a case's own session would not.
    return watched_env({**os.environ, "PYTHONUNBUFFERED": "1",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def must(argv: list[str]) -> None:
    """Run a command that makes a shared input; RuntimeError with its last line if it fails."""
    r = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, errors="replace",
                       env=environment(), timeout=600)
    if r.returncode:
        last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{' '.join(argv[:1])} exited {r.returncode}: {last}")


def wait_for(test: Callable[[], bool], proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until `test()` holds (or the process ended, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while not test() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def run_case(ctx: Ctx, case: Case, number: int) -> Outcome:
    """Set the case up in W/cNN (NN = `number`), run its command under its time limit, and judge what came
    out. The folder is numbered, not named after the case, so that no word of a case's name can pass for
    a word the message must hold."""
    w = ctx.root / f"c{number:02d}"
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    start = time.monotonic()
    with Work(ctx, w) as work:
        try:
            argv = case.setup(work)
        except Skip as e:
            return Outcome(case, None, "", "SKIP", str(e), 0.0)
        except Exception as e:  # a shared input that could not be made is as much a finding as the case
            return Outcome(case, None, "", "DEFECT", f"setup failed: {type(e).__name__}: {e}", 0.0)
        code, out, err = _run(work, case, argv)
        problem = case.check(work) if case.check is not None and code is not None else None
    verdict, reason, line = judge(case, code, out, err, problem, w)
    return Outcome(case, code, line.replace(str(ctx.root), "W"), verdict, reason, time.monotonic() - start)


def _terminal_signals() -> None:
    """In the tool's process, before exec: the stop signals as a terminal's command gets them. A table run in
    the background (`&`, nohup) would pass SIGINT or SIGHUP on ignored, and the signal cases would judge
    that instead of the tools (a case that wants them ignored says so itself)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _run(work: Work, case: Case, argv: list[str]) -> tuple[int | None, str, str]:
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", env=environment(), start_new_session=True,
                            preexec_fn=_terminal_signals)
    work.stack.callback(lambda: proc.poll() is None and _kill_group(proc))
    if case.during is not None:
        threading.Thread(target=case.during, args=(work, proc), daemon=True).start()
    try:
        out, err = proc.communicate(timeout=case.timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return None, out, err


def _kill_group(proc: subprocess.Popen) -> None:
    """The case's process and everything it started (its own session), if still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def message_line(case: Case, out: str, err: str) -> str:
    """The first line of stderr (else stdout); with `case.line`, the first line of either matching it."""
    if case.line:
        return next((s.strip() for s in (err + "\n" + out).splitlines() if re.search(case.line, s)), "")
    return next((s.strip() for text in (err, out) for s in text.splitlines() if s.strip()), "")


def judge(case: Case, code: int | None, out: str, err: str, problem: str | None, w: Path) -> tuple[str, str, str]:
    """(verdict, reason, the message line) of one run; see the module docstring."""
    line = message_line(case, out, err)
    if code is None:
        return "DEFECT", f"no exit within {case.timeout:g} s (a hang?)", line
    defects, weak = [], []
    if TRACEBACK in out + err:
        defects.append("a traceback")
    if code < 0:
        defects.append(f"killed by signal {-code}")
    elif code != case.expect:
        (defects if 0 in (code, case.expect) else weak).append(f"exit {code}, expected {case.expect}")
    missing = [n for n in (n.format(w=w) for n in case.names) if n not in line]
    if missing:
        weak.append("the message does not name " + ", ".join(repr(m.replace(str(w), "W")) for m in missing))
    if problem:
        defects.append(problem)
    verdict = "DEFECT" if defects else "WEAK" if weak else "OK"
    return verdict, "; ".join(defects + weak), line


def read_json(path: Path):
    return json.loads(path.read_text())


def restamp_mean(root: Path, array) -> None:
    """`array` as `root`'s mean.npy with its digest in meta.json: a mean the output's own preprocess got wrong
    (NaN, another shape), which the checks after the digest must catch."""
    import hashlib
    import io
    import json

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, array)
    (root / "mean.npy").write_bytes(buf.getvalue())
    meta = json.loads((root / "meta.json").read_text())
    meta["mean_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    (root / "meta.json").write_text(json.dumps(meta))
