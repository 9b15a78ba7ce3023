"""The staging ring: a batch's uint8 images, labels and crop parameters to the device together.

A pageable host-to-device copy waits for everything queued on the stream, so on a GPU every batch goes
through a ring of pinned host slots. One slot holds one batch: its images (N x S x S x 3 uint8) and
one int64 table whose four rows are the labels and the crops' top rows, left columns and flips. Both
are filled on the host, copied with one asynchronous copy each, and guarded by one event: the slot is
written again only after the device has finished copying out of it. Both copied regions start at the
slot's first byte and are contiguous for any batch size up to the capacity: a strided pinned region
would be copied through a pageable temporary, which can block the host.

On the CPU nothing is staged: the arrays are handed over as tensors sharing their memory. A ring made
with ``staged=True`` on the CPU runs the GPU path's layout and copies without pinning or events (its
CPU twin, for tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .augment import CropSpec

DEPTH = 2  # slots: the host may run this many batches ahead of the copies before it waits for one


@dataclass
class Staged:
    """One batch on the device: images, labels, and its crops as rows (oy, ox, flip) when staged."""

    images: torch.Tensor  # uint8 N x S x S x 3
    labels: torch.Tensor  # int64 N
    crops: torch.Tensor | None  # int64 3 x N, the CropSpec's device copy (None: not staged, use the spec)


class _Slot:
    """One batch's host memory: the images, and the labels and crops as one table."""

    def __init__(self, batch: int, size: int, pin: bool):
        self.images = torch.empty((batch, size, size, 3), dtype=torch.uint8)
        self.table = torch.empty(4 * batch, dtype=torch.int64)  # the first 4n values are 4 rows of n
        if pin:
            self.images, self.table = self.images.pin_memory(), self.table.pin_memory()

    def regions(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What is copied for a batch of n: the images' first n rows and the table's first 4n values."""
        return self.images[:n], self.table[:4 * n]


def copy_event() -> torch.cuda.Event:
    """An event the host waits on: blocking, so the waiting thread sleeps instead of spinning a core."""
    return torch.cuda.Event(blocking=True)


def _copy_to(region: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous copy of a contiguous (pinned, on a GPU) host region to the device."""
    return torch.empty(region.shape, dtype=region.dtype, device=device).copy_(region, non_blocking=True)


class StagingRing:
    """Batches to the device through `depth` host slots, each reused once its last copy is done."""

    def __init__(self, device: torch.device, batch: int, size: int, depth: int = DEPTH,
                 staged: bool | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self.slots = [_Slot(batch, size, pin=cuda) for _ in range(depth)] if self.staged else []
        self.events = [copy_event() for _ in range(depth)] if self.staged and cuda else None
        self.turn, self._waited = 0, False

    @property
    def depth(self) -> int:
        return len(self.slots)

    def _slot(self) -> _Slot:
        """The slot of the next batch, once the device has copied its previous batch out of it."""
        if not self._waited and self.events is not None:
            self.events[self.turn].synchronize()
        self._waited = True
        return self.slots[self.turn]

    def host_images(self, n: int) -> np.ndarray | None:
        """Host memory to read the next batch's images into (None when not staged).

        Reading a batch straight into its slot saves one host copy of the whole batch; upload() notices.
        """
        return self._slot().images[:n].numpy() if self.staged else None

    def upload(self, images: np.ndarray, labels: np.ndarray, crops: CropSpec) -> Staged:
        """The batch on the device; asynchronous on the current stream when staged."""
        if not self.staged:
            return Staged(torch.from_numpy(images), torch.from_numpy(labels), None)
        n, slot = len(labels), self._slot()
        host_images, table = slot.regions(n)
        if images.ctypes.data != host_images.data_ptr():  # not read in place (host_images): copy it over
            host_images.numpy()[...] = images
        rows = table.numpy().reshape(4, n)
        rows[0], rows[1], rows[2], rows[3] = labels, crops.oy[:n], crops.ox[:n], crops.flip[:n]
        x, t = _copy_to(host_images, self.device), _copy_to(table, self.device).view(4, n)
        if self.events is not None:
            self.events[self.turn].record()
        self.turn, self._waited = (self.turn + 1) % self.depth, False
        return Staged(x, t[0], t[1:])
