"""alexnet/replica.py in one process: a batch run as slices is the same update as the whole batch (a second
route to the same step), and each process's place in the R x M mesh (what it reads, how it counts, how its
loss is scaled) as a table written by hand from the module docstring."""
from __future__ import annotations

import contextlib

import pytest
import torch

from alexnet.config import load_config
from alexnet.distributed import DistInfo
from alexnet.models import build_model
from alexnet.optim import build_optimizer
from alexnet.replica import MeshLayout, sgd_step


def _model_and_optimizer(cfg):
    torch.manual_seed(0)
    model = build_model("alexnet", 5, 0.125, 0.0, 67, "torch")  # no dropout: both routes see one function
    return model, build_optimizer(model, cfg.train)


@pytest.mark.parametrize("slices", [2, 3])
def test_a_batch_in_slices_is_one_step_on_the_whole_batch(slices):
    """train.slices: the micro-batches' gradients add up to the whole batch's mean-loss gradient; the loss
    returned is the batch's mean and the logits are every row's."""
    cfg = load_config("configs/demo.yaml", ["train.batch_size=6", "train.weight_decay=0"])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, 67, 67, generator=gen), torch.randint(0, 5, (6,), generator=gen)
    results = []
    for k in (1, slices):
        model, optimizer = _model_and_optimizer(cfg)
        for group in optimizer.param_groups:
            group["lr"] = 0.5  # large: a gradient off by a factor shows in the weights
        loss, logits = sgd_step(model, optimizer, x, y, contextlib.nullcontext, slices=k)
        results.append((loss, logits, [p.detach().clone() for p in model.parameters()]))
    (loss1, logits1, w1), (loss_k, logits_k, w_k) = results
    torch.testing.assert_close(loss_k, loss1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits_k, logits1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss1, torch.nn.functional.cross_entropy(logits1, y), rtol=1e-6, atol=1e-7)
    for a, b in zip(w_k, w1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# (mode, R, M): per rank (reader_rank, reader_world, counts_metrics, keep_empty_batches); global batch; loss scale
MESH = {
    ("fc", 2, 2): ([(0, 4, True, True), (1, 4, True, True), (2, 4, True, True), (3, 4, True, True)], 4 * 8, 0.5),
    ("columns", 2, 2): ([(0, 2, True, False), (0, 2, False, False), (1, 2, True, False), (1, 2, False, False)],
                        2 * 8, 0.5),
    ("columns", 1, 4): ([(0, 1, True, False)] + [(0, 1, False, False)] * 3, 8, 0.25),
    ("fc", 3, 1): ([(0, 3, True, False), (1, 3, True, False), (2, 3, True, False)], 3 * 8, 1.0),
}


@pytest.mark.parametrize("mode, replicas, size", list(MESH))
def test_each_process_reads_counts_and_scales_as_its_place_says(mode, replicas, size):
    cfg = load_config("configs/demo.yaml", ["train.batch_size=8", f"parallel.model={mode}",
                                             f"parallel.model_size={size}", f"parallel.replicas={replicas}"])
    places, batch, scale = MESH[(mode, replicas, size)]
    for rank, want in enumerate(places):
        layout = MeshLayout(cfg, DistInfo(rank=rank, world=replicas * size, model_size=size))
        got = (layout.reader_rank, layout.reader_world, layout.counts_metrics, layout.keep_empty_batches)
        assert got == want, rank
        assert (layout.global_batch, layout.loss_scale) == (batch, scale)


@pytest.mark.parametrize("mode, replicas, size, rank, unit, words", [
    ("fc", 3, 1, 2, "per replica", "3 replica(s)"),
    ("fc", 2, 2, 3, "per process", "2 replica(s) x model groups of 2 (fc model parallel), this process model rank 1 "
                                   "of replica 1"),
    ("columns", 1, 2, 1, "per model group", "1 replica(s) x model groups of 2 (columns model parallel), this process "
                                            "model rank 1 of replica 0"),
])
def test_what_the_start_line_says_of_the_layout(mode, replicas, size, rank, unit, words):
    cfg = load_config("configs/demo.yaml", [f"parallel.model={mode}", f"parallel.model_size={size}",
                                             f"parallel.replicas={replicas}"])
    layout = MeshLayout(cfg, DistInfo(rank=rank, world=replicas * size, model_size=size))
    assert (layout.batch_unit, layout.describe()) == (unit, words)
