"""A child told to end with the process that started it (data.procs.watched_env, follow_parent) ends when that
process is gone, even one gone before the child asked (it asks after its imports, seconds after its start), and
only then: a pid that names a living process other than its parent (a grandparent's, passed on by torchrun's
agent) leaves it running."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.imports import mentioning

# P (this script) forks C and then, by `case`, exits or waits for C. C waits for "go" on stdin (the test's pipe,
# inherited), asks to follow the pid the case names, and says "alive" on stdout if it still lives.
FAMILY = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from data import procs
case, grandparent = sys.argv[1], int(sys.argv[3])
parent = os.getpid()
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdin.readline()
    if case in ("reaped", "zombie"):
        while os.getppid() == parent:  # adopted once P has exited
            time.sleep(0.01)
    os.environ[procs.ENV_PARENT] = str(grandparent if case == "grandparent" else parent)
    procs.follow_parent()
    assert procs.ENV_PARENT not in os.environ
    time.sleep(0.3)  # a signal on its way lands
    print("alive", flush=True)
    os._exit(0)
if case in ("reaped", "zombie"):
    os._exit(0)
os.wait()
"""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:][:1]


@pytest.mark.processes
@pytest.mark.parametrize("case, lives", [("reaped", False), ("zombie", False), ("grandparent", True),
                                         ("parent", True)])
def test_a_child_follows_its_parent_only_once_that_parent_is_gone(case, lives):
    """reaped: P exited and was waited for before C asked; zombie: P exited, not yet waited for (a dead
    process: it only waits for its status to be read); grandparent: the pid is this test's, alive, not C's
    parent; parent: P, alive."""
    p = subprocess.Popen([sys.executable, "-c", FAMILY, case, str(REPO), str(os.getpid())], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if case == "reaped":
        p.wait()
    elif case == "zombie":
        deadline = time.monotonic() + 30
        while _state(p.pid) != "Z":  # exited, and not waited for
            assert time.monotonic() < deadline
            time.sleep(0.01)
    p.stdin.write("go\n")
    p.stdin.close()
    out = p.stdout.read()  # until C and P have both closed it: C has ended
    p.wait()
    assert out == ("alive\n" if lives else ""), case


def _outer_functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions of a module or class not inside another function (each walk of one covers its nested)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append(node)
        elif isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With)):
            found += _outer_functions(node)
    return found


def _watching() -> set[str]:
    """What gives a child the starter's pid: procs.watched_env, and every function that returns a call of one
    of these or a dict built on one (gpu_check's clean_env and step_env, the fault table's environment),
    found, not listed."""
    watched, grew = {"watched_env"}, True
    while grew:
        more = {f.name for name in list(watched) for tree in mentioning(name).values()
                for f in _outer_functions(tree) if any(_gives(r.value, watched) for r in ast.walk(f)
                                                       if isinstance(r, ast.Return) and r.value is not None)}
        grew, watched = not more <= watched, watched | more
    return watched


def _gives(value: ast.expr, watched: set[str]) -> bool:
    """Whether `value` is a call of a watched function, or a dict that unpacks one (`{**clean_env(), ...}`)."""
    if isinstance(value, ast.Dict):
        return any(k is None and _gives(v, watched) for k, v in zip(value.keys, value.values))
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in watched


def _python_children_without_watch(tree: ast.Module, name: str, watched: set[str]) -> list[str]:
    """`name:line` of each subprocess.run/Popen in `tree` that starts a Python process (sys.executable first)
    without an env from `watched`, in the call or in the assignment of the name it passes."""
    bad = []
    for func in _outer_functions(tree):
        nodes = list(ast.walk(func))
        assigned = {t.id: n.value for n in nodes if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        for call in [n for n in nodes if isinstance(n, ast.Call)]:
            f = call.func
            if not (isinstance(f, ast.Attribute) and f.attr in ("run", "Popen") and
                    isinstance(f.value, ast.Name) and f.value.id == "subprocess" and call.args):
                continue
            argv = call.args[0]
            argv = assigned.get(argv.id, argv) if isinstance(argv, ast.Name) else argv
            first = argv.elts[0] if isinstance(argv, ast.List) and argv.elts else None
            if first is None or ast.unparse(first) != "sys.executable":
                continue
            env = next((k.value for k in call.keywords if k.arg == "env"), None)
            env = assigned.get(env.id, env) if isinstance(env, ast.Name) else env
            names = {n.id for n in ast.walk(env) if isinstance(n, ast.Name)} if env is not None else set()
            if not names & watched:
                bad.append(f"{name}:{call.lineno}")
    return bad


def test_every_python_process_the_tools_start_is_told_to_end_with_them():
    """Each train.py run, step or replica a tool starts gets the starter's pid in its environment (its
    protect_streams then follows it: tests/test_script_help.py checks that every script does), so a tool
    killed by SIGKILL takes them along; gpu_check's steps and their commands run in sessions of their own,
    which a kill of its process group misses. The walk is seen to find a bare start, planted."""
    watched = _watching()
    assert watched == {"watched_env", "clean_env", "step_env", "environment"}  # what they are today, found
    trees = mentioning("subprocess")
    assert REPO / "alexnet" / "launch.py" in trees and REPO / "scripts" / "bench" / "large_batch.py" in trees
    assert [hit for path, tree in trees.items() for hit in _python_children_without_watch(tree, path, watched)] == []
    for path, bare in (("scripts/bench/large_batch.py", ("env=env, capture_output", "capture_output")),
                       ("alexnet/launch.py", ("**watched_env()", "**os.environ"))):
        planted = ast.parse((REPO / path).read_text().replace(*bare, 1))
        assert _python_children_without_watch(planted, path, watched) != [], path


# -- the decisions, in this process (what mutation testing sees) ------------------------------------------

class _Prctl:
    """ctypes.CDLL(None)'s stand-in: records the prctl calls."""

    def __init__(self, calls: list):
        self.calls = calls

    def prctl(self, *args):
        self.calls.append(args)
        return 0


_GONE_PID = 2**22 + 1  # above any pid_max Linux allows: never a process


def _recording(kills: list):
    """os.kill's stand-in: a signal is recorded, not sent; signal 0 (is it alive?) asks the real one."""
    real = os.kill

    def kill(pid: int, sig: int) -> None:
        if sig == 0:
            return real(pid, 0)
        kills.append((pid, sig))
    return kill


@pytest.mark.parametrize("parent, mp_parent, ppid, killed", [
    (None, None, 4242, False),        # the parent of the moment: nothing to tell apart
    (None, _GONE_PID, 1, True),       # multiprocessing's parent, gone: adopted meanwhile
    (None, "self", 1, False),         # multiprocessing's parent, alive though not the parent of the moment
    (_GONE_PID, None, 1, True),       # the starter's pid, gone
    (_GONE_PID, _GONE_PID, _GONE_PID, False),  # the starter is the parent
    ("self", _GONE_PID, 1, False),    # the starter's pid alive (a grandparent's): the kernel watches the parent
])
def test_die_with_parent_asks_the_kernel_and_ends_only_if_the_named_parent_is_gone(
        monkeypatch, parent, mp_parent, ppid, killed):
    import ctypes
    import multiprocessing
    import signal as signals

    from data import procs
    me = os.getpid()
    prctl, kills = [], []
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Prctl(prctl))
    monkeypatch.setattr(os, "kill", _recording(kills))
    monkeypatch.setattr(os, "getppid", lambda: ppid)
    known = None if mp_parent is None else type("P", (), {"pid": me if mp_parent == "self" else mp_parent})()
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: known)
    procs.die_with_parent(signals.SIGTERM, me if parent == "self" else parent)
    assert prctl == [(1, int(signals.SIGTERM), 0, 0, 0)]  # PR_SET_PDEATHSIG, the signal
    assert kills == ([(me, signals.SIGTERM)] if killed else [])


def test_die_with_parent_does_nothing_off_linux_or_without_prctl(monkeypatch):
    import ctypes

    from data import procs
    kills = []
    monkeypatch.setattr(os, "kill", _recording(kills))
    monkeypatch.setattr(os, "getppid", lambda: 1)

    def no_libc(name):
        raise OSError("no libc")
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    procs.die_with_parent(parent=_GONE_PID)  # prctl unavailable: nothing can be asked, nothing is ended
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: pytest.fail("prctl asked off Linux"))
    procs.die_with_parent(parent=_GONE_PID)
    assert kills == []


def test_follow_parent_takes_the_pid_out_of_the_environment_and_follows_it(monkeypatch):
    import signal as signals

    from data import procs
    followed = []
    monkeypatch.setattr(procs, "die_with_parent", lambda sig, parent=None: followed.append((sig, parent)))
    monkeypatch.delenv(procs.ENV_PARENT, raising=False)
    procs.follow_parent()
    assert followed == []  # nobody asked
    monkeypatch.setenv(procs.ENV_PARENT, "4242")
    procs.follow_parent()
    assert followed == [(signals.SIGTERM, 4242)] and procs.ENV_PARENT not in os.environ
    monkeypatch.setenv(procs.ENV_PARENT, "77")
    procs.follow_parent(signals.SIGKILL)
    assert followed[-1] == (signals.SIGKILL, 77)


def test_watched_env_names_this_process_and_leaves_the_given_environment_as_it_was(monkeypatch):
    from data import procs
    given = {"A": "1"}
    assert procs.watched_env(given) == {"A": "1", procs.ENV_PARENT: str(os.getpid())} and given == {"A": "1"}
    monkeypatch.setenv("ALEXNET_PROBE", "x")
    env = procs.watched_env()
    assert env["ALEXNET_PROBE"] == "x" and env[procs.ENV_PARENT] == str(os.getpid())
    assert procs.ENV_PARENT not in os.environ


@pytest.mark.processes
def test_alive_tells_a_running_process_from_a_gone_one_and_a_zombie(tmp_path):
    """fsutil.pid_alive, which die_with_parent asks. A command name may hold ") Z (" (the state is read after
    the last parenthesis)."""
    from data.fsutil import pid_alive
    assert pid_alive(os.getpid()) and not pid_alive(_GONE_PID)
    odd = tmp_path / "a) Z (b"
    odd.symlink_to(shutil.which("sleep"))
    sleeper = subprocess.Popen([str(odd), "30"])
    try:
        deadline = time.monotonic() + 30
        while "a) Z (b" not in Path(f"/proc/{sleeper.pid}/stat").read_text():  # exec'd: its name is the link's
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pid_alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while _state(child.pid) != "Z":  # exited, not yet waited for
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not pid_alive(child.pid)
    finally:
        child.wait()
