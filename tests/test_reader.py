"""data/reader.py: sharding, seeded epoch order, start-at-position, corrupt files named."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from data.batchfile import BatchFileError, read_batch_file
from data.layouts import DataError
from data.reader import BatchReader, SplitData, epoch_order


def reference_split(out, split):
    """Every image of a split in file order, read with the plain whole-file reader."""
    parts = [read_batch_file(p) for p in SplitData(out, split).paths]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def test_read_random_indices_matches_files(prep):
    out, _ = prep
    data = SplitData(out, "train")
    images, labels = reference_split(out, "train")
    idx = np.random.default_rng(0).permutation(len(data))[:20]
    got_i, got_l = data.read(idx)
    np.testing.assert_array_equal(got_i, images[idx])
    np.testing.assert_array_equal(got_l, labels[idx])
    # a contiguous run (one read in place) and a reversed run
    for idx in (np.arange(3, 14), np.arange(14, 3, -1)):
        got_i, got_l = data.read(idx)
        np.testing.assert_array_equal(got_i, images[idx])
        np.testing.assert_array_equal(got_l, labels[idx])


@pytest.mark.parametrize("window", [0, 1, 2, 100])
def test_epoch_order_is_a_seeded_permutation(window):
    counts = np.array([8, 8, 5, 8, 3])
    a = epoch_order(counts, 0, seed=3, shuffle=True, window=window)
    assert sorted(a.tolist()) == list(range(counts.sum()))
    np.testing.assert_array_equal(a, epoch_order(counts, 0, seed=3, shuffle=True, window=window))
    assert not np.array_equal(a, epoch_order(counts, 1, seed=3, shuffle=True, window=window))
    assert not np.array_equal(a, epoch_order(counts, 0, seed=4, shuffle=True, window=window))
    np.testing.assert_array_equal(epoch_order(counts, 5, 3, shuffle=False, window=window), np.arange(32))


def test_window_keeps_images_of_a_window_together():
    counts = np.array([4] * 6)
    order = epoch_order(counts, 0, seed=0, shuffle=True, window=2)
    files = order // 4
    for w in range(3):  # each block of 8 positions draws from exactly two files
        assert len(set(files[8 * w: 8 * w + 8].tolist())) == 2


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_shards_disjoint_cover_and_equal_the_big_batch(prep, shuffle, world):
    out, _ = prep
    data = SplitData(out, "train")
    b = 4
    readers = [BatchReader(data, b, rank=r, world=world, shuffle=shuffle, seed=7) for r in range(world)]
    single = BatchReader(data, b * world, shuffle=shuffle, seed=7)
    steps = readers[0].steps_per_epoch()
    assert steps == single.steps_per_epoch() == len(data) // (b * world)
    for epoch in (0, 1):
        seen = []
        for step in range(steps):
            shares = [r.indices(epoch, step) for r in readers]
            np.testing.assert_array_equal(np.concatenate(shares), single.indices(epoch, step))
            seen.extend(np.concatenate(shares).tolist())
        assert len(seen) == len(set(seen)) == steps * b * world  # disjoint; only the remainder unused
    # the n replicas' images of one step are the big batch's images, in order
    imgs = np.concatenate([next(r.batches(1, start=2))[0] for r in readers])
    np.testing.assert_array_equal(imgs, next(single.batches(1, start=2))[0])


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_validation_shards_cover_every_image_once(prep, world):
    out, _ = prep
    data = SplitData(out, "val")
    readers = [BatchReader(data, 3, rank=r, world=world, shuffle=False, drop_last=False) for r in range(world)]
    seen = [i for r in readers for s in range(r.steps_per_epoch()) for i in r.indices(0, s).tolist()]
    assert sorted(seen) == list(range(len(data)))
    _, labels = reference_split(out, "val")
    got = np.concatenate([lab for r in readers for _, lab in r.batches(0)])
    assert np.bincount(got, minlength=4).tolist() == np.bincount(labels, minlength=4).tolist()


def test_start_at_position_equals_skipping(prep):
    out, _ = prep
    data = SplitData(out, "train")
    reader = BatchReader(data, 5, rank=1, world=2, shuffle=True, seed=1, window=2)
    full = list(reader.batches(3))
    tail = list(BatchReader(data, 5, rank=1, world=2, shuffle=True, seed=1, window=2).batches(3, start=2))
    assert len(tail) == len(full) - 2
    for (a, la), (b, lb) in zip(full[2:], tail):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)


def test_batch_larger_than_split_is_a_clear_error(prep):
    out, _ = prep
    with pytest.raises(DataError, match="fewer than one global batch"):
        BatchReader(SplitData(out, "train"), 1000)


def test_truncated_batch_file_is_named(prep, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    victim = out / "train" / "00003.h5"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size - 5000])
    data = SplitData(out, "train")
    reader = BatchReader(data, 8, shuffle=False)
    with pytest.raises(BatchFileError, match="00003.h5"):
        for _ in reader.batches(0):
            pass


def test_corrupted_image_bytes_are_detected_and_named(prep, tmp_path):
    """A flipped byte inside an image fails its Fletcher-32 checksum: an error naming the file."""
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    victim = out / "train" / "00001.h5"
    raw = bytearray(victim.read_bytes())
    images, _, _ = read_batch_file(victim)
    needle = images[2].tobytes()[1000:1064]  # 64 bytes from the middle of image 2
    at = raw.find(needle)
    assert at > 0
    raw[at + 10] ^= 0xFF
    victim.write_bytes(bytes(raw))
    data = SplitData(out, "train")
    with pytest.raises(BatchFileError, match="00001.h5"):
        data.read(np.arange(len(data)))


def test_missing_meta_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        SplitData(tmp_path / "nope", "train")
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="meta.json is missing"):
        SplitData(tmp_path / "half", "train")


def test_mean_image_loads(prep):
    out, _ = prep
    mean = SplitData(out, "train").mean_image()
    assert mean.shape == (64, 64, 3) and mean.dtype == np.float32
