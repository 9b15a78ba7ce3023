"""Waiting on a test's child process by its progress, not by the clock.

A wall-clock limit fails a slow child as if it hung: with six times the cores in work (three suites and a
mutation run on 2 cores), a training run that takes a minute alone ran past its 240 s limit. So a child is
watched together with every process it starts (its tree), and given
- a CPU budget: the CPU seconds the tree may use, which is what the work costs whatever the load, and stops
  a child that spins for ever;
- a stall limit: a tree that used under MIN_SHARE of its fair share of a core over the last STALL_S seconds
  is hung. A slow child still gets its share: all of a core on an idle machine, cores / runnable tasks on a
  busy one (a tenth of one with 20 tasks runnable on 2 cores, as three suites at once have); a hung one,
  waiting on a peer that will never answer, uses next to none (the elastic hang of issue 26: 1 % of one
  core, caught on an idle machine; under load the bar falls with the share, and a hang that still
  trickles CPU is caught later, by its CPU budget).
A tree that hangs or overspends is stopped and killed as a whole (a wall-clock timeout once left a
preprocess run's main process and both its workers running for 41 min after the test had failed), and the
error names the command, the cause, the CPU used, the output so far and, where py-spy is installed, the
Python stacks of every process in the tree.

The CPU is sampled every POLL_S seconds: what a process uses between the last look and its exit is not
counted (a quarter of a second of a core at most, for a process that gets a whole one).

ALEXNET_CHILD_LOG=FILE appends one JSON line per waited-on child (its CPU, wall time and budget): how the
budgets were checked against what the children use.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

STALL_S = 120.0
MIN_SHARE = 0.05
POLL_S = 0.25
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ChildHung(AssertionError):
    """A child's tree stopped using CPU, or used more than its budget; it has been killed."""


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of its own threads) of one live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree(*roots: int) -> dict[int, float]:
    """{pid: CPU seconds} of each root and each of their descendants alive now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := _stat(int(entry))) is not None:
            table[int(entry)] = s
    found, todo = {}, list(roots)
    while todo:
        p = todo.pop()
        if p in table and p not in found:
            found[p] = table[p][1]
            todo += [q for q, (parent, _) in table.items() if parent == p]
    return found


def waiting_on_a_pipe(root: int) -> list[str]:
    """The threads of `root`'s tree blocked opening a named pipe (read or write: the kernel's
    wait_for_partner), as "pid/tid: command": such an open waits for a partner that may never come."""
    found = []
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    if f.read().strip() == "wait_for_partner":
                        with open(f"/proc/{pid}/cmdline", "rb") as c:
                            command = c.read().replace(b"\0", b" ").decode(errors="replace")
                        found.append(f"{pid}/{tid}: {command[:200]}")
    return found


def wait_unless_blocked_on_a_pipe(proc: subprocess.Popen, cpu_s: float) -> list[str]:
    """proc.wait() with its tree watched (Watch); if a thread of the tree blocks opening a named pipe, the
    tree is killed at once and those threads returned ([] for a child that ended by itself)."""
    watch = Watch(proc.pid, _command(proc), cpu_s, STALL_S)
    while proc.poll() is None:
        blocked = waiting_on_a_pipe(proc.pid)
        if blocked:
            kill_tree(proc.pid)
            proc.wait()
            return blocked
        watch.check()
        time.sleep(POLL_S)
    watch.log()
    return []


def runnable() -> int:
    """Tasks running or waiting for a core, machine-wide, now (/proc/loadavg's fourth field)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fair_share(runnables: list[int], cores: int) -> float:
    """The part of one core a runnable process got while `runnables` were counted (at most all of it)."""
    return min(1.0, cores / max(1.0, sum(runnables) / len(runnables)))


def kill_tree(pid: int) -> None:
    """Stop every process of the tree first (none can fork away or restart another), kill them, and return
    once each is gone or a zombie: the kernel ends a killed process a moment after the signal (a test that
    looked at once found a killed grandchild still there, with two suites on 2 cores)."""
    stopped, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
            stopped.append(p)
            todo += [q for q in tree(p) if q != p and q not in stopped]
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    ends = time.monotonic() + 30  # only so that this helper itself cannot hang: it takes milliseconds
    while any(_running(p) for p in stopped) and time.monotonic() < ends:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; its parent has yet to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def stacks(pids: list[int]) -> str:
    """py-spy's Python stacks of each process (a development requirement; skipped without it)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not spy:
        return "(py-spy not installed: no stacks)"
    out = []
    for p in pids:
        r = subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30)
        out.append(f"--- pid {p}\n{(r.stdout or r.stderr).strip()}")
    return "\n".join(out)


class Watch:
    """The CPU a child's tree has used, and whether it has hung or overspent `cpu_s`."""

    def __init__(self, pid: int | list[int], name: str, cpu_s: float, stall_s: float = STALL_S):
        self.roots = [pid] if isinstance(pid, int) else list(pid)
        self.name, self.cpu_s, self.stall_s, self.cores = name, cpu_s, stall_s, cores()
        self.began = time.monotonic()
        self.seen: dict[int, float] = {}
        self.used = 0.0
        self.history = collections.deque([(self.began, 0.0, runnable())])

    def sample(self) -> None:
        """Add what each process used since the last look (a new one: all it has used)."""
        now = tree(*self.roots)
        self.used += sum(max(0.0, cpu - self.seen.get(p, 0.0)) for p, cpu in now.items())
        self.seen = now
        t = time.monotonic()
        self.history.append((t, self.used, runnable()))
        while len(self.history) > 2 and self.history[1][0] <= t - self.stall_s:
            self.history.popleft()

    def fault(self) -> str:
        """Why the tree must be stopped now, or ''."""
        if self.used > self.cpu_s:
            return f"used {self.used:.1f} s of CPU, over its budget of {self.cpu_s:.0f} s (a loop that spins?)"
        (t0, used0, _), (t1, used1, _) = self.history[0], self.history[-1]
        share = fair_share([r for _, _, r in self.history], self.cores)
        if t1 - t0 >= self.stall_s and used1 - used0 < MIN_SHARE * share * (t1 - t0):
            return (f"hung: its processes used {used1 - used0:.2f} s of CPU in the last {t1 - t0:.0f} s, under "
                    f"{MIN_SHARE:.0%} of the {share:.2f} of a core that a process would get meanwhile")
        return ""

    def check(self) -> None:
        """Sample (at most every POLL_S: a look reads all of /proc); if the tree has hung or overspent, kill
        it and raise ChildHung."""
        if time.monotonic() - self.history[-1][0] < POLL_S:
            return
        self.sample()
        if why := self.fault():
            pids = list(tree(*self.roots))
            where = stacks(pids)
            for root in self.roots:
                kill_tree(root)
            raise ChildHung(f"{self.name}: {why}; killed after {time.monotonic() - self.began:.0f} s "
                            f"with {len(pids)} process(es)\n{where}")

    def log(self) -> None:
        if path := os.environ.get("ALEXNET_CHILD_LOG"):
            with open(path, "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "cmd": self.name[:200],
                                    "cpu": round(self.used, 2),
                                    "wall": round(time.monotonic() - self.began, 2), "cpu_s": self.cpu_s}) + "\n")


def _command(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return " ".join(map(str, args))


def communicate(proc: subprocess.Popen, cpu_s: float, input: str | bytes | None = None,
                stall_s: float = STALL_S) -> tuple:
    """proc.communicate(input), with the child's tree watched instead of a wall-clock limit."""
    watch, box = Watch(proc.pid, _command(proc), cpu_s, stall_s), {}

    def talk() -> None:
        try:
            box["out"] = proc.communicate(input)
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
    talker = threading.Thread(target=talk, daemon=True)
    talker.start()
    try:
        while talker.is_alive():
            watch.check()
            talker.join(POLL_S)
    except ChildHung as e:
        talker.join(10)  # the pipes close with the killed tree: keep what it wrote
        out = box.get("out", (None, None))
        raise ChildHung(f"{e}\n--- its stdout:\n{_tail(out[0])}\n--- its stderr:\n{_tail(out[1])}") from None
    watch.log()
    if "error" in box:
        raise box["error"]
    return box["out"]


def run(cmd: list, cpu_s: float, input: str | bytes | None = None, text: bool = True, stall_s: float = STALL_S,
        stdout: object = subprocess.PIPE, stderr: object = subprocess.PIPE,
        **popen: object) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) with its output captured (unless redirected) and the child's tree watched (see the
    module's doc)."""
    stdin = subprocess.PIPE if input is not None else popen.pop("stdin", None)
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, **popen)
    try:
        out, err = communicate(proc, cpu_s, input, stall_s)
    finally:
        if proc.poll() is None:  # an error in this process (KeyboardInterrupt): leave nothing behind
            kill_tree(proc.pid)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait(proc: subprocess.Popen, cpu_s: float, stall_s: float = STALL_S) -> int:
    """proc.wait(), with the child's tree watched (its output goes where Popen sent it)."""
    watch = Watch(proc.pid, _command(proc), cpu_s, stall_s)
    while proc.poll() is None:
        watch.check()
        time.sleep(POLL_S)
    watch.log()
    return proc.returncode


def wait_until(ready: Callable[[], object], proc: subprocess.Popen, cpu_s: float, what: str,
               stall_s: float = STALL_S) -> object:
    """Poll `ready()` until it returns something true, while the child runs and makes progress."""
    watch = Watch(proc.pid, _command(proc), cpu_s, stall_s)
    while not (got := ready()):
        if proc.poll() is not None:
            out = proc.communicate() if proc.stdout or proc.stderr else ("", "")
            raise AssertionError(f"{what}: the child exited with {proc.returncode} first\n{_tail(out[0])}\n"
                                 f"{_tail(out[1])}")
        watch.check()
        time.sleep(0.05)
    return got


def read_until(proc: subprocess.Popen, stream: object, wanted: Callable[[str], bool], cpu_s: float,
               stall_s: float = STALL_S) -> list[str]:
    """The lines of `stream` (the child's text pipe) up to the first that is `wanted`, with the child's tree
    watched; the rest of the stream is left to be read (proc.communicate)."""
    import queue as queues
    lines: queues.Queue = queues.Queue()

    def reader() -> None:  # stops after the wanted line, so that nothing after it is taken
        for line in stream:
            lines.put(line)
            if wanted(line):
                break
        lines.put(None)
    threading.Thread(target=reader, daemon=True).start()
    watch, seen = Watch(proc.pid, _command(proc), cpu_s, stall_s), []
    while True:
        try:
            line = lines.get(timeout=POLL_S)
        except queues.Empty:
            watch.check()
            continue
        if line is None:
            raise AssertionError(f"{_command(proc)}: no wanted line before its end\n{''.join(seen)[-4000:]}")
        seen.append(line)
        if wanted(line):
            return seen


def get(queue: object, pid: int, name: str, cpu_s: float, stall_s: float = STALL_S) -> object:
    """queue.get() from a multiprocessing child `pid`, with its tree watched."""
    import queue as queues
    watch = Watch(pid, name, cpu_s, stall_s)
    while True:
        try:
            got = queue.get(timeout=POLL_S)
        except queues.Empty:
            watch.check()
            continue
        watch.log()
        return got


def _tail(text: str | bytes | None, chars: int = 4000) -> str:
    if text is None:
        return "(none)"
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-chars:]


# Survivors: every process of a run started with TOKEN=<a fresh value> in its environment inherits it,
# whatever starts it, so the processes a run left behind are found by it.
TOKEN = "ALEXNET_TEST_RUN_TOKEN"  # in the environment of every process of a run: its survivors
GONE_S = 60.0   # how long the tool's processes may take to end after their parent (a generous bound: a
                # process that has no way to learn of its parent's death never ends at all)


def with_a_token(env: dict | None = None) -> tuple[str, dict]:
    """A fresh token, and the environment (`env`, else this process's) that carries it to a run's processes."""
    token = uuid.uuid4().hex
    return token, {**(os.environ if env is None else env), TOKEN: token}


def with_token(token: str) -> list[int]:
    """Live processes whose environment holds `token` (this user's; zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{TOKEN}={token}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(") ", 1)[1][:1] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def none_left(token: str, what: str) -> None:
    """No process of the run `token` lives GONE_S after `what` ended (those found are killed, and named)."""
    end = time.monotonic() + GONE_S
    while (left := with_token(token)) and time.monotonic() < end:
        time.sleep(0.05)
    if left:
        listing = "; ".join(f"{p}: {_cmdline(p)}" for p in left)
        for p in left:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since
                os.kill(p, signal.SIGKILL)
        raise AssertionError(f"{len(left)} process(es) outlived {what} by {GONE_S:.0f} s: {listing}")
