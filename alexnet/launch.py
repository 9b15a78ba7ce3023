"""train.py's own launcher for the replicas of one host, and the heartbeat that names a stuck replica.

``python train.py CONFIG parallel.replicas=N`` starts N copies of itself with the environment variables
torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so both
launches share one initialisation path (alexnet/distributed.py). The launcher then watches them:

- a replica that exits with an error makes the launcher stop the others at once (SIGKILL: the last
  checkpoint is safe, every write is atomic) and report which rank failed and how; a replica that
  failed by itself (its own error, or a signal such as the out-of-memory killer's) is named as such;
- each replica reports through a pipe (the heartbeat) every time it enters a collective operation, with
  a count of those it entered so far; replicas blocked on a hung peer time out after ``parallel.timeout``,
  say so through the pipe and exit, and the launcher names the rank that fell behind (it never arrived
  where the others wait), not the one whose timeout fired first;
- Ctrl-C / SIGTERM / SIGHUP (unless ignored, as under nohup) are forwarded once to every replica, which
  checkpoint together and stop.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from data.procs import watched_env

from . import startup

ENV_HEARTBEAT = "ALEXNET_HEARTBEAT_FD"
ENV_LOCK_FD = "ALEXNET_RUN_LOCK_FD"  # run.dir's lock, held by the launcher and inherited (alexnet/rundir.py)
_RECORD = startup.RECORD  # rank, collectives entered, kind
_PROGRESS, _ALIVE, _GAVE_UP, _LISTENING = 0, 1, 2, startup.LISTENING
# A replica that never says it listens (not train.py) gets a forwarded stop signal this long after it came.
UNHEARD_FORWARD_S = 5.0
LIVE_EVERY = 1.0  # seconds between a replica's "alive" records
# Stop signals passed on to the replicas (each checkpoints and exits 128 + N: a stop, not a failure).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Heartbeat:
    """Replica side: small non-blocking writes; nothing at all if not started by the launcher.

    Every replica enters the same collectives in the same order, so the count of collectives entered
    is comparable across replicas: the one with the lowest count is where the others wait. A thread
    also says "alive" every LIVE_EVERY seconds: when every replica entered the same collective, the
    one that went silent (stopped, or hung holding the interpreter) is the one the others wait for.
    """

    def __init__(self, rank: int, live: bool = True):
        fd = os.environ.get(ENV_HEARTBEAT)
        self.fd, self.rank, self.count = (int(fd) if fd else None), rank, 0
        self._stopped = threading.Event()
        self._thread = None
        if self.fd is not None and live:
            self._thread = threading.Thread(target=self._live, name="heartbeat", daemon=True)
            self._thread.start()

    def arrive(self) -> None:
        """Call right before a collective operation."""
        self.count += 1
        self.beat()

    def beat(self) -> None:
        """Still making progress (e.g. during a long validation), without entering a collective."""
        self._send(_PROGRESS)

    def _send(self, kind: int) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # launcher gone or pipe full: the heartbeat is best effort
            os.write(self.fd, _RECORD.pack(self.rank, self.count, kind))

    def _live(self) -> None:
        while not self._stopped.wait(LIVE_EVERY):
            self._send(_ALIVE)

    def stop(self) -> None:
        """No more "alive" records (the thread ends): before the descriptor is closed, since a thread writing
        to a closed descriptor writes into whatever file gets its number next."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def report_gave_up(rank: int) -> None:
    """Tell the launcher (if any) that this replica stops because a collective failed: a peer died or
    hung, so the launcher looks for that peer instead of blaming this one."""
    Heartbeat(rank, live=False)._send(_GAVE_UP)


def _how(code: int) -> str:
    if code == -signal.SIGKILL:
        return ("was killed by signal 9 (SIGKILL; if no one sent it, the kernel's out-of-memory killer did: too "
                "many processes for this machine's memory?)")
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code} (its own error, printed above)"


def replica_threads(replicas: int, environ) -> str | None:
    """OMP_NUM_THREADS for each of `replicas` local processes, by torchrun's rule (torch.distributed.run):
    the user's value if set, else 1 where there are several (they would oversubscribe the cores), else
    torch's own default (None: not set). The same rule under both launchers gives the same threads per
    process, so that train.py's replicas and torchrun's give bitwise the same run."""
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"]
    return "1" if replicas > 1 else None


class Launcher:
    """Start and watch the replicas of one host."""

    def __init__(self, script: str, argv: list[str], replicas: int, timeout: float, lock_fd: int | None = None):
        self.timeout = timeout
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.read_fd = read_fd
        port = free_port()
        threads = replica_threads(replicas, os.environ)
        self.procs: list[subprocess.Popen] = []
        # Forwarded from before the first start: a Ctrl-C while they start reaches each replica once
        # (SIGHUP ignored, as under nohup, stays so).
        self._watch_state(replicas)
        startup.done()  # quiet_start's handlers give way
        for s in FORWARDED:
            if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN:
                signal.signal(s, self._forward)
        for rank in range(replicas):
            env = {**watched_env(), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(replicas), "LOCAL_WORLD_SIZE": str(replicas), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), ENV_HEARTBEAT: str(write_fd)}
            if threads:
                env["OMP_NUM_THREADS"] = threads
            fds = (write_fd,)
            if lock_fd is not None:  # run.dir's lock: held while any replica lives, even if we die
                env[ENV_LOCK_FD], fds = str(lock_fd), (write_fd, lock_fd)
            # A session of their own: a terminal's Ctrl-C reaches the launcher only, which forwards it
            # exactly once (a replica treats a second Ctrl-C as "stop without checkpoint").
            self.procs.append(subprocess.Popen([sys.executable, script, *argv], env=env, pass_fds=fds,
                                               start_new_session=True))
        os.close(write_fd)

    def _watch_state(self, replicas: int) -> None:
        """What the launcher knows of each replica, from its heartbeats and the signals passed on."""
        self.counts = [0] * replicas
        self.beaten = [False] * replicas
        self.gave_up = [False] * replicas  # stopped because a collective failed (a peer's fault)
        self.progress_at = time.monotonic()
        self.seen_at = [time.monotonic()] * replicas  # the last record of any kind, per rank
        self.forwarded = 0  # the first stop signal passed on to the replicas
        self.listening = [False] * replicas  # quiet_start's handlers in place: a stop signal may be sent
        self.pending: list[tuple[int, int, float]] = []  # (rank, signal, when) not sent yet

    def _forward(self, signum, frame) -> None:
        """Pass a stop signal on to each replica once it listens (its quiet_start handlers in place, which it
        says through the heartbeat pipe): a replica still starting its interpreter would die of it with a
        traceback. Until then it is kept (`pending`) and sent when the replica says it listens."""
        self.forwarded = self.forwarded or signum
        for rank in range(len(self.listening)):  # those not started yet too
            if self.listening[rank]:
                if self.procs[rank].poll() is None:
                    self.procs[rank].send_signal(signum)
            else:
                self.pending.append((rank, signum, time.monotonic()))

    def _send_overdue(self) -> None:
        """Pending signals of replicas that never said they listen (not train.py), after UNHEARD_FORWARD_S."""
        self._send_pending(lambda rank, since: time.monotonic() - since > UNHEARD_FORWARD_S)

    def _send_pending(self, due=lambda rank, since: True) -> None:
        keep = []
        for rank, signum, since in self.pending:
            if rank < len(self.procs) and due(rank, since):
                if self.procs[rank].poll() is None:
                    self.procs[rank].send_signal(signum)
            else:
                keep.append((rank, signum, since))
        self.pending = keep

    def _read_heartbeats(self, wait: float) -> None:
        """Read the records waiting in the pipe (all of them: with many replicas a read may not drain it)."""
        while select.select([self.read_fd], [], [], wait)[0]:
            data = os.read(self.read_fd, _RECORD.size * 1024)
            if not data:
                return
            for i in range(0, len(data) - len(data) % _RECORD.size, _RECORD.size):
                self._record(*_RECORD.unpack_from(data, i))
            wait = 0

    def _record(self, rank: int, count: int, kind: int) -> None:
        if 0 <= rank < len(self.counts):
            self.counts[rank] = max(self.counts[rank], count)
            self.seen_at[rank] = time.monotonic()
            self.gave_up[rank] |= kind == _GAVE_UP
            if kind == _LISTENING:
                self.listening[rank] = True
                self._send_pending(lambda r, since: r == rank)
            if kind == _PROGRESS:
                self.beaten[rank] = True
                self.progress_at = time.monotonic()

    def _culprit(self, failed: int) -> str:
        """Who to blame: a rank that fell behind the others, else the one that failed."""
        self._read_heartbeats(0)
        behind = min(self.counts)
        laggards = [r for r, c in enumerate(self.counts) if c == behind]
        if behind < max(self.counts) and failed not in laggards:
            return (f"replica rank {', '.join(map(str, laggards))} stopped making progress (it never reached "
                    f"collective operation {behind + 1}, where the others waited); replica rank {failed} then "
                    "gave up waiting")
        now = time.monotonic()
        silent = [r for r, seen in enumerate(self.seen_at) if r != failed and now - seen > 3 * LIVE_EVERY]
        if silent:
            quiet = now - max(self.seen_at[r] for r in silent)
            return (f"replica rank {', '.join(map(str, silent))} stopped making progress (no sign of life for "
                    f"{quiet:.0f} s: stopped, or hung; the others waited in collective operation {behind}); "
                    f"replica rank {failed} then gave up waiting")
        return ""

    def _stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def run(self) -> int:
        """Wait for the replicas; the exit code is theirs, or 1 if one failed."""
        try:
            return self._watch()
        finally:
            self._stop_all()
            startup.ignore_stops()  # the outcome is decided: a late Ctrl-C must not make it a traceback
            os.close(self.read_fd)

    def _watch(self) -> int:
        while True:
            self._read_heartbeats(0.2)
            self._send_overdue()
            codes = [p.poll() for p in self.procs]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0, *(128 + s for s in FORWARDED))]
            if failed:
                self._read_heartbeats(0)
                first = next((r for r in failed if not self.gave_up[r]), failed[0])  # a cause before an effect
                return self._failed(first, codes[first])
            if all(c is not None for c in codes):
                self._say_stopped_at_start()
                return max(codes)
            if self.forwarded and not any(self.beaten) and any(c == 128 + self.forwarded for c in codes):
                # One stopped before the group formed: the others would wait for it until parallel.timeout.
                # Nothing was written yet; they are stopped (run's end) and this says it once for all.
                self._say_stopped_at_start()
                return 128 + self.forwarded
            # Replicas stuck on a peer time out by themselves (parallel.timeout) and exit; this is the
            # backstop for a deadlock in which none of them does.
            silent = time.monotonic() - self.progress_at
            if all(self.beaten) and silent > 3 * self.timeout + 120:
                print(f"train.py: no replica reported progress for {silent:.0f} s; stopping all "
                      f"(collectives entered, by rank: {self.counts})", file=sys.stderr, flush=True)
                return 1

    def _say_stopped_at_start(self) -> None:
        """The one line of a run stopped before any replica began (they say nothing at start-up)."""
        if self.forwarded and not any(self.beaten):
            print(f"train.py: interrupted by {signal.Signals(self.forwarded).name} while the replicas started; "
                  "nothing was done", file=sys.stderr, flush=True)

    def _failed(self, rank: int, code: int) -> int:
        blame = self._culprit(rank) if self.gave_up[rank] else ""  # else it failed by itself: name it
        msg = blame or f"replica rank {rank} (pid {self.procs[rank].pid}) {_how(code)}"
        print(f"train.py: {msg}; stopping the other replicas", file=sys.stderr, flush=True)
        return 1


def launch_local(script: str, argv: list[str], replicas: int, timeout: float, lock_fd: int | None = None) -> int:
    """Start `replicas` copies of `script` and watch them (module docstring); they inherit `lock_fd`."""
    return Launcher(script, argv, replicas, timeout, lock_fd).run()
