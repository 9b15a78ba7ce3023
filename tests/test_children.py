"""tests/children.py, the suite's way of waiting on a child: a hung tree (no CPU) is killed whole, a slow one
(its share of the cores, in any process of the tree) is waited for, a spinning one stops at its CPU budget."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import children

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

# A child that spins `cpu` CPU seconds (its own clock: the same work under any load), then sleeps `idle`
# seconds, `rounds` times; with PARENT=1 it does so in a grandchild while the child itself only waits.
SPIN = """
import os, subprocess, sys, time
cpu, idle, rounds, parent = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if parent:
    sys.exit(subprocess.call([sys.executable, sys.argv[5], *sys.argv[1:4], "0", sys.argv[5]]))
for _ in range(rounds):
    t = time.process_time()
    while time.process_time() - t < cpu:  # busy: CPU time is what the watch counts as progress
        sum(range(1000))
    time.sleep(idle)
print("done", flush=True)
"""


def spin(tmp_path, cpu: float, idle: float, rounds: int, parent: bool = False) -> list[str]:
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    return [sys.executable, str(script), str(cpu), str(idle), str(rounds), "1" if parent else "0", str(script)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_a_hung_tree_is_killed_whole_and_named(tmp_path):
    """A child waiting on a grandchild that sleeps for ever: ChildHung after the stall limit, the command and
    its output so far in the message, and neither process left."""
    code = ("import subprocess, sys, time; print('started', flush=True); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(p.pid, flush=True); p.wait()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    began = time.monotonic()
    with pytest.raises(children.ChildHung) as e:
        children.communicate(proc, cpu_s=60, stall_s=2)
    assert time.monotonic() - began < 60
    message = str(e.value)
    assert "hung: its processes used" in message and "time.sleep(600)" in message and "started" in message
    grandchild = int(message.split("started\n")[1].split()[0])
    assert proc.poll() is not None and not alive(grandchild)


def test_a_slow_child_is_waited_for(tmp_path):
    """About a third of one core for 3 rounds of a second: past the stall limit of 2 s, but not hung."""
    r = children.run(spin(tmp_path, 0.3, 0.7, 3), cpu_s=60, stall_s=2)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr


def test_the_work_of_a_grandchild_counts(tmp_path):
    """The child only waits while its child works: the tree made progress."""
    r = children.run(spin(tmp_path, 0.3, 0.7, 3, parent=True), cpu_s=60, stall_s=2)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr


def verdict(cpu_per_s: float, runnable: int, cores: int = 2, seconds: int = 120) -> str:
    """Watch's verdict on a tree that used `cpu_per_s` of a core for `seconds`, with `runnable` tasks
    runnable machine-wide all along (a history written by hand: the same on any machine, at any load)."""
    w = children.Watch(os.getpid(), "hand-made", cpu_s=1e9, stall_s=seconds)
    w.cores = cores
    w.history.clear()
    w.history.extend((t, t * cpu_per_s, runnable) for t in range(seconds + 1))
    return w.fault()


def test_progress_is_measured_against_the_share_of_a_core_the_tree_could_get():
    """On an idle machine (2 tasks runnable on 2 cores) the bar is 5 % of one core: the elastic hang's 1 %
    is a hang, 10 % is progress. With 20 runnable (three suites at once), a process gets a tenth of a core
    and the bar is 0.5 %: 1 % is progress there, 0.2 % is still a hang; on 16 cores 20 is nearly idle."""
    assert verdict(0.01, runnable=2).startswith("hung: its processes used 1.20 s of CPU in the last 120 s")
    assert verdict(0.10, runnable=2) == ""
    assert verdict(0.01, runnable=20) == ""
    assert "under 5% of the 0.10 of a core" in verdict(0.002, runnable=20)
    assert verdict(0.01, runnable=20, cores=16).startswith("hung")
    assert verdict(0.0, runnable=0) != ""  # no division by zero: a lone hung child on an idle machine
    assert verdict(0.01, runnable=2, seconds=60) != ""  # judged over the stall limit given


def test_a_spell_shorter_than_the_stall_limit_is_not_judged():
    w = children.Watch(os.getpid(), "hand-made", cpu_s=1e9, stall_s=120)
    w.history.clear()
    w.history.extend((t, 0.0, 2) for t in range(119))
    assert w.fault() == ""


def test_a_spinning_child_stops_at_its_cpu_budget(tmp_path):
    with pytest.raises(children.ChildHung, match=r"over its budget of 1 s"):
        children.run(spin(tmp_path, 30, 0, 1), cpu_s=1, stall_s=60)


def test_wait_until_sees_the_child_exit_first(tmp_path):
    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", f"open({str(flag)!r}, 'w').close()"])
    assert children.wait_until(flag.exists, proc, cpu_s=60, what="flag") is True
    proc.wait()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], stderr=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError, match="never: the child exited with 3 first"):
        children.wait_until(lambda: False, proc, cpu_s=60, what="never")


def test_the_log_records_each_child(tmp_path, monkeypatch):
    """The CPU is sampled every POLL_S: the child idles a second before it exits, so that its last look
    sees all 0.5 s (a child that exits while it works loses what it used after the last look)."""
    log = tmp_path / "children.jsonl"
    monkeypatch.setenv("ALEXNET_CHILD_LOG", str(log))
    children.run(spin(tmp_path, 0.5, 1.0, 1), cpu_s=60)
    (line,) = log.read_text().splitlines()
    assert '"cpu_s": 60' in line and float(line.split('"cpu": ')[1].split(",")[0]) >= 0.45
    assert os.path.getsize(log) > 0


def test_read_until_leaves_the_rest_and_names_a_child_that_ends_first():
    code = "import time; print('a'); print('go', flush=True); time.sleep(0.5); print('rest')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert children.read_until(proc, proc.stdout, lambda line: line == "go\n", cpu_s=60) == ["a\n", "go\n"]
    assert children.communicate(proc, cpu_s=60)[0] == "rest\n"
    proc = subprocess.Popen([sys.executable, "-c", "print('a')"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError, match="no wanted line before its end"):
        children.read_until(proc, proc.stdout, lambda line: line == "go\n", cpu_s=60)
    proc.wait()
