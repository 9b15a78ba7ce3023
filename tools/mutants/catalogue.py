"""The catalogue of hand-made mutants: reading it, checking it against a tree, applying one mutant."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

CATALOGUE = Path(__file__).resolve().with_name("catalogue.yaml")
FIELDS = ("id", "file", "old", "new", "bug", "tests")
ID = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class StaleMutant(ValueError):
    """A mutant whose `old` snippet does not occur exactly once in its file."""


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str      # path relative to the repository root
    old: str       # exact snippet of today's code, found exactly once
    new: str       # what the bug puts in its place
    bug: str       # one line: what goes wrong
    tests: tuple[str, ...]  # pytest node ids that must fail with this mutant

    def apply(self, text: str) -> str:
        """`text` with the mutant in place; StaleMutant if `old` is not found exactly once."""
        count = text.count(self.old)
        if count != 1:
            raise StaleMutant(f"{self.id}: the old snippet occurs {count} times in {self.file} (expected once)")
        return text.replace(self.old, self.new)


def load(path: Path = CATALOGUE) -> list[Mutant]:
    """The mutants of `path`, in order; ValueError naming the first malformed entry."""
    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list of mutants")
    mutants, seen = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or sorted(e) != sorted(FIELDS):
            raise ValueError(f"{path}: entry {i} must have exactly the keys {', '.join(FIELDS)}")
        tests = e["tests"]
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) and "::" in t for t in tests)):
            raise ValueError(f"{path}: {e['id']}: tests must be a non-empty list of pytest node ids")
        if not all(isinstance(e[k], str) and e[k] for k in ("id", "file", "old", "new", "bug")):
            raise ValueError(f"{path}: entry {i}: id, file, old, new and bug must be non-empty strings")
        if not ID.match(e["id"]) or e["id"] in seen or e["old"] == e["new"] or "\n" in e["bug"].strip():
            raise ValueError(f"{path}: {e['id']}: a bad or repeated id, no change, or a bug of several lines")
        seen.add(e["id"])
        mutants.append(Mutant(e["id"], e["file"], e["old"], e["new"], e["bug"].strip(), tuple(tests)))
    return mutants


def test_function(node: str) -> tuple[str, str]:
    """(file, function name) of a node id such as tests/test_x.py::test_y[param]."""
    file, _, rest = node.partition("::")
    return file, rest.split("::")[-1].split("[")[0]


def problems(mutants: list[Mutant], root: Path) -> list[str]:
    """What is wrong with the catalogue against the tree at `root`: stale snippets, missing tests."""
    found = []
    for m in mutants:
        source = root / m.file
        if not source.is_file():
            found.append(f"{m.id}: no file {m.file}")
            continue
        try:
            m.apply(source.read_text())
        except StaleMutant as e:
            found.append(str(e))
        for node in m.tests:
            file, name = test_function(node)
            path = root / file
            if not path.is_file() or not re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M):
                found.append(f"{m.id}: no test function {name} in {file}")
    return found
