"""One process's trainable part of the model, and how it keeps in step with the other processes.

Where the process sits in the R x M mesh decides what it reads, how its loss is scaled, which model it
holds and how that becomes the ordinary checkpoint. M = 1 is plain data parallelism (or one process).
With M > 1 (alexnet/model_parallel.py):

- ``fc``: every process reads its own images (the reader's shards are all W = R x M processes, model
  groups consecutive: a model group reads what one replica with M times the batch would read);
- ``columns``: both columns of a model group read the same images (the reader's shards are the R
  model groups); only model rank 0 counts them in the metrics;
- the loss of each process is 1/M of its rows' mean (see model_parallel's docstring);
- a checkpoint holds the single-device state dict and optimizer state: rank 0 assembles them from
  its model group, and every process takes its own part back on resume, whatever layout wrote it
  (every per-parameter state tensor: SGD's and LARS's velocity, LAMB's moments);
- LARS and LAMB take a sharded layer's norms over the model group (``ModelGroupNorms``).

Replicas (the processes holding the same part) then keep in step by averaging gradients (DDP over
them, its bucketed all-reduces overlapped with the backward pass, in every layout) or weights and
momentum (the paper). Every byte that crosses a link is counted (:meth:`Replica.sent_bytes`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config, ConfigError
from .distributed import DistInfo
from .exchange import WeightExchange, average_statistics, broadcast_from_first, wrap_gradients
from .large_batch import ModelGroupNorms
from .model_parallel import ShardedNet, build_sharded, parameter_bytes
from .models import build_model
from .optim import build_optimizer


class MeshLayout:
    """This process's place in the R x M mesh (see the module docstring): what it reads, how it counts,
    which part of the model it holds."""

    def __init__(self, cfg: Config, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.model_size, self.mode = dist.model_size, cfg.parallel.model
        self.sharded = self.model_size > 1

    @property
    def reader_rank(self) -> int:
        return self.dist.data_rank if self.sharded and self.mode == "columns" else self.dist.rank

    @property
    def reader_world(self) -> int:
        return self.dist.replicas if self.sharded and self.mode == "columns" else self.dist.world

    def per_reader(self, images: int) -> int:
        """A replica's (a model group's) `images` per step as this process reads them: fc splits them over
        the group's processes (rounded up: a last, short step is shared out whatever its rows), columns each
        read all of them."""
        return -(-images // self.model_size) if self.sharded and self.mode == "fc" else images

    @property
    def reader_batch(self) -> int:
        """The images this process reads per step (train.batch_size is a replica's in every layout; fc needs
        a multiple of its model size, checked with the config)."""
        return self.per_reader(self.cfg.train.batch_size)

    @property
    def global_batch(self) -> int:
        return self.reader_batch * self.reader_world

    @property
    def loss_scale(self) -> float:
        return 1.0 / self.model_size

    @property
    def counts_metrics(self) -> bool:
        """Whether this process's rows are its own (not a copy of a column partner's)."""
        return not (self.sharded and self.mode == "columns" and self.dist.model_rank)

    @property
    def keep_empty_batches(self) -> bool:
        """fc: every member of a model group must take part in every step, even with no images."""
        return self.sharded and self.mode == "fc"

    @property
    def batch_unit(self) -> str:
        """What train.batch_size counts the images of, and how a process reads them."""
        if not self.sharded:
            return "per replica"
        if self.mode == "columns":
            return "per replica, each of its model group's processes reading all of them"
        return f"per replica, {self.reader_batch} per process of its model group"

    def describe(self) -> str:
        if not self.sharded:
            return f"{self.dist.world} replica(s)"
        return (f"{self.dist.replicas} replica(s) x model groups of {self.model_size} ({self.mode} model "
                f"parallel), this process model rank {self.dist.model_rank} of replica {self.dist.data_rank}")

    # -- the model ---------------------------------------------------------------------------------------

    def build_model(self, num_classes: int, before_collective=None) -> nn.Module:
        """This process's model (the whole one, or its part), initialised from train.seed."""
        m = self.cfg.model
        torch.manual_seed(self.cfg.train.seed)  # the same initial weights on every process
        args = (m.arch, num_classes, m.width, m.dropout, self.cfg.data.crop, m.init, m.dropout_style)
        if not self.sharded:
            return build_model(*args, lrn=m.lrn)
        return build_sharded(*args, self.mode, self.dist.model_peers.with_before(before_collective), lrn=m.lrn)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def full_state(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """(model state dict, optimizer state dict) of the single-device model, complete on rank 0.

        Every process calls this (a gather inside model group 0 when sharded); other ranks get their
        own, partial, dicts back, which they do not use.
        """
        model_state, opt_state = model.state_dict(), optimizer.state_dict()
        if not self.sharded or self.dist.data_rank:
            return model_state, opt_state
        named = _named_params(model, optimizer)
        shaped = _shaped_state(opt_state["state"], named, lambda name, p: tuple(p.shape))
        mine = ({k: v.detach().cpu() for k, v in model_state.items()},
                {key: {name: v.detach().cpu() for name, v in by_name.items()} for key, by_name in shaped.items()})
        pieces = self.dist.model_peers.gather_object(mine, dst=0)
        if not self.dist.is_main:
            return model_state, opt_state
        whole = {key: model.assemble([p[1][key] for p in pieces]) for key in shaped}
        opt_state["state"] = _with_state(opt_state["state"], named, whole)
        return model.assemble([p[0] for p in pieces]), opt_state

    def load_full_state(self, model: nn.Module, optimizer, model_state: dict, opt_state: dict) -> None:
        """Load a single-device checkpoint's state into this process's model (its part of it)."""
        if isinstance(model, ShardedNet):
            named = _named_params(model, optimizer)

            def full_shape(name: str, p: torch.Tensor) -> tuple:  # the single-device parameter's shape
                rows = p.shape[0] * model.comm.size if name in model.sharded_keys else p.shape[0]
                return (rows, *p.shape[1:])
            shaped = _shaped_state(opt_state["state"], named, full_shape)
            mine = {key: model.local_shard(by_name) for key, by_name in shaped.items()}
            opt_state = {**opt_state, "state": _with_state(opt_state["state"], named, mine)}
            model_state = model.local_shard(model_state)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)  # moves the velocities to the parameters' device


def _named_params(model: nn.Module, optimizer) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every index of the optimizer's state dict (its param_groups' order).

    The single-device model and a ShardedNet have the same names in the same order, so the indices
    of one are the indices of the other."""
    name_of = {id(p): k for k, p in model.named_parameters()}
    return [(name_of[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _shaped_state(state: dict, named: list, shape_of) -> dict[str, dict[str, torch.Tensor]]:
    """{state key: {parameter name: tensor}} of the per-parameter state tensors: those whose shape is
    `shape_of(name, parameter)` (a velocity, Adam's moments), not scalars (LAMB's step count)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, s in state.items():
        name, p = named[i]
        for key, value in s.items():
            if torch.is_tensor(value) and tuple(value.shape) == tuple(shape_of(name, p)):
                out.setdefault(key, {})[name] = value
    return out


def _with_state(state: dict, named: list, shaped: dict[str, dict[str, torch.Tensor]]) -> dict:
    """`state` (an optimizer state dict's) with its per-parameter tensors replaced by `shaped`'s."""
    out = {}
    for i, s in state.items():
        name = named[i][0]
        out[i] = {**s, **{key: by_name[name] for key, by_name in shaped.items() if name in by_name}}
    return out


def _refuse_replica_adaptation(cfg: Config, dist: DistInfo) -> None:
    """LARS/LAMB with the weights exchange over several replicas (known here under torchrun, where
    parallel.replicas is ignored): each replica would adapt to its own gradient. ConfigError (exit 2)."""
    t = cfg.train
    if t.optimizer != "sgd" and cfg.parallel.exchange == "weights" and dist.replicas > 1:
        raise ConfigError(f"train.optimizer={t.optimizer} with parallel.exchange=weights would adapt each of the "
                          f"{dist.replicas} replicas to its own gradient, not to the global batch's; set "
                          "parallel.exchange=gradients")


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Autocast's bf16 logits in fp32 for the loss; a float64 model's stay float64."""
    return t if t.dtype == torch.float64 else t.float()


def sgd_step(forward, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, autocast,
             slices: int = 1, no_sync=None, keep_grads: bool = False, loss_scale: float = 1.0,
             before_update=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One update from the batch (x, y); returns (mean loss, logits), detached, nothing synchronised.

    `autocast` makes a fresh autocast context. With `slices` > 1 the batch runs as that many sequential
    micro-batches whose gradients accumulate (each loss is its share of the batch mean), then one
    update: the same step with less activation memory. `no_sync` (DistributedDataParallel's) keeps the
    gradient all-reduce for the last micro-batch only. `keep_grads` zeroes the gradients instead of
    dropping them: under DDP they are views of its all-reduce buckets, and a dropped gradient is
    re-allocated by autograd and then copied into its bucket, every step. `loss_scale` multiplies the
    loss that is differentiated (a model-parallel process's share), not the one returned;
    `before_update` runs between the last backward pass and the update (gradient synchronisation).
    """
    n, losses, outputs = y.shape[0], [], []
    for i, (xs, ys) in enumerate(zip(x.chunk(slices), y.chunk(slices))):
        defer = no_sync is not None and i < slices - 1
        with no_sync() if defer else contextlib.nullcontext():
            with autocast():
                logits = forward(xs)
            loss = F.cross_entropy(_at_least_fp32(logits), ys, reduction="sum") / n
            (loss * loss_scale if loss_scale != 1 else loss).backward()
        losses.append(loss.detach())
        outputs.append(logits.detach())
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=not keep_grads)
    if slices == 1:
        return losses[0], outputs[0]
    return torch.stack(losses).sum(), torch.cat(outputs)


class Replica:
    """This process's model, optimizer and synchronisation with its peers; `step` trains on one batch."""

    def __init__(self, cfg: Config, dist: DistInfo, num_classes: int, arrive: Callable[[], None] | None = None):
        self.cfg, self.dist, self.layout = cfg, dist, MeshLayout(cfg, dist)
        _refuse_replica_adaptation(cfg, dist)
        self.arrive = arrive or (lambda: None)  # called before every collective (the launcher's heartbeat)
        try:
            model = self.layout.build_model(num_classes, before_collective=self.arrive)
        except ValueError as e:  # a layer that the model parallelism cannot split
            raise ConfigError(str(e)) from None
        model = model.to(dist.device)
        self.model = model.to(memory_format=torch.channels_last) if cfg.train.channels_last else model
        self.optimizer = build_optimizer(self.model, cfg.train)
        if isinstance(self.model, ShardedNet) and hasattr(self.optimizer, "norm_reducer"):
            # a split layer's trust ratio is the whole layer's: its squared norms summed over the group
            self.optimizer.norm_reducer = ModelGroupNorms(self.model.sharded_parameters(), self.model.comm)
        # DDP over the processes holding the same part: all of them (M = 1), or the part's data group
        self.ddp = cfg.parallel.exchange == "gradients" and dist.data_peers is not None and dist.data_peers.size > 1
        self.exchange: WeightExchange | None = None
        self.start_bytes = 0  # weights mode: the first replica's weights broadcast at the start
        self.comms = [self.model.comm] if self.layout.sharded else []
        forward = self._replicate()
        self.forward = torch.compile(forward) if cfg.train.compile else forward

    def _replicate(self) -> nn.Module:
        """An identical start on every replica, then gradient or weight averaging; the forward module."""
        model, p, peers = self.model, self.cfg.parallel, self.dist.data_peers
        if not self.dist.distributed:
            return model
        if peers.size == 1:  # one model group and no replica of it: nothing to keep in step
            return model
        comm = peers.with_before(self.arrive)
        if p.exchange == "weights":
            before = comm.sent[0]
            broadcast_from_first([t.data for t in model.parameters()], comm)
            self.start_bytes = comm.sent[0] - before  # the exchange counts its own bytes, not this comm's
            self.exchange = WeightExchange(model, self.optimizer, comm, self.dist.transport, p.exchange_every)
            return model
        self.comms.append(comm)
        return wrap_gradients(model, self.dist.device, p.bucket_mb, comm)  # DDP broadcasts the first's weights

    def step(self, x: torch.Tensor, y: torch.Tensor, steps_done: int, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """One update from (x, y), then the weights exchange if due; (mean loss, logits) as sgd_step."""
        slices = self.cfg.train.slices
        no_sync = getattr(self.forward, "no_sync", None) if slices > 1 else None
        out = sgd_step(self.forward, self.optimizer, x, y, autocast, slices, no_sync, keep_grads=self.ddp,
                       loss_scale=self.layout.loss_scale, before_update=self._before_update)
        if self.exchange is not None:
            self.exchange.after_step(steps_done)
        return out

    def _before_update(self) -> None:
        """Between the last backward pass and the update: the gradients the step applies are the model
        group's (replicated layers summed over it) and, without DDP, the data group's mean."""
        if self.layout.sharded:
            self.model.sync_model_group()
        sync = getattr(self.forward, "sync", None)  # AveragedGradients (DDP averages during backward)
        if sync is not None:
            sync()

    def average_now(self) -> None:
        """Weights mode between two exchanges: average, so a checkpoint holds every replica."""
        if self.exchange is not None:
            self.exchange.average()

    def average_statistics(self) -> None:
        """Batch norm's per-process running statistics averaged over the processes holding the same layers
        (before validation and checkpoints), so that neither depends on the rank that evaluates or writes:
        over the model group for fc's replicated convs, then over the data group in gradients mode (the
        weights exchange averages them itself)."""
        data = self.dist.data_peers.with_before(self.arrive) if self.ddp else None
        average_statistics(self.model, data)

    def sent_bytes(self) -> int:
        """Bytes this process has put on links so far (activations, gradients, weights)."""
        exchanged = self.exchange.sent[0] if self.exchange is not None else 0
        return self.start_bytes + exchanged + sum(c.sent[0] for c in self.comms)

    def parameter_bytes(self) -> int:
        return parameter_bytes(self.model)

    def full_state(self) -> tuple[dict, dict]:
        return self.layout.full_state(self.model, self.optimizer)

    def load_full_state(self, model_state: dict, opt_state: dict) -> None:
        self.layout.load_full_state(self.model, self.optimizer, model_state, opt_state)
        # load_state_dict restored the checkpoint's momentum, weight decay (and LARS's trust coefficient,
        # ...); the config decides them (as the schedule decides the lr), so that a changed setting is not
        # silently ignored.
        fresh = build_optimizer(self.model, self.cfg.train).param_groups
        for group, new in zip(self.optimizer.param_groups, fresh):
            group.update({key: value for key, value in new.items() if key not in ("params", "lr")})

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
