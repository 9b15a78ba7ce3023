"""The house's floors: data/ and layers/ at the bottom, alexnet/ above them, train.py and scripts/ on top.

Every import (top-level or inside a function) of every library module is read with `ast`; an arrow
pointing up a floor fails the test with the file and the import.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

FLOORS = {"data": 0, "layers": 0, "alexnet": 1, "scripts": 2, "train": 2}
# Within alexnet/, the modules below the training loop: none of them may import the trainer.
BELOW_TRAINER = ("alexnet/evaluation.py", "alexnet/precision.py", "alexnet/checkpoint.py", "alexnet/models.py",
                 "alexnet/config.py", "alexnet/weights", "alexnet/figures")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def _library_files() -> list[Path]:
    return [p for top in ("data", "layers", "alexnet") for p in sorted((REPO / top).rglob("*.py"))]


def floor_violations(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        here = FLOORS[path.relative_to(REPO).parts[0]]
        for line, name in _imports(path):
            top = name.split(".")[0]
            if top in FLOORS and FLOORS[top] > here:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return bad


def test_no_library_module_imports_a_floor_above_it():
    files = _library_files()
    assert len(files) > 40  # the walk found the library
    assert floor_violations(files) == []


def test_the_check_sees_an_upward_import():
    # A planted data/ module importing alexnet must be reported (the check can fail).
    planted = REPO / "data" / "_planted_upward_import.py"
    planted.write_text("def f():\n    from alexnet.trainer import Trainer\n    return Trainer\n")
    try:
        assert floor_violations([planted]) == ["data/_planted_upward_import.py:2 imports alexnet.trainer"]
    finally:
        planted.unlink()


def test_modules_below_the_training_loop_do_not_import_it():
    bad = []
    for path in _library_files():
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(BELOW_TRAINER):
            bad += [f"{rel}:{line}" for line, name in _imports(path) if name == "alexnet.trainer"]
    assert bad == []
