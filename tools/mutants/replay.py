"""Replaying mutants: each in its own copy of the tree, its tests run there under a time limit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from alexnet.cli import temporary_directory
from data.procs import in_threads, watched_env

from .catalogue import Mutant, StaleMutant

PYTEST = ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist")


@dataclass
class Verdict:
    mutant: Mutant
    result: str     # killed, survived, stale, error
    seconds: float
    detail: str = ""


def tree_files(root: Path) -> list[str]:
    """The files git would carry: tracked and untracked-but-not-ignored (new tests not yet committed)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)


def run_tests(where: Path, nodes: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """(pytest's exit code or None on timeout, the tail of its output), run in `where`."""
    # the copy's modules, not the checkout's; the suite ends with this process (tests/conftest.py follows it)
    env = watched_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    proc = subprocess.Popen([sys.executable, *PYTEST, *nodes], cwd=where, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the test's children go too
        out, _ = proc.communicate()
        return None, out[-2000:]
    return proc.returncode, out[-2000:]


def judge(code: int | None) -> str:
    """pytest 1 (failed), 2 (interrupted: the mutant broke an import), 3, or the time limit: killed."""
    if code == 0:
        return "survived"
    return "killed" if code in (None, 1, 2, 3) else "error"


def replay_one(m: Mutant, root: Path, files: list[str], timeout: float) -> Verdict:
    start = time.monotonic()
    with temporary_directory(prefix=f"mutant-{m.id}-") as tmp:
        where = Path(tmp)
        copy_tree(root, files, where)
        target = where / m.file
        try:
            target.write_text(m.apply(target.read_text()))
        except (StaleMutant, FileNotFoundError) as e:
            return Verdict(m, "stale", 0.0, str(e))
        code, out = run_tests(where, m.tests, timeout)
    detail = "time limit" if code is None else ("" if code in (0, 1) else f"pytest exit {code}: {out[-300:]}")
    return Verdict(m, judge(code), time.monotonic() - start, detail)


def check_clean(mutants: list[Mutant], root: Path, files: list[str], timeout: float) -> tuple[bool, str]:
    """Every named test passes on an unmutated copy (else a 'kill' would mean nothing)."""
    nodes = tuple(dict.fromkeys(n for m in mutants for n in m.tests))
    with temporary_directory(prefix="mutant-clean-") as tmp:
        copy_tree(root, files, Path(tmp))
        code, out = run_tests(Path(tmp), nodes, timeout * max(1, len(mutants)))
    return code == 0, out


def replay(mutants: list[Mutant], root: Path, timeout: float, jobs: int = 1) -> list[Verdict]:
    """The verdicts in catalogue order; each is also printed as one line when it is known."""
    files = tree_files(root)

    def one(m: Mutant) -> Verdict:
        v = replay_one(m, root, files, timeout)
        print(f"{m.id}: {v.result} ({v.seconds:.0f} s){' ' + v.detail if v.detail else ''}", flush=True)
        return v
    return in_threads(one, mutants, jobs)  # a Ctrl-C starts no queued mutant


def table(verdicts: list[Verdict]) -> str:
    """A markdown table: id, file, bug, result, seconds, killing tests."""
    rows = ["| id | file | bug | result | s | tests |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        result = v.result + (f" ({v.detail})" if v.detail else "")
        rows.append(f"| {v.mutant.id} | {v.mutant.file} | {v.mutant.bug} | {result} | {v.seconds:.0f} | "
                    f"{'<br>'.join(v.mutant.tests)} |")
    killed = sum(v.result == "killed" for v in verdicts)
    return "\n".join(rows) + f"\n\nkilled {killed} of {len(verdicts)}"
