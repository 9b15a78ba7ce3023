"""A stop (SIGTERM, SIGHUP, Ctrl-C) that lands inside a step it must not cut in two waits for that step's end:
a temporary folder's making and removal (a folder left behind otherwise), a worker's start (tests/
test_benchmarks.py). data.procs.stops_between_calls holds them, and cli.temporary_directory is built on it."""
from __future__ import annotations

import ast
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from alexnet import cli
from data.procs import stops_between_calls
from tests.conftest import REPO, in_fast_tier
from tests.imports import mentioning, source_files


def _fill(folder: str) -> None:
    """Something for the removal to walk: files beside a folder of files."""
    (Path(folder) / "inner").mkdir()
    for name in ("a", "b", "inner/c", "inner/d"):
        (Path(folder) / name).write_text(name)


def _signalling_tracer(at: int, seen: list[int]):
    """A trace function counting the lines run outside this test module, raising SIGTERM at the `at`-th
    (0: never). raise_signal, not kill: the signal is this thread's, so it is taken at once."""
    def local(frame, event, arg):
        if event == "line" and frame.f_code.co_filename != __file__:
            seen.append(1)
            if len(seen) == at:
                signal.raise_signal(signal.SIGTERM)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename != __file__ else None
    return tracer


def _made_and_removed(at: int, seen: list[int]) -> None:
    """A temporary folder made, filled and removed under the stops, with the signal at line `at`."""
    sys.settrace(_signalling_tracer(at, seen))
    try:
        with cli.temporary_directory() as folder:
            sys.settrace(None)
            _fill(folder)
            sys.settrace(_signalling_tracer(at, seen))
    finally:
        sys.settrace(None)


def test_a_stop_at_any_line_of_a_temporary_folders_making_or_removal_leaves_nothing(tmp_path, monkeypatch):
    """tempfile's own TemporaryDirectory left its folder when the stop landed between mkdtemp's mkdir and its
    return (the name never given back), or inside the removal at the block's end (cut short, and its finalizer
    already detached): the read benchmark stopped by SIGHUP left `tmpbq83i8he` (make test, 2026-11-29). A
    SIGTERM at each line the making and the removal run (tempfile, shutil, os, contextlib, the helper), in
    turn: each time the block ends in Stopped and nothing is left."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    seen: list[int] = []
    for _ in range(2):  # the first run also runs what is done once (tempfile's name generator, enum's caches)
        seen.clear()
        with cli.stopping_on_signals():
            _made_and_removed(0, seen)
    lines = len(seen)
    assert lines > 50 and list(parent.iterdir()) == []  # mkdtemp's name loop, rmtree's walk: many lines
    for at in range(1, lines + 1, 7 if in_fast_tier() else 1):  # the edit loop's tier: every 7th line
        seen.clear()
        with pytest.raises(cli.Stopped), cli.stopping_on_signals():
            _made_and_removed(at, seen)
        assert len(seen) >= at, f"the run took {len(seen)} lines, the count {lines}: the signal was never sent"
        assert list(parent.iterdir()) == [], f"signal at line {at} of {lines}"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_stop_while_held_reaches_its_handler_at_the_blocks_end_whichever_thread_the_kernel_gave_it():
    """A signal mask held nothing once the process had other threads (torch starts them): the kernel gives a
    signal the main thread blocks to another thread, and Python runs the handler in the main thread anyway.
    A process-directed SIGTERM, with a second thread alive, during the block: not handled there, and raised
    (Stopped) when the block ends; a second one meanwhile is delivered once."""
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)
    other.start()
    went_on = []
    try:
        with pytest.raises(cli.Stopped), cli.stopping_on_signals():
            with stops_between_calls():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 0.2  # long enough for the handler to run, had it been called
                while time.monotonic() < deadline:
                    time.sleep(0.01)
                went_on.append("the block's end")
            went_on.append("after the block")
    finally:
        done.set()
    assert went_on == ["the block's end"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_held_stops_reach_their_own_handlers_and_an_ignored_one_stays_ignored():
    """Each held signal goes to the handler it had (Ctrl-C's KeyboardInterrupt here, a callable there); an
    ignored one (nohup's SIGHUP) is not taken over, so that a process started during the block inherits it
    ignored (exec keeps an ignored signal ignored, and resets a handled one to its default).
    Nothing is held outside the main thread, where Python cannot set handlers."""
    calls = []
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with pytest.raises(KeyboardInterrupt):
            with stops_between_calls():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGINT)
                ignored = signal.getsignal(signal.SIGHUP)  # what a process started now inherits (exec keeps it)
                assert calls == []
        assert calls == [signal.SIGTERM] and ignored == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_held_in_a_thread()))
        thread.start()
        thread.join()
        assert seen == [signal.getsignal(signal.SIGTERM)]
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _held_in_a_thread() -> object:
    with stops_between_calls():
        return signal.getsignal(signal.SIGTERM)


# The calls that make a temporary file or folder a stop could leave behind; cli.temporary_directory is the one
# way the project's code makes one (TemporaryFile is unnamed on Linux: nothing to leave).
_LEAVING = {"TemporaryDirectory", "mkdtemp", "mkstemp", "NamedTemporaryFile"}


def _leaving_calls(path: Path, tree: ast.Module) -> list[str]:
    """`file:line name` of each reference to tempfile's leaving calls in `tree` (`path`), however imported."""
    found, module = [], {"tempfile"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                                         for a in n.names if a.name == "tempfile" and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _LEAVING and \
                isinstance(node.value, ast.Name) and node.value.id in module:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} tempfile.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "tempfile":
            found += [f"{path.relative_to(REPO)}:{node.lineno} from tempfile import {a.name}"
                      for a in node.names if a.name in _LEAVING | {"*"}]
    return found


def test_every_temporary_folder_of_the_project_is_made_with_the_stops_held():
    """The library, the scripts and the tools make temporary folders through cli.temporary_directory only
    (where the stops are held), so one added later is covered. The walk is seen to find: the helper's own."""
    trees, cli_py = mentioning("tempfile"), REPO / "alexnet" / "cli.py"
    assert len(source_files()) > 100 and cli_py in trees
    assert _leaving_calls(cli_py, trees[cli_py]) == [f"alexnet/cli.py:{_line_of_helper()} tempfile.TemporaryDirectory"]
    assert [hit for path, tree in trees.items() if path != cli_py for hit in _leaving_calls(path, tree)] == []


def _line_of_helper() -> int:
    text = (REPO / "alexnet" / "cli.py").read_text().splitlines()
    return next(i for i, line in enumerate(text, 1) if "tempfile.TemporaryDirectory(**kwargs)" in line
                and "folder =" in line)
