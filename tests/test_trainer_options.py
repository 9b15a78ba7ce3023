"""The trainer's options beyond their defaults (train.val_every, train.log_every, run.save_every_steps,
run.keep_last, the best.pt choice), in one in-process run of train.py, each checked against a count made
by hand from the run's shape: `train_data` holds 48 training images, batch 8, so 6 steps an epoch.

The run validates epochs 2, 4 and 5 (val_every 2, and the last epoch always); each validation's top-1
error is replaced by a scripted one (SCRIPT), so that which checkpoint is best is known in advance.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import train
from alexnet.checkpoint import load
from alexnet.metrics import read_metrics
from alexnet.trainer import Trainer
from tests.conftest import signal_handlers_kept, tiny_overrides

EPOCHS, STEPS, BATCH, LOG_EVERY, SAVE_EVERY = 5, 6, 8, 4, 5
# The top-1 error each validation reports: a tie at epoch 4 (not better than epoch 2), then worse.
SCRIPT = {2: 0.5, 4: 0.5, 5: 0.75}


@pytest.fixture(scope="module")
def scripted(train_data, tmp_path_factory) -> tuple[Path, str]:
    """(run dir, its stdout) of 5 epochs with val_every 2, log_every 4, save_every_steps 5, keep_last 9."""
    run = tmp_path_factory.mktemp("options") / "run"
    real = Trainer.evaluate

    def evaluate(self, epoch):
        return {**real(self, epoch), "top1_err": SCRIPT.get(epoch, 0.9)}

    out = io.StringIO()
    overrides = tiny_overrides(train_data, run, **{
        "train.epochs": EPOCHS, "train.val_every": 2, "train.log_every": LOG_EVERY, "run.keep_last": 9,
        "run.save_every_steps": SAVE_EVERY, "data.loading": "inline"})
    with pytest.MonkeyPatch.context() as mp, signal_handlers_kept(), contextlib.redirect_stdout(out):
        mp.setattr(Trainer, "evaluate", evaluate)
        assert train.main(["configs/demo.yaml", *overrides]) == 0
    return run, out.getvalue()


def test_val_every_validates_every_kth_epoch_and_the_last(scripted):
    run, _ = scripted
    val = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "val"]
    assert [(r["epoch"], r["iter"]) for r in val] == [(2, 2 * STEPS), (4, 4 * STEPS), (5, 5 * STEPS)]


def test_every_log_window_and_every_epoch_end_is_one_train_record(scripted):
    """Records at steps 4 and 6 of each epoch (the epoch's end closes its window): 32 then 16 images."""
    run, _ = scripted
    train_records = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    want = [(e, (e - 1) * STEPS + s, s_images) for e in range(1, EPOCHS + 1)
            for s, s_images in ((LOG_EVERY, LOG_EVERY * BATCH), (STEPS, (STEPS - LOG_EVERY) * BATCH))]
    assert [(r["epoch"], r["iter"], r["n"]) for r in train_records] == want


def test_best_pt_is_the_first_epoch_with_the_lowest_error(scripted):
    run, _ = scripted
    ckpt = run / "checkpoints"
    best, second = load(ckpt / "best.pt"), load(ckpt / "epoch_002.pt")
    assert best["epoch"] == 2 and best["best_top1_err"] == 0.5
    for key, value in second["model"].items():
        assert torch.equal(best["model"][key], value), key
    assert load(ckpt / "last.pt")["best_top1_err"] == 0.5  # the lowest so far, not the last (0.75)


def test_save_every_steps_counts_global_steps_and_keep_last_keeps_them_all(scripted):
    """Global steps 5, 10, ..., 30 are (epoch, step) (1, 5), (2, 4), (3, 3), (4, 2), (5, 1), (5, 6)."""
    run, out = scripted
    saved = [tuple(map(int, m)) for m in re.findall(r"checkpoint at epoch (\d+), step (\d+):", out)]
    want = [divmod(g - 1, STEPS) for g in range(SAVE_EVERY, EPOCHS * STEPS + 1, SAVE_EVERY)]
    assert saved == [(e + 1, s + 1) for e, s in want]
    assert sorted(p.name for p in (run / "checkpoints").glob("epoch_*.pt")) == [
        f"epoch_{e:03d}.pt" for e in range(1, EPOCHS + 1)]
