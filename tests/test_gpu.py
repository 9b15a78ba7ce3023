"""The CUDA twins of the CPU training tests: every loading mode, replicas on one GPU, speed options.

Marked `gpu`: skipped without CUDA (CI); on a GPU machine: `python3 -m pytest -q -m gpu`. The loader's
own CUDA twins (slots over CUDA IPC, a killed loader) are the `cuda:0` cases of tests/test_loader.py.
"""
from __future__ import annotations

import functools
import time

import numpy as np
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
                       cpu_s=600)
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


# -- stream ordering and host waits (issue "Every GPU path right the first time", items 2 and 5; issue 14) --
# torch.cuda._sleep keeps a stream busy for a while; whatever is queued behind it has not run yet. A host
# call that returns long before the sleep ends did not wait for the device.

@functools.cache
def _cycles_per_second() -> float:
    """The GPU's sleep rate, measured once on a stream of its own (clocks differ between GPUs)."""
    import torch
    cycles, start, end = 200_000_000, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(cycles // 4)  # let the clocks rise first
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def _busy(stream=None, seconds: float = 1.0) -> None:
    import torch
    cycles = int(seconds * _cycles_per_second())
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(cycles)


def _through_the_ring(ring, norm, images: np.ndarray, i: int):
    """Batch i as BatchMaker makes it: read into the ring's slot, uploaded, cropped with staged indices."""
    from data.augment import train_crops
    crops = train_crops(0, 0, np.arange(8) + 8 * i, 32, 24, True, True)
    host = ring.host_images(8)
    host[...] = images
    staged = ring.upload(host, np.arange(8) + i, crops)
    return norm(staged.images, crops, 24, indices=staged.crops), staged.labels


def test_random_crops_do_not_wait_for_the_stream():
    """A ring's worth of batches is queued behind a 3 s sleep: the host returns from all of them at once."""
    import torch

    from data.augment import Normalizer, train_crops
    from data.staging import DEPTH, StagingRing
    ring = StagingRing(torch.device("cuda"), 8, 32)
    assert ring.depth == DEPTH  # one more batch than the depth waits for the first slot's copy, by design
    norm = Normalizer("image", np.full((32, 32, 3), 100, np.float32), device="cuda")
    images = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    for i in range(DEPTH):  # warm up: kernels loaded, every slot used once
        _through_the_ring(ring, norm, images, i)
    torch.cuda.synchronize()
    _busy(seconds=3.0)
    start = time.perf_counter()
    outs = [_through_the_ring(ring, norm, images, i) for i in range(DEPTH)]
    host_s = time.perf_counter() - start
    after = torch.cuda.Event()
    after.record()
    assert host_s < 0.5, f"the host waited {host_s:.2f} s for the device"
    assert not after.query()  # the calls above were queued behind the sleep, which is still running
    cpu = Normalizer("image", np.full((32, 32, 3), 100, np.float32))
    for i, (x, y) in enumerate(outs):
        want = cpu(torch.from_numpy(images), train_crops(0, 0, np.arange(8) + 8 * i, 32, 24, True, True), 24)
        assert torch.equal(x.cpu(), want) and torch.equal(y.cpu(), torch.arange(8) + i)


def test_staging_waits_asleep_not_spinning():
    """When the host must wait for a slot (the device is behind), it sleeps: blocking events."""
    import torch

    from data.augment import Normalizer
    from data.staging import StagingRing
    ring = StagingRing(torch.device("cuda"), 8, 32)
    norm = Normalizer("image", np.full((32, 32, 3), 100, np.float32), device="cuda")
    images = np.zeros((8, 32, 32, 3), np.uint8)
    for i in range(ring.depth):
        _through_the_ring(ring, norm, images, i)
    torch.cuda.synchronize()
    _busy(seconds=1.5)
    for i in range(ring.depth):  # every slot's copy queued behind the sleep
        _through_the_ring(ring, norm, images, i)
    wall, cpu = time.perf_counter(), time.thread_time()
    ring.host_images(8)  # waits for the first slot's copy
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall > 0.5, f"did not wait ({wall:.2f} s): the test proves nothing"
    assert cpu < 0.2 * wall, f"the waiting thread used {cpu:.2f} s of CPU in {wall:.2f} s"


def test_normalizer_constants_are_ready_for_another_stream():
    import torch

    from data.augment import Normalizer, center_crops
    _busy()
    norm = Normalizer("channel", None, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], device="cuda")
    assert torch.cuda.current_stream().query()  # built and finished: nothing left for other streams to race
    side = torch.cuda.Stream()
    images = torch.full((2, 8, 8, 3), 200, dtype=torch.uint8)
    with torch.cuda.stream(side):
        out = norm(images.cuda(), center_crops(2, 8, 8), 8)
    side.synchronize()
    want = Normalizer("channel", None, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])(images, center_crops(2, 8, 8), 8)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_first_batches_wait_for_the_slot_allocation(train_data, mode):
    """Label slots are zero-filled on the trainer's stream; the loader must not write before that ran."""
    import torch

    from data.loader import InlineLoader
    from data.slot_loader import SlotLoader
    from tests.test_loader import collect, spec_for
    spec = spec_for(train_data, device="cuda:0")
    want = collect(InlineLoader(spec), "train", 0)
    torch.cuda.synchronize()
    _busy(seconds=10)  # longer than a loader process takes to start; the zero fill of the label slots
    # queues behind it
    loader = SlotLoader(spec, mode, k=3)
    try:
        got = collect(loader, "train", 0)
    finally:
        loader.close()
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, wx, wy), (_, gx, gy) in zip(want, got):
        assert torch.equal(wy, gy) and torch.equal(wx, gx)


def test_closed_thread_loader_slots_are_reused_after_its_writes(train_data):
    """The slots are the trainer's memory, written on the loader thread's stream. After close() the
    trainer frees them and its next allocations may take that memory at once: their writes must land
    after the loader's pending ones (the loader finishes its stream when it quits, and close() orders
    the trainer's stream after the loader's; each is tested alone on the CPU in tests/test_loader.py)."""
    import gc

    import torch

    from data.slot_loader import SlotLoader
    from tests.test_loader import spec_for
    loader = SlotLoader(spec_for(train_data, device="cuda:0"), "thread", k=2)
    shape, spans = loader.slots.x[0].shape, [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in loader.slots.x]
    torch.cuda.synchronize()
    _busy(loader.loader_stream, seconds=2)
    with torch.cuda.stream(loader.loader_stream):  # a write still queued on the loader's stream at close
        for x in loader.slots.x:
            x.fill_(1.0)
    loader.close()
    del loader, x
    gc.collect()
    fresh = []
    for _ in range(64):  # until the allocator hands out the freed slots' memory
        fresh.append(torch.full(shape, 7.0, device="cuda:0"))
        if any(a < fresh[-1].data_ptr() + fresh[-1].nbytes and fresh[-1].data_ptr() < b for a, b in spans):
            break
    else:
        raise AssertionError("the allocator never reused the slots' memory: the test proves nothing")
    torch.cuda.synchronize()
    assert (fresh[-1] == 7.0).all(), "the loader's write landed after the trainer's"


# -- resume and determinism on CUDA (items 1 and 3) ------------------------------------------------------

def test_cuda_resume_after_a_stop_equals_uninterrupted(train_data, tmp_path):
    """A stop mid-epoch and the same command again, on the GPU: it resumes (the RNG states loaded to the
    CPU, as torch requires) and ends where the uninterrupted run ends, within cuDNN's tolerance."""
    over = {**DETERMINISTIC, "run.device": "cuda", "model.dropout": 0.5}
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, straight, **over)]) == 0
    args = ["configs/demo.yaml", *tiny_overrides(train_data, split, **over)]
    assert train.main([*args, "train.max_steps=4"]) == 0
    assert train.main(args) == 0
    assert rel_diff(split, straight) <= 1e-4


def test_deterministic_cuda_training_repeats_bitwise(train_data, tmp_path):
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{
            **DETERMINISTIC, "run.device": "cuda", "model.dropout": 0.5, "train.deterministic": True}), cpu_s=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(run)
    from tests.test_train import assert_same_weights
    assert_same_weights(runs[0] / "checkpoints" / "last.pt", runs[1] / "checkpoints" / "last.pt")
