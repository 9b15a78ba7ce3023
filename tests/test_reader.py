"""data/reader.py: sharding, seeded epoch order, start-at-position, corrupt files named."""
from __future__ import annotations

import json
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
        list(reader.batches(0))  # every batch of the epoch read


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
    """The mean image SplitData gives is the mean of every stored training image (read with h5py)."""
    import h5py
    out, _ = prep
    mean = SplitData(out, "train").mean_image()
    assert mean.shape == (64, 64, 3) and mean.dtype == np.float32
    images = []
    for path in sorted((out / "train").glob("[0-9]*.h5")):
        with h5py.File(path, "r") as f:
            images.append(f["images"][...])
    expected = np.concatenate(images).astype(np.float64).mean(axis=0)
    count = json.loads((out / "meta.json").read_text())["splits"]["train"]["count"]
    assert sum(map(len, images)) == count and expected.std() > 1  # all of them; a mean with structure
    np.testing.assert_allclose(mean, expected, rtol=0, atol=1e-4)


def test_mean_image_is_the_file_meta_json_names(prep, tmp_path):
    """meta.json's "mean" names the file; without the key it is mean.npy."""
    import json
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    meta = json.loads((out / "meta.json").read_text())
    del meta["mean_sha256"]  # an output written before the mean's digest: the file is read unchecked
    ours = np.random.default_rng(5).uniform(0, 255, (64, 64, 3)).astype(np.float32)
    np.save(out / "other.npy", ours)
    (out / "meta.json").write_text(json.dumps({**meta, "mean": "other.npy"}))
    np.testing.assert_array_equal(SplitData(out, "train").mean_image(), ours)
    del meta["mean"]
    np.save(out / "mean.npy", ours[::-1])
    (out / "meta.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(SplitData(out, "train").mean_image(), ours[::-1])


def test_defaults_order_and_epoch_changes_against_epoch_order(prep):
    """BatchReader's defaults (shuffle, seed 0, window 16), each epoch's own order, the argument checks."""
    data = SplitData(prep[0], "train")
    reader = BatchReader(data, 1)  # a batch of one image is allowed
    for epoch in (0, 1, 0):
        want = epoch_order(data.counts, epoch, seed=0, shuffle=True, window=16)
        assert [int(reader.indices(epoch, s)[0]) for s in range(len(data))] == want.tolist()
    with pytest.raises(ValueError, match=r"^batch size must be positive, got 0$"):
        BatchReader(data, 0)
    with pytest.raises(ValueError, match=r"^rank 2 outside 0\.\.1$"):
        BatchReader(data, 2, rank=2, world=2)
    with pytest.raises(ValueError, match=r"^rank -1 outside 0\.\.1$"):
        BatchReader(data, 2, rank=-1, world=2)


def test_window_of_one_file_keeps_files_together():
    counts = np.array([3, 5, 2, 4])
    order = epoch_order(counts, 2, seed=1, shuffle=True, window=1)
    files = np.searchsorted(np.cumsum(counts), order, side="right")
    runs = [int(f) for i, f in enumerate(files) if i == 0 or f != files[i - 1]]
    assert sorted(runs) == [0, 1, 2, 3]  # each file's images in one run, the files in a shuffled order
    for window in (0, 1, 2):
        assert epoch_order(counts, 2, seed=1, shuffle=True, window=window).dtype == np.int64
    for window in (0, 2):  # no files: an empty order
        empty = epoch_order(np.zeros(0, np.int64), 0, seed=1, shuffle=True, window=window)
        assert empty.shape == (0,) and empty.dtype == np.int64


def _new_read_threads(before: set) -> list:
    """The read helpers started since `before`: other tests in this process may leave readers open."""
    import threading
    return [t for t in threading.enumerate() if t.name.startswith("batch-read") and t not in before]


def test_close_stops_the_read_threads_and_reading_reopens(prep):
    import threading
    before = set(threading.enumerate())
    data = SplitData(prep[0], "train", threads=3)
    idx = np.arange(len(data))  # enough images for helper threads (data.fastread.MIN_IMAGES_PER_THREAD)
    images, labels = data.read(idx)
    images, labels = images.copy(), labels.copy()
    assert _new_read_threads(before)
    data.close()
    assert not _new_read_threads(before)
    again, again_labels = data.read(idx)
    np.testing.assert_array_equal(again, images)
    np.testing.assert_array_equal(again_labels, labels)
    data.close()


@pytest.fixture(scope="module")
def old_format(prep, tmp_path_factory):
    from tests.test_fastread import format_1_copy
    return format_1_copy(prep[0], tmp_path_factory.mktemp("old") / "data")


def test_format_1_reads_repeated_and_scattered_rows(prep, old_format, monkeypatch, capsys):
    """Format-1 files (h5py path): a repeated row, runs in and out of order, against the plain reader."""
    monkeypatch.setattr("data.reader._noticed", set())
    data = SplitData(old_format, "train")
    err = capsys.readouterr().err
    assert err.startswith(f"note: {old_format} holds format-1 batch files") and err.endswith(
        "(resumable; the data can stay in use)\n")
    images, labels = reference_split(prep[0], "train")
    for idx in ([1, 1, 3], [0, 0, 2], [2, 0, 0], [9, 10, 11], [11, 10, 9], [4, 6, 5, 8], [3]):
        got_i, got_l = data.read(np.array(idx))
        np.testing.assert_array_equal(got_i, images[idx])
        np.testing.assert_array_equal(got_l, labels[idx])


def test_a_pickled_reader_reads_in_the_same_process(prep):
    import pickle
    data = SplitData(prep[0], "train")
    first = data.read(np.arange(5, 12))[0].copy()
    again = pickle.loads(pickle.dumps(data))
    np.testing.assert_array_equal(again.read(np.arange(5, 12))[0], first)


def test_split_attributes_and_argument_checks(prep, tmp_path):
    out = prep[0]
    data = SplitData(out, "train", threads=1)
    assert (data.num_classes, data.image_size, data.threads, len(data)) == (4, 64, 1, 48)
    assert SplitData(out, "train", threads=0).threads == 1
    with pytest.raises(DataError, match=f"^{out} has no 'test' split \\(has: train, val\\)$"):
        SplitData(out, "test")
    for bad in ([-1], [48], [0, 48]):
        with pytest.raises(IndexError, match=f"^index out of range 0..47 of {out / 'train'}$"):
            data.read(np.array(bad))
    copy = tmp_path / "data"
    shutil.copytree(out, copy)
    (copy / "train" / "00002.h5").unlink()
    with pytest.raises(BatchFileError, match=f"^{copy / 'train' / '00002.h5'}: batch file is missing$"):
        SplitData(copy, "train").read(np.array([17]))


def test_open_files_are_kept_and_the_least_recently_used_closed(prep):
    import gc
    import os
    gc.collect()  # a reader an earlier test left in a cycle must not close its files mid-count
    data = SplitData(prep[0], "train", max_open=2, threads=2)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        data.read(np.array([0, 1]))  # file 0, opened once
    assert len(os.listdir("/proc/self/fd")) == fds + 1
    data.read(np.array([8]))   # file 1
    data.read(np.array([0]))   # file 0 again: now the most recent
    data.read(np.array([16]))  # file 2: file 1 is closed
    assert list(data._open) == [0, 2]
    assert len(os.listdir("/proc/self/fd")) == fds + 2
    data.close()


def test_two_threads_use_one_helper(prep):
    import threading
    before = set(threading.enumerate())
    data = SplitData(prep[0], "train", threads=2)
    data.read(np.arange(len(data)))
    assert len(_new_read_threads(before)) == 1
    data.close()
