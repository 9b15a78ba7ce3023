"""alexnet/launch.py without replicas: the heartbeat's records read back from a pipe and unpacked by hand, how
an exit is told, and the launcher's judgement (who to blame, when to stop, which code to return) over
fake processes whose exits and heartbeats each test scripts. The launcher with real child processes:
tests/test_faults.py (fake replicas), tests/test_parallel.py and tests/test_model_parallel.py (train.py)."""
from __future__ import annotations

import os
import signal
import struct
import time

import pytest

from alexnet import launch
from alexnet.launch import ENV_HEARTBEAT, Heartbeat, Launcher, report_gave_up

RECORD = "<iqb"  # rank (int32), collectives entered (int64), kind (int8): 0 progress, 1 alive, 2 gave up


def _records(fd: int) -> list[tuple]:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return []
    size = struct.calcsize(RECORD)
    return [struct.unpack_from(RECORD, data, i) for i in range(0, len(data), size)]


@pytest.fixture
def pipe(monkeypatch):
    r, w = os.pipe()
    monkeypatch.setenv(ENV_HEARTBEAT, str(w))
    yield r
    os.close(r)
    os.close(w)


def test_the_heartbeat_sends_rank_count_and_kind(pipe):
    beat = Heartbeat(3, live=False)
    beat.arrive()
    beat.arrive()
    beat.beat()
    report_gave_up(5)
    assert _records(pipe) == [(3, 1, 0), (3, 2, 0), (3, 2, 0), (5, 0, 2)]


def test_the_heartbeats_thread_says_alive_until_stopped(pipe, monkeypatch):
    monkeypatch.setattr(launch, "LIVE_EVERY", 0.01)
    beat = Heartbeat(7)
    beat.arrive()
    time.sleep(0.2)
    beat.stop()  # before the pipe closes: a thread still writing would write into the next file given its number
    got = _records(pipe)
    assert got[0] == (7, 1, 0) and (7, 1, 1) in got[1:] and not beat._thread.is_alive()
    assert _records(pipe) == []


def test_without_a_launcher_the_heartbeat_writes_nothing(monkeypatch):
    monkeypatch.delenv(ENV_HEARTBEAT, raising=False)
    beat = Heartbeat(0)
    beat.arrive()
    beat.beat()
    assert beat.fd is None and beat.count == 1


@pytest.mark.parametrize("code, words", [
    (-signal.SIGKILL, "was killed by signal 9 (SIGKILL; if no one sent it, the kernel's out-of-memory killer did"),
    (-signal.SIGSEGV, "was killed by signal 11 (SIGSEGV)"),
    (3, "exited with code 3 (its own error, printed above)"),
])
def test_how_an_exit_is_told(code, words):
    assert launch._how(code).startswith(words)


class FakeProc:
    """A replica process whose exit code each test sets; records what the launcher did to it."""

    def __init__(self, pid: int, code: int | None = None):
        self.pid, self.code, self.signals, self.killed = pid, code, [], False

    def poll(self):
        return self.code

    def kill(self):
        self.killed = True
        self.code = -signal.SIGKILL if self.code is None else self.code

    def wait(self):
        return self.code

    def send_signal(self, signum):
        self.signals.append(signum)


OPEN: list[int] = []


@pytest.fixture(autouse=True)
def _close_pipes():
    yield
    while OPEN:
        os.close(OPEN.pop())


def launcher(codes: list[int | None], timeout: float = 30.0) -> Launcher:
    """A Launcher watching fake replicas (no process started), with a pipe as its heartbeat channel."""
    lau = Launcher.__new__(Launcher)
    lau.timeout = timeout
    lau.read_fd, lau.write_fd = os.pipe()
    OPEN.extend((lau.read_fd, lau.write_fd))
    lau.procs = [FakeProc(1000 + r, c) for r, c in enumerate(codes)]
    n = len(codes)
    lau.counts, lau.beaten, lau.gave_up = [0] * n, [False] * n, [False] * n
    lau.progress_at, lau.seen_at = time.monotonic(), [time.monotonic()] * n
    return lau


def send(lau: Launcher, rank: int, count: int, kind: int = 0) -> None:
    os.write(lau.write_fd, struct.pack(RECORD, rank, count, kind))


def test_records_update_counts_liveness_and_who_gave_up():
    lau = launcher([None, None, None])
    for rank, count, kind in ((0, 4, 0), (1, 2, 1), (2, 5, 2), (0, 3, 0), (9, 1, 0), (-1, 1, 0)):
        send(lau, rank, count, kind)
    lau._read_heartbeats(0)
    assert lau.counts == [4, 2, 5]  # the highest seen; ranks outside the world ignored
    assert lau.gave_up == [False, False, True] and lau.beaten == [True, False, False]  # "alive" is not progress


def test_the_laggard_is_blamed_not_the_rank_that_gave_up():
    lau = launcher([None, None, None])
    for rank, count in ((0, 7), (1, 6), (2, 7)):
        send(lau, rank, count)
    lau._read_heartbeats(0)
    assert lau._culprit(2) == ("replica rank 1 stopped making progress (it never reached collective operation 7, "
                               "where the others waited); replica rank 2 then gave up waiting")
    assert lau._culprit(1) == ""  # the failed rank is itself the one behind: nothing more to say


def test_a_silent_rank_is_blamed_when_all_entered_the_same_collective():
    lau = launcher([None, None, None])
    now = time.monotonic()
    lau.counts, lau.seen_at = [5, 5, 5], [now, now - 10, now]
    msg = lau._culprit(2)
    assert msg.startswith("replica rank 1 stopped making progress (no sign of life for 10 s") and \
        msg.endswith("the others waited in collective operation 5); replica rank 2 then gave up waiting"), msg
    lau.seen_at = [now, now - 2, now]  # within 3 heartbeats' time: not silent
    assert lau._culprit(2) == ""


def _watch(lau: Launcher, capsys) -> tuple[int, str]:
    code = lau._watch()
    return code, capsys.readouterr().err


@pytest.mark.parametrize("codes, want", [([0, 0], 0), ([130, 130], 130), ([0, 143], 143), ([129, 0], 129)])
def test_finished_replicas_give_their_code(codes, want, capsys):
    assert _watch(launcher(codes), capsys) == (want, "")


def test_a_failed_replica_is_named_with_its_pid(capsys):
    code, err = _watch(launcher([None, 3, None]), capsys)
    assert code == 1 and err == ("train.py: replica rank 1 (pid 1001) exited with code 3 (its own error, printed "
                                 "above); stopping the other replicas\n")


def test_a_rank_that_failed_by_itself_is_named_before_one_that_gave_up(capsys):
    lau = launcher([1, -signal.SIGKILL])
    send(lau, 0, 3, 2)  # rank 0 gave up waiting: rank 1 (killed) is the cause
    code, err = _watch(lau, capsys)
    assert code == 1 and "replica rank 1 (pid 1001) was killed by signal 9" in err


def test_a_rank_that_gave_up_is_not_blamed_when_the_laggard_is_known(capsys):
    lau = launcher([1, None, None])
    send(lau, 0, 4, 2)
    send(lau, 1, 3)
    send(lau, 2, 4)
    code, err = _watch(lau, capsys)
    assert code == 1 and "replica rank 1 stopped making progress (it never reached collective operation 4" in err


def test_no_progress_from_any_replica_stops_them_all(capsys):
    lau = launcher([None, None], timeout=0.0)
    lau.beaten = [True, True]
    lau.progress_at = time.monotonic() - 121
    lau.counts = [2, 3]
    code, err = _watch(lau, capsys)
    assert code == 1 and "no replica reported progress for 121 s; stopping all (collectives entered, by rank: " \
        "[2, 3])" in err


def test_stopping_kills_the_replicas_still_running():
    lau = launcher([0, None, None])
    lau._stop_all()
    assert [p.killed for p in lau.procs] == [False, True, True]


def test_signals_are_forwarded_once_to_the_running_replicas():
    lau = launcher([None, 0])
    lau._forward(signal.SIGTERM, None)
    assert lau.procs[0].signals == [signal.SIGTERM] and lau.procs[1].signals == []
