"""How the suite runs (tests/conftest.py). CI runs every oracle: `make test` installs requirements-dev.txt and
sets ALEXNET_ORACLES_REQUIRED, and there a test that skips for a missing oracle fails instead of passing over
it. No fixture leaves signal handlers behind for the tests after it."""
from __future__ import annotations

import getpass
import os
import signal
import sys
import threading

import pytest

from tests import children


def _judged(reason: str, required: bool, monkeypatch) -> pytest.TestReport:
    """A skipped test's report after conftest's hook, with ALEXNET_ORACLES_REQUIRED set or not."""
    from tests import conftest
    if required:
        monkeypatch.setenv("ALEXNET_ORACLES_REQUIRED", "1")
    else:
        monkeypatch.delenv("ALEXNET_ORACLES_REQUIRED", raising=False)
    report = pytest.TestReport("tests/test_x.py::test_x", ("tests/test_x.py", 1, "test_x"), {}, "skipped",
                               ("tests/test_x.py", 2, f"Skipped: {reason}"), "call")
    hook = conftest.pytest_runtest_makereport(item=None, call=None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(type("Outcome", (), {"get_result": lambda self: report})())
    return report


def test_a_skip_for_a_missing_oracle_fails_where_oracles_are_required(monkeypatch):
    missing = "could not import 'cv2': No module named 'cv2'"
    assert _judged(missing, True, monkeypatch).outcome == "failed"
    assert "an oracle test skipped where the oracles are required" in _judged(missing, True, monkeypatch).longrepr
    assert _judged("this OpenCV has no Caffe importer (dropped in 5.x)", True, monkeypatch).outcome == "failed"
    assert _judged(missing, False, monkeypatch).outcome == "skipped"  # a developer's machine: a skip
    assert _judged("needs CUDA", True, monkeypatch).outcome == "skipped"  # not an oracle


@pytest.mark.skipif(not os.environ.get("ALEXNET_ORACLES_REQUIRED"), reason="only where make test installed them")
def test_the_oracles_are_there():
    import cv2
    import tensorboard  # noqa: F401
    assert cv2.__version__.startswith("4.") and hasattr(cv2.dnn, "readNetFromCaffe")


@pytest.fixture(scope="module")
def handler_left_behind():
    """As a fixture that runs train.py's main in-process does: installs its own SIGTERM handler."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    return signal.SIGTERM


def test_a_fixture_leaves_no_signal_handler_behind(handler_left_behind):
    assert signal.getsignal(handler_left_behind) == signal.SIG_DFL


@pytest.mark.processes
def test_children_get_the_terminals_sighup_when_the_suite_runs_under_nohup():
    """nohup starts the suite with SIGHUP ignored, and exec keeps it ignored: a child sent SIGHUP by a test
    would go on (as it should under nohup) and the test would judge that instead of the tool."""
    import sys

    from tests import conftest
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        conftest.pytest_configure(None)
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, signal.SIG_DFL)  # the suite outlives it
        child = children.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGHUP)))"],
                             cpu_s=60)
        assert child.stdout.strip() == str(int(signal.SIG_DFL))
    finally:
        signal.signal(signal.SIGHUP, saved)


@pytest.mark.processes
def test_a_mutants_session_leaves_no_temporary_folder(tmp_path):
    """mutmut runs one session per mutant and ends it with os._exit (pytest's lock on the session's folder then
    stays, and pytest keeps a locked folder three days): without conftest's clean-up a session whose test
    fails (a killed mutant) keeps its folder. Here as mutmut runs it, and without MUTANT_UNDER_TEST."""
    import getpass
    import subprocess
    import sys

    from tests.conftest import REPO
    (tmp_path / "test_fails.py").write_text("def test_writes_and_fails(tmp_path):\n"
                                            "    (tmp_path / 'x').write_text('x')\n    assert False\n")
    left = {}
    for mutant in ("", "data.reader.x_f__mutmut_1"):
        root = tmp_path / f"root{len(left)}"
        root.mkdir()
        env = {**os.environ, "MUTANT_UNDER_TEST": mutant, "PYTEST_DEBUG_TEMPROOT": str(root)}
        code = subprocess.run([sys.executable, "-c", "import os, pytest; os._exit(pytest.main(['-q', '-p', "
                               "'no:xdist', '-p', 'no:cacheprovider', '-p', 'tests.conftest', 'test_fails.py']))"],
                              cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True).returncode
        assert code == 1
        left[mutant] = sorted(p.name for p in (root / f"pytest-of-{getpass.getuser()}").iterdir()
                              if not p.is_symlink())  # pytest-current: a link to the newest, replaced each time
    assert left == {"": ["pytest-0"], "data.reader.x_f__mutmut_1": []}


FORK_SERVER = """
import os, sys
os.environ["MUTANT_UNDER_TEST"] = ""  # as in mutmut's fork server: no mutant yet
import contextlib, mutmut.__main__, pytest, signal
got = []
def server(signum, frame):  # mutmut's server handles SIGTERM and SIGCHLD (and ignores SIGINT): here, all
    got.append(signum)
faults = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
for sig in signal.valid_signals() - faults:
    with contextlib.suppress(OSError, ValueError):  # those no process may handle
        signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else server)
args = ["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_probe.py"]
assert pytest.main(["--collect-only", *args]) == 0  # the server's warm-up imports the tests once
os.environ["MUTANT_UNDER_TEST"] = "data.reader.x_f__mutmut_1"
pid = os.fork()
if pid == 0:
    os._exit(pytest.main(args))
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("the mutant's session ended:", code)
sys.exit(code)
"""
PROBE_UNDER_A_MUTANT = """
import gc, signal
from hypothesis import Phase, settings
from tests.conftest import examples
AT_IMPORT = examples(25)  # decided in the fork server, before any mutant was set

def test_probe():
    assert AT_IMPORT == 5, AT_IMPORT
    assert gc.get_freeze_count() > 0
    assert Phase.shrink not in settings().phases, settings().phases
    kept = [s for s in signal.valid_signals() if getattr(signal.getsignal(s), "__name__", "") == "server"]
    assert not kept, kept
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
"""


def test_the_suite_draws_every_example():
    """What CI runs is not mutmut's run: a Hypothesis property draws all its examples there."""
    from tests.conftest import examples, in_fast_tier
    assert examples(25) == (5 if in_fast_tier() else 25)


def test_the_fast_tier_runs_a_cover_of_the_named_cases_and_the_suite_all(monkeypatch):
    """In the tier: the fewest named cases, greedily in order, that together set every value any case sets
    (worked by hand below); in the suite, every case in order. Dicts, dataclasses and tuples of them."""
    from dataclasses import dataclass

    from tests.conftest import FAST_TIER, tier_cases

    @dataclass
    class L:
        replicas: int = 1
        mode: str = "fc"

    cases = {"a": {"r": 2}, "b": {"r": 2, "m": "fc"}, "c": {"r": 4, "m": "fc"}, "d": {"r": 4, "m": "columns"},
             "e": {"m": "fc"}}
    monkeypatch.delenv(FAST_TIER, raising=False)
    assert tier_cases(cases) == list("abcde")
    monkeypatch.setenv(FAST_TIER, "1")
    # the values: r=2, r=4, m=fc, m=columns. b (r=2, fc) then d (r=4, columns) take all four: a, c, e not run
    assert tier_cases(cases) == ["b", "d"]
    assert tier_cases({"x": L(), "y": L(replicas=2), "z": L(2, "columns")}) == ["x", "z"]
    # a pair's sides are told apart: the same layouts swapped are another case
    pairs = {"p": (L(), L(2)), "q": (L(2), L()), "s": (L(), L())}
    assert tier_cases(pairs) == ["p", "q"]
    assert tier_cases({"only": {"r": 1}}) == ["only"]


@pytest.mark.processes
def test_a_mutant_forked_from_mutmuts_warm_server_gets_the_mutants_settings(tmp_path):
    """mutmut imports the tests once in a fork server, with no mutant set, and forks each mutant's session
    from it: a Hypothesis property draws a fifth of its examples, does not shrink, and the session's inherited
    heap is frozen (conftest._under_a_mutant), though nothing is imported again in the mutant's process."""
    from tests.conftest import REPO
    pytest.importorskip("mutmut")  # not mutmut.__main__: importing it here would make this session mutmut's
    (tmp_path / "test_probe.py").write_text(PROBE_UNDER_A_MUTANT)
    (tmp_path / "src").mkdir()  # mutmut's command line reads its configuration as it is imported
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["src"]\n')
    run = children.run([sys.executable, "-c", FORK_SERVER], cpu_s=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DEBUG_TEMPROOT": str(tmp_path)})
    ended = run.returncode == 0 and "the mutant's session ended: 0" in run.stdout
    assert ended, run.stdout[-3000:] + run.stderr[-3000:]


PROBE = '''
import os, pytest
LOG = os.environ["ALEXNET_PROBE_LOG"]

def note(what):
    with open(LOG, "a") as f:
        f.write(what + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.fixture(scope="module")
def shared():
    note("made")

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    note("alone")  # no shared fixture: free to go to either worker

@pytest.mark.parametrize("i", range(6))
def test_shares(shared, i):
    note("ran")
'''


def suite_probe(tmp_path, probe: str, ini: str = "") -> dict:
    """A folder whose test_probe.py runs under the suite's own conftest, loaded as a conftest is (after the
    plugins: its pytest_cmdline_main runs before xdist's, which reads the worker count it sets), its
    temporary folders under tmp_path; the environment to run pytest there with (ALEXNET_PROBE_LOG: a file
    the probe may write)."""
    from tests.conftest import REPO
    (tmp_path / "test_probe.py").write_text(probe)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = test_probe.py\n" + ini)
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    return {**os.environ, "ALEXNET_PROBE_LOG": str(tmp_path / "log.txt"), "PYTHONPATH": str(REPO),
            "PYTEST_DEBUG_TEMPROOT": str(tmp_path)}


@pytest.mark.processes
def test_under_xdist_the_tests_of_a_module_fixture_run_on_one_worker_that_makes_it_once(tmp_path):
    """What `make test` runs (`pytest` with no paths: conftest chooses the workers and the grouping), on a
    module whose tests share a module-scoped fixture: one worker runs them all and makes it once."""
    env = suite_probe(tmp_path, PROBE)
    log = tmp_path / "log.txt"
    r = children.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cpu_s=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = log.read_text().split()
    notes = list(zip(lines[::2], lines[1::2]))
    made = [w for what, w in notes if what == "made"]
    assert len(made) == 1, log.read_text()
    assert {w for what, w in notes if what == "ran"} == set(made), log.read_text()


def test_the_rewritten_test_modules_are_cached_once_as_pytest_reads_them(tmp_path, request):
    """The xdist controller writes pytest's rewritten test modules once (tests/rewrite_cache.py): where
    Python may not write bytecode, each worker rewrote them all again."""
    import marshal

    from tests import rewrite_cache
    (tmp_path / "conftest.py").write_text("X = 1\n")
    (tmp_path / "test_m.py").write_text("def f():\n    return 1\n\n\ndef test_m():\n    assert f() == 2\n")
    (tmp_path / "test_broken.py").write_text("def test_(:\n")
    (tmp_path / "helper.py").write_text("Y = 2\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_n.py").write_text("def test_n():\n    assert True\n")
    stand_in = type("Config", (), {"args": [str(tmp_path)], "getini": lambda self, key: ["test_*.py"],
                                   "invocation_params": type("P", (), {"dir": tmp_path})})()
    found = rewrite_cache.modules(stand_in)
    assert found == sorted([tmp_path / "conftest.py", tmp_path / "sub" / "test_n.py", tmp_path / "test_broken.py",
                            tmp_path / "test_m.py"])
    stand_in.args = [f"{tmp_path / 'sub' / 'test_n.py'}::test_n"]
    assert rewrite_cache.modules(stand_in) == [tmp_path / "conftest.py", tmp_path / "sub" / "test_n.py"]

    assert rewrite_cache.written(request.config, found) == [p for p in found if p.name != "test_broken.py"]
    pyc = tmp_path / "__pycache__" / f"test_m.{sys.implementation.cache_tag}-pytest-{pytest.__version__}.pyc"
    namespace: dict = {}
    exec(marshal.loads(pyc.read_bytes()[16:]), namespace)
    with pytest.raises(AssertionError, match=r"where 1 = f\(\)"):  # pytest's explanation: rewritten
        namespace["test_m"]()
    assert rewrite_cache.written(request.config, found) == []  # up to date: read, not written again
    (tmp_path / "test_m.py").write_text("def test_m():\n    assert 1\n")
    assert rewrite_cache.written(request.config, found) == [tmp_path / "test_m.py"]


def test_a_module_whose_parse_fails_beside_another_thread_is_left_to_the_worker(tmp_path, request, monkeypatch):
    """CPython 3.11's AST builder keeps its depth per interpreter (gh-106905): a parse in the rewriting
    thread while another thread builds a tree can fail with SystemError. That module is left for the worker
    to rewrite; the others are written and the thread does not die (which fails the run at its end)."""
    from _pytest.assertion import rewrite

    from tests import rewrite_cache
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text("def test_x():\n    assert True\n")
    real = rewrite._rewrite_test

    def racing(fn, config):
        if fn.name == "test_a.py":
            raise SystemError("AST constructor recursion depth mismatch (before=21, after=108)")
        return real(fn, config)
    monkeypatch.setattr(rewrite, "_rewrite_test", racing)
    paths = [tmp_path / "test_a.py", tmp_path / "test_b.py"]
    assert rewrite_cache.written(request.config, paths) == [tmp_path / "test_b.py"]


def test_only_xdists_controller_writes_the_rewritten_modules(monkeypatch):
    from tests import conftest, rewrite_cache
    started = []

    def start(config) -> threading.Thread:
        started.append(config)
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread
    monkeypatch.setattr(rewrite_cache, "start", start)

    def config(**kw):
        c = type("Config", (), {"option": type("O", (), {"numprocesses": 2})(), "stash": pytest.Stash(), **kw})()
        conftest.pytest_configure(c)
        conftest.pytest_unconfigure(c)
        return c
    controller = config()
    config(workerinput={})
    config(option=type("O", (), {"numprocesses": None})())
    assert started == [controller]


@pytest.mark.parametrize("marks, refused", [((), True), (("processes",), False), (("slow",), False),
                                            (("gpu",), False)])
@pytest.mark.processes  # `true`, to see the guard let it through
def test_a_test_that_starts_a_process_needs_the_mark_in_every_run(marks, refused, monkeypatch):
    """The fast tier's guard holds in make test too (CI), not only under ALEXNET_FAST_TIER."""
    import subprocess

    from tests import conftest
    monkeypatch.delenv("ALEXNET_FAST_TIER", raising=False)
    item = type("Item", (), {"nodeid": "tests/test_x.py::test_x",
                             "get_closest_marker": lambda self, name: name if name in marks else None})()
    hook = conftest.pytest_runtest_call(item)
    next(hook)
    try:
        if refused:
            with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.processes"):
                subprocess.Popen(["true"])
        else:
            assert subprocess.Popen(["true"]).wait() == 0
    finally:
        hook.close()
    assert subprocess.Popen(["true"]).wait() == 0  # put back


TEMP_PROBE = '''
import os, subprocess, sys, tempfile
from pathlib import Path
import pytest

SEEN = []

@pytest.fixture(scope="module")
def made():
    Path(os.environ["TMPDIR"], "fixture-left").write_text("x")  # in the fixture's own folder
    yield

def test_clean():
    SEEN.append(os.environ["TMPDIR"])
    with tempfile.TemporaryDirectory() as made:  # made and removed: nothing left
        Path(made, "x").write_text("x")

def test_leaves_a_file():
    SEEN.append(os.environ["TMPDIR"])
    fd, name = tempfile.mkstemp(prefix="mine-")  # this process: tempfile's cached choice
    os.close(fd)

def test_child_leaves_a_folder():
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp(prefix='child-')"], check=True)

def test_uses_the_fixture(made):
    assert os.environ["TMPDIR"].endswith("-test_uses_the_fixture")  # the test's own again after the fixture's

def test_torchruns_folder_is_allowed():
    Path(os.environ["TMPDIR"], "torchelastic_ab", "none_cd", "attempt_0", "0").mkdir(parents=True)
    Path(os.environ["TMPDIR"], "torchelastic_ab", "none_cd", "attempt_0", "0", "error.json").write_text("{}")

def test_more_than_torchrun_leaves_is_not():
    Path(os.environ["TMPDIR"], "torchelastic_ef", "none_gh").mkdir(parents=True)
    Path(os.environ["TMPDIR"], "torchelastic_ef", "none_gh", "notes.txt").write_text("x")

def test_each_test_had_its_own_and_tempfile_follows():
    assert len(set(SEEN)) == 2 and os.environ["TMPDIR"] not in SEEN
    assert tempfile.gettempdir() == os.environ["TMPDIR"]
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # torch's compile cache: the run's, in no test's folder
    assert cache.name == "torchinductor" and cache.parent == Path(os.environ["TMPDIR"]).parents[1]
'''


@pytest.mark.processes
def test_a_test_or_fixture_that_leaves_its_temporary_directory_unclean_fails(tmp_path):
    """tests/temp_guard.py over a probe: what a test, its child or a module fixture leaves in TMPDIR fails
    it by name; torchrun's own log folder is allowed only as torchrun leaves it."""
    from tests.conftest import REPO
    (tmp_path / "test_probe.py").write_text(TEMP_PROBE)
    r = children.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
                      "-p", "no:randomly", "-p", "tests.temp_guard", "test_probe.py"], cpu_s=60, cwd=tmp_path,
                     env={**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
                          "PYTHONPATH": str(REPO), "PYTEST_DEBUG_TEMPROOT": str(tmp_path),
                          "COLUMNS": "1000"})  # the summary's lines whole
    summary = [line for line in r.stdout.splitlines() if line.startswith(("PASSED ", "ERROR ", "FAILED "))]
    errors = {line.split()[1].split("::")[1]: line for line in summary if line.startswith("ERROR ")}
    # the module fixture is torn down, and checked, after the module's last test
    last = "test_each_test_had_its_own_and_tempfile_follows"
    assert sorted(errors) == sorted([last, "test_child_leaves_a_folder", "test_leaves_a_file",
                                     "test_more_than_torchrun_leaves_is_not"]), r.stdout
    assert "mine-" in errors["test_leaves_a_file"] and "(a file)" in errors["test_leaves_a_file"]
    assert "child-" in errors["test_child_leaves_a_folder"] and "(a folder)" in errors["test_child_leaves_a_folder"]
    assert "torchelastic_ef (a folder)" in errors["test_more_than_torchrun_leaves_is_not"]
    assert "fixture 'made' (module scope) left" in errors[last] and "fixture-left (a file)" in errors[last]
    assert sum(line.startswith("PASSED ") for line in summary) == 7, r.stdout  # the tests themselves pass
    kept = sorted(p.name for p in (tmp_path / f"pytest-of-{getpass.getuser()}" / "pytest-current" / "tmpdir").iterdir())
    assert [name.split("-", 1)[1] for name in kept] == [  # what failed stays to be looked at; the rest is gone
        "test_leaves_a_file", "test_child_leaves_a_folder", "module-made", "test_more_than_torchrun_leaves_is_not"]


END_PROBE = '''
import atexit, gc, os

class Raises:
    def __del__(self):
        raise RuntimeError("raised by a test's garbage")

def test_leaves_garbage_for_the_end():
    assert gc.get_freeze_count() > 0  # what the collection made is frozen (conftest)
    gc.disable()  # collected by pytest's check at the run's end, not by chance during the run
    garbage = Raises()
    garbage.itself = garbage
    del garbage
    KEPT.extend([i] for i in range(1000))  # made by the run, after the collection was frozen
    frozen = gc.get_freeze_count()
    # atexit runs the last registered first: this runs after what conftest registered when the run ended
    atexit.register(lambda: open(os.environ["ALEXNET_PROBE_LOG"], "w").write(
        str(gc.get_freeze_count() >= frozen + 1000)))

KEPT = []
'''


@pytest.mark.processes
def test_a_runs_end_still_reports_its_garbage_and_the_teardown_skips_the_frozen_heap(tmp_path):
    """The end of a run under xdist: pytest's last check (five garbage collections) still finds what a
    test's garbage raises, and only then is the heap frozen, so the interpreter's teardown does not walk it
    again (tests/conftest.py's pytest_unconfigure)."""
    env = suite_probe(tmp_path, END_PROBE)
    log = tmp_path / "log.txt"
    r = children.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cpu_s=120, cwd=tmp_path,
                     env=env)
    assert r.returncode == 0 and "bringing up nodes" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "raised by a test's garbage" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert log.read_text() == "True"


def test_the_cached_parse_trees_are_let_go_before_pytests_last_check(monkeypatch):
    """conftest's pytest_sessionfinish empties tests/imports.py's caches of parse trees (a third of a
    worker's heap), which pytest's check after it would walk five times."""
    import functools
    import types

    from tests import conftest
    stand_in = types.ModuleType("tests.imports")
    stand_in._parsed = functools.cache(lambda path: [path])
    stand_in._parsed_imports = functools.cache(lambda path: [path])
    stand_in._parsed("a.py"), stand_in._parsed_imports("a.py")
    monkeypatch.setitem(sys.modules, "tests.imports", stand_in)
    conftest.pytest_sessionfinish(session=None, exitstatus=0)
    assert stand_in._parsed.cache_info().currsize == stand_in._parsed_imports.cache_info().currsize == 0


def test_a_source_walk_skips_in_mutmuts_copy_of_a_module(tmp_path):
    """In mutants/ each mutant of a function is a function of its own beside the original: a walk there (of
    the processes the tools start, of the pools) saw the mutants' bare starts and failed mutmut's first run
    of every test, so `make mutants` ran none. The walks' parser skips such a file, and only such a file."""
    from tests.imports import parsed
    copy = tmp_path / "launch.py"
    copy.write_text("def f():\n    return 1\n\n\ndef x_f__mutmut_orig():\n    return 1\n\n\n"
                    "def x_f__mutmut_1():\n    return 2\n")
    with pytest.raises(pytest.skip.Exception, match="mutmut's copy"):
        parsed(copy)
    method = tmp_path / "heartbeat.py"
    method.write_text("class Heartbeat:\n    def xǁHeartbeatǁbeat__mutmut_orig(self):\n        pass\n")
    with pytest.raises(pytest.skip.Exception):
        parsed(method)
    plain = tmp_path / "table.py"  # the name in a string or a call (tools/mutmut_table.py) is not a copy
    plain.write_text("NAME = 'x_f__mutmut_orig'\nprint(NAME.endswith('__mutmut_orig'))\n")
    try:
        assert parsed(plain).body
    except pytest.skip.Exception as skipped:  # a skip here would end this test as skipped, not failed
        pytest.fail(f"a plain module was taken for mutmut's copy: {skipped}")


@pytest.mark.processes
def test_a_test_that_first_imports_h5py_starts_no_process(tmp_path):
    """h5py's first import asks platform for the processor, which runs `uname -p` once per process: under
    the guard against unmarked process starts, the test that happened to import h5py first failed (this
    file run alone did, the whole suite did not). A probe run under the suite's conftest."""
    env = suite_probe(tmp_path, "def test_imports_h5py():\n    import h5py  # noqa: F401\n")
    r = children.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
                     cpu_s=120, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


REMOVAL_PROBE = '''
import os, time
from pathlib import Path

def test_the_earlier_runs_folder_goes_while_this_run_is_on():
    earlier = Path(os.environ["ALEXNET_EARLIER_RUN"])
    if earlier.name == "none":
        return
    for _ in range(600):  # a few milliseconds' work: 60 s of waiting is a removal that waits for the end
        if not earlier.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"{earlier} is still there")
'''


@pytest.mark.processes
@pytest.mark.parametrize("workers", ["xdist", "no:xdist"])
def test_an_earlier_runs_folder_is_removed_while_the_next_run_is_on(tmp_path, workers):
    """pytest removes the folders of earlier runs when a run ends (all but tmp_path_retention_count of
    them); conftest does the same while the tests run. The earlier folder goes during the second run, its
    own stays, and a folder whose run still holds its lock is left alone."""
    env = suite_probe(tmp_path, REMOVAL_PROBE, "tmp_path_retention_count = 1\n")
    root = tmp_path / f"pytest-of-{getpass.getuser()}"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", workers]

    def run(earlier: str) -> None:
        r = children.run(command, cpu_s=120, cwd=tmp_path, env={**env, "ALEXNET_EARLIER_RUN": earlier})
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run("none")
    first = sorted(root.glob("pytest-[0-9]*"))
    assert len(first) == 1
    (first[0] / "kept-by-its-run").write_text("")
    live = root / "pytest-0000"  # older by its number, and still locked by a run that is on
    live.mkdir()
    (live / ".lock").write_text("")
    run(str(first[0]))
    assert sorted(p.name for p in root.glob("pytest-[0-9]*")) == ["pytest-0000", f"pytest-{int(first[0].name[7:]) + 1}"]
