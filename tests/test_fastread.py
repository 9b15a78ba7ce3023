"""The format-2 read path (data/fastread.py via SplitData): integrity per image, both formats alike."""
from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from data.batchfile import BatchFileError, read_batch_file, read_file_attrs
from data.reader import BatchReader, SplitData
from data.upgrade import convert_file
from tests import children


def format_1_copy(src: Path, dst: Path) -> Path:
    """A copy of the preprocessed folder `src` as an older version wrote it: format-1 files and meta."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    for split, s in meta["splits"].items():
        for f in s["files"]:
            assert convert_file(dst / split / f["name"], version=1)
    meta["format_version"] = 1
    (dst / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return dst


@pytest.fixture(scope="module")
def old(prep, tmp_path_factory) -> Path:
    return format_1_copy(prep[0], tmp_path_factory.mktemp("old") / "data")


def flip_byte(path: Path, row: int, at: int = 777) -> None:
    """Flip one byte inside image `row` of a batch file on disk (either format)."""
    with h5py.File(path, "r") as f:
        ds = f["images"]
        if ds.chunks:  # format 1: the chunk of that image
            offset = ds.id.get_chunk_info(row).byte_offset
        else:
            offset = ds.id.get_offset() + row * ds[0].nbytes
        name = f["names"].asstr()[row]
    with open(path, "r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)[0]
        fh.seek(offset + at)
        fh.write(bytes([byte ^ 0x5A]))
    return name


def test_new_files_are_format_2_contiguous_and_aligned(prep):
    out, _ = prep
    data = SplitData(out, "train")
    assert data.meta["format_version"] == 2
    for path in data.paths:
        with h5py.File(path, "r") as f:
            assert f.attrs["format_version"] == 2 and f["images"].chunks is None
            if f["images"].nbytes >= 64 * 1024:  # HDF5 aligns objects from that size on
                assert f["images"].id.get_offset() % 4096 == 0
            assert f["checksums"].shape == (f["images"].shape[0],)


@pytest.mark.parametrize("split", ["train", "val"])
def test_old_format_reads_identically(prep, old, split):
    """A format-1 folder (h5py path) and the same data in format 2 (pread path) give the same batches."""
    new_data, old_data = SplitData(prep[0], split), SplitData(old, split)
    assert old_data.meta["format_version"] == 1
    idx = np.random.default_rng(1).permutation(len(new_data))
    for a, b in zip(new_data.read(idx), old_data.read(idx)):
        np.testing.assert_array_equal(a, b)
    for p_new, p_old in zip(new_data.paths, old_data.paths):
        for a, b in zip(read_batch_file(p_new), read_batch_file(p_old)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert read_file_attrs(p_old)["format_version"] == 1
    np.testing.assert_array_equal(new_data.mean_image(), old_data.mean_image())
    if split == "train":
        readers = [BatchReader(d, 5, shuffle=True, seed=3, window=2) for d in (new_data, old_data)]
        for (ia, la), (ib, lb) in zip(*(r.batches(1) for r in readers)):
            np.testing.assert_array_equal(ia, ib)
            np.testing.assert_array_equal(la, lb)


def test_old_format_prints_one_upgrade_notice(old, prep, capfd, monkeypatch):
    monkeypatch.setattr("data.reader._noticed", set())  # once per process: forget earlier tests' notices
    SplitData(old, "train")
    SplitData(old, "val")
    err = capfd.readouterr().err
    assert err.count("scripts/upgrade_data.py") == 1 and str(old) in err
    SplitData(prep[0], "train")
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("threads", [1, 3])
def test_flipped_byte_names_file_and_image(prep, tmp_path, threads):
    """One flipped byte in one image: a batch holding it fails naming the file, the row and the source;
    a batch without it still reads, identical to before."""
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    ref = SplitData(prep[0], "train")
    everything = np.arange(len(ref))
    ref_images, ref_labels = ref.read(everything)
    name = flip_byte(out / "train" / "00001.h5", row=3)
    bad = int(ref.offsets[1]) + 3
    data = SplitData(out, "train", threads=threads)
    # the bad image last: with 3 threads it is read by a helper thread, not the caller
    with pytest.raises(BatchFileError, match=rf"00001\.h5: image 3 \({name}\) fails its xxh3_64 checksum"):
        data.read(np.concatenate([np.delete(everything, bad), [bad]]))
    good = np.delete(everything, bad)
    images, labels = data.read(good)
    np.testing.assert_array_equal(images, ref_images[good])
    np.testing.assert_array_equal(labels, ref_labels[good])
    with pytest.raises(BatchFileError, match=r"00001\.h5: image 3 "):
        read_batch_file(out / "train" / "00001.h5")


def test_flipped_byte_in_old_format_names_file_and_image(old, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(old, out)
    name = flip_byte(out / "train" / "00002.h5", row=5)
    data = SplitData(out, "train")
    with pytest.raises(BatchFileError, match=rf"00002\.h5: image 5 \({name}\) fails its Fletcher-32"):
        data.read(np.arange(len(data)))
    data.read(np.arange(int(data.offsets[2])))  # the files before it still read


def test_threads_and_strided_output_give_the_same_batch(prep):
    out, _ = prep
    one, three = SplitData(out, "train", threads=1), SplitData(out, "train", threads=3)
    idx = np.random.default_rng(2).permutation(len(one))
    ref_images, ref_labels = one.read(idx)
    images, labels = three.read(idx)
    np.testing.assert_array_equal(images, ref_images)
    np.testing.assert_array_equal(labels, ref_labels)
    strided = np.zeros((2 * len(idx),) + images.shape[1:], np.uint8)[::2]  # not C-contiguous
    three.read(idx, out=strided)
    np.testing.assert_array_equal(strided, ref_images)
    three.close()


def test_a_ctrl_c_inside_the_threads_wait_is_raised_after_it(prep, monkeypatch):
    """Ctrl-C landing inside the wait for the reader's threads (data.procs.stops_between_calls): the wait
    returns, KeyboardInterrupt follows it, Python's handler is back, and the threads and the reader are
    whole: the next read equals a one-thread read."""
    import signal

    import data.fastread as fastread
    from tests.conftest import sigint_inside_the_pool
    out, _ = prep
    one, three = SplitData(out, "train", threads=1), SplitData(out, "train", threads=3)
    idx = np.arange(len(one))
    assert len(idx) >= 2 * fastread.MIN_IMAGES_PER_THREAD  # helper threads read: there is a wait
    handler = signal.getsignal(signal.SIGINT)
    returned = sigint_inside_the_pool(monkeypatch, fastread, "wait")
    with pytest.raises(KeyboardInterrupt):
        three.read(idx)
    assert returned and signal.getsignal(signal.SIGINT) is handler
    np.testing.assert_array_equal(three.read(idx)[0], one.read(idx)[0])
    three.close()


def test_file_replaced_in_place_while_open_is_reread(prep, old, tmp_path):
    """A reader keeps working while its folder is upgraded in place (it reopens replaced files)."""
    out = tmp_path / "data"
    shutil.copytree(old, out)
    data = SplitData(out, "train", max_open=1)
    idx = np.arange(len(data))
    before = data.read(idx)
    for path in data.paths:
        assert convert_file(path)
        now = data.read(idx)  # a mix of handles to old inodes and newly converted files
        for a, b in zip(before, now):
            np.testing.assert_array_equal(a, b)


def _read_in_child(data: SplitData, idx: np.ndarray, queue) -> None:
    queue.put(data.read(idx)[0].sum(dtype=np.int64))


@pytest.mark.processes
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_reader_works_after_fork_and_spawn(prep, method):
    """Descriptors and threads are per process: a forked or spawned copy opens its own."""
    data = SplitData(prep[0], "train", threads=2)
    idx = np.arange(len(data))
    expect = data.read(idx)[0].sum(dtype=np.int64)  # the parent holds descriptors and a thread pool
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_read_in_child, args=(data, idx, queue))
    proc.start()
    got = children.get(queue, proc.pid, f"a {method} reader", cpu_s=60)
    proc.join()
    assert proc.exitcode == 0 and got == expect
    assert data.read(idx)[0].sum(dtype=np.int64) == expect  # the parent's handles still work


def test_truncated_images_are_named(prep, tmp_path):
    """Cut inside the image data: the header still opens, the reader names the file and what is missing."""
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    victim = out / "train" / "00000.h5"
    with h5py.File(victim, "r") as f:
        end = f["images"].id.get_offset() + f["images"].id.get_storage_size()
    with open(victim, "r+b") as fh:
        fh.truncate(end - 100)
    with pytest.raises(BatchFileError, match=r"00000\.h5: "):
        SplitData(out, "train").read(np.arange(4))


def test_pooled_output_is_reused_only_when_nothing_holds_it(prep):
    """read() without `out` recycles its arrays (no page faults per batch), never one still in use."""
    import torch
    data = SplitData(prep[0], "train")
    ref = SplitData(prep[0], "train").read(np.arange(24))[0]
    a, _ = data.read(np.arange(8))
    b, _ = data.read(np.arange(8, 16))  # `a` is held: another buffer
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, ref[:8])
    held = torch.from_numpy(b[2:])  # a tensor on a view of `b` holds b's buffer
    a_ptr = a.__array_interface__["data"][0]
    del a, b
    c, _ = data.read(np.arange(16, 24))
    assert c.__array_interface__["data"][0] == a_ptr  # a's buffer came back
    np.testing.assert_array_equal(held.numpy(), ref[10:16])
    np.testing.assert_array_equal(c, ref[16:24])


@pytest.mark.processes
def test_benchmark_read_reports_every_path(tmp_path):
    from tests.conftest import run_script
    out = tmp_path / "read.json"
    r = run_script("scripts/benchmark.py", "read", "--files", "3", "--per-file", "16", "--size", "32",
                   "--batch-sizes", "16", "8", "--threads", "2", "--repeat", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    whats = " | ".join(row["what"] for row in rows)
    for part in ("format 1 via h5py", "raw chunks", "pread+xxh3", "raw pread", "memory bound"):
        assert part in whats
    assert all(row["img_per_s"] > 0 and row["GB_per_s"] >= 0 and row["vs_memory_bound"] > 0 for row in rows)
    assert {row["batch"] for row in rows} == {16, 8}


def test_the_read_table_never_rounds_a_slow_path_to_zero():
    """A path at 1/2500 of the memory bound is 0.0004 of it, not 0.0 (3 decimals gave 0.0 on a loaded
    machine and the benchmark's own test failed)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench.read import rate_table
    rows = [("memory bound (one copy)", 64), ("format 1 (h5py)", 64), ("format 2", 64)]
    table = rate_table(rows, [50000.0, 20.0, 12345.0], 3 * 64 * 64)
    assert [r["vs_memory_bound"] for r in table] == [1.0, 0.0004, 0.247]
    assert [r["img_per_s"] for r in table] == [50000, 20, 12345]
    assert [r["GB_per_s"] for r in table] == [0.61, 0.0, 0.15]
