"""The parallel loader (Ding et al. 2014, section 2.1): the next batches are prepared while the trainer
computes, directly in device memory the trainer owns.

The trainer allocates k >= 2 slots (float batches on its device) and starts a loader, a process
(``data.loading: process``; the slots are shared by CUDA IPC on a GPU, by shared memory on the CPU) or
a thread (``thread``). Per batch there is one small message each way over a pipe:

    loader -> trainer   ("ready", slot, step, n, job)   after recording ready[slot] on its stream
    trainer -> loader   ("free", slot)                  after recording free[slot] on its stream

The trainer's stream waits for ready[slot] before reading the slot, and the loader's stream waits for
free[slot] before writing it again: the GPU orders the two processes' work and neither host waits for
the device. Each event is recorded only by the process that created it (ready: loader, free: trainer).

A job is one pass over a split from a step (``("job", split, epoch, start, job)``); it ends with
``("end", job)`` once every slot is back with the loader, so no message crosses a job boundary. A
consumer that stops early sends ``("stop", job)`` and returns what it holds.

Lifecycle: the loader dies with its trainer (pipe EOF, and the kernel's parent-death signal for a
process); a loader that dies or hangs makes the trainer raise :class:`LoaderError` naming it, while
bad data it meets (a ``BatchFileError`` or ``DataError``) is raised again in the trainer as itself;
Ctrl-C, SIGTERM and SIGHUP are left to the trainer, which checkpoints and then closes the loader.

A loader process is spawned for a GPU (CUDA cannot be forked) and forked on the CPU, where a spawned one
would spend its first one to two seconds of CPU importing torch again (every run and every replica);
``start="spawn"`` gives the CPU the GPU's way, for its CPU twin.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from .batchfile import BatchFileError
from .layouts import DataError
from .loader import Batch, BatchMaker, LoaderSpec, count_steps
from .procs import die_with_parent


class LoaderError(RuntimeError):
    """The loader died, failed or stopped answering; the message names it and its error."""


@dataclass
class Slots:
    """k batches of float images and labels on the trainer's device.

    Separate tensors, not one k x B tensor: autograd's version counter is per storage, and writing
    slot j must not look like a modification of slot i, which the trainer's backward still needs.
    """

    x: list[torch.Tensor]  # k of B x 3 x crop x crop (channels_last if requested)
    y: list[torch.Tensor]  # k of B, int64

    @property
    def k(self) -> int:
        return len(self.y)


def allocate_slots(spec: LoaderSpec, k: int, shared: bool) -> Slots:
    """The trainer-owned output slots; CPU slots go to shared memory when a process fills them."""
    b, c, device = max(spec.batch_size, spec.val_batch_size), spec.crop, torch.device(spec.device)
    fmt = torch.channels_last if spec.channels_last else torch.contiguous_format
    x = [torch.empty((b, 3, c, c), device=device, memory_format=fmt) for _ in range(k)]
    y = [torch.zeros(b, dtype=torch.int64, device=device) for _ in range(k)]
    if shared and device.type == "cpu":
        for t in x + y:
            t.share_memory_()
    return Slots(x, y)


def _events(device: torch.device, k: int, interprocess: bool) -> list | None:
    if device.type != "cuda":
        return None
    # Only streams wait on these (never the host), so they need no blocking sync.
    return [torch.cuda.Event(interprocess=interprocess) for _ in range(k)]


def _loader_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def order_after(stream, other) -> None:
    """Make `stream`'s later work wait for everything queued on `other` so far (no-op without CUDA)."""
    if stream is not None and other is not None:
        stream.wait_stream(other)


# -- the loader side -----------------------------------------------------------------------------

class _Worker:
    """Fills slots for the jobs the trainer sends (runs in the loader thread or process)."""

    def __init__(self, spec: LoaderSpec, slots: Slots, free_events, ready_events, conn, stream=None):
        self.maker = BatchMaker(spec)
        self.device = self.maker.device
        self.slots, self.free_events, self.ready_events, self.conn = slots, free_events, ready_events, conn
        self.stream = stream if stream is not None else _loader_stream(self.device)

    def serve(self) -> None:
        while True:
            msg = self.conn.recv()
            if msg[0] == "quit":
                if self.stream is not None:  # the slots are the trainer's memory: finish writing them first
                    self.stream.synchronize()
                return
            if msg[0] != "job":
                raise LoaderError(f"loader got {msg[0]!r} outside a job")
            self.run_job(*msg[1:])

    def run_job(self, split: str, epoch: int, start: int, job: int) -> None:
        free, step, end, stopped = deque(range(self.slots.k)), start, self.maker.steps(split), False
        while True:
            producing = not stopped and step < end
            if producing and free and not self.conn.poll():
                self.produce(free.popleft(), split, epoch, step, job)
                step += 1
                continue
            if not producing and len(free) == self.slots.k:
                self.conn.send(("end", job))
                return
            msg = self.conn.recv()  # nothing to do until a slot comes back (or the job is stopped)
            if msg[0] == "free":
                free.append(msg[1])
            elif msg[0] == "stop":
                stopped = True
            else:
                raise LoaderError(f"loader got {msg[0]!r} inside job {job}")

    def produce(self, slot: int, split: str, epoch: int, step: int, job: int) -> None:
        host = self.maker.read(split, epoch, step)  # disk and host work first
        n = host.n
        if n:
            with torch.cuda.stream(self.stream):  # a no-op context for None (CPU)
                wait = None if self.stream is None else (lambda: self.stream.wait_event(self.free_events[slot]))
                _, y = self.maker.to_device(host, out=self.slots.x[slot], before_write=wait)
                self.slots.y[slot][:n].copy_(y, non_blocking=True)
                if self.stream is not None:
                    self.ready_events[slot].record(self.stream)
        self.conn.send(("ready", slot, step, n, job))


def worker_main(spec: LoaderSpec, slots: Slots, free_events, conn, in_process: bool = True,
                ready_events=None, stream=None) -> None:
    """Entry point of the loader process (it creates the ready events and sends them) or thread.

    A thread is given its ready events and its stream by the trainer, which orders its own stream
    after the loader's when it closes (see SlotLoader.close).
    """
    try:
        if in_process:
            # Ctrl-C, SIGTERM and SIGHUP (a terminal's signals reach its whole process group) are the
            # trainer's to handle: it checkpoints, then closes the loader. A forked loader would otherwise
            # run the trainer's own handlers.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            die_with_parent()
            torch.set_num_threads(1)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if in_process:
            ready_events = _events(device, slots.k, interprocess=True)
        worker = _Worker(spec, slots, free_events, ready_events, conn, stream)
        conn.send(("started", ready_events if in_process else None))
        worker.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the trainer is gone: nothing to report to
    except (BatchFileError, DataError) as e:  # bad data, not a loader failure: the trainer raises it again
        with contextlib.suppress(OSError):
            conn.send(("bad_data", getattr(e, "path", None), str(e)))
        if in_process:
            sys.exit(1)
    except BaseException:
        with contextlib.suppress(OSError):  # the trainer may be gone too: then nobody is listening
            conn.send(("error", traceback.format_exc()))
        if in_process:
            sys.exit(1)
    finally:
        if in_process:
            release(slots)


def release(slots: Slots) -> None:
    """A loader process lets go of the trainer's slots before it exits. On a GPU they are CUDA IPC
    views: the trainer may free that memory only once every process that opened it has closed it, and
    a process's exit closes nothing (multiprocessing ends it without freeing its arguments), so the
    trainer would warn at its own exit that its shared CUDA tensors were never released."""
    slots.x.clear()
    slots.y.clear()


def _bad_data(path: str | None, text: str) -> BatchFileError | DataError:
    """The loader's BatchFileError or DataError, raised again in the trainer: bad input, exit 2."""
    if path is None:
        return DataError(text)
    return BatchFileError(path, text.removeprefix(f"{path}: "))


# -- the trainer side ----------------------------------------------------------------------------

class SlotLoader:
    """``data.loading: process | thread``: batches arrive in shared slots, prepared concurrently."""

    def __init__(self, spec: LoaderSpec, mode: str = "process", k: int = 3, timeout: float = 300.0,
                 start: str | None = None):
        if mode not in ("process", "thread"):
            raise ValueError(f"data.loading must be process or thread here, got {mode!r}")
        if k < 2:
            raise ValueError(f"data.slots must be at least 2, got {k}")
        self.spec, self.mode, self.timeout = spec, mode, timeout
        self.device = torch.device(spec.device)
        self._steps = count_steps(spec)
        self.slots = allocate_slots(spec, k, shared=mode == "process")
        self.free_events = _events(self.device, k, interprocess=mode == "process")
        self.home_stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self.free_events is not None:
            # The slots were allocated (labels zero-filled) on this stream: the loader's first write
            # into a slot must wait for that too, and a never-recorded event would not make it wait.
            for event in self.free_events:
                event.record(self.home_stream)
        self.loader_stream = None  # a loader thread's stream (a process's own is out of reach)
        self.job, self._closed = 0, False
        if mode == "process":
            ctx = mp.get_context(start or ("spawn" if self.device.type == "cuda" else "fork"))
            sys.stdout.flush()  # a forked child would write out what the parent still buffers a second time
            sys.stderr.flush()
            self.conn, child = ctx.Pipe()
            self.worker = ctx.Process(target=worker_main, args=(spec, self.slots, self.free_events, child),
                                      name=f"alexnet-loader-{spec.rank}", daemon=True)
            self.worker.start()
            child.close()
            self.ready_events = self._recv("started")[1]
        else:
            self.conn, child = mp.Pipe()
            self.ready_events = _events(self.device, k, interprocess=False)
            self.loader_stream = _loader_stream(self.device)
            self.worker = threading.Thread(
                target=worker_main, name=f"alexnet-loader-{spec.rank}", daemon=True,
                args=(spec, self.slots, self.free_events, child, False, self.ready_events, self.loader_stream))
            self.worker.start()
            self._recv("started")

    @property
    def name(self) -> str:
        if self.mode == "process":
            return f"loader process {self.worker.name} (pid {self.worker.pid})"
        return f"loader thread {self.worker.name}"

    def steps(self, split: str) -> int:
        return self._steps[split]

    def _death(self) -> str:
        if self.mode == "thread":
            return f"the {self.name} ended unexpectedly"
        self.worker.join(5)  # its pipe may close before the process is reaped: wait for the exit code
        code = self.worker.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"the {self.name} {how}"

    def _recv(self, during: str) -> tuple:
        """The loader's next message, watching that it is alive; LoaderError otherwise."""
        deadline = time.monotonic() + self.timeout
        while not self.conn.poll(0.05):
            if not self.worker.is_alive() and not self.conn.poll():
                raise LoaderError(f"{self._death()} (while waiting for: {during})")
            if time.monotonic() > deadline:
                raise LoaderError(f"the {self.name} sent nothing for {self.timeout:.0f} s while the trainer "
                                  f"waited for {during} (data.loader_timeout)")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise LoaderError(f"{self._death()} (while waiting for: {during})") from None
        if msg[0] == "error":
            raise LoaderError(f"the {self.name} failed:\n{msg[1]}")
        if msg[0] == "bad_data":
            raise _bad_data(*msg[1:])
        return msg

    def _send(self, msg: tuple) -> None:
        """A message to the loader; a loader that is gone is a LoaderError naming it, not a BrokenPipe,
        unless it said why before it went (bad data, its own error): then that is raised."""
        try:
            self.conn.send(msg)
        except OSError:
            self._last_words()
            raise LoaderError(f"{self._death()} (while sending it {msg[0]!r})") from None

    def _last_words(self) -> None:
        """Raise what a loader that has gone sent last, if it was bad data or its error (messages the
        trainer had not read yet when it found the pipe closed)."""
        said = []
        with contextlib.suppress(EOFError, OSError):
            while self.conn.poll():
                said.append(self.conn.recv())
        for msg in said:  # raised outside the suppression: a BatchFileError is an OSError
            if msg[0] == "error":
                raise LoaderError(f"the {self.name} failed:\n{msg[1]}")
            if msg[0] == "bad_data":
                raise _bad_data(*msg[1:])

    def batches(self, split: str, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches of `split` from step `start`; the loader works ahead into free slots."""
        self.job += 1
        job, held, finished = self.job, None, False
        self._send(("job", split, epoch, start, job))
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            while True:
                msg = self._recv(f"{split} batch")
                if msg[0] == "end":
                    finished = True
                    return
                _, slot, step, n, _ = msg
                if n == 0 and not self.spec.keep_empty:
                    self._send(("free", slot))
                    continue
                if stream is not None and n:  # nothing was written, so no ready event was recorded
                    stream.wait_event(self.ready_events[slot])
                held = slot
                yield Batch(self.slots.x[slot][:n], self.slots.y[slot][:n], step)
                self._give_back(slot, stream)
                held = None
        finally:
            if not finished:
                self._abandon(job, held, stream)

    def _give_back(self, slot: int, stream) -> None:
        if stream is not None:
            self.free_events[slot].record(stream)
        self._send(("free", slot))

    def _abandon(self, job: int, held: int | None, stream) -> None:
        """Stop a job early: return every slot and wait for its end, so the next job starts clean."""
        if not self.worker.is_alive():
            return
        # If the loader fails meanwhile, the caller's own error is the one to report.
        with contextlib.suppress(LoaderError, OSError):
            if held is not None:
                self._give_back(held, stream)
            self.conn.send(("stop", job))
            while (msg := self._recv("the end of a stopped job"))[0] != "end":
                self.conn.send(("free", msg[1]))

    def close(self) -> None:
        """Ask the loader to quit, and make sure it is gone."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # a dead loader's pipe is closed: nothing to ask
            self.conn.send(("quit",))
        self.worker.join(10)
        if self.mode == "process" and self.worker.is_alive():
            self.worker.kill()
            self.worker.join(5)
        # The slots' memory belongs to the stream they were allocated on, and a thread wrote them on
        # its own: once freed, that memory must not be reused before those writes are done.
        order_after(self.home_stream, self.loader_stream)
        self.conn.close()
