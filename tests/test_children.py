"""tests/children.py, the suite's way of waiting on a child: a hung tree (no CPU) is killed whole, a slow one
(its share of the cores, in any process of the tree) is waited for, a spinning one stops at its CPU budget."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import children

# A child that spins `cpu` CPU seconds (its own clock: the same work under any load), then sleeps `idle`
# seconds, `rounds` times; with PARENT=1 it does so in a grandchild while the child itself only waits.
SPIN = """
import os, subprocess, sys, time
cpu, idle, rounds, parent = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if parent:
    sys.exit(subprocess.call([sys.executable, sys.argv[5], *sys.argv[1:4], "0", sys.argv[5]]))
for _ in range(rounds):
    t = time.process_time()
    while time.process_time() - t < cpu:
        pass
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
    """About a third of one core for 5 rounds of a second: over the stall limit of 2 s, but not hung."""
    r = children.run(spin(tmp_path, 0.3, 0.7, 5), cpu_s=60, stall_s=2)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr


def test_the_work_of_a_grandchild_counts(tmp_path):
    """The child only waits while its child works: the tree made progress."""
    r = children.run(spin(tmp_path, 0.3, 0.7, 5, parent=True), cpu_s=60, stall_s=2)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr


def test_a_trickle_of_cpu_is_a_hang(tmp_path):
    """1 % of one core (the elastic hang's figure) is under the 5 % that makes progress."""
    with pytest.raises(children.ChildHung, match="hung"):
        children.run(spin(tmp_path, 0.01, 0.99, 30), cpu_s=60, stall_s=3)


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
    log = tmp_path / "children.jsonl"
    monkeypatch.setenv("ALEXNET_CHILD_LOG", str(log))
    children.run(spin(tmp_path, 0.5, 0, 1), cpu_s=60)
    (line,) = log.read_text().splitlines()
    assert '"cpu_s": 60' in line and float(line.split('"cpu": ')[1].split(",")[0]) >= 0.45
    assert os.path.getsize(log) > 0
