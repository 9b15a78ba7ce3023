"""data/staging.py: the one ring that carries a batch's images, labels and crops to the device.

On the CPU the ring's staged path (the GPU's slot layout and copies, without pinning or events) is
checked against the zero-copy CPU path, and its waits and records against the order CUDA needs.
"""
from __future__ import annotations

import numpy as np
import torch

import data.staging as staging
from data.augment import center_crops, train_crops
from data.loader import BatchMaker, LoaderSpec
from data.staging import StagingRing

CPU = torch.device("cpu")


def _batch(n: int, size: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    labels = rng.integers(0, 1000, n).astype(np.int64)
    return images, labels, train_crops(seed, 0, np.arange(n), size, 4, True, True)


def test_staged_twin_gives_the_batches_of_the_cpu_path(train_data):
    """Random crops (per-image gather with staged indices) and center crops, bit for bit."""
    spec = LoaderSpec(str(train_data), batch_size=8, val_batch_size=5, crop=67, seed=3)
    plain, twin = BatchMaker(spec), BatchMaker(spec)
    twin.ring = StagingRing(CPU, max(spec.batch_size, spec.val_batch_size), twin.size, staged=True)
    flips = 0
    for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
        for step in range(plain.steps(split)):
            want, host = plain.make(split, epoch, step), twin.read(split, epoch, step)
            flips += int(host.crops.flip.sum())
            x, y = twin.to_device(host)
            assert torch.equal(x, want.x) and torch.equal(y, want.y), (split, epoch, step)
    assert flips  # the per-image gather ran


def test_every_copied_region_is_a_contiguous_start_of_its_slot(monkeypatch):
    """A strided pinned region goes through a pageable temporary and can block the host (issue 14)."""
    handed = []
    monkeypatch.setattr(staging, "_copy_to", lambda region, device: handed.append(region) or region.clone())
    ring = StagingRing(CPU, 8, 6, staged=True)
    for n in (8, 5, 1):
        handed.clear()
        slot = ring.slots[ring.turn]
        ring.upload(*_batch(n))
        assert len(handed) == 2
        for region, base in zip(handed, (slot.images, slot.table)):
            assert region.is_contiguous() and region.data_ptr() == base.data_ptr(), n


def test_one_upload_carries_images_labels_and_crops():
    ring = StagingRing(CPU, 8, 6, staged=True)
    images, labels, crops = _batch(5)
    got = ring.upload(images, labels, crops)
    assert np.array_equal(got.images.numpy(), images) and np.array_equal(got.labels.numpy(), labels)
    assert np.array_equal(got.crops.numpy(), np.stack([crops.oy, crops.ox, crops.flip.astype(np.int64)]))
    images2, labels2, _ = _batch(5, seed=1)  # the next upload reuses no memory the first one handed out
    ring.upload(images2, labels2, center_crops(5, 6, 4))
    ring.upload(images2, labels2, center_crops(5, 6, 4))
    assert np.array_equal(got.images.numpy(), images) and np.array_equal(got.labels.numpy(), labels)


class _Event:
    def __init__(self, log: list, j: int):
        self.log, self.j = log, j

    def synchronize(self) -> None:
        self.log.append(("wait", self.j))

    def record(self) -> None:
        self.log.append(("record", self.j))


def test_a_slot_is_written_only_after_its_last_copy_and_recorded_after_the_next(monkeypatch):
    """The order CUDA needs: wait for slot j's event, fill it, copy both regions, record the event."""
    log: list = []
    ring = StagingRing(CPU, 4, 6, staged=True)
    slot_of = {s.images.data_ptr(): j for j, s in enumerate(ring.slots)}
    slot_of.update({s.table.data_ptr(): j for j, s in enumerate(ring.slots)})
    ring.events = [_Event(log, j) for j in range(ring.depth)]
    monkeypatch.setattr(staging, "_copy_to", lambda r, d: log.append(("copy", slot_of[r.data_ptr()])) or r.clone())
    want = []
    for i in range(2 * ring.depth + 1):
        j = i % ring.depth
        images, labels, crops = _batch(3, seed=i)
        if i % 2:  # read in place, as BatchMaker does
            into = ring.host_images(3)
            log.append(("fill", j))
            into[...] = images
            images = into
        ring.upload(images, labels, crops)
        want += [("wait", j)] + ([("fill", j)] if i % 2 else []) + [("copy", j), ("copy", j), ("record", j)]
    assert log == want


def test_copy_events_let_the_host_sleep(monkeypatch):
    """The host waits on the staging events: blocking ones sleep, the default ones spin a core."""
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kw: made.append((args, kw)))
    staging.copy_event()
    assert made == [((), {"blocking": True})]


def test_cpu_path_hands_over_the_arrays_without_a_copy():
    images, labels, crops = _batch(4)
    got = StagingRing(CPU, 4, 6).upload(images, labels, crops)
    assert got.crops is None and got.images.data_ptr() == images.ctypes.data
    assert got.labels.data_ptr() == labels.ctypes.data
