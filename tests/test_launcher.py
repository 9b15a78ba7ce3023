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
    # the first "alive" may come before the arrival on a loaded machine (the thread's 10 ms against this
    # thread's next line): the order between them is not the point
    assert (7, 1, 0) in got and (7, 1, 1) in got[got.index((7, 1, 0)):] and not beat._thread.is_alive()
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
    lau._watch_state(len(codes))
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


def test_a_stop_signal_reaches_each_running_replica_once_when_it_listens(monkeypatch):
    """Sent at once to a replica that said it listens (its start-up handlers in place), kept for one still
    starting (it would die of it with a traceback) until it says so; never to one that exited; to a
    replica that never says it (not train.py) after UNHEARD_FORWARD_S."""
    lau = launcher([None, 0, None])
    send(lau, 0, 0, launch._LISTENING)
    lau._read_heartbeats(0)
    lau._forward(signal.SIGTERM, None)
    assert [p.signals for p in lau.procs] == [[signal.SIGTERM], [], []]
    send(lau, 2, 0, launch._LISTENING)
    lau._read_heartbeats(0)
    assert [p.signals for p in lau.procs] == [[signal.SIGTERM], [], [signal.SIGTERM]]
    assert lau.listening == [True, False, True] and lau.beaten == [False] * 3  # listening is not progress
    silent = launcher([None])
    silent._forward(signal.SIGINT, None)
    silent._send_overdue()
    assert silent.procs[0].signals == []
    monkeypatch.setattr(launch, "UNHEARD_FORWARD_S", 0.0)
    silent._send_overdue()
    assert silent.procs[0].signals == [signal.SIGINT]
    silent._send_overdue()
    assert silent.procs[0].signals == [signal.SIGINT]  # once


class StopsOnSignal(FakeProc):
    """Ends with 128 + N once signalled; after `patience` polls without a signal it ends with 0."""

    def __init__(self, pid: int, patience: int = 25):
        super().__init__(pid)
        self.patience = patience

    def poll(self):
        self.patience -= 1
        if self.code is None and self.patience <= 0:
            self.code = 0
        return self.code

    def send_signal(self, signum):
        super().send_signal(signum)
        self.code = 128 + signum


class Stuck(StopsOnSignal):
    """A replica waiting in the rendezvous for one that is gone: it takes no signal (ends with 0 after
    `patience` polls, so that a launcher that waited for it returns at last)."""

    def send_signal(self, signum):
        self.signals.append(signum)


def test_one_replica_stopped_while_starting_ends_the_run_without_waiting_for_the_others(capsys):
    lau = launcher([None, None])
    lau.procs = [StopsOnSignal(1000), Stuck(1001, patience=50)]
    for rank in (0, 1):
        send(lau, rank, 0, launch._LISTENING)
    lau._read_heartbeats(0)
    lau._forward(signal.SIGTERM, None)
    code, err = _watch(lau, capsys)
    assert code == 143 and lau.procs[1].code is None  # not waited for: the launcher's end kills it
    assert err == "train.py: interrupted by SIGTERM while the replicas started; nothing was done\n"


class StopsAfter(FakeProc):
    """Once signalled, ends with 128 + N after `polls` more polls (a replica finishing its step and its
    checkpoint first)."""

    def __init__(self, pid: int, polls: int):
        super().__init__(pid)
        self.polls, self.ending = polls, None

    def poll(self):
        if self.ending is not None and self.code is None:
            self.polls -= 1
            if self.polls <= 0:
                self.code = 128 + self.ending
        return self.code

    def send_signal(self, signum):
        super().send_signal(signum)
        self.ending = signum


@pytest.mark.parametrize("began", [True, False])
def test_a_forwarded_stop_ends_the_watch_when_the_replicas_end(capsys, began):
    """Once a replica reported progress, one that ends on the forwarded signal does not end the run: the
    others are finishing their own stop (the agreed step's checkpoint) and are waited for, and the run
    began, so no line says nothing was done. Before any progress the first to end on it ends the watch
    (the others would wait for it in the rendezvous), but only once one has: not as soon as the signal
    was passed on."""
    lau = launcher([None, None])
    lau.procs = [StopsAfter(1000, polls=2), StopsAfter(1001, polls=6)]
    for rank in (0, 1):
        send(lau, rank, 0, launch._LISTENING)
        if began:
            send(lau, rank, 1, launch._PROGRESS)
    lau._read_heartbeats(0)
    lau._forward(signal.SIGTERM, None)
    code, err = _watch(lau, capsys)
    assert code == 143 and lau.procs[0].code == 143
    if began:
        assert lau.procs[1].code == 143 and err == ""
    else:
        assert lau.procs[1].code is None  # not waited for: the launcher's end kills it
        assert err == "train.py: interrupted by SIGTERM while the replicas started; nothing was done\n"


def test_the_watch_sends_a_signal_still_pending_for_a_replica_that_never_listens(monkeypatch, capsys):
    """The launcher's own loop passes the pending signal on (after UNHEARD_FORWARD_S): the run ends with
    128 + N and one line, since no replica had begun."""
    monkeypatch.setattr(launch, "UNHEARD_FORWARD_S", 0.0)
    lau = launcher([None])
    lau.procs = [StopsOnSignal(1000)]
    lau._forward(signal.SIGINT, None)
    code, err = _watch(lau, capsys)
    assert (code, lau.procs[0].signals) == (130, [signal.SIGINT])
    assert err == "train.py: interrupted by SIGINT while the replicas started; nothing was done\n"


# -- boundaries and wording, each by hand ---------------------------------------------------------------------

def test_report_gave_up_sends_one_record_and_no_alive_thread(pipe, monkeypatch):
    monkeypatch.setattr(launch, "LIVE_EVERY", 0.01)
    report_gave_up(5)
    time.sleep(0.1)  # a heartbeat thread, if one had been started, would have written "alive" records by now
    assert _records(pipe) == [(5, 0, 2)]


def test_how_an_exit_is_told_in_full():
    assert launch._how(-signal.SIGKILL) == (
        "was killed by signal 9 (SIGKILL; if no one sent it, the kernel's out-of-memory killer did: too many "
        "processes for this machine's memory?)")
    assert launch._how(0) == "exited with code 0 (its own error, printed above)"


def test_a_partial_record_is_left_for_later_and_reading_never_waits(monkeypatch):
    """Records arrive whole or in part; a part is not unpacked. After the first wait, the pipe is drained
    without waiting again (select's timeouts, by hand: the given one, then 0)."""
    lau = launcher([None, None])
    waits = []
    real = launch.select.select
    monkeypatch.setattr(launch.select, "select", lambda r, w, x, t: waits.append(t) or real(r, w, x, t))
    record = struct.pack(RECORD, 1, 4, 0)
    os.write(lau.write_fd, record + record[:7])
    lau._read_heartbeats(0.25)
    assert lau.counts == [0, 4] and waits[0] == 0.25 and set(waits[1:]) == {0}


def test_the_rank_just_past_the_world_is_ignored_and_giving_up_is_not_forgotten():
    lau = launcher([None, None, None])
    before = lau.progress_at
    time.sleep(0.01)
    for rank, count, kind in ((3, 9, 0), (1, 2, 2), (1, 3, 0), (1, 4, 1)):
        send(lau, rank, count, kind)
    lau._read_heartbeats(0)
    assert lau.counts == [0, 4, 0] and lau.gave_up == [False, True, False]
    assert lau.progress_at > before and isinstance(lau.progress_at, float)


def test_two_laggards_are_both_named():
    lau = launcher([None, None, None, None])
    lau.counts = [7, 5, 7, 5]
    assert lau._culprit(0).startswith("replica rank 1, 3 stopped making progress (it never reached collective "
                                      "operation 6")


@pytest.mark.parametrize("quiet, live_every, silent", [(2.99, 1.0, False), (3.0, 1.0, False), (3.01, 1.0, True),
                                                      (3.5, 1.0, True), (4.0, 2.0, False), (6.5, 2.0, True)])
def test_a_rank_is_silent_after_three_heartbeats_time(monkeypatch, quiet, live_every, silent):
    monkeypatch.setattr(launch, "LIVE_EVERY", live_every)
    lau = launcher([None, None, None])
    now = 1000.0
    monkeypatch.setattr(launch.time, "monotonic", lambda: now)
    lau.counts, lau.seen_at = [5, 5, 5], [now, now - quiet, now - quiet]
    lau.seen_at[2] = now  # the rank that gave up (2) is not judged
    assert lau._culprit(2).startswith("replica rank 1 stopped") == silent


def test_silent_ranks_are_all_named():
    lau = launcher([None, None, None])
    now = time.monotonic()
    lau.counts, lau.seen_at = [5, 5, 5], [now - 8, now - 9, now]
    assert lau._culprit(2).startswith("replica rank 0, 1 stopped making progress (no sign of life for 8 s")


class ScriptedProc(FakeProc):
    """Running for `polls` polls, then exiting with `code`."""

    def __init__(self, pid: int, code: int, polls: int):
        super().__init__(pid, None)
        self.final, self.polls = code, polls

    def poll(self):
        if self.polls > 0:
            self.polls -= 1
            return None
        self.code = self.final
        return self.code


@pytest.mark.parametrize("silent, stops", [(150.0, False), (150.5, True), (155.0, True)])
def test_the_backstop_stops_only_after_three_timeouts_and_two_minutes_without_progress(monkeypatch, silent,
                                                                                        stops, capsys):
    """timeout 10 s: stopped once every replica made progress before and none has for more than 3 x 10 + 120
    s; otherwise the replicas run on (here: to their end, exit 0)."""
    lau = launcher([None, None], timeout=10.0)
    lau.procs = [ScriptedProc(1000 + r, 0, 2) for r in range(2)]
    lau.beaten = [True, True]
    now = 5000.0
    monkeypatch.setattr(launch.time, "monotonic", lambda: now)
    lau.progress_at = now - silent
    monkeypatch.setattr(launch.select, "select", lambda r, w, x, t: ([], [], []))
    code, err = _watch(lau, capsys)
    assert (code, "no replica reported progress" in err) == ((1, True) if stops else (0, False))


def test_no_backstop_before_every_replica_made_progress(monkeypatch, capsys):
    lau = launcher([None, None], timeout=10.0)
    lau.procs = [ScriptedProc(1000 + r, 0, 2) for r in range(2)]
    lau.beaten = [True, False]
    lau.progress_at = time.monotonic() - 10_000
    monkeypatch.setattr(launch.select, "select", lambda r, w, x, t: ([], [], []))
    assert _watch(lau, capsys) == (0, "")


def test_a_rank_that_failed_by_itself_is_named_even_when_another_lags(capsys):
    lau = launcher([None, 3, None])
    lau.counts = [3, 5, 5]
    code, err = _watch(lau, capsys)
    assert code == 1 and "replica rank 1 (pid 1001) exited with code 3" in err and "rank 0" not in err


def test_a_rank_that_gave_up_and_is_itself_behind_is_named_as_it_failed(capsys):
    lau = launcher([None, None, 1])
    send(lau, 0, 5)
    send(lau, 1, 5)
    send(lau, 2, 3, 2)  # rank 2 gave up, but it is the one behind: no one else to blame
    code, err = _watch(lau, capsys)
    assert code == 1 and err.startswith("train.py: replica rank 2 (pid 1002) exited with code 1"), err


def test_the_heartbeat_thread_is_a_daemon_named_heartbeat(pipe):
    beat = Heartbeat(2)
    try:
        assert beat._thread.name == "heartbeat" and beat._thread.daemon
    finally:
        beat.stop()


def test_stopping_a_heartbeat_without_a_launcher_does_nothing(monkeypatch):
    monkeypatch.delenv(ENV_HEARTBEAT, raising=False)
    beat = Heartbeat(0)
    beat.stop()
    assert beat._thread is None


def test_a_heartbeat_to_a_launcher_that_is_gone_is_no_error(monkeypatch):
    r, w = os.pipe()
    os.close(r)  # the launcher's end closed: a write is EPIPE
    monkeypatch.setenv(ENV_HEARTBEAT, str(w))
    try:
        beat = Heartbeat(1, live=False)
        beat.arrive()
        report_gave_up(1)
        assert beat.count == 1
    finally:
        os.close(w)


def test_threads_per_replica_follow_the_users_value_else_torchruns_rule():
    assert launch.replica_threads(2, {"OMP_NUM_THREADS": "3"}) == "3"
    assert launch.replica_threads(1, {"OMP_NUM_THREADS": "3"}) == "3"
    assert launch.replica_threads(4, {"OMP_NUM_THREADS": ""}) == "1"
    assert launch.replica_threads(2, {}) == "1"
    assert launch.replica_threads(1, {}) is None


@pytest.mark.processes
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_thread_rule_is_what_torchrun_itself_gives_its_processes(tmp_path, nproc):
    """The oracle: torch.distributed.run started on a script that records the OMP_NUM_THREADS it was given,
    without one set by the user."""
    import sys

    from tests import children
    script = tmp_path / "threads.py"
    script.write_text("import os, sys\nopen(sys.argv[1] + os.environ['LOCAL_RANK'], 'w')"
                      ".write(os.environ.get('OMP_NUM_THREADS', 'unset'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = children.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
                      "--master-port", str(launch.free_port()), str(script), str(tmp_path / "rank")],
                     cpu_s=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    given = {(tmp_path / f"rank{rank}").read_text() for rank in range(nproc)}
    assert given == {launch.replica_threads(nproc, env) or "unset"}
