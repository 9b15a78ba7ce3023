"""What several benchmarks time: the trainer's training step, and a dataset of random images."""
from __future__ import annotations

from pathlib import Path


def trainer_step(arch: str, width: float, crop: int, precision: str, channels_last: bool, device,
                 compile_model: bool = False, num_classes: int = 1000):
    """step(x, y): one training step of a fresh model (the code path of alexnet.trainer)."""
    import torch

    from alexnet.config import TrainConfig
    from alexnet.models import build_model
    from alexnet.optim import build_optimizer
    from alexnet.precision import autocast_for, configure_backends
    from alexnet.replica import sgd_step
    torch.manual_seed(0)
    configure_backends(precision, device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(arch, num_classes, width, 0.5, crop).to(device).to(memory_format=fmt)
    opt = build_optimizer(model, TrainConfig())
    forward = torch.compile(model) if compile_model else model
    return lambda x, y: sgd_step(forward, opt, x, y, lambda: autocast_for(precision, device))


def constant_batch_step(arch: str, width: float, crop: int, batch: int, precision: str, channels_last: bool,
                        device, compile_model: bool = False, num_classes: int = 1000):
    """A closure running one training step on a fixed random batch already on `device`."""
    import torch
    step = trainer_step(arch, width, crop, precision, channels_last, device, compile_model, num_classes)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 3, crop, crop, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch,), device=device)
    return lambda: step(x, y)


def make_random_dataset(root: Path, n_images: int, size: int = 256, per_file: int = 256, classes: int = 1000,
                        version: int | None = None) -> Path:
    """A preprocessed-format folder of random images (for loader speed, where content does not matter)."""
    import numpy as np

    from data.batchfile import FORMAT_VERSION, atomic_write_json, batch_file_name, write_batch_file
    version = version or FORMAT_VERSION
    rng = np.random.default_rng(0)
    files = []
    (root / "train").mkdir(parents=True, exist_ok=True)
    for i, lo in enumerate(range(0, n_images, per_file)):
        n = min(per_file, n_images - lo)
        images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        write_batch_file(root / "train" / batch_file_name(i), images, rng.integers(0, classes, n),
                         [f"c{i}/x{j}.JPEG" for j in range(n)], split="train", index=i, version=version)
        files.append({"name": batch_file_name(i), "count": n})
    np.save(root / "mean.npy", np.full((size, size, 3), 127.5, np.float32))
    atomic_write_json(root / "meta.json", {"format_version": version, "classes": [f"c{i}" for i in range(classes)],
                                           "num_classes": classes, "image_size": size, "mean": "mean.npy",
                                           "splits": {"train": {"count": n_images, "files": files}}})
    return root
