"""The CUDA twins of the CPU tests: loader slots over CUDA IPC, replicas on one GPU, speed options.

Marked `gpu`: skipped without CUDA (CI); on a GPU machine: `python3 -m pytest -q -m gpu`.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import train
from alexnet.metrics import read_metrics
from data.loader import InlineLoader, LoaderSpec
from data.slot_loader import LoaderError, SlotLoader
from tests.conftest import run_script, tiny_overrides
from tests.test_parallel import DETERMINISTIC, rel_diff

pytestmark = pytest.mark.gpu


def cuda_spec(root, **kw) -> LoaderSpec:
    base = {"root": str(root), "batch_size": 8, "val_batch_size": 5, "crop": 67, "seed": 3, "device": "cuda:0"}
    base.update(kw)
    return LoaderSpec(**base)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cuda_slots_give_the_inline_batches(train_data, mode):
    spec = cuda_spec(train_data, channels_last=mode == "process")
    inline, slot = InlineLoader(spec), SlotLoader(spec, mode, k=2)
    try:
        for split, epoch, start in (("train", 0, 0), ("val", 0, 0), ("train", 1, 2)):
            want = [(b.step, b.x.clone(), b.y.clone()) for b in inline.batches(split, epoch, start)]
            got = [(b.step, b.x.clone(), b.y.clone()) for b in slot.batches(split, epoch, start)]
            assert [w[0] for w in want] == [g[0] for g in got] and want
            for (_, wx, wy), (_, gx, gy) in zip(want, got):
                assert gx.is_cuda and torch.equal(wx, gx) and torch.equal(wy, gy)
    finally:
        slot.close()


def test_cuda_killed_loader_is_reported(train_data):
    loader = SlotLoader(cuda_spec(train_data), "process", k=2)
    try:
        it = loader.batches("train", 0)
        next(it)
        os.kill(loader.worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(LoaderError, match="killed by signal 9"):
            for _ in it:
                pass
        assert time.monotonic() - start < 30
    finally:
        loader.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cuda_training_identical_in_every_mode(train_data, tmp_path, mode):
    over = {**DETERMINISTIC, "run.device": "cuda", "data.loading": "inline"}
    ref, run = tmp_path / "inline", tmp_path / mode
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, ref, **over)]) == 0
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **{**over, "data.loading": mode})]) == 0
    assert rel_diff(run, ref) <= 1e-5  # same batches; cuDNN may pick other algorithms between runs
    a, b = read_metrics(ref / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [x["iter"] for x in a] == [x["iter"] for x in b]


@pytest.mark.parametrize("exchange, transport", [("weights", "ipc"), ("gradients", "gloo")])
def test_two_replicas_on_one_gpu_agree_with_cpu(train_data, tmp_path, exchange, transport):
    """2 replicas share cuda:0 (NCCL would refuse): equal to 1 replica x 2B on the GPU and on the CPU."""
    common = {**DETERMINISTIC}
    cpu_one, gpu_one, gpu_two = tmp_path / "cpu1", tmp_path / "gpu1", tmp_path / "gpu2"
    for run, extra in ((cpu_one, {"run.device": "cpu", "train.batch_size": 16}),
                       (gpu_one, {"run.device": "cuda", "train.batch_size": 16}),
                       (gpu_two, {"parallel.devices": "[cuda:0,cuda:0]", "parallel.replicas": 2,
                                  "train.batch_size": 8, "parallel.exchange": exchange,
                                  "parallel.transport": transport, "data.loading": "process"})):
        r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{**common, **extra}),
                       timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert rel_diff(gpu_two, gpu_one) <= 1e-4
    assert rel_diff(gpu_two, cpu_one) <= 1e-3  # GPU and CPU kernels sum in other orders


@pytest.mark.parametrize("option", ["train.precision=bf16", "train.precision=tf32", "train.channels_last=true"])
def test_speed_options_train(train_data, tmp_path, option):
    run = tmp_path / "run"
    over = tiny_overrides(train_data, run, **{"run.device": "cuda", "train.epochs": 1})
    assert train.main(["configs/demo.yaml", *over, option]) == 0
    val = [x for x in read_metrics(run / "metrics.jsonl") if x["split"] == "val"]
    assert val and val[-1]["loss"] == val[-1]["loss"]  # finite, not NaN
