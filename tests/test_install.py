"""What `make` installs, and where: requirements.txt (ranges) at constraints.txt's tested versions, into a .venv
of the project's own, never into an active virtual environment or conda env (a cluster node's CUDA torch)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import children
from tests.conftest import REPO


def _requirements(path: Path) -> dict[str, str]:
    """{package: its requirement text} of a requirements file (comments and blank lines left out)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out[re.split(r"[<>=!~ ]", line, maxsplit=1)[0].lower()] = line
    return out


def test_requirements_are_ranges_and_constraints_pin_each_of_them():
    needs, pins = _requirements(REPO / "requirements.txt"), _requirements(REPO / "constraints.txt")
    assert needs.keys() == pins.keys() and "torch" in needs
    for name, need in needs.items():
        assert ">=" in need and "==" not in need, need
        low = need.split(">=")[1]
        pinned = pins[name].split("==")[1]
        assert tuple(map(int, re.findall(r"\d+", low))) <= tuple(map(int, re.findall(r"\d+", pinned))), (need, pinned)
    assert needs["torch"] == "torch>=2.4"  # the oldest torch the code claims (README, docs/install.md)


def _make_n(target: str, env: dict, *args: str) -> str:
    r = subprocess.run(["make", "-n", target, *args], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return r.stdout


def _environment(tmp_path: Path) -> tuple[Path, dict]:
    """A virtual environment that holds other versions (torch 0.0.1, as pip records a distribution), made
    active the way `source activate` and conda do it."""
    active = tmp_path / "active"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(active)], check=True)
    site = next(active.glob("lib/python*/site-packages"))
    info = site / "torch-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n")
    (info / "RECORD").write_text("")
    env = {**os.environ, "VIRTUAL_ENV": str(active), "CONDA_PREFIX": str(active),
           "PATH": f"{active / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHON", None)
    return active, env


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "link-or-dir"
            for p in sorted(folder.rglob("*"))}


@pytest.mark.processes
def test_make_installs_into_its_own_venv_with_the_constraints_whatever_is_active(tmp_path):
    active, env = _environment(tmp_path)
    for target in ("demo", "test", "test-fast", "mutants"):
        commands = _make_n(target, env)
        installs = [line for line in commands.splitlines() if "pip install" in line]
        assert installs and str(active) not in commands, commands
        assert all(line.startswith(".venv/bin/python -m pip install") and line.endswith("-c constraints.txt")
                   for line in installs), installs
    ranges = _make_n("demo", env, "CONSTRAINTS=")  # a node with its own torch: the ranges alone
    assert "-r requirements.txt" in ranges and "constraints" not in ranges
    chosen = _make_n("test", env, f"PYTHON={sys.executable}")  # asked for: that interpreter
    assert f"{sys.executable} -m pip install" in chosen


@pytest.mark.processes
def test_make_setup_leaves_an_active_environment_byte_for_byte_as_it_was(tmp_path):
    """The real install step, with another environment active: every file of it unchanged. It runs where the
    suite runs in the project's .venv (as `make test` runs it), where the install finds everything there."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("the suite is not running in the project's .venv (make test runs it there)")
    active, env = _environment(tmp_path)
    before = _digest(active)
    r = children.run(["make", "setup"], cwd=REPO, env=env, cpu_s=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _digest(active) == before
