"""The CUDA twins of the CPU training tests: every loading mode, replicas on one GPU, speed options.

Marked `gpu`: skipped without CUDA (CI); on a GPU machine: `python3 -m pytest -q -m gpu`. The loader's
own CUDA twins (slots over CUDA IPC, a killed loader) are the `cuda:0` cases of tests/test_loader.py.
"""
from __future__ import annotations

import pytest

import train
from alexnet.metrics import read_metrics
from tests.conftest import run_script, tiny_overrides
from tests.test_parallel import DETERMINISTIC, rel_diff

pytestmark = pytest.mark.gpu


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
