"""The Makefile's installs: each runs once, and again only when a file it read is newer than its record in
the project's .venv; another interpreter is asked every time. Run with make on a copy of the Makefile and
its requirement files, and a stand-in interpreter that logs what it is asked."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.processes  # make and a shell

FILES = ["Makefile", "requirements.txt", "requirements-test.txt", "requirements-dev.txt", "constraints.txt"]
# target: the sets it installs, read from the Makefile: a target that needs `setup` installs requirements.txt,
# and one whose recipe calls pip_once installs that set too (a target added later is tested unasked).
RULES = re.findall(r"^([\w-]+):([^\n]*)\n((?:\t[^\n]*\n)*)", (REPO / "Makefile").read_text(), re.M)
TARGETS_THAT_INSTALL = {
    t: [s for s in ("run", "dev") if f"pip_once,{s}," in recipe or s == "run" and "setup" in deps.split()]
    for t, deps, recipe in RULES if "pip_once" in recipe or "setup" in deps.split()}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in FILES:
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def stand_in(path: Path) -> Path:
    """An executable that appends its arguments to $LOG, one line a call, and succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/sh\necho "$*" >> "$LOG"\n')
    path.chmod(0o755)
    return path


def make(tree: Path, target: str, *args: str) -> list[str]:
    """The pip calls of `make TARGET` in `tree` (what the stand-in logged)."""
    log = tree / "calls.log"
    log.unlink(missing_ok=True)
    r = subprocess.run(["make", "-s", "-C", str(tree), target, *args], capture_output=True, text=True,
                       env={**os.environ, "LOG": str(log)}, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if c.startswith("-m pip install")]


def test_every_install_goes_through_the_record():
    """No recipe runs pip but pip_once (a new target's install is then recorded too)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    direct = [line for line in lines if "pip install" in line and not line.lstrip().startswith("#")]
    assert direct and all("$(2) $(PIN)" in line for line in direct), direct


def installs(calls: list[str]) -> list[str]:
    """Which sets the pip calls installed: "run" (requirements.txt), "dev" (requirements-dev.txt)."""
    return [{"requirements.txt": "run", "requirements-dev.txt": "dev"}[c.split(" -r ")[1].split()[0]] for c in calls]


@pytest.mark.parametrize("target", TARGETS_THAT_INSTALL)
def test_an_install_runs_again_only_when_a_file_it_read_is_newer(tree, target):
    stand_in(tree / ".venv" / "bin" / "python")
    first = make(tree, target)
    assert all(c.endswith(" -c constraints.txt") for c in first), first
    assert installs(first) == TARGETS_THAT_INSTALL[target], first
    assert make(tree, target) == []  # recorded: pip is not asked
    now = time.time()
    for name in FILES[1:]:
        for f in [*tree.glob(".venv/installed-*"), *(tree / n for n in FILES[1:])]:
            os.utime(f, (now - 100, now - 100) if f.name.startswith("installed-") else (now - 200, now - 200))
        os.utime(tree / name, (now - 50, now - 50))  # edited after the records were made
        want = (["run"] if name in ("requirements.txt", "constraints.txt") else []) + \
            (["dev"] if "dev" in TARGETS_THAT_INSTALL[target] else [])
        assert installs(make(tree, target)) == want, name
        assert make(tree, target) == [], name
    shutil.rmtree(tree / ".venv")  # the records go with it
    stand_in(tree / ".venv" / "bin" / "python")
    assert make(tree, target) == first


def test_other_pins_have_their_own_record(tree):
    stand_in(tree / ".venv" / "bin" / "python")
    assert len(make(tree, "setup")) == 1
    assert make(tree, "setup", "CONSTRAINTS=") == ["-m pip install -q -r requirements.txt"]
    assert make(tree, "setup", "CONSTRAINTS=") == [] and make(tree, "setup") == []


def test_another_interpreter_is_asked_every_time(tree):
    other = stand_in(tree / "elsewhere" / "python")
    for _ in range(2):
        assert make(tree, "setup", f"PYTHON={other}") == ["-m pip install -q -r requirements.txt -c constraints.txt"]
    assert not list(tree.rglob("installed-*"))
