"""The numpy XXH3-64 fallback: the xxhash package's digests, and the read path's checks without it."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import data.xxh3 as xxh3
from data.batchfile import BatchFileError
from data.reader import SplitData
from tests.test_fastread import flip_byte

xxhash = pytest.importorskip("xxhash")


@pytest.mark.parametrize("size", [241, 256, 1024, 1025, 1087, 1088, 1089, 13467, 49152, 196608, 196609])
def test_numpy_digest_equals_xxhash(size):
    rng = np.random.default_rng(size)
    for _ in range(3):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        assert xxh3.xxh3_64_numpy(data) == xxhash.xxh3_64_intdigest(data)
    image = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)  # arrays are hashed as their bytes
    assert xxh3.xxh3_64_numpy(image) == xxhash.xxh3_64_intdigest(image.tobytes())


def test_short_inputs_need_xxhash():
    with pytest.raises(ValueError, match="over 240 bytes"):
        xxh3.xxh3_64_numpy(np.zeros(240, np.uint8))


def test_read_path_checks_every_image_without_xxhash(prep, tmp_path, monkeypatch, capsys):
    """Where xxhash is missing the reader still verifies (numpy), says so once, and names a bad image."""
    root = tmp_path / "data"
    shutil.copytree(prep[0], root)
    want = SplitData(prep[0], "train").read(np.arange(10))
    monkeypatch.setattr(xxh3, "xxhash", None)
    monkeypatch.setattr(xxh3, "_notified", [False])
    data = SplitData(root, "train")
    for a, b in zip(data.read(np.arange(10)), want):
        np.testing.assert_array_equal(a, b)
    assert capsys.readouterr().err.count("xxhash package is not installed") == 1
    name = flip_byte(data.paths[0], 3)
    with pytest.raises(BatchFileError, match=f"{data.paths[0]}: image 3 .*{name}"):
        SplitData(root, "train").read(np.arange(10))
