"""The order a mutant's tests run in: cheapest first, counting the fixtures each test would make.

mutmut runs a mutant's tests with `-x` (the first failure ends the session), sorted by the time of each
test's call alone. A test that needs a module fixture which trains a model (test_evaluate's `trained`)
calls quickly and so ran first, and every such mutant made that fixture again in its own session, where
a test without it would have killed the mutant in a fraction of the time (py-spy found most running
mutants inside `Trainer.fit` under such a fixture). Here each test costs its call plus the module, class,
package and session fixtures it needs that are not alive at that point of the order (module and class
fixtures end when the order leaves their module or class), and the order is built greedily, cheapest
next. The fixtures' own times are recorded in mutmut's stats run (MUTANT_UNDER_TEST=stats), where every
test runs once, into FIXTURE_SECONDS beside mutmut's own mutmut-stats.json.

A plugin (tests/conftest.py loads it), so that it can run on its own over a probe (tests/test_mutant_order.py);
conftest imports it first, so pytest does not rewrite its asserts (it has none): PYTEST_DONT_REWRITE.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

CALL_SECONDS = "mutmut-stats.json"          # mutmut's: duration_by_test, each test's call alone
FIXTURE_SECONDS = "mutmut-fixture-seconds.json"
SCOPE_NODES = {"session": pytest.Session, "package": pytest.Package, "module": pytest.Module, "class": pytest.Class}


def mutant_under_test() -> str:
    return os.environ.get("MUTANT_UNDER_TEST", "")


def a_mutants_session() -> bool:
    """Whether this pytest session runs one mutant's tests (mutmut sets MUTANT_UNDER_TEST to the mutant's
    name in the process it forks for it; "stats" and "fail" are its own runs on the unmutated code)."""
    return mutant_under_test() not in ("", "stats", "fail")


@dataclass(frozen=True)
class Candidate:
    """What the order needs of a test: its call's seconds, the nodes it sits in, the fixtures it needs."""

    call: float
    chain: frozenset[str]           # the node ids of its session, package, module and class
    fixtures: tuple[str, ...]       # fixture_key()s of its module, class, package and session fixtures


def fixture_key(scope: str, node_id: str, name: str) -> str:
    return f"{scope}\t{node_id}\t{name}"


def cheapest_first(tests: list[Candidate], seconds: dict[str, float]) -> list[int]:
    """The tests' indices in the order to run them: each next one the cheapest to run at that point (its
    call and the fixtures it needs that are not alive then); the collected order between equals."""
    left, order, alive = list(range(len(tests))), [], set()

    def cost(i: int) -> float:
        return tests[i].call + sum(seconds.get(k, 0.0) for k in tests[i].fixtures if k not in alive)
    while left:
        best = min(left, key=cost)  # the first of equal costs
        left.remove(best)
        order.append(best)
        # pytest ends a module's and a class's fixtures when the next test is outside them
        alive = {k for k in alive if k.split("\t")[1] in tests[best].chain} | set(tests[best].fixtures)
    return order


def describe(item: pytest.Item, call: float) -> Candidate:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    keys = []
    for name in item.fixturenames:
        if name in defs and defs[name][-1].scope != "function":
            scope = defs[name][-1].scope
            node = item.session if scope == "session" else item.getparent(SCOPE_NODES[scope])
            keys.append(fixture_key(scope, node.nodeid if node is not None else "", name))
    return Candidate(call, frozenset(n.nodeid for n in item.listchain()[:-1]), tuple(keys))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not a_mutants_session():
        return
    calls = _read(Path(CALL_SECONDS)).get("duration_by_test", {})
    tests = [describe(item, calls.get(item.nodeid, 0.0)) for item in items]
    items[:] = [items[i] for i in cheapest_first(tests, _read(Path(FIXTURE_SECONDS)))]


_SECONDS = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """In mutmut's stats run: each module, class, package and session fixture's own set-up time (the fixtures
    it needs are made before this hook)."""
    if mutant_under_test() != "stats" or fixturedef.scope == "function":
        yield
        return
    began = time.perf_counter()
    yield
    seconds = request.config.stash.setdefault(_SECONDS, {})
    key = fixture_key(fixturedef.scope, request.node.nodeid, fixturedef.argname)
    seconds[key] = max(seconds.get(key, 0.0), time.perf_counter() - began)


def pytest_sessionfinish(session: pytest.Session) -> None:
    seconds = session.config.stash.get(_SECONDS, None)
    if seconds:
        path = Path(FIXTURE_SECONDS)  # beside mutmut's own stats, in its working folder
        merged = {**_read(path), **seconds}
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        temp.write_text(json.dumps(merged, indent=0, sort_keys=True))
        os.replace(temp, path)
