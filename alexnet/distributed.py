"""Where this process runs: rank, world size, device and process groups, and the rank-0 helpers.

One initialisation path for every launch: torch.distributed's environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), set by torchrun on many hosts or by
train.py itself for the replicas of one host (alexnet/launch.py). Without them: one replica.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from layers import Comm, TorchComm

from .config import Config, ConfigError, ParallelConfig


def alone() -> Comm:
    """The group of one process: every collective on it returns at once."""
    return TorchComm(None, None, 0, (0,))


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = torch.device("cpu")
    transport: str = "none"   # how replicas exchange: ipc | nccl | gloo (none for one replica)
    comm: Comm = field(default_factory=alone)  # every process: metrics, stop requests, RNG states, barriers
    slow: Comm = field(default_factory=alone)  # every process, for waiting on disks (run.checkpoint_timeout)
    model_size: int = 1       # M: processes holding one model between them (rank = data rank x M + model rank)
    model_peers: Comm | None = None  # this process's model group (M > 1)
    data_peers: Comm | None = None   # the processes holding the same part of the model: they average
    store: Any = None         # this attempt's own namespace of the rendezvous store (attempt_store)

    @property
    def model_rank(self) -> int:
        return self.rank % self.model_size

    @property
    def data_rank(self) -> int:
        return self.rank // self.model_size

    @property
    def replicas(self) -> int:
        """R: data-parallel copies of the model (each held by a model group of M processes)."""
        return self.world // self.model_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def device_for(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: the local rank's GPU if CUDA is present, else the CPU; ``cuda``: the local rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device {name!r} is not a device (cpu, cuda, cuda:N, auto)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) present")
    return device


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """device_for(), made this thread's current CUDA device where it is one."""
    device = device_for(name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def replica_device_name(devices: list[str], fallback: str, local_rank: int) -> str:
    """parallel.devices[local_rank % len] (several replicas may share one), else run.device."""
    return devices[local_rank % len(devices)] if devices else fallback


def machine_id() -> str:
    """This machine: host name and kernel boot id (two containers of one host may share the boot id
    but have their own host names, shared memory and CUDA IPC namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def gpu_id(device: torch.device) -> str | None:
    """The physical identity of a CUDA device (its UUID, else its PCI bus id); None for the CPU.

    Device indices are not identities: with a per-process CUDA_VISIBLE_DEVICES (SLURM --gpus-per-task,
    some Kubernetes set-ups) every process calls its GPU cuda:0.
    """
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    if hasattr(props, "pci_bus_id"):
        return f"pci-{getattr(props, 'pci_domain_id', 0)}:{props.pci_bus_id}:{getattr(props, 'pci_device_id', 0)}"
    return f"{machine_id()}/cuda:{device.index}"  # an old torch that tells neither: the index, as a last resort


@dataclass(frozen=True)
class Placement:
    """Where every rank runs: its machine and its physical GPU (None on the CPU), in rank order."""

    hosts: tuple[str, ...]
    gpus: tuple[str | None, ...]

    @property
    def single_host(self) -> bool:
        return len(set(self.hosts)) == 1

    @property
    def gpu_each(self) -> bool:
        """Every rank has a GPU of its own (what NCCL needs)."""
        return None not in self.gpus and len(set(self.gpus)) == len(self.gpus)

    @property
    def one_gpu(self) -> bool:
        """All ranks share a single GPU (where ipc is the right weights exchange)."""
        return None not in self.gpus and len(set(self.gpus)) == 1


def resolve_transport(p: ParallelConfig, placement: Placement) -> str:
    """The transport for `p.transport`, with auto resolved; ConfigError for impossible choices."""
    t, cuda = p.transport, placement.gpus[0] is not None
    ipc_fits = placement.single_host and (not cuda or placement.one_gpu)
    if t == "auto":
        if cuda and placement.gpu_each:
            return "nccl"
        return "ipc" if p.exchange == "weights" and ipc_fits else "gloo"
    if t == "nccl" and not (cuda and placement.gpu_each):
        raise ConfigError("parallel.transport=nccl needs one GPU per replica (NCCL refuses two ranks on one GPU, "
                          "and has no CPU path); use ipc (weights exchange) or gloo")
    if t == "ipc" and not placement.single_host:
        raise ConfigError("parallel.transport=ipc works between replicas of one host; use nccl or gloo")
    if t == "ipc" and not ipc_fits:
        raise ConfigError("parallel.transport=ipc across distinct GPUs would open a CUDA context on every peer's "
                          "GPU (0.3-0.5 GB each) and copy the peers' buffers one after another; use nccl (what "
                          "auto picks when every replica has its own GPU) or gloo")
    return t


class StartError(RuntimeError):
    """This process could not join the others (a peer that never came, a rendezvous that failed)."""


_HELLO, _ACK = "alexnet/hello", "alexnet/ack"


def attempt_store(store, rank: int, world: int, timeout: float):
    """A namespace of `store` that only the processes of this attempt use.

    torchrun's c10d rendezvous hands every attempt (restart) of a job the same store, shared with the
    attempts before it, and its restart counter is per agent (an agent whose own workers did not fail
    restarts them without counting), so neither the store nor TORCHELASTIC_RESTART_COUNT tells attempts
    apart. Keys an earlier attempt left (gloo's listening addresses of killed workers, placement) would
    then be read as this attempt's: connections refused or hung. So rank 0 draws a fresh token and hands
    it to each rank in answer to a nonce that rank drew itself: a rank waits only for a key named after
    its own nonce, rank 0 only for keys under its own token, and neither can be left by another attempt.
    Rank 0 answers every nonce it reads (a stale one harmlessly) until every rank confirmed the token.
    """
    deadline = time.monotonic() + timeout
    if rank != 0:
        nonce = secrets.token_hex(16)
        store.set(f"{_HELLO}/{rank}", nonce)
        try:
            store.wait([f"{_ACK}/{nonce}"], timedelta(seconds=timeout))
        except RuntimeError as e:  # DistStoreError: the wait timed out
            raise StartError(f"rank {rank}: rank 0 did not answer within {timeout:g} s (parallel.timeout): "
                             f"is it running? ({_first_line(e)})") from None
        namespace = f"alexnet/attempt/{store.get(f'{_ACK}/{nonce}').decode()}"
        store.set(f"{namespace}/ready/{rank}", "1")
        return dist.PrefixStore(namespace, store)
    namespace = f"alexnet/attempt/{secrets.token_hex(16)}"
    answered: set[str] = set()
    pending, pause = set(range(1, world)), 0.01
    while pending:
        for r in sorted(pending):
            if store.check([f"{_HELLO}/{r}"]):
                nonce = store.get(f"{_HELLO}/{r}").decode()
                if nonce not in answered:
                    store.set(f"{_ACK}/{nonce}", namespace.rsplit("/", 1)[1])
                    answered.add(nonce)
        pending = {r for r in pending if not store.check([f"{namespace}/ready/{r}"])}
        if pending and time.monotonic() > deadline:
            raise StartError(f"rank 0: rank(s) {_ranks(pending)} did not join within {timeout:g} s "
                             "(parallel.timeout): not started, or stopped at start-up")
        time.sleep(pause if pending else 0)
        pause = min(0.5, pause * 2)
    return dist.PrefixStore(namespace, store)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _ranks(ranks: set[int]) -> str:
    listed = ", ".join(map(str, sorted(ranks)[:10]))
    return listed + (f" and {len(ranks) - 10} more" if len(ranks) > 10 else "")


def exchange_placement(store, rank: int, world: int, device: torch.device) -> Placement:
    """Every rank's machine and GPU, through this attempt's store (attempt_store), before any process
    group exists, since the backend depends on them."""
    store.set(f"placement/{rank}", json.dumps([machine_id(), gpu_id(device)]))
    seen = [json.loads(store.get(f"placement/{r}")) for r in range(world)]
    return Placement(tuple(h for h, _ in seen), tuple(g for _, g in seen))


def setup(cfg: Config) -> DistInfo:
    """This process's replica: one alone, or one of WORLD_SIZE set up through torch.distributed."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(device=pick_device(replica_device_name(cfg.parallel.devices, cfg.run.device, 0)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % cfg.parallel.model_size:
        raise ConfigError(f"{world} processes cannot form model groups of parallel.model_size="
                          f"{cfg.parallel.model_size}; start a multiple of it")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(replica_device_name(cfg.parallel.devices, cfg.run.device, local_rank), local_rank)
    with _finished_within(cfg.parallel.timeout + SETUP_MARGIN, f"rank {rank}: joining the other processes"):
        return _join(cfg, rank, world, local_rank, local_world, device)


SETUP_MARGIN = 60.0  # seconds past parallel.timeout before a start-up that hangs is cut short


@contextlib.contextmanager
def _finished_within(seconds: float, what: str):
    """End the process (exit 1, one line) if the block runs past `seconds`.

    torch.distributed's own timeouts bound each step of joining, but a gloo connection to a peer that
    vanished mid-handshake has been seen to wait forever inside C++ (py-spy: ProcessGroupGloo's
    constructor, idle), where no Python exception can reach the main thread. A hang is never an answer.
    """
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(f"train.py: error: {what} did not finish within {seconds:g} s (parallel.timeout + "
                  f"{SETUP_MARGIN:g} s): a peer died or never came; stopping", file=sys.stderr, flush=True)
            os._exit(1)
    threading.Thread(target=watch, name="setup-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _join(cfg: Config, rank: int, world: int, local_rank: int, local_world: int, device: torch.device) -> DistInfo:
    """setup()'s part that talks to the other processes: this attempt's store, the placement, the groups."""
    timeout = timedelta(seconds=cfg.parallel.timeout)
    try:
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store = attempt_store(store, rank, world, cfg.parallel.timeout)
        transport = resolve_transport(cfg.parallel, exchange_placement(store, rank, world, device))
        backend = "nccl" if transport == "nccl" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        # A gloo rank that arrives early at a barrier gives up after its group's timeout, whatever the
        # barrier's own: waiting for a checkpoint write needs a group of its own.
        slow_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.run.checkpoint_timeout))
        model_peers, data_peers = build_mesh(rank, world, cfg.parallel.model_size, backend, timeout, cpu_group)
    except (StartError, ConfigError):
        raise
    except RuntimeError as e:  # a peer died or never came while the groups formed
        raise StartError(f"rank {rank}: could not join the other processes: {_first_line(e)}") from None
    everyone = tuple(range(world))
    comm, slow = TorchComm(dist.group.WORLD, cpu_group, rank, everyone), TorchComm(slow_group, None, rank, everyone)
    return DistInfo(rank, world, local_rank, local_world, device, transport, comm, slow,
                    cfg.parallel.model_size, model_peers, data_peers, store)


def mesh_ranks(world: int, model_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(model groups, data-parallel groups) of the R x M mesh, as global ranks: model groups are
    consecutive ranks (one host's fast links), data groups every M-th rank."""
    if model_size < 1 or world % model_size:
        raise ConfigError(f"{world} processes cannot form model groups of parallel.model_size={model_size}")
    replicas = world // model_size
    model = [tuple(range(d * model_size, (d + 1) * model_size)) for d in range(replicas)]
    data = [tuple(range(m, world, model_size)) for m in range(model_size)]
    return model, data


def own_group(rank: int, groups: list[tuple[int, ...]]) -> tuple[int, tuple[int, ...]]:
    """(index of the group holding `rank`, that group)."""
    i = next(i for i, ranks in enumerate(groups) if rank in ranks)
    return i, groups[i]


def build_mesh(rank: int, world: int, model_size: int, backend: str, timeout: timedelta,
               cpu_group) -> tuple[Comm | None, Comm]:
    """(model group, data-parallel group) of this rank in the R x M mesh (mesh_ranks). Every rank creates
    every group, in the same order, as torch.distributed requires."""
    model_ranks, data_ranks = mesh_ranks(world, model_size)
    if model_size == 1:
        return None, TorchComm(dist.group.WORLD, cpu_group, rank, data_ranks[0])

    def groups(all_ranks: list[tuple[int, ...]]) -> Comm:
        made = [(dist.new_group(list(r), backend=backend, timeout=timeout),
                 dist.new_group(list(r), backend="gloo", timeout=timeout) if backend != "gloo" else None)
                for r in all_ranks]
        i, ranks = own_group(rank, all_ranks)
        group, cpu = made[i]
        return TorchComm(group, cpu or group, ranks.index(rank), ranks)
    return groups(model_ranks), groups(data_ranks)


def slow_barrier(info: DistInfo, seconds: float) -> None:
    """All ranks meet; rank 0 may arrive late (it writes the checkpoints).

    The other ranks wait for rank 0 up to the slow group's own timeout (run.checkpoint_timeout);
    rank 0, the barrier's coordinator, waits for them `seconds` after it arrives, and names a rank
    that never comes: a hung replica is found within `seconds`, not within the checkpoint timeout.
    """
    if info.distributed:
        info.slow.barrier(timeout=seconds)


def teardown(info: DistInfo, seconds: float = 300.0) -> None:
    """Leave together, after rank 0's last checkpoint write (see leave_together). `seconds`: how long
    rank 0 waits for the others at the barrier (slow_barrier)."""
    if info.distributed and dist.is_initialized():
        slow_barrier(info, seconds)
        leave_together(info.rank, info.world, info.store, seconds, barrier=False)


def leave_together(rank: int, world: int, store=None, seconds: float = 300.0, barrier: bool = True) -> None:
    """Destroy the default process group with no early leaver.

    A member that tears its connections down while a peer is still in a collective can make the C++
    side abort; and rank 0 of train.py's own launch hosts the rendezvous store in its process, so a
    rank 0 that exits while a peer still reads or writes the store resets that peer's connection. So:
    a barrier of all members (unless the caller just passed one), then every member destroys the group,
    then each rank but 0 says in the store that it is done with it (its last use of the store), and
    rank 0 returns only once all of them have: it is the last to leave. `store`: the one the group was
    made on (default: the default group's).
    """
    if not dist.is_initialized():
        return
    if world > 1 and barrier:
        dist.barrier()
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    if world == 1:
        return
    if rank:
        store.add("alexnet/left", 1)
        return
    deadline, pause = time.monotonic() + seconds, 0.005
    while store.add("alexnet/left", 0) < world - 1:
        if time.monotonic() > deadline:
            raise StartError(f"rank 0: {world - 1 - store.add('alexnet/left', 0)} rank(s) did not leave within "
                             f"{seconds:g} s")
        time.sleep(pause)
        pause = min(0.2, pause * 2)


def print0(info: DistInfo, *args, **kwargs) -> None:
    """print on rank 0 only."""
    if info.is_main:
        print(*args, **kwargs, flush=True)
