"""Metrics: top-k counts kept on the device, metrics.jsonl, optional TensorBoard.

Accumulators live on the training device and are read (one host synchronisation) only when a record
is written, so the hot path never waits for the GPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> torch.Tensor:
    """Number of samples whose label is among the top-k logits, for each k (a device tensor)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hit = top.eq(labels[:, None])
    return torch.stack([hit[:, :min(k, k_max)].any(dim=1).sum() for k in ks])


class Meter:
    """Sums of loss, top-1 and top-5 hits and sample count since the last reset, on the device."""

    FIELDS = ("loss_sum", "top1", "top5", "n")

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch (mean `loss` over its samples); device ops only, no copy from the host."""
        n = labels.shape[0]
        self.sums[0] += loss.detach().double() * n
        self.sums[1:3] += topk_correct(logits, labels).double()
        self.sums[3] += n

    def add(self, sums: torch.Tensor) -> None:
        self.sums += sums.to(self.sums.device, torch.float64)

    def reset(self) -> None:
        self.sums.zero_()

    @staticmethod
    def summarize(sums: torch.Tensor) -> dict:
        """loss, top1_err, top5_err, n from a (possibly all-reduced) sums vector."""
        loss_sum, top1, top5, n = (float(v) for v in sums.cpu())
        if n == 0:
            return {"loss": float("nan"), "top1_err": float("nan"), "top5_err": float("nan"), "n": 0}
        return {"loss": loss_sum / n, "top1_err": 1 - top1 / n, "top5_err": 1 - top5 / n, "n": int(n)}


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per record, flushed) and TensorBoard scalars if available."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._tb = _tensorboard_writer(Path(run_dir) / "tb") if tensorboard else None

    def truncate_after(self, global_step: int) -> None:
        """Drop records past `global_step` (written after the checkpoint a run resumes from)."""
        self._file.close()
        lines = self.path.read_text().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):  # a record cut short (kill -9, full disk): never trusted
            lines.pop()
        keep = [line for line in lines if line.strip() and json.loads(line)["iter"] <= global_step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "top1_err", "top5_err", "lr", "img_per_s"):
                if key in record:
                    self._tb.add_scalar(f"{record['split']}/{key}", record[key], record["iter"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is optional: any import failure just means no event files
        return None
    return SummaryWriter(str(log_dir))


WALL_CLOCK = ("time", "img_per_s")  # the only fields two runs of the same training may differ in


def without_wall_clock(records: list[dict]) -> list[dict]:
    """The records without their wall-clock fields: what must repeat exactly (resume, loading modes)."""
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in records]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
