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
