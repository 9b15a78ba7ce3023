"""Every import of a Python file, read with `ast` (top-level or inside a function; relative ones resolved
against the file's package), for the tests that walk the repository's imports (test_floors, test_session_data).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.conftest import REPO


def _package(path: Path, repo: Path) -> str:
    return ".".join(path.relative_to(repo).with_suffix("").parts[:-1])


def imports(path: Path, repo: Path = REPO) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module name, names imported from it) of every import in `path`, relative ones
    resolved; `import a.b` gives ('a.b', [])."""
    stat = path.stat()  # the file as it is now: a planted module of a test is parsed anew
    return _parsed_imports(path, repo, stat.st_mtime_ns, stat.st_size)


@functools.cache  # the walks of the repository parse each module once, not once per test
def _parsed_imports(path: Path, repo: Path, _mtime_ns: int, _size: int) -> list[tuple[int, str, list[str]]]:
    package = _package(path, repo)
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name, [a.name for a in node.names]))
    return found


def source_files(repo: Path = REPO) -> list[Path]:
    """The Python files of the library, the scripts and the tools (not the tests)."""
    return [repo / "train.py", *(path for top in ("alexnet", "data", "layers", "scripts", "tools")
                                 for path in sorted((repo / top).rglob("*.py")))]


def mentioning(word: str, repo: Path = REPO) -> dict[Path, ast.Module]:
    """The parsed source_files whose text holds `word` (a walk for calls of a module needs no other file:
    parsing them all took a second of the edit loop's tier per walk)."""
    return {path: parsed(path) for path in source_files(repo) if word in path.read_text()}


def parsed(path: Path) -> ast.Module:
    """`path` parsed, once per version of the file (a planted file is parsed anew). In mutmut's copy of a
    module the calling test skips: there every mutant of a function is a function of its own beside the
    original, so a walk of the text judges them all at once and says nothing of the one mutant under test
    (whose tests are those that run it)."""
    stat = path.stat()
    tree = _parsed(path, stat.st_mtime_ns, stat.st_size)
    if _is_mutmut_copy(path, stat.st_mtime_ns, stat.st_size):
        pytest.skip(f"{path} is mutmut's copy of the module (a walk of its text would judge every mutant at once)")
    return tree


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


@functools.cache
def _is_mutmut_copy(path: Path, mtime_ns: int, size: int) -> bool:
    """Whether a module or class defines mutmut's `*__mutmut_orig` (the original beside its mutants)."""
    body = _parsed(path, mtime_ns, size).body
    members = [*body, *(m for c in body if isinstance(c, ast.ClassDef) for m in c.body)]
    return any(isinstance(n, _DEFS) and n.name.endswith("__mutmut_orig") for n in members)


@functools.cache
def _parsed(path: Path, _mtime_ns: int, _size: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))
