"""The bytes each process puts on links per step, counted where the collectives send them (layers.Comm),
against scripts/bench/parallel.py's cost model (its formulas, written from the code's collectives), for
every layout of the benchmark, on the rank simulator with gloo's routes and with NCCL's (native
reduce-scatter), which no CPU process can show. One layout also through the benchmark's own measurement,
real processes over gloo (tests/test_model_parallel.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from alexnet.config import Config, apply
from alexnet.replica import Replica
from alexnet.simulate import run_ranks
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from bench import parallel as bp  # noqa: E402

GLOBAL_BATCH, WIDTH = 8, 0.125


@pytest.mark.parametrize("nccl", [False, True], ids=["gloo", "nccl"])
@pytest.mark.parametrize("name, replicas, model_size, mode", bp.LAYOUTS, ids=[layout[0] for layout in bp.LAYOUTS])
def test_bytes_per_step_match_the_cost_model(name, replicas, model_size, mode, nccl):
    batch = bp.per_process_batch(GLOBAL_BATCH, replicas, model_size, mode)
    cfg = Config()
    apply(cfg, {"model.arch": "alexnet", "model.width": WIDTH, "model.dropout": 0.5, "data.crop": 227,
                "data.root": "unused", "train.batch_size": batch, "parallel.replicas": replicas,
                "parallel.model_size": model_size, "parallel.model": mode, "parallel.exchange": "gradients"},
          "test")

    def member(info):
        replica = Replica(cfg, info, 1000)
        g = torch.Generator().manual_seed(info.rank)
        x, y = torch.randn(batch, 3, 227, 227, generator=g), torch.randint(0, 1000, (batch,), generator=g)
        before = replica.sent_bytes()
        replica.step(x, y, 1, lambda: torch.autocast("cpu", enabled=False))
        return replica.sent_bytes() - before
    sent = run_ranks(replicas * model_size, member, model_size, cfg, nccl=nccl)
    want = bp.bytes_per_step(bp.alexnet_shapes(WIDTH), GLOBAL_BATCH, replicas, model_size, mode, nccl=nccl)
    assert max(sent) == want and (want > 0) == (replicas * model_size > 1), (sent, want)
