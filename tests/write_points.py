"""Every write point of the tools, found at run time and killed at (tests/test_write_points.py).

A tool's files take their final names in one place, data.fsutil.commit; with ALEXNET_WRITE_TRACE set it
records each moment (before and after each rename) of the whole process tree, numbered in order, and the
thread that reaches moment ALEXNET_WRITE_PAUSE_AT waits there. The test then does what `kill -9`,
a batch scheduler's timeout or the out-of-memory killer does to the tool: SIGKILL to its top process
only, and lets the held thread go on (in a child, which must then end by itself). Then:

- no process of the tool survives it (each child must die with its parent, by itself);
- the same command again finishes (exit 0) with the output an uninterrupted run gives, and leaves no
  temporary file.

Outputs are compared by content (`snapshot`): batch files by their arrays and attributes, checkpoints by
their tensors, JSON and metrics without wall-clock fields or the preprocessed output's random identity.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.fsutil import PAUSE_AT, TEMP_FILE, WRITE_TRACE
from tests.children import none_left, with_a_token
from tests.conftest import REPO

# Values that differ from run to run by design: the wall clock, and the random identity that ties a
# preprocessed output's files together (checked against each other, not against another run).
VOLATILE = re.compile(r"(^|_)(time|times|seconds|s|wall|date|started|finished|elapsed|img_per_s|dataset|"
                      r"created|host|pid|duration|when|started_at|speed|cached|last_run)$")
# (cached: whether a cache served this run; last_run: what this run itself did, e.g. a resumed preprocess)


AUDIT = "ALEXNET_WRITE_AUDIT"  # tests/write_audit/sitecustomize.py records each file opened for writing
AUDIT_DIR = REPO / "tests" / "write_audit"


@dataclass
class Run:
    rc: int | None
    output: str
    trace: list[tuple[int, int, str, str]]   # (number, pid, moment, path)
    opened: list[str] = field(default_factory=list)  # every file the tree opened for writing, absolute


def read_opened(path: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []


def written_in_place(opened: list[str], out: Path, allowed: dict[str, str]) -> list[str]:
    """The files under `out` that were opened for writing under a name of their own: neither a temporary
    (data.fsutil.temp_path's names, renamed into place by commit) nor matched by a glob of `allowed`."""
    import fnmatch
    root = os.path.realpath(out)
    found = []
    for path in dict.fromkeys(opened):
        rel = os.path.relpath(os.path.realpath(path), root)
        name = os.path.basename(path)
        # a folder: tempfile.TemporaryFile's nameless O_TMPFILE file in it (the writable-folder probes)
        if (rel.startswith("..") or TEMP_FILE.match(name) or any(fnmatch.fnmatch(name, g) for g in allowed)
                or os.path.isdir(path)):
            continue
        found.append(rel)
    return found


def read_trace(path: Path) -> list[tuple[int, int, str, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        n, pid, moment, target = line.split(" ", 3)
        rows.append((int(n), int(pid), moment, target))
    return rows


def written_outside(opened: list[str], out: Path, allowed: tuple[str, ...]) -> list[str]:
    """The files opened for writing outside `out` (a tool writes its output and nothing else), but for
    devices and shared memory (/dev), folders (tempfile's nameless probe files) and paths starting with
    one of `allowed` (the test's own trace)."""
    root = os.path.realpath(out) + os.sep
    return [path for path in dict.fromkeys(opened)
            if not (os.path.realpath(path) + os.sep).startswith(root) and not path.startswith(("/dev/", *allowed))
            and not os.path.isdir(path)]


@dataclass
class _Started:
    proc: subprocess.Popen
    trace: Path
    audit: Path
    log: Path
    token: str

    def result(self) -> Run:
        return Run(self.proc.returncode, self.log.read_text(errors="replace"), read_trace(self.trace),
                   read_opened(self.audit))


def _start(argv: list[str], work: Path, pause_at: int | None = None) -> _Started:
    """Start `argv` (a repository script and its arguments) with the write trace and the write audit on,
    in a session of its own."""
    trace = work / f"trace-{uuid.uuid4().hex[:8]}.txt"
    audit = trace.with_name(trace.stem + "-opened.txt")
    path = os.pathsep.join(p for p in (str(AUDIT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    token, env = with_a_token({**os.environ, "PYTHONUNBUFFERED": "1", WRITE_TRACE: str(trace), AUDIT: str(audit),
                               "PYTHONPATH": path})
    if pause_at is not None:
        env[PAUSE_AT] = str(pause_at)
    log = work / f"log-{uuid.uuid4().hex[:8]}.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return _Started(proc, trace, audit, log, token)


def _wait_for_moment(s: _Started, moment: int, deadline: float) -> None:
    """Until the tree of `s` holds one of its threads at `moment` (its write trace says so)."""
    while s.proc.poll() is None and time.monotonic() < deadline:
        if any(r[0] == moment for r in read_trace(s.trace)):
            return
        time.sleep(0.02)
    raise AssertionError(f"moment {moment} never came (exit {s.proc.poll()}): "
                         f"{s.log.read_text(errors='replace')[-2000:]}")


def run_inside(argv: list[str], work: Path, moment: int, timeout: float = 600) -> tuple[Run, Run]:
    """Run `argv` held at its write moment `moment`; meanwhile run the same command again, whole; then let
    the first go on. Both runs, the held one first."""
    s = _start(argv, work, moment)
    deadline = time.monotonic() + timeout
    try:
        _wait_for_moment(s, moment, deadline)
        second = run_tool(argv, work, timeout=max(deadline - time.monotonic(), 1))
        Path(f"{s.trace}.go").touch()
        s.proc.wait(timeout=max(deadline - time.monotonic(), 1))
        return s.result(), second
    finally:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


def run_tool(argv: list[str], work: Path, pause_at: int | None = None, timeout: float = 600) -> Run:
    """Run `argv` (a repository script and its arguments) with the write trace on; with `pause_at`, kill
    its top process with SIGKILL once the tree reaches that moment. Either way, no process of it may
    outlive its top process."""
    s = _start(argv, work, pause_at)
    proc, trace, token = s.proc, s.trace, s.token
    deadline = time.monotonic() + timeout
    try:
        if pause_at is None:
            proc.wait(timeout=timeout)
            none_left(token, f"the tool's top process (exit {proc.returncode})")
            return s.result()
        _wait_for_moment(s, pause_at, deadline)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        Path(f"{trace}.go").touch()  # the hold was the test's: a child held there goes on as it would
        none_left(token, "the tool's top process, killed")
        return s.result()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- what a run leaves, by content ------------------------------------------------------------------------

def _plain(value, root: str):
    """JSON-like data without its volatile keys, the output folder's own path written <OUT>."""
    if isinstance(value, dict):
        return {k: _plain(v, root) for k, v in value.items() if not VOLATILE.search(str(k))}
    if isinstance(value, (list, tuple)):
        return [_plain(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(root, "<OUT>")
    return value


def _h5(path: Path, root: str) -> dict:
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        for name, ds in f.items():
            out[name] = np.asarray(ds[()]).tobytes() if ds.dtype.kind != "O" else [str(x) for x in ds[()]]
        out["attrs"] = _plain({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in f.attrs.items()}, root)
    return out


def _pt(path: Path, root: str) -> dict:
    import torch

    def flat(value, name=""):
        if isinstance(value, torch.Tensor):
            return {name: (str(value.dtype), tuple(value.shape), value.cpu().numpy().tobytes())}
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not VOLATILE.search(str(k)):
                    out.update(flat(v, f"{name}.{k}"))
            return out
        if isinstance(value, (list, tuple)):
            out = {}
            for i, v in enumerate(value):
                out.update(flat(v, f"{name}.{i}"))
            return out
        return {name: repr(_plain(value, root))}
    return flat(torch.load(path, map_location="cpu", weights_only=True))


def content(path: Path, root: str):
    """One file's content as compared across runs (`root`: the output folder, whose path it may hold)."""
    suffix = path.suffix
    if suffix == ".h5":
        return _h5(path, root)
    if suffix == ".pt":
        return _pt(path, root)
    if suffix == ".json":
        return _plain(json.loads(path.read_text()), root)
    if suffix == ".jsonl":
        return [_plain(json.loads(line), root) for line in path.read_text().splitlines() if line.strip()]
    if suffix == ".yaml":  # by meaning: where a flow mapping wraps depends on the length of the paths in it
        import yaml
        return _plain(yaml.safe_load(path.read_text()), root)
    if suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k].tobytes() for k in z.files}
    raw = path.read_bytes().replace(root.encode(), b"<OUT>")
    if suffix == ".html":  # the page says when it was made
        raw = re.sub(rb"generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", b"generated <time>", raw)
    return raw


def snapshot(root: Path, ignore: tuple[str, ...] = ()) -> dict[str, object]:
    """Every file under `root` (but the lock and names in `ignore`), by content."""
    return {str(p.relative_to(root)): content(p, str(root)) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock" and not any(p.match(g) for g in ignore)}


def temporaries(root: Path) -> list[str]:
    """Files under `root` that are a write's temporary (an atomic write's, or a download's .partial)."""
    return [str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and (TEMP_FILE.match(p.name) or p.name.endswith((".tmp", ".partial")))]


def differences(got: dict, want: dict) -> list[str]:
    out = [f"missing: {k}" for k in want.keys() - got.keys()] + [f"extra: {k}" for k in got.keys() - want.keys()]
    out += [f"differs: {k}" for k in sorted(want.keys() & got.keys()) if got[k] != want[k]]
    return out
