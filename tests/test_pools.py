"""Every module that makes a concurrent.futures pool runs its waits under data.procs.stops_between_calls,
found by walking the source (ast) of data/, layers/, alexnet/, scripts/, tools/ and train.py: a pool added
later is checked without an edit here (an exemption says why). Ctrl-C raised inside concurrent.futures' own
code (cf.wait and as_completed take the futures' locks one by one) once left a lock held and hung
preprocess's shutdown; a pool whose shutdown runs the queued work kept a benchmark training after Ctrl-C.
What the helper does in each pool is tested where it is used (tests/test_preprocess.py, tests/test_upgrade.py,
tests/test_benchmarks.py) and for any handler below; data.procs.in_threads (the thread pool of the benchmark
grid, tools/faults.py and tools/mutants.py) below."""
from __future__ import annotations

import ast
import contextlib
import os
import signal
import threading
from pathlib import Path

import pytest

from data.procs import in_threads, stops_between_calls
from tests.conftest import REPO
from tests.imports import parsed

# Modules that make a pool and need not, with the reason.
EXEMPT = {
    "data/reader.py": "makes the batch reader's pool; its waits are data/fastread.py's, under stops_between_calls",
    "scripts/bench/read.py": "a benchmark's memory bound: pool.map waits on one future at a time",
}


def pools_without_stops(root: Path = REPO) -> list[str]:
    """Every module that makes a *PoolExecutor and never enters stops_between_calls."""
    files = [root / "train.py", *(p for d in ("data", "layers", "alexnet", "scripts", "tools")
                                  for p in sorted((root / d).rglob("*.py")))]
    bad = []
    for path in (f for f in files if f.is_file()):
        called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                  for n in ast.walk(parsed(path)) if isinstance(n, ast.Call)}
        name = path.relative_to(root).as_posix()
        if any(c.endswith("PoolExecutor") for c in called) and "stops_between_calls" not in called \
                and name not in EXEMPT:
            bad.append(name)
    return bad


def test_every_pool_runs_under_stops_between_calls():
    bad = pools_without_stops()
    assert not bad, "process or thread pools without data.procs.stops_between_calls:\n" + "\n".join(bad)


def test_the_walk_finds_the_pools_and_sees_one_without_it(tmp_path):
    """An independent look: a module with one pool under the helper and one without."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "m.py").write_text(
        "import concurrent.futures as cf\nfrom data.procs import stops_between_calls\n"
        "def good():\n    with stops_between_calls() as check, cf.ProcessPoolExecutor(2) as pool:\n        pass\n"
        "def bad():\n    with cf.ThreadPoolExecutor(2) as pool:\n        pass\n")
    assert pools_without_stops(tmp_path) == []
    (tmp_path / "data" / "n.py").write_text("import concurrent.futures as cf\ndef bad():\n"
                                            "    with cf.ThreadPoolExecutor(2) as pool:\n        pass\n")
    assert pools_without_stops(tmp_path) == ["data/n.py"]
    # the real code holds the pools this check exists for
    source = {p: (REPO / p).read_text() for p in ("data/preprocess.py", "data/upgrade.py", "data/fastread.py")}
    assert all("stops_between_calls()" in text for text in source.values())
    threads = {p: (REPO / p).read_text() for p in ("scripts/bench/large_batch.py", "tools/faults.py",
                                                   "tools/mutants/replay.py")}
    assert all("in_threads(" in text and "PoolExecutor" not in text for text in threads.values())


class Raised(Exception):
    """What the test's SIGTERM handler raises (as cli.stopping_on_signals' raises Stopped)."""


@contextlib.contextmanager
def raising_sigterm():
    """SIGTERM's handler raises Raised (as cli.stopping_on_signals' does Stopped), in the main thread only; not
    a fixture: conftest hands back the handlers a fixture's setup installed."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")

    def handler(signum, frame):
        raise Raised(signum)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_signal_inside_the_block_is_handled_after_it_by_its_own_handler():
    """Any Python handler, not only Ctrl-C's: cli.stopping_on_signals' Stopped is raised by check(), after the
    call it landed in; the handlers are handed back."""
    with raising_sigterm() as handler:
        with pytest.raises(Raised):
            with stops_between_calls() as check:
                signal.raise_signal(signal.SIGTERM)  # noted, not raised here
                after = True
                check()
        assert after and signal.getsignal(signal.SIGTERM) is handler
        with pytest.raises(Raised):  # noted in the block's last moment: handled on leaving
            with stops_between_calls():
                signal.raise_signal(signal.SIGTERM)


def _main_thread_only() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")


def test_in_threads_gives_the_results_in_order_and_each_once_as_it_finishes():
    seen, last_done = [], threading.Event()

    def square(x: int) -> int:
        if x == 0:  # the first item ends last: it waits for the others' done()
            assert last_done.wait(30)
        return x * x

    def done(i: int, r: int) -> None:
        seen.append((i, r))
        if i == 4:
            last_done.set()
    assert in_threads(square, [0, 1, 2, 3, 4], 2, done) == [0, 1, 4, 9, 16]
    assert seen == [(1, 1), (2, 4), (3, 9), (4, 16), (0, 0)]


def test_a_ctrl_c_in_in_threads_starts_no_queued_item_and_hands_the_handler_back():
    """Ctrl-C while the first item runs: KeyboardInterrupt after the pool's call, the running item finishes,
    no other item starts (before, leaving the pool ran every queued one), Python's own handler is back."""
    _main_thread_only()
    started, ended = [], []

    def work(x: int) -> int:
        started.append(x)
        if x == 0:  # from the pool's thread: the main thread, in the pool's wait, gets it
            os.kill(os.getpid(), signal.SIGINT)
        ended.append(x)
        return x
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        in_threads(work, list(range(8)), 1)
    assert started == ended == [0] and signal.getsignal(signal.SIGINT) is handler


def test_a_failing_item_in_in_threads_is_raised_and_starts_no_other():
    started = []

    def work(x: int) -> int:
        started.append(x)
        if x == 1:
            raise ValueError("item 1")
        return x
    with pytest.raises(ValueError, match="item 1"):
        in_threads(work, list(range(8)), 1)
    assert started == [0, 1]


def test_a_block_inside_another_runs_the_real_handler_between_its_own_calls():
    """preprocess's shard pass (a thread pool) runs inside its process pool's block: a Ctrl-C there must stop
    the pass between the inner pool's calls, not be noted for the outer block's next call, after the pass."""
    with raising_sigterm() as handler:
        with stops_between_calls() as outer:
            with stops_between_calls() as inner:
                signal.raise_signal(signal.SIGTERM)
                with pytest.raises(Raised):
                    inner()
            outer()  # nothing left for the outer block: the signal was handled once
        assert signal.getsignal(signal.SIGTERM) is handler


def test_a_ctrl_c_in_in_threads_sets_stop_before_the_running_items_are_waited_for():
    """The running items see `stop` (a shard pass gives up at its next member) rather than finishing."""
    _main_thread_only()
    stop, saw = threading.Event(), []

    def work(x: int) -> int:
        os.kill(os.getpid(), signal.SIGINT)
        saw.append(stop.wait(30))  # a long pass, unless asked to give up
        return x
    with pytest.raises(KeyboardInterrupt):
        in_threads(work, [0], 1, stop=stop)
    assert saw == [True]


def test_run_all_raises_a_stop_between_the_pools_calls_and_cancels_what_did_not_start():
    """preprocess's and upgrade_data's process pools (data.procs.run_all): a Ctrl-C during the submits stops
    them at the next one; a Ctrl-C while a call runs is raised after the wait, and the calls still queued
    never start (the running one is let go)."""
    import concurrent.futures as cf

    from data.procs import run_all
    _main_thread_only()
    submitted, started, gate, all_in = [], [], threading.Event(), threading.Event()

    class Pool(cf.ThreadPoolExecutor):
        def submit(self, fn, *args):
            submitted.append(args)
            if len(submitted) == 1 and fn is noop:
                os.kill(os.getpid(), signal.SIGINT)  # lands during the first submit
            if fn is work and args == (5,):
                all_in.set()
            return super().submit(fn, *args)

    def noop(i: int) -> int:
        return i

    def work(i: int) -> int:
        started.append(i)
        if i == 0:  # once every call is in: the Ctrl-C lands while run_all waits
            assert all_in.wait(30)
            os.kill(os.getpid(), signal.SIGINT)
        else:
            gate.wait(5)  # the call the pool took next: it runs on, the others are cancelled
        return i
    try:
        with Pool(1) as pool, stops_between_calls() as check:
            with pytest.raises(KeyboardInterrupt):
                run_all(pool, [(noop, (i,)) for i in range(6)], check)
        assert len(submitted) == 1
        with Pool(1) as pool, stops_between_calls() as check:
            with pytest.raises(KeyboardInterrupt):
                run_all(pool, [(work, (i,)) for i in range(6)], check)
            gate.set()
        assert started in ([0], [0, 1]) and len(submitted) == 1 + 6
    finally:
        gate.set()


def test_run_all_reports_each_wait_and_returns_the_futures_in_order():
    """`waited(finished, left)` after each wait (preprocess's and upgrade_data's progress bars): every call
    counted once, `left` what is still pending then; the futures in the calls' order."""
    import concurrent.futures as cf

    from data.procs import run_all
    seen = []
    with cf.ThreadPoolExecutor(2) as pool:
        futures = run_all(pool, [(pow, (i, 2)) for i in range(5)], lambda: None,
                          lambda finished, left: seen.append((len(finished), left)))
    assert [f.result() for f in futures] == [0, 1, 4, 9, 16]
    done = 0
    for finished, left in seen:
        done += finished
        assert left == 5 - done
    assert done == 5
