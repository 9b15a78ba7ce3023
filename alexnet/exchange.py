"""Keeping data-parallel replicas in step.

``parallel.exchange: weights`` (Ding et al. 2014, section 2.2): every ``exchange_every`` steps each
replica's parameters and momentum are averaged with its peers'. Everything is packed into one flat
buffer first, so a transport moves a few large blocks, never one message per tensor:

- ``ipc`` (one host): each replica exposes two flat buffers (alternating between exchanges), through
  CUDA IPC on a GPU or a shared-memory mapping on the CPU, and reads its peers' buffers directly: the
  paper's peer-to-peer copies. It also works for several replicas on one GPU, where NCCL refuses.
  Every replica sums the buffers in rank order, so all replicas hold bit-identical weights afterwards.
- ``nccl`` / ``gloo`` (and the in-process rank simulator): one all-reduce of the flat buffer (``Comm``).

``parallel.exchange: gradients`` (synchronous SGD, Synkhronos / Goyal et al.): gradients are averaged
during the backward pass by DistributedDataParallel (bucketed, overlapped with computation) over the
processes that hold the same part of the model: every process with data parallelism alone, the
data-parallel group of each model part otherwise; see :func:`wrap_gradients`. A group without a
torch.distributed process group (the rank simulator, layers/sim.py) averages them after the backward
pass instead (:class:`AveragedGradients`): the same mean, over the same group, without the overlap.

Batch norm's running statistics (alexnet_bn) are per replica during training, as in Caffe: each replica
normalises its own images and updates its own statistics. The weights exchange averages them with the
weights (floating buffers only, not the batch count); in gradients mode :func:`average_buffers` averages
them before validation and checkpoints. The running statistics are exponential moving averages, linear
in the batch statistics, so averaging them now and then gives the same averages later as never doing it
(up to rounding).
"""
from __future__ import annotations

import contextlib
import fcntl
import inspect
import os
import re
import secrets
import time
from pathlib import Path

import torch
from torch import nn

from layers import Comm, TorchComm, all_reduce_sum


def flat_size(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy `tensors` (any memory format) one after another into the 1-d `flat`."""
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


def floating_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's floating-point buffers: batch norm's running statistics (not its integer batch count)."""
    return [b for b in model.buffers() if b.is_floating_point()]


@torch.no_grad()
def average_buffers(buffers: list[torch.Tensor], comm: Comm) -> None:
    """Replace every buffer by its mean over `comm`'s group (one flat all-reduce; nothing if none)."""
    if not buffers or comm.size == 1:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    all_reduce_sum(flat, comm)
    unpack(flat.div_(comm.size), buffers)


def average_statistics(model: nn.Module, data: Comm | None) -> None:
    """Batch norm's running statistics, per process in training, averaged over the processes that hold the
    same layers (before validation and checkpoints): a ShardedNet's model group for its replicated layers
    (fc's convs, data parallel inside it), then `data`, the data-parallel group in gradients mode (the
    weights exchange averages them itself). Nothing without such statistics."""
    replicated = getattr(model, "replicated_buffers", None)  # a ShardedNet; columns shard every statistic
    if replicated is not None:
        average_buffers(replicated(), model.comm)
    if data is not None:
        average_buffers(floating_buffers(model), data)


@torch.no_grad()
def broadcast_from_first(tensors: list[torch.Tensor], peers: Comm) -> None:
    """Make every member of `peers` start from its first member's values (one flat broadcast)."""
    if peers.size == 1:
        return
    flat = torch.empty(flat_size(tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    pack(tensors, flat)
    peers.broadcast(flat, src=0)
    unpack(flat, tensors)


class AllReduceAverage:
    """The mean over the peers through one all-reduce (nccl, gloo, the simulator)."""

    def __init__(self, numel: int, device: torch.device, peers: Comm, dtype: torch.dtype = torch.float32):
        self.flat = torch.empty(numel, device=device, dtype=dtype)
        self.peers = peers

    def average(self, tensors: list[torch.Tensor]) -> None:
        pack(tensors, self.flat)
        self.peers.all_reduce(self.flat)
        self.flat.div_(self.peers.size)
        unpack(self.flat, tensors)

    def close(self) -> None:
        """Nothing to release: the buffer is ordinary device memory."""


# The CPU twin's shared buffers: files in /dev/shm (RAM), named alexnet-<token>-<rank>-<buffer>. Each maker
# holds an flock on its files from the moment it makes them until it unlinks them, once every peer has mapped
# them; a file nobody holds that is older than STALE_AFTER_S was left by a replica killed in that window
# (any name after the token: those of mutmut's mutants, which it kills at a time limit, are left too).
SEGMENT = re.compile(r"^alexnet-[0-9a-f]{16}-")
STALE_AFTER_S = 60.0


def shm_folder() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def make_segment(path: Path, nbytes: int) -> int:
    """Make the file `path` of `nbytes` bytes, locked: the open descriptor (close it after unlinking)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def remove_stale_segments(folder: Path) -> list[Path]:
    """Remove the segments of replicas killed while they shared them (SIGKILL, the OOM killer: nothing of
    theirs ran to unlink them, and a file in /dev/shm holds its size of RAM until the machine restarts);
    returns them. A live one is locked by its maker; a young one may not be locked yet."""
    removed = []
    for path in sorted(folder.glob("alexnet-*")):
        if not SEGMENT.match(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # unlinked meanwhile by its maker, or not ours to open
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < STALE_AFTER_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
            removed.append(path)
        except OSError:  # held by a live maker
            continue
        finally:
            os.close(fd)
    return removed


class IpcAverage:
    """The mean over the replicas of one host, each reading its peers' buffers directly.

    CPU: shared-memory buffers; host barriers order everything. CUDA (every replica on the same GPU;
    resolve_transport refuses distinct GPUs): CUDA IPC buffers, ordered by interprocess events so the
    host never waits for the device. Per replica and buffer, ``packed`` is recorded after writing it
    and ``consumed`` after reading every peer's; a replica's stream waits for its peers' ``packed``
    before reading and for their ``consumed`` (two exchanges old) before writing its buffer again.
    One host barrier per exchange makes sure each waited-for event was recorded for the right round.
    """

    def __init__(self, numel: int, device: torch.device, peers: Comm, dtype: torch.dtype = torch.float32):
        self.info, self.device, self.dtype = peers, device, dtype
        self.turn = 0
        if device.type == "cuda":  # pragma: no mutate block (CUDA only: make gpu-check)
            own = [torch.empty(numel, device=device, dtype=dtype) for _ in range(2)]
            self.packed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            self.buffers, self.peer_packed, self.peer_consumed = self._share_cuda(own)
        else:
            self.buffers = self._share_cpu(numel)
        self.acc = torch.empty(numel, device=device, dtype=dtype)

    def _share_cuda(self, own: list[torch.Tensor]):  # pragma: no mutate block (CUDA only: make gpu-check)
        """Every peer's two buffers and events, rebuilt here from CUDA IPC handles (ours used as they are)."""
        from torch.multiprocessing.reductions import reduce_tensor
        mine = ([reduce_tensor(b) for b in own], [e.ipc_handle() for e in self.packed],
                [e.ipc_handle() for e in self.consumed])
        handles = self.info.all_gather_object(mine)
        peers, packed, consumed = [], [], []
        for r, (buffers, packed_h, consumed_h) in enumerate(handles):
            if r == self.info.rank:
                peers.append(own)
                packed.append(self.packed)
                consumed.append(self.consumed)
                continue
            peers.append([fn(*args) for fn, args in buffers])
            packed.append([torch.cuda.Event.from_ipc_handle(self.device, h) for h in packed_h])
            consumed.append([torch.cuda.Event.from_ipc_handle(self.device, h) for h in consumed_h])
        return peers, packed, consumed

    def _share_cpu(self, numel: int) -> list[list[torch.Tensor]]:
        """Shared mappings of files in /dev/shm, unlinked once every peer has mapped them, or when this
        replica fails first; those a killed replica left are removed by the next start (module note)."""
        folder = shm_folder()
        if self.info.rank == 0 and (stale := remove_stale_segments(folder)):
            more = f" and {len(stale) - 1} more" if len(stale) > 1 else ""
            print(f"removed {stale[0]}{more}: shared memory of replicas that were killed", flush=True)
        token = self.info.broadcast_object(secrets.token_hex(8), src=0)
        name = lambda r, b: folder / f"alexnet-{token}-{r}-{b}"  # noqa: E731
        held = []
        try:
            for b in range(2):
                held.append(make_segment(name(self.info.rank, b), numel * self.dtype.itemsize))
            self.info.barrier()
            peers = [[torch.from_file(str(name(r, b)), shared=True, size=numel, dtype=self.dtype)
                      for b in range(2)] for r in range(self.info.size)]
            self.info.barrier()
        finally:
            for b in range(len(held)):
                name(self.info.rank, b).unlink(missing_ok=True)
            for fd in held:
                os.close(fd)
        return peers

    def _others(self) -> list[int]:  # pragma: no mutate block (CUDA only: its callers are)
        return [r for r in range(self.info.size) if r != self.info.rank]

    def average(self, tensors: list[torch.Tensor]) -> None:
        t, cuda = self.turn, self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None  # pragma: no mutate (CUDA only)
        if cuda:  # pragma: no mutate block (CUDA only) - peers may still be reading this buffer from two exchanges ago
            for r in self._others():
                stream.wait_event(self.peer_consumed[r][t])
        pack(tensors, self.buffers[self.info.rank][t])
        if cuda:  # pragma: no mutate block (CUDA only)
            self.packed[t].record(stream)
        # After this barrier every peer has written (CPU) or recorded the writing of (CUDA) its buffer of
        # this turn; the other turn's buffers may still be read by slower peers, hence two per replica.
        self.info.barrier()
        if cuda:  # pragma: no mutate block (CUDA only)
            for r in self._others():
                stream.wait_event(self.peer_packed[r][t])
        for r in range(self.info.size):  # rank order on every replica: bit-identical sums
            if r == 0:
                self.acc.copy_(self.buffers[r][t])
            else:
                self.acc.add_(self.buffers[r][t])
        if cuda:  # pragma: no mutate block (CUDA only)
            self.consumed[t].record(stream)
        self.acc.div_(self.info.size)
        unpack(self.acc, tensors)
        self.turn = 1 - t

    def close(self) -> None:
        """Drop the mappings. Peers still reading our CUDA buffers keep them alive: torch counts the
        references of memory sent through CUDA IPC and frees it only after the consumers let go."""
        self.buffers = []
        self.acc = None


class WeightExchange:
    """Average parameters, momentum buffers and batch norm's running statistics across replicas every
    `every` steps."""

    def __init__(self, model: nn.Module, optimizer, peers: Comm, transport: str, every: int = 1):
        self.model, self.optimizer, self.every, self.peers = model, optimizer, every, peers
        tensors = self.tensors()
        impl = IpcAverage if transport == "ipc" else AllReduceAverage
        # one heartbeat per exchange (average()), however many collectives the transport makes of it
        self.impl = impl(flat_size(tensors), tensors[0].device, peers.with_before(None), tensors[0].dtype)
        n, size = peers.size, self.bytes_per_exchange()
        # bytes that cross a link per exchange, per replica: ring all-reduce, or reading every peer
        self.moved = (n - 1) * size if transport == "ipc" else 2 * (n - 1) * size // n
        self.sent = [0]

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, velocities, then running statistics (looked up each time: loading a checkpoint
        replaces the velocities)."""
        return [p.data for p in self.model.parameters()] + self.optimizer.velocities() + floating_buffers(self.model)

    def bytes_per_exchange(self) -> int:
        tensors = self.tensors()
        return flat_size(tensors) * tensors[0].element_size()

    @torch.no_grad()
    def after_step(self, steps_done: int) -> bool:
        """Call after each optimizer step; exchanges when `steps_done` is a multiple of `every`."""
        if steps_done % self.every:
            return False
        self.average()
        return True

    @torch.no_grad()
    def average(self) -> None:
        """Average now (also between scheduled exchanges: before a checkpoint)."""
        self.peers.arrive()
        self.impl.average(self.tensors())
        self.sent[0] += self.moved

    def close(self) -> None:
        self.impl.close()


_DDP_ARGS = frozenset(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)


def wrap_gradients(model: nn.Module, device: torch.device, bucket_mb: float, comm: Comm | None = None) -> nn.Module:
    """The gradients of `model` averaged over `comm`'s group (default: the whole world) at every step.

    A torch.distributed group: DistributedDataParallel, gradients averaged in buckets of `bucket_mb`, each
    bucket's all-reduce launched as soon as its gradients are ready, so it overlaps the rest of the
    backward pass. Another Comm (the rank simulator): :class:`AveragedGradients`, the same mean after it.

    `comm`: the processes holding the same parameters (a model part's data-parallel group); its
    `before` runs ahead of DDP's start-up collectives and of each bucket's all-reduce (the launcher's
    heartbeat), and it counts the bytes sent.
    """
    if comm is not None and not isinstance(comm, TorchComm):
        return AveragedGradients(model, comm)
    # pragma: no mutate start (DDP needs real processes: tests/test_parallel_math.py's gloo layouts,
    # tests/test_model_parallel.py's buckets, the hand-made mutants of tools/mutants)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [device.index] if device.type == "cuda" else None
    if comm is not None:
        comm.arrive()  # DDP's constructor checks the shapes and broadcasts the parameters
    # Batch norm's running statistics stay per replica (as Caffe's); DDP's default would overwrite them with
    # rank 0's before every forward. They are averaged before validation and checkpoints instead
    # (average_buffers). torch 2.13 renamed the switch (and warns about the old name); the init sync the new
    # one keeps is harmless: every replica starts from the same statistics.
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS else {"broadcast_buffers": False}
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
              process_group=comm.group if comm is not None else None, **no_sync)
    if comm is None:
        return ddp

    def hook(group, bucket):
        comm.arrive()
        buffer = bucket.buffer()
        comm.sent[0] += 2 * buffer.numel() * buffer.element_size() * (comm.size - 1) // comm.size
        return allreduce_hook(group, bucket)  # the group is the hook's state: without it, the whole world
    ddp.register_comm_hook(comm.group, hook)
    return ddp
    # pragma: no mutate end


class AveragedGradients(nn.Module):
    """DistributedDataParallel's mean over a Comm that is not a torch.distributed group (the simulator):
    the first member's parameters and buffers at the start, then after the backward passes of a step,
    :meth:`sync` replaces every gradient by its mean over the group (one flat all-reduce). `no_sync` is
    accepted as DDP's (gradients accumulate until the sync)."""

    def __init__(self, module: nn.Module, comm: Comm):
        super().__init__()
        self.module, self.comm = module, comm
        broadcast_from_first([p.data for p in module.parameters()] + floating_buffers(module), comm)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    @torch.no_grad()
    def sync(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads or self.comm.size == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat)
        unpack(flat.div_(self.comm.size), grads)
