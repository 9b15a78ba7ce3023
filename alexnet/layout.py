"""What a process's place in the R x M mesh means for training: which images it reads, how its loss
is scaled, which model it holds, and how its part of the model becomes the ordinary checkpoint.

M = 1 is plain data parallelism (or one process). With M > 1 (alexnet/model_parallel.py):

- ``fc``: every process reads its own images (the reader's shards are all W = R x M processes, model
  groups consecutive: a model group reads what one replica with M times the batch would read);
- ``columns``: both columns of a model group read the same images (the reader's shards are the R
  model groups); only model rank 0 counts them in the metrics;
- the loss of each process is 1/M of its rows' mean (see model_parallel's docstring);
- a checkpoint holds the single-device state dict and optimizer state: rank 0 assembles them from
  its model group, and every process takes its own part back on resume, whatever layout wrote it.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from layers import Comm

from .config import Config
from .distributed import DistInfo
from .model_parallel import ShardedNet, build_sharded
from .models import build_model


class Layout:
    """This process's role in the mesh (see the module docstring)."""

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

    @property
    def global_batch(self) -> int:
        return self.cfg.train.batch_size * self.reader_world

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
            return build_model(*args)
        peers = self.dist.model_peers
        comm = Comm(peers.group, peers.rank, peers.size, before=before_collective)
        return build_sharded(*args, self.mode, comm)

    # -- checkpoints ---------------------------------------------------------------------------------------

    def full_state(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """(model state dict, optimizer state dict) of the single-device model, complete on rank 0.

        Every process calls this (a gather inside model group 0 when sharded); other ranks get their
        own, partial, dicts back, which they do not use.
        """
        model_state, opt_state = model.state_dict(), optimizer.state_dict()
        if not self.sharded or self.dist.data_rank:
            return model_state, opt_state
        names = _param_names(model, optimizer)
        mine = ({k: v.detach().cpu() for k, v in model_state.items()},
                {names[i]: s["velocity"].detach().cpu() for i, s in opt_state["state"].items()})
        peers = self.dist.model_peers
        pieces = [None] * peers.size if self.dist.is_main else None
        tdist.gather_object(mine, pieces, dst=peers.ranks[0], group=peers.cpu_group)
        if not self.dist.is_main:
            return model_state, opt_state
        velocities = model.assemble([p[1] for p in pieces])
        opt_state["state"] = {i: {**s, "velocity": velocities[names[i]]} for i, s in opt_state["state"].items()}
        return model.assemble([p[0] for p in pieces]), opt_state

    def load_full_state(self, model: nn.Module, optimizer, model_state: dict, opt_state: dict) -> None:
        """Load a single-device checkpoint's state into this process's model (its part of it)."""
        if isinstance(model, ShardedNet):
            names = _param_names(model, optimizer)
            velocities = model.local_shard({names[i]: s["velocity"] for i, s in opt_state["state"].items()})
            opt_state = {**opt_state, "state": {i: {**s, "velocity": velocities[names[i]]}
                                                for i, s in opt_state["state"].items()}}
            model_state = model.local_shard(model_state)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)  # moves the velocities to the parameters' device


def _param_names(model: nn.Module, optimizer) -> list[str]:
    """The parameter name of every index of the optimizer's state dict (its param_groups' order).

    The single-device model and a ShardedNet have the same names in the same order, so the indices
    of one are the indices of the other."""
    name_of = {id(p): k for k, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
