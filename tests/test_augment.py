"""data/augment.py: crop, flip and mean subtraction on the device equal a numpy reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.augment import CropSpec, Normalizer, center_crops, random_bits, ten_crops, train_crops


def reference(images, mean, spec, crop):
    out = []
    for img, oy, ox, fl in zip(images, spec.oy, spec.ox, spec.flip):
        x = img[oy:oy + crop, ox:ox + crop].astype(np.float64) - mean[oy:oy + crop, ox:ox + crop]
        out.append((x[:, ::-1] if fl else x).transpose(2, 0, 1))
    return np.stack(out)


@pytest.mark.parametrize("with_out", [False, True])
def test_image_mean_crop_flip_equals_numpy(with_out):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 20, 20, 3), dtype=np.uint8)
    mean = rng.uniform(0, 255, (20, 20, 3)).astype(np.float32)
    spec = train_crops(1, 2, np.arange(10, 16), 20, 13, True, True)
    assert spec.flip.any() and not spec.flip.all() and len(set(spec.oy.tolist())) > 1
    norm = Normalizer("image", mean)
    out = torch.empty(6, 3, 13, 13).contiguous(memory_format=torch.channels_last) if with_out else None
    got = norm(torch.from_numpy(images), spec, 13, out=out)
    np.testing.assert_allclose(got.numpy(), reference(images, mean, spec, 13), rtol=0, atol=1e-4)
    if with_out:
        assert got.data_ptr() == out.data_ptr()


def test_channel_mode():
    images = np.random.default_rng(1).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    m, s = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    got = Normalizer("channel", None, m, s)(torch.from_numpy(images), center_crops(2, 8, 6), 6).numpy()
    expect = ((images[:, 1:7, 1:7] / 255.0 - m) / s).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(got, expect, atol=1e-5)


def test_randomness_is_a_function_of_seed_epoch_position():
    pos = np.arange(100, 164)
    a = train_crops(3, 5, pos, 256, 227, True, True)
    halves = [train_crops(3, 5, p, 256, 227, True, True) for p in (pos[:32], pos[32:])]
    for field in ("oy", "ox", "flip"):  # however a batch is split (replicas), each image's choice is the same
        np.testing.assert_array_equal(getattr(a, field), np.concatenate([getattr(h, field) for h in halves]))
    b = train_crops(3, 6, pos, 256, 227, True, True)
    assert not np.array_equal(a.oy, b.oy)  # another epoch, other crops
    assert a.oy.min() >= 0 and a.oy.max() <= 29 and a.ox.max() <= 29
    big = train_crops(0, 0, np.arange(20000), 256, 227, True, True)
    assert abs(big.flip.mean() - 0.5) < 0.02 and len(np.unique(big.oy)) == 30
    assert not np.array_equal(random_bits(1, 0, pos, 0), random_bits(1, 0, pos, 1))


def test_randomness_off_gives_center_and_no_flip():
    spec = train_crops(0, 0, np.arange(8), 256, 227, False, False)
    assert (spec.oy == 14).all() and (spec.ox == 14).all() and not spec.flip.any()  # Theano's offset 14


def test_ten_crops_are_corners_center_and_mirrors():
    views = ten_crops(1, 256, 224)
    got = {(int(v.oy[0]), int(v.ox[0]), bool(v.flip[0])) for v in views}
    assert got == {(oy, ox, f) for f in (False, True) for oy, ox in ((0, 0), (0, 32), (32, 0), (32, 32), (16, 16))}
    assert isinstance(views[0], CropSpec)


def test_whole_batch_views_slice_exactly_as_the_gather(tmp_path):
    """Center/10-crop views take the slicing path; it must equal the per-image gather bit for bit."""
    import numpy as np
    import torch

    from data.augment import Normalizer, ten_crops
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (3, 20, 20, 3), dtype=np.uint8))
    for mode, mean in (("image", rng.random((20, 20, 3)).astype(np.float32) * 255), ("channel", None)):
        norm = Normalizer(mode, mean, [0.4, 0.5, 0.6], [0.2, 0.3, 0.25])
        for view in ten_crops(3, 20, 15):
            sliced = norm(images, view, 15)
            gathered = norm._gather(images, view, 15).permute(0, 3, 1, 2)
            assert torch.equal(sliced, gathered)


def test_center_crops_are_int64_offsets_and_no_flip():
    spec = center_crops(3, 256, 227)  # 29 spare rows: offset 14 (floor), as Theano's
    assert spec.oy.dtype == spec.ox.dtype == np.int64 and spec.flip.dtype == bool
    assert spec.oy.tolist() == spec.ox.tolist() == [14, 14, 14] and spec.flip.tolist() == [False] * 3


MASK = (1 << 64) - 1


def splitmix64_next(state: int) -> tuple[int, int]:
    """Vigna's SplitMix64 generator step in plain Python integers: (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def reference_bits(seed: int, epoch: int, position: int, stream: int) -> int:
    """random_bits's documented construction: the key hashes seed, epoch and stream in turn."""
    key = 0
    for part in (seed, epoch, stream):
        key = splitmix64_next(key ^ (part & MASK))[1]
    return splitmix64_next(position ^ key)[1]


def test_hash_is_splitmix64():
    """The published first outputs of SplitMix64 seeded with 0, and random_bits against plain integers."""
    state, outputs = 0, []
    for _ in range(3):
        state, out = splitmix64_next(state)
        outputs.append(out)
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    pos = np.array([0, 1, 7, 2**40 + 3])
    for seed, epoch, stream in ((0, 0, 0), (1, 2, 1), (2**63 - 1, 64, 2)):
        got = random_bits(seed, epoch, pos, stream)
        assert got.dtype == np.uint64
        assert [int(v) for v in got] == [reference_bits(seed, epoch, int(p), stream) for p in pos]


def test_train_crops_use_streams_0_1_2_by_hand():
    pos = np.arange(40, 48)
    spec = train_crops(9, 3, pos, 40, 32, True, True)
    assert spec.oy.dtype == spec.ox.dtype == np.int64 and spec.flip.dtype == bool
    assert spec.oy.tolist() == [reference_bits(9, 3, int(p), 0) % 9 for p in pos]  # 9 offsets: 0..8
    assert spec.ox.tolist() == [reference_bits(9, 3, int(p), 1) % 9 for p in pos]
    assert spec.flip.tolist() == [bool(reference_bits(9, 3, int(p), 2) & 1) for p in pos]
    no_flip = train_crops(9, 3, pos, 40, 32, True, False)
    assert no_flip.oy.tolist() == spec.oy.tolist() and no_flip.flip.dtype == bool and not no_flip.flip.any()
    fixed = train_crops(9, 3, pos, 40, 33, False, True)  # 7 spare rows: offset 3
    assert fixed.oy.tolist() == fixed.ox.tolist() == [3] * 8 and fixed.flip.tolist() == spec.flip.tolist()


def test_uniform_views_are_detected_over_the_first_n_only():
    from data.augment import _uniform
    spec = CropSpec(np.array([2, 2, 5]), np.array([1, 1, 1]), np.array([True, True, False]))
    assert _uniform(spec, 2) == (2, 1, True) and _uniform(spec, 3) is None and _uniform(spec, 0) is None
    assert _uniform(spec, 1) == (2, 1, True)  # a batch of one image
    for field in ("oy", "ox", "flip"):  # one differing field is enough to need the gather
        arrays = {"oy": np.array([2, 2]), "ox": np.array([1, 1]), "flip": np.array([False, False])}
        arrays[field] = arrays[field].copy()
        arrays[field][1] = 1 - arrays[field][1] if field != "flip" else True
        assert _uniform(CropSpec(**arrays), 2) is None


def test_staged_indices_and_a_larger_out_buffer():
    """Per-image crops given as device index rows (data.staging), written into the head of `out`."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (4, 12, 12, 3), dtype=np.uint8)
    mean = rng.uniform(0, 255, (12, 12, 3)).astype(np.float32)
    spec = CropSpec(np.array([0, 3, 1, 2]), np.array([2, 0, 3, 1]), np.array([True, False, False, True]))
    indices = torch.tensor(np.stack([spec.oy, spec.ox, spec.flip]).astype(np.int64))
    out = torch.full((6, 3, 9, 9), -1.0).contiguous(memory_format=torch.channels_last)
    got = Normalizer("image", mean)(torch.from_numpy(images), spec, 9, out=out, indices=indices)
    assert got.shape == (4, 3, 9, 9) and got.data_ptr() == out.data_ptr()
    np.testing.assert_allclose(got.numpy(), reference(images, mean, spec, 9), rtol=0, atol=1e-4)
    assert (out[4:] == -1).all()
    plain = Normalizer("image", mean)(torch.from_numpy(images), spec, 9)
    assert plain.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(plain.numpy(), reference(images, mean, spec, 9), rtol=0, atol=1e-4)


def test_channel_mode_with_per_image_crops_and_bad_modes():
    images = np.random.default_rng(2).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    m, s = (0.5, 0.25, 0.75), (0.5, 0.125, 0.25)
    spec = CropSpec(np.array([0, 2]), np.array([1, 0]), np.array([False, True]))
    got = Normalizer("channel", None, m, s)(torch.from_numpy(images), spec, 6).numpy()
    crops = [images[0, 0:6, 1:7], images[1, 2:8, 0:6, :][:, ::-1]]
    expect = np.stack([((c / 255.0 - m) / s).transpose(2, 0, 1) for c in crops])
    np.testing.assert_allclose(got, expect, atol=1e-5)
    with pytest.raises(ValueError, match="^data.mean=image needs the dataset's mean image$"):
        Normalizer("image", None)
    with pytest.raises(ValueError, match="^data.mean must be image or channel, got 'pixel'$"):
        Normalizer("pixel", None)


def test_output_is_float32_whatever_the_mean_image_dtype():
    images = np.random.default_rng(4).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    mean = np.random.default_rng(5).uniform(0, 255, (8, 8, 3))  # float64
    got = Normalizer("image", mean)(torch.from_numpy(images), center_crops(2, 8, 6), 6)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), reference(images, mean, center_crops(2, 8, 6), 6), atol=1e-4)


def test_staged_indices_are_used_as_given():
    """The rows staged on the device are what the crops are cut from (the spec is not copied again)."""
    images = np.random.default_rng(6).integers(0, 256, (2, 10, 10, 3), dtype=np.uint8)
    mean = np.zeros((10, 10, 3), np.float32)
    staged = CropSpec(np.array([0, 2]), np.array([1, 0]), np.array([True, False]))
    other = CropSpec(np.array([1, 0]), np.array([0, 2]), np.array([False, True]))
    indices = torch.tensor(np.stack([staged.oy, staged.ox, staged.flip]).astype(np.int64))
    got = Normalizer("image", mean)(torch.from_numpy(images), other, 8, indices=indices)
    np.testing.assert_allclose(got.numpy(), reference(images, mean, staged, 8), atol=1e-4)


def test_hash_overflow_is_silent():
    """The hash wraps around 2**64 by design: no overflow warning (an error under -W error)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert random_bits(2**63 - 1, 7, np.arange(3), 2).shape == (3,)
