"""The session fixtures' data under mutmut (tests/session_data.py): one build per mutation run for the
mutants outside data/, found as it was left or made again; a mutant of data/ and the normal suite build
their own."""
from __future__ import annotations

import concurrent.futures
import json
import tempfile
import time
import types
from pathlib import Path

from tests import session_data
from tests.conftest import REPO
from tests.imports import imports


def test_the_data_package_imports_nothing_of_the_code_it_is_tested_with():
    """What makes one build right for every mutant outside data/: data/'s code reads none of the project's
    other packages (a mutant there cannot change what the fixtures write)."""
    ours = {p.name for p in REPO.iterdir() if p.is_dir() and any(p.glob("*.py"))} | {"train"}
    others = ours - {session_data.BUILT_BY}
    assert {"alexnet", "layers", "tests", "scripts", "tools"} <= others
    found = []
    for path in sorted((REPO / session_data.BUILT_BY).rglob("*.py")):
        found += [f"{path.relative_to(REPO)}:{line}: {name}" for line, name, _ in imports(path)
                  if name.split(".")[0] in others]
    assert not found, found


def test_which_mutants_build_their_own():
    assert session_data.mutant_builds_it("data.reader.x_read__mutmut_3")
    assert session_data.mutant_builds_it("data.preprocess.xǁOptionsǁ__init____mutmut_1")
    assert not session_data.mutant_builds_it("alexnet.replica.x_step__mutmut_1")
    assert not session_data.mutant_builds_it("layers.collectives.x_gather__mutmut_2")
    assert not session_data.mutant_builds_it("database.x_f__mutmut_1")  # a package's name, not a prefix


class _Builds:
    """A fixture's build: writes a file, counts its calls, and returns a value with a tuple in it."""

    def __init__(self, pause: float = 0.0):
        self.calls, self.pause = 0, pause

    def __call__(self, out: Path) -> dict:
        self.calls += 1
        time.sleep(self.pause)
        (out / "part").mkdir()
        (out / "part" / "x.bin").write_bytes(b"made %d" % self.calls)
        return {"n": 3, "shape": (2, 2)}


def _code(tmp_path: Path) -> Path:
    """The code folder the key is made of (made once, before any thread uses it)."""
    code = tmp_path / "code"
    if not code.exists():
        code.mkdir()
        (code / "m.py").write_text("x = 1\n")
    return code


def _mktemp_in(folder: Path):
    """As tmp_path_factory.mktemp: a new folder under `folder` each call, from any thread."""
    return lambda name: Path(tempfile.mkdtemp(prefix=name, dir=folder))


def _use(builds, tmp_path, *, shared: bool, params: str = "p", change=None):
    """One session's use of the fixture: its folder and value (and `change`, what the session does to it)."""
    code = _code(tmp_path)
    root, value = session_data.built("f", params, _mktemp_in(tmp_path), builds, shared=shared, cache=tmp_path / "cache",
                                     code=code)
    if change:
        change(root)
    return root, value


def test_a_mutation_run_builds_once_and_its_sessions_find_it(tmp_path):
    builds = _Builds()
    first, value = _use(builds, tmp_path, shared=True)
    again, same = _use(builds, tmp_path, shared=True)
    assert builds.calls == 1 and first == again and (first / "part" / "x.bin").read_bytes() == b"made 1"
    assert value == same == {"n": 3, "shape": [2, 2]}  # every session gets what JSON gives back
    _use(builds, tmp_path, shared=True, params="q")  # other parameters: another build
    assert builds.calls == 2


def test_the_suite_and_a_mutant_of_data_build_their_own(tmp_path):
    builds = _Builds()
    one, value = _use(builds, tmp_path, shared=False)
    two, _ = _use(builds, tmp_path, shared=False)
    assert builds.calls == 2 and one != two and not (tmp_path / "cache").exists()
    assert value == {"n": 3, "shape": (2, 2)}


def test_a_build_changed_by_a_session_or_after_it_is_made_again(tmp_path):
    builds = _Builds()
    root, _ = _use(builds, tmp_path, shared=True,
                   change=lambda r: (r / "part" / "x.bin").write_bytes(b"changed by a mutant"))
    _use(builds, tmp_path, shared=True)
    assert builds.calls == 2 and (root / "part" / "x.bin").read_bytes() == b"made 2"
    (root / "part" / "left.txt").write_text("a stray file")  # changed between sessions
    _use(builds, tmp_path, shared=True)
    assert builds.calls == 3 and not (root / "part" / "left.txt").exists()
    (root / "part" / "x.bin").unlink()  # a file gone
    _use(builds, tmp_path, shared=True)
    assert builds.calls == 4


def test_the_code_that_writes_it_changed_makes_it_again(tmp_path):
    builds = _Builds()
    _use(builds, tmp_path, shared=True)
    (tmp_path / "code" / "m.py").write_text("x = 2\n")
    _use(builds, tmp_path, shared=True)
    assert builds.calls == 2


def test_sessions_beside_each_other_build_once(tmp_path):
    builds = _Builds(pause=0.3)
    _code(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # a thread's exception reaches the test
        roots = list(pool.map(lambda _: _use(builds, tmp_path, shared=True)[0], range(3)))
    assert builds.calls == 1 and len(roots) == 3 and len(set(roots)) == 1


def test_a_half_made_build_is_made_again(tmp_path):
    """A session killed while it built (a mutant's time limit) leaves a folder and no record."""
    builds = _Builds()
    root, _ = _use(builds, tmp_path, shared=True)
    next(iter(tmp_path.glob("cache/*.json"))).unlink()
    _use(builds, tmp_path, shared=True)
    assert builds.calls == 2 and (root / "part" / "x.bin").read_bytes() == b"made 2"


def test_the_fixtures_values_come_back_from_json_as_they_were(synth, prep):
    """A shared build hands every session its value as JSON gives it back: the fixtures' must survive that."""
    for _, value in (synth, prep):
        assert json.loads(json.dumps(value)) == value


def test_conftests_fixtures_share_only_in_a_mutants_session_outside_data(tmp_path, monkeypatch):
    """conftest's wiring: the suite and mutmut's own runs build their own, a mutant outside data/ shares
    (the second session finds the first's build), a mutant of data/ builds its own."""
    from tests import conftest
    monkeypatch.setattr(conftest, "REPO", tmp_path)
    (tmp_path / session_data.BUILT_BY).mkdir()
    (tmp_path / session_data.BUILT_BY / "m.py").write_text("x = 1\n")
    builds = _Builds()
    factory = types.SimpleNamespace(mktemp=_mktemp_in(tmp_path))
    for mutant, shares in [("", False), ("stats", False), ("alexnet.replica.x_step__mutmut_1", True),
                           ("layers.collectives.x_f__mutmut_2", True), ("data.reader.x_read__mutmut_3", False)]:
        monkeypatch.setenv("MUTANT_UNDER_TEST", mutant)
        before = builds.calls
        root, _ = conftest._session_data("f", {"a": 1}, factory, builds)
        assert (root.parent == tmp_path / ".session-data") == shares, mutant
        assert builds.calls == before + (0 if shares and mutant.startswith("layers") else 1), mutant
