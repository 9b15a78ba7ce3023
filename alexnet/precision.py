"""Numeric precision and backend switches shared by training, evaluation and the benchmarks."""
from __future__ import annotations

import contextlib
import os

import torch


def configure_backends(precision: str, device: torch.device, deterministic: bool = False) -> None:
    """tf32 matmuls/convolutions only for precision tf32; cuDNN autotuning on GPUs unless deterministic.

    Deterministic: torch's deterministic algorithms (an op without one raises instead of running),
    cuDNN without autotuning (it may pick other algorithms from run to run), cuBLAS with a fixed
    workspace (its documented requirement), and the fixed-order pooling and LRN of layers/.
    """
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        # only when it changes: setting it imports torch._inductor (and dynamo), over a second of CPU
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def autocast_for(precision: str, device: torch.device):
    """bf16 autocast for precision bf16; fp32 and tf32 run without autocast."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
