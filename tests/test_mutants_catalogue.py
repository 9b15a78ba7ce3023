"""tools/mutants/catalogue.yaml stays in step with the tree: well-formed, every `old` snippet found exactly
once, every named test defined (no replay here: tools/mutants.py does that)."""
from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
from mutants import catalogue  # noqa: E402


def test_the_catalogue_matches_the_tree():
    mutants = catalogue.load()
    assert len(mutants) >= 14
    assert catalogue.problems(mutants, REPO) == []


def test_a_stale_snippet_or_a_missing_test_is_reported(tmp_path):
    m = catalogue.load()[0]
    (tmp_path / "tests").mkdir()
    (tmp_path / m.file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / m.file).write_text(f"{m.old}\n{m.old}\n")  # twice: ambiguous
    found = catalogue.problems([m], tmp_path)
    assert found[0] == f"{m.id}: the old snippet occurs 2 times in {m.file} (expected once)"
    file, name = catalogue.test_function(m.tests[0])
    assert found[1] == f"{m.id}: no test function {name} in {file}"
    (tmp_path / m.file).write_text(f"x = 1\n{m.old}\n")
    (tmp_path / file).write_text(f"def {name}():\n    pass\n")
    assert catalogue.problems([m], tmp_path) == []
    assert m.apply((tmp_path / m.file).read_text()) == f"x = 1\n{m.new}\n"


@pytest.mark.parametrize("edit, message", [
    (lambda e: e.pop("tests"), "must have exactly the keys"),
    (lambda e: e.__setitem__("tests", ["tests/test_x.py"]), "tests must be a non-empty list of pytest node ids"),
    (lambda e: e.__setitem__("new", e["old"]), "no change"),
    (lambda e: e.__setitem__("id", "Bad Id"), "a bad or repeated id"),
])
def test_a_malformed_entry_is_refused(tmp_path, edit, message):
    import yaml
    entry = {"id": "m", "file": "a.py", "old": "x + 1", "new": "x - 1", "bug": "sign", "tests": ["t.py::test_a"]}
    edit(entry)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump([entry]))
    with pytest.raises(ValueError, match=message):
        catalogue.load(path)
