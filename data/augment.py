"""Device-side augmentation: per-image crop and flip, mean subtraction, uint8 NHWC in, float NCHW out.

The random choices of an image depend only on (seed, epoch, position in the epoch order), through a
counter-based hash, not on a stateful generator: the same image gets the same crop and flip whichever
process prepares it (loader process, thread or inline), however the epoch is split across replicas,
and wherever a resumed run restarts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element (Steele et al.'s SplitMix64 finaliser)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def random_bits(seed: int, epoch: int, positions: np.ndarray, stream: int) -> np.ndarray:
    """64 random bits per position, a pure function of (seed, epoch, position, stream)."""
    key = np.uint64(0)
    for part in (seed, epoch, stream):
        key = _splitmix64(key ^ np.uint64(part & 0xFFFFFFFFFFFFFFFF))
    return _splitmix64(np.asarray(positions, dtype=np.uint64) ^ key)


@dataclass(frozen=True)
class CropSpec:
    """Where each image of a batch is cut and whether it is mirrored."""

    oy: np.ndarray  # int64, top row of each crop
    ox: np.ndarray  # int64, left column
    flip: np.ndarray  # bool


def train_crops(seed: int, epoch: int, positions: np.ndarray, size: int, crop: int, random_crop: bool,
                flip: bool) -> CropSpec:
    """Random (or centred) crops and random flips for the images at `positions` of `epoch`."""
    n, span = len(positions), size - crop + 1
    if random_crop:
        oy = (random_bits(seed, epoch, positions, 0) % np.uint64(span)).astype(np.int64)
        ox = (random_bits(seed, epoch, positions, 1) % np.uint64(span)).astype(np.int64)
    else:
        oy = ox = np.full(n, (size - crop) // 2, np.int64)
    flips = (random_bits(seed, epoch, positions, 2) & np.uint64(1)).astype(bool) if flip else np.zeros(n, bool)
    return CropSpec(oy, ox, flips)


def center_crops(n: int, size: int, crop: int) -> CropSpec:
    c = np.full(n, (size - crop) // 2, np.int64)
    return CropSpec(c, c, np.zeros(n, bool))


def ten_crops(n: int, size: int, crop: int) -> list[CropSpec]:
    """The four corners and the center, each plain and mirrored (Krizhevsky 2012's test views)."""
    far, mid = size - crop, (size - crop) // 2
    views = []
    for flip in (False, True):
        for oy, ox in ((0, 0), (0, far), (far, 0), (far, far), (mid, mid)):
            views.append(CropSpec(np.full(n, oy, np.int64), np.full(n, ox, np.int64), np.full(n, flip)))
    return views


def _uniform(spec: CropSpec, n: int) -> tuple[int, int, bool] | None:
    """(oy, ox, flip) if every image of the batch is cut alike (center and 10-crop views), else None."""
    oy, ox, fl = spec.oy[:n], spec.ox[:n], spec.flip[:n]
    if n and (oy == oy[0]).all() and (ox == ox[0]).all() and (fl == fl[0]).all():
        return int(oy[0]), int(ox[0]), bool(fl[0])
    return None


class Normalizer:
    """Crop, flip and normalise uint8 NHWC batches on their device, writing float NCHW.

    Nothing here waits for the device when per-image crops come staged (`indices`, from
    data.staging's pinned ring); views shared by the whole batch (validation, 10-crop) are plain
    slices with no index tensor at all.
    """

    def __init__(self, mode: str, mean_image: np.ndarray | None, channel_mean=None, channel_std=None,
                 device: torch.device | str = "cpu"):
        self.mode, self.device = mode, torch.device(device)
        if mode == "image":
            if mean_image is None:
                raise ValueError("data.mean=image needs the dataset's mean image")
            self.mean = torch.as_tensor(mean_image, dtype=torch.float32, device=self.device)
        elif mode == "channel":
            self.cmean = torch.tensor(channel_mean, dtype=torch.float32, device=self.device) * 255.0
            self.cstd = torch.tensor(channel_std, dtype=torch.float32, device=self.device) * 255.0
        else:
            raise ValueError(f"data.mean must be image or channel, got {mode!r}")
        if self.device.type == "cuda":  # pragma: no mutate block (CUDA only: tests/test_gpu.py)
            # The constants were made on this thread's current stream; a loader reads them on its own
            # stream, which nothing orders after these copies and kernels: finish them now, once.
            torch.cuda.current_stream(self.device).synchronize()

    def __call__(self, images: torch.Tensor, spec: CropSpec, crop: int, out: torch.Tensor | None = None,
                 indices: torch.Tensor | None = None) -> torch.Tensor:
        """images: uint8 N x S x S x 3 on the device -> float N x 3 x crop x crop (into `out` if given).

        indices: `spec` as int64 rows (oy, ox, flip) already on the device (see data.staging); without
        them per-image crops are copied from `spec`, which on a GPU waits for the stream.
        """
        n = images.shape[0]
        same = _uniform(spec, n)
        x = self._slice(images, crop, *same) if same is not None else self._gather(images, spec, crop, indices)
        x = x.permute(0, 3, 1, 2)
        if out is None:
            return x.contiguous(memory_format=torch.channels_last)
        out[:n].copy_(x)
        return out[:n]

    def _normalize(self, x8: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        x = x8.float()
        if self.mode == "image":
            return x - mean
        return (x - self.cmean) / self.cstd

    def _slice(self, images: torch.Tensor, crop: int, oy: int, ox: int, flip: bool) -> torch.Tensor:
        x8 = images[:, oy:oy + crop, ox:ox + crop]
        mean = self.mean[oy:oy + crop, ox:ox + crop] if self.mode == "image" else None
        if flip:
            x8 = x8.flip(2)
            mean = mean.flip(1) if mean is not None else None
        return self._normalize(x8, mean)

    def _gather(self, images: torch.Tensor, spec: CropSpec, crop: int, indices: torch.Tensor | None = None
                ) -> torch.Tensor:
        n = images.shape[0]
        if indices is None:
            indices = torch.as_tensor(np.stack([spec.oy[:n], spec.ox[:n], spec.flip[:n]]).astype(np.int64),
                                      device=images.device)
        oy, ox, fl = indices[0], indices[1], indices[2].bool()
        ar = torch.arange(crop, device=images.device)
        rows = (oy[:, None] + ar)[:, :, None]                                   # N x crop x 1
        cols = (ox[:, None] + torch.where(fl[:, None], crop - 1 - ar, ar))[:, None, :]  # N x 1 x crop
        batch = torch.arange(n, device=images.device)[:, None, None]
        mean = self.mean[rows, cols] if self.mode == "image" else None
        return self._normalize(images[batch, rows, cols], mean)                 # N x crop x crop x 3
