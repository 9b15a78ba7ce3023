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


class _PinnedIndices:
    """Crop parameters to the device without a pageable copy (which would wait for the whole stream).

    A small ring of pinned buffers, each reused only once its previous copy is done (an event per
    buffer; by then it normally is, since the host never runs that far ahead of its stream).
    """

    RING = 4

    def __init__(self, device: torch.device):
        self.device, self.turn = device, 0
        self.buffers = [torch.empty((3, 0), dtype=torch.int64).pin_memory() for _ in range(self.RING)]
        self.copied = [torch.cuda.Event() for _ in range(self.RING)]

    def __call__(self, spec: CropSpec, n: int) -> torch.Tensor:
        """int64 3 x n on the device, rows oy, ox, flip; asynchronous on the current stream."""
        j = self.turn
        self.copied[j].synchronize()
        if self.buffers[j].shape[1] < n:
            self.buffers[j] = torch.empty((3, max(n, 2 * self.buffers[j].shape[1])), dtype=torch.int64).pin_memory()
        host = self.buffers[j][:, :n]
        view = host.numpy()
        view[0], view[1], view[2] = spec.oy[:n], spec.ox[:n], spec.flip[:n]
        out = host.to(self.device, non_blocking=True)
        self.copied[j].record()
        self.turn = (j + 1) % self.RING
        return out


def _uniform(spec: CropSpec, n: int) -> tuple[int, int, bool] | None:
    """(oy, ox, flip) if every image of the batch is cut alike (center and 10-crop views), else None."""
    oy, ox, fl = spec.oy[:n], spec.ox[:n], spec.flip[:n]
    if n and (oy == oy[0]).all() and (ox == ox[0]).all() and (fl == fl[0]).all():
        return int(oy[0]), int(ox[0]), bool(fl[0])
    return None


class Normalizer:
    """Crop, flip and normalise uint8 NHWC batches on their device, writing float NCHW.

    Nothing here waits for the device: per-image crops reach it through pinned memory, and views
    shared by the whole batch (validation, 10-crop) are plain slices with no index tensor at all.
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
        self._indices = None
        if self.device.type == "cuda":
            # The constants were made on this thread's current stream; a loader reads them on its own
            # stream, which nothing orders after these copies and kernels: finish them now, once.
            torch.cuda.current_stream(self.device).synchronize()
            self._indices = _PinnedIndices(self.device)

    def __call__(self, images: torch.Tensor, spec: CropSpec, crop: int, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """images: uint8 N x S x S x 3 on the device -> float N x 3 x crop x crop (into `out` if given)."""
        n = images.shape[0]
        same = _uniform(spec, n)
        x = self._slice(images, crop, *same) if same is not None else self._gather(images, spec, crop)
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

    def _gather(self, images: torch.Tensor, spec: CropSpec, crop: int) -> torch.Tensor:
        n = images.shape[0]
        if self._indices is not None:
            oy, ox, fl = self._indices(spec, n)
            fl = fl.bool()
        else:
            oy, ox, fl = (torch.from_numpy(np.ascontiguousarray(a[:n])) for a in (spec.oy, spec.ox, spec.flip))
        ar = torch.arange(crop, device=images.device)
        rows = (oy[:, None] + ar)[:, :, None]                                   # N x crop x 1
        cols = (ox[:, None] + torch.where(fl[:, None], crop - 1 - ar, ar))[:, None, :]  # N x 1 x crop
        batch = torch.arange(n, device=images.device)[:, None, None]
        mean = self.mean[rows, cols] if self.mode == "image" else None
        return self._normalize(images[batch, rows, cols], mean)                 # N x crop x crop x 3
