"""The order of a mutant's tests (tests/mutant_order.py): cheapest first, counting the fixtures each test
would make at that point, against orders worked out by hand; and over a probe session, the fixtures'
times recorded in mutmut's stats run and read back by a mutant's session."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests import children
from tests.mutant_order import Candidate, cheapest_first, describe, fixture_key

A, B = "tests/test_a.py", "tests/test_b.py"
TRAINED = fixture_key("module", A, "trained")
DATA = fixture_key("session", "", "data")


def case(module: str, call: float, *fixtures: str, cls: str = "") -> Candidate:
    return Candidate(call, frozenset({"", module} | ({f"{module}::{cls}"} if cls else set())), fixtures)


@pytest.mark.parametrize("tests, seconds, expected", [
    # the quick call behind a 10 s module fixture waits for the test without one; then its module-mate
    # needs nothing new
    ([case(A, 0.1, TRAINED), case(B, 0.5), case(A, 0.1, TRAINED)], {TRAINED: 10.0}, [1, 0, 2]),
    # without fixture times (no stats run yet), the calls alone, as mutmut orders them
    ([case(A, 0.3, TRAINED), case(B, 0.5), case(A, 0.1, TRAINED)], {}, [2, 0, 1]),
    # a fixture alive makes its module's next test cheaper than another module's
    ([case(A, 0.0, TRAINED), case(B, 1.5), case(A, 1.0, TRAINED)], {TRAINED: 1.0}, [0, 2, 1]),
    # leaving the module ends its fixture: back in it, the fixture is made (and paid) again
    ([case(A, 0.0, TRAINED), case(B, 1.2), case(A, 1.5, TRAINED), case(B, 1.9)], {TRAINED: 1.0}, [0, 1, 3, 2]),
    # a session fixture made once stays alive across modules
    ([case(A, 0.0, DATA), case(B, 1.0, DATA), case(B, 2.0)], {DATA: 5.0}, [2, 0, 1]),
    ([case(A, 0.0, DATA), case(B, 1.0, DATA), case(B, 5.5)], {DATA: 5.0}, [0, 1, 2]),
    # a class fixture ends when the order leaves the class, though not the module
    ([case(A, 0.0, fixture_key("class", f"{A}::C", "c"), cls="C"), case(A, 0.5),
      case(A, 1.0, fixture_key("class", f"{A}::C", "c"), cls="C")], {fixture_key("class", f"{A}::C", "c"): 1.0},
     [1, 0, 2]),
    # equal costs keep the collected order
    ([case(B, 0.5), case(A, 0.5), case(B, 0.5)], {}, [0, 1, 2]),
])
def test_cheapest_first_by_hand(tests, seconds, expected):
    assert cheapest_first(tests, seconds) == expected


@pytest.fixture(scope="module")
def module_thing() -> int:
    return 1


def test_a_test_is_described_by_the_nodes_it_sits_in_and_its_wider_fixtures(request, module_thing, tmp_path):
    here = "tests/test_mutant_order.py"
    got = describe(request.node, 0.25)
    assert got.call == 0.25 and {"", here} <= got.chain and request.node.nodeid not in got.chain
    assert set(got.fixtures) == {fixture_key("module", here, "module_thing"),
                                 fixture_key("session", "", "tmp_path_factory")}  # not tmp_path, request: a test's own


PROBE = '''
import os, time, pytest
LOG = os.environ["PROBE_LOG"]

@pytest.fixture(scope="module")
def trained():
    time.sleep(0.5)

def test_quick_call_slow_fixture(trained):
    open(LOG, "a").write("slow-fixture\\n")

def test_no_fixture():
    time.sleep(0.05)
    open(LOG, "a").write("no-fixture\\n")
'''


@pytest.mark.processes
def test_the_stats_run_records_the_fixture_and_a_mutant_runs_the_test_without_it_first(tmp_path):
    """The probe's test behind a 0.5 s module fixture calls faster than the other; mutmut's order (calls
    alone) runs it first, this one second."""
    from tests.conftest import REPO
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the root: the probe's node id is probe/test_probe.py
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "test_probe.py").write_text(PROBE)
    log = tmp_path / "log.txt"

    def session(mutant: str) -> list[str]:
        log.write_text("")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PROBE_LOG": str(log), "MUTANT_UNDER_TEST": mutant,
               "PYTEST_DEBUG_TEMPROOT": str(tmp_path)}
        r = children.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:randomly", "-p", "tests.mutant_order", "probe/test_probe.py"], cpu_s=60,
                         cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stdout[-2000:]
        return log.read_text().split()
    assert session("stats") == ["slow-fixture", "no-fixture"]  # collected order
    recorded = json.loads((tmp_path / "mutmut-fixture-seconds.json").read_text())
    key = "module\tprobe/test_probe.py\ttrained"  # written out: the key a mutant's session must find
    assert list(recorded) == [key] and 0.5 <= recorded[key] < 5
    calls = {"probe/test_probe.py::test_quick_call_slow_fixture": 0.001, "probe/test_probe.py::test_no_fixture": 0.05}
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": calls}))
    assert session("data.reader.x_f__mutmut_1") == ["no-fixture", "slow-fixture"]
    (tmp_path / "mutmut-fixture-seconds.json").unlink()  # no record: the calls alone, as mutmut orders them
    assert session("data.reader.x_f__mutmut_1") == ["slow-fixture", "no-fixture"]
