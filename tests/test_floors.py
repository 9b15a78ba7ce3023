"""The house's floors: data/ and layers/ at the bottom, alexnet/ above them, train.py, scripts/ and tools/ on
top; and no import circle anywhere.

Every import (top-level or inside a function) of every module of data/, layers/, alexnet/, scripts/, tools/
and train.py is read with `ast` and resolved to the file it loads: relative imports against the module's
package, and the spellings that the entry scripts' `sys.path` tweaks make work (`gpucheck.report` and
`scripts.gpucheck.report` are the same file; `mutants.catalogue` is tools/mutants/catalogue.py). An arrow
pointing up a floor (or from a user script to a developer tool) fails with the file and the import; a
circle (modules that import each other, directly or around a loop, or a module importing itself) fails
with the circle's modules and the imports that close it.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.imports import imports as _imports

FLOORS = {"data": 0, "layers": 0, "alexnet": 1, "scripts": 2, "tools": 2, "train": 2}
# Users' scripts do not depend on developer tools (tools may use scripts, both may use the library).
FORBIDDEN = {("scripts", "tools")}
# Where a name is looked up: the repository, then the folders the entry scripts put on sys.path.
ROOTS = ("", "scripts", "tools")
# Within alexnet/, the modules below the training loop: none of them may import the trainer.
BELOW_TRAINER = ("alexnet/evaluation.py", "alexnet/precision.py", "alexnet/checkpoint.py", "alexnet/models.py",
                 "alexnet/config.py", "alexnet/weights", "alexnet/figures")


@functools.cache  # within one walk (each walk clears it: a test plants files between walks)
def _module_file(name: str, repo: Path) -> Path | None:
    """The file that `import name` loads (a package's __init__.py before a same-named module, as Python
    finds them), looked up in each of ROOTS; None for anything outside the repository."""
    if not name:
        return None
    for root in ROOTS:
        base = repo.joinpath(root, *name.split("."))
        for candidate in (base / "__init__.py", base.with_name(base.name + ".py")):
            if candidate.is_file():
                return candidate
    return None


def _targets(name: str, names: list[str], repo: Path) -> list[Path]:
    """The files an import loads: `from pkg import mod` is the module pkg/mod.py, `from mod import f` is mod."""
    found = [f for n in names if n != "*" and (f := _module_file(f"{name}.{n}", repo)) is not None]
    if len(found) < len([n for n in names if n != "*"]) or not names:
        whole = _module_file(name, repo)
        found += [whole] if whole is not None else []
    return found


def _rel(path: Path, repo: Path) -> str:
    return path.relative_to(repo).as_posix()


def _library_files(repo: Path = REPO) -> list[Path]:
    return [p for top in ("data", "layers", "alexnet") for p in sorted((repo / top).rglob("*.py"))]


def _all_files(repo: Path = REPO) -> list[Path]:
    """The library, the user scripts, the developer tools and train.py."""
    files = [*_library_files(repo), *(p for top in ("scripts", "tools") for p in sorted((repo / top).rglob("*.py")))]
    return files + [repo / "train.py"] if (repo / "train.py").is_file() else files


def _floor_name(path: Path, repo: Path) -> str:
    return path.relative_to(repo).with_suffix("").parts[0]


def floor_violations(files: list[Path], repo: Path = REPO) -> list[str]:
    _module_file.cache_clear()
    bad = []
    for path in files:
        here = _floor_name(path, repo)
        for line, name, names in _imports(path, repo):
            tops = {_floor_name(t, repo) for t in _targets(name, names, repo)} or {name.split(".")[0]}
            if any(top in FLOORS and (FLOORS[top] > FLOORS[here] or (here, top) in FORBIDDEN) for top in tops):
                bad.append(f"{_rel(path, repo)}:{line} imports {name}")
    return bad


def import_graph(files: list[Path], repo: Path = REPO) -> dict[str, dict[str, int]]:
    """file -> {imported file: line of the first such import}, over `files` only."""
    _module_file.cache_clear()
    known = {_rel(p, repo) for p in files}
    graph: dict[str, dict[str, int]] = {}
    for path in files:
        edges = graph.setdefault(_rel(path, repo), {})
        for line, name, names in _imports(path, repo):
            for target in _targets(name, names, repo):
                if _rel(target, repo) in known:
                    edges.setdefault(_rel(target, repo), line)
    return graph


def _reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += graph.get(node, {})
    return seen


def import_cycles(files: list[Path], repo: Path = REPO) -> list[str]:
    """Each strongly connected component of more than one module (or a module importing itself), named
    with the imports inside it."""
    graph = import_graph(files, repo)
    reach = {node: _reachable(graph, node) for node in graph}
    cycles, done = [], set()
    for node in sorted(graph):
        if node in done or node not in reach[node]:
            continue
        component = sorted({node} | {m for m in reach[node] if node in reach[m]})
        done.update(component)
        inside = [f"{a}:{graph[a][b]} imports {b}" for a in component for b in sorted(graph[a]) if b in component]
        cycles.append(f"circle of {', '.join(component)} ({'; '.join(inside)})")
    return cycles


@pytest.fixture(scope="module")
def repo_files() -> list[Path]:
    """The repository's files: a module fixture, so that both walks run on one xdist worker, the second on
    the parse trees the first cached (tests/imports.py)."""
    return _all_files()


def test_no_module_imports_a_floor_above_it(repo_files):
    files = repo_files
    assert len(_library_files()) > 40 and len(files) > 100  # the walk found the library, scripts and tools
    bad = floor_violations(files)
    assert not bad, "imports up a floor (or from a script to a tool):\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import():
    # A planted data/ module importing alexnet must be reported (the check can fail).
    planted = REPO / "data" / "_planted_upward_import.py"
    planted.write_text("def f():\n    from alexnet.trainer import Trainer\n    return Trainer\n")
    try:
        assert floor_violations([planted]) == ["data/_planted_upward_import.py:2 imports alexnet.trainer"]
    finally:
        planted.unlink()


def test_the_check_sees_a_script_importing_a_tool_and_the_library_importing_a_script(tmp_path):
    for rel, text in {"scripts/user.py": "import tools.faults\nfrom faultcheck import core\n",
                      "scripts/gpucheck/__init__.py": "", "scripts/gpucheck/step.py": "",
                      "tools/faults.py": "import gpucheck.step\n", "tools/faultcheck/__init__.py": "",
                      "tools/faultcheck/core.py": "from data import reader\n", "data/__init__.py": "",
                      "data/reader.py": "def f():\n    from gpucheck import step\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert floor_violations(_all_files(tmp_path), tmp_path) == [
        "data/reader.py:2 imports gpucheck", "scripts/user.py:1 imports tools.faults",
        "scripts/user.py:2 imports faultcheck"]


def test_no_import_circle(repo_files):
    graph = import_graph(repo_files)
    # The resolver finds imports in every spelling (else an empty graph would pass): relative, through
    # scripts/ and tools/ on sys.path, `from package import module`.
    assert graph["scripts/gpu_check.py"].keys() >= {"scripts/gpucheck/cli.py"}
    assert graph["scripts/benchmark.py"].keys() >= {"scripts/bench/common.py", "scripts/bench/train.py"}
    assert graph["tools/mutants.py"].keys() >= {"tools/mutants/catalogue.py", "tools/mutants/replay.py"}
    assert graph["tools/faults.py"].keys() >= {"tools/faultcheck/report.py"}
    assert graph["data/sources.py"].keys() >= {"data/layouts.py", "data/archives.py"}
    assert sum(map(len, graph.values())) > 300
    cycles = import_cycles(repo_files)
    assert not cycles, "import circles (move the shared piece down a module):\n" + "\n".join(cycles)


def test_the_check_sees_a_circle(tmp_path):
    # Planted circles: a pair inside data/ (one import inside a function), a pair of scripts/ modules
    # spelling each other both ways, a self-import; and a chain that is no circle.
    for rel, text in {"data/__init__.py": "", "data/a.py": "from . import b\n",
                      "data/b.py": "def f():\n    from .a import g\n    return g\n",
                      "data/c.py": "from data.a import g\n",
                      "scripts/gpucheck/__init__.py": "", "scripts/gpucheck/runner.py": "import gpucheck.report\n",
                      "scripts/gpucheck/report.py": "from scripts.gpucheck.runner import Budget\n",
                      "tools/mutants.py": "from mutants import catalogue\n", "tools/mutants/__init__.py": "",
                      "tools/mutants/catalogue.py": "", "tools/claims.py": "import tools.claims\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert import_cycles(_all_files(tmp_path), tmp_path) == [
        "circle of data/a.py, data/b.py (data/a.py:1 imports data/b.py; data/b.py:2 imports data/a.py)",
        "circle of scripts/gpucheck/report.py, scripts/gpucheck/runner.py (scripts/gpucheck/report.py:1 imports "
        "scripts/gpucheck/runner.py; scripts/gpucheck/runner.py:1 imports scripts/gpucheck/report.py)",
        "circle of tools/claims.py (tools/claims.py:1 imports tools/claims.py)"]


def test_modules_below_the_training_loop_do_not_import_it():
    bad = []
    for path in _library_files():
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(BELOW_TRAINER):
            bad += [f"{rel}:{line}" for line, name, _ in _imports(path) if name == "alexnet.trainer"]
    assert bad == []
