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


def _pip_commands(commands: str) -> list[str]:
    """The pip installs in `make -n`'s output (each inside the shell test of its record, and echoed)."""
    return re.findall(r"(?<![\w\"/.-])([\w./-]+ -m pip install -q -r [\w.-]+(?: -c [\w./-]+)?)", commands)


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
        installs = _pip_commands(commands)
        assert len(installs) == (1 if target == "demo" else 2) and str(active) not in commands, commands
        assert all(line.startswith(".venv/bin/python -m pip install") and line.endswith("-c constraints.txt")
                   for line in installs), installs
    ranges = _make_n("demo", env, "CONSTRAINTS=")  # a node with its own torch: the ranges alone
    assert _pip_commands(ranges) == [".venv/bin/python -m pip install -q -r requirements.txt"], ranges
    chosen = _make_n("test", env, f"PYTHON={sys.executable}")  # asked for: that interpreter
    assert _pip_commands(chosen) == [f"{sys.executable} -m pip install -q -r {f} -c constraints.txt"
                                     for f in ("requirements.txt", "requirements-dev.txt")], chosen


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


# What each part of the tree may import beyond the standard library and the project's own modules: the
# distributions that the make target which runs it installs. The tests' lines are those of `make test`
# (what CI runs), read from `make -n`, so a test that imports a tool no file it installs names fails here,
# not only on a clean machine.
_TREES = {"alexnet": "demo", "data": "demo", "layers": "demo", "scripts": "demo", "train.py": "demo",
          "tools": "test", "tests": "test"}
# Imported only where the machine has it, each importing test skipping without it.
_THE_MACHINES_OWN = {"torchvision": "the GPU machine's python has it; tests/test_models.py skips without it"}
# `import a, b.c` and `from a.b import c`, anywhere in a file: a script a test runs from a string counts too.
_IMPORT = re.compile(r"^[ \t]*(?:import[ \t]+([\w. \t]+(?:,[\w. \t]+)*)|from[ \t]+(\w+)[\w.]*[ \t]+import\b)", re.M)


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_by(target: str) -> set[str]:
    """The distributions (normalised names) of every requirements file `make TARGET` installs, and of the
    files those name with -r."""
    files = [REPO / f for line in _make_n(target, dict(os.environ)).splitlines() if "pip install" in line
             for f in re.findall(r"-r\s+(\S+)", line)]
    out: set[str] = set()
    while files:
        path = files.pop()
        out |= {_dist(name) for name in _requirements(path)}
        files += [path.parent / f for f in re.findall(r"^-r\s+(\S+)", path.read_text(), re.M)]
    return out


def _imported(paths) -> dict[str, set[str]]:
    """{top-level module: the files that import it} over the given Python files."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for m in _IMPORT.finditer(path.read_text()):
            names = [n.split()[0] for n in m.group(1).split(",") if n.strip()] if m.group(1) else [m.group(2)]
            for name in names:
                out.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return out


@pytest.mark.processes  # git ls-files
def test_every_import_is_installed_by_the_make_target_that_runs_it():
    from importlib.metadata import packages_distributions
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    own = {Path(part).stem for p in tracked.split() if p.endswith(".py") for part in Path(p).parts}  # ours
    provides = {module: {_dist(d) for d in dists} for module, dists in packages_distributions().items()}
    missing = []
    for tree, target in _TREES.items():
        files = [REPO / tree] if tree.endswith(".py") else sorted((REPO / tree).rglob("*.py"))
        allowed = _installed_by(target)
        for module, where in _imported(files).items():
            if module in sys.stdlib_module_names or module in own or module in _THE_MACHINES_OWN:
                continue
            if not provides.get(module, set()) & allowed:
                found = f"none of {sorted(provides[module])}" if module in provides else "nothing that provides it"
                missing.append(f"{module} (imported by {', '.join(sorted(where)[:3])}; make {target} installs {found})")
    assert not missing, "imports that no requirements file installed by their make target provides:\n" + \
        "\n".join(missing)
