"""Metrics: top-k counts kept on the device, metrics.jsonl, optional TensorBoard.

Accumulators live on the training device and are read (one host synchronisation) only when a record
is written, so the hot path never waits for the GPU.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from data.fsutil import commit, temp_path

if TYPE_CHECKING:
    import torch
# torch is imported where a tensor is made, not here: the tools that only read metrics.jsonl (plot.py, the gpu
# check's steps) start 1.5 s of CPU sooner without it.


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> torch.Tensor:
    """Number of samples whose label is among the top-k logits, for each k (a device tensor)."""
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    found = top.eq(labels[:, None]).cumsum(dim=1)  # column j: 1 where the label is among the first j + 1
    return found[:, [min(k, k_max) - 1 for k in ks]].sum(dim=0)


class Meter:
    """Sums of loss, top-1 and top-5 hits and sample count since the last reset, on the device."""

    FIELDS = ("loss_sum", "top1", "top5", "n")

    def __init__(self, device: torch.device):
        import torch
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch (mean `loss` over its samples); device ops only, no copy from the host."""
        n = labels.shape[0]
        self.sums[0] += loss.detach().double() * n
        self.sums[1:3] += topk_correct(logits, labels).double()
        self.sums[3] += n

    def add(self, sums: torch.Tensor) -> None:
        self.sums += sums.to(self.sums.device, self.sums.dtype)

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
    """``metrics.jsonl`` (one JSON object per record, flushed) and TensorBoard scalars if available.

    A record cut short (kill -9, a full disk) leaves a last line without its newline; it is dropped
    when the file is opened, so the next record never merges with it.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, say=print):
        self.path, self.say = Path(run_dir) / "metrics.jsonl", say
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_cut_short()
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = _tensorboard_writer(Path(run_dir) / "tb") if tensorboard else None
        if tensorboard and self._tb is None:
            say("note: run.tensorboard is on but tensorboard is not installed: no event files, metrics.jsonl "
                "only (pip install tensorboard, or run.tensorboard=false to silence this)")

    def _drop_cut_short(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            os.truncate(self.path, keep)
            self.say(f"{self.path}: dropped its last record, cut short by an earlier run ({len(data) - keep} bytes "
                     "without a line end)")

    def start_over(self) -> Path | None:
        """A run that starts from no checkpoint: earlier records (of a run that died before its first
        checkpoint) move to metrics.prev-N.jsonl, returned, so that no step is recorded twice."""
        if self.path.stat().st_size == 0:
            return None
        self._file.close()
        numbers = [int(m.group(1)) for p in self.path.parent.iterdir() if (m := _PREVIOUS.match(p.name))]
        kept = self.path.with_name(f"metrics.prev-{max(numbers, default=0) + 1}.jsonl")
        commit(self.path, kept)
        self._file = open(self.path, "a", encoding="utf-8")
        return kept

    def truncate_after(self, global_step: int) -> None:
        """Drop records past `global_step` (written after the checkpoint a run resumes from), and damaged
        lines (each named)."""
        self._file.close()
        keep = [line for line in _lines(self.path, self.say) if line[1]["iter"] <= global_step]
        tmp = temp_path(self.path)
        tmp.write_text("".join(json.dumps(record) + "\n" for _, record in keep), encoding="utf-8")
        commit(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

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


_PREVIOUS = re.compile(r"^metrics\.prev-(\d+)\.jsonl$")


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


def read_metrics(path: str | os.PathLike, warn=None) -> list[dict]:
    """All records of a metrics.jsonl. A damaged line (not UTF-8, not a JSON object with an integer
    `iter`, cut short) is a ValueError naming the file and line, or, given `warn`, skipped and named
    through it."""
    return [record for _, record in _lines(Path(path), warn)]


def _lines(path: Path, warn) -> list[tuple[int, dict]]:
    """(line number, record) of every good line of `path`; see read_metrics."""
    out = []
    for number, raw in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        if not raw.strip():
            continue
        problem = _damage(raw)
        if problem is None:
            out.append((number, json.loads(raw)))
            continue
        message = f"{path}: line {number} is damaged ({problem}); skipped"
        if warn is None:
            raise ValueError(message.removesuffix("; skipped"))
        warn(message)
    return out


def _damage(raw: bytes) -> str | None:
    """What is wrong with one line of a metrics.jsonl, or None."""
    if not raw.endswith(b"\n"):
        return "cut short: no line end"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError:
        return "not JSON"
    if not isinstance(record, dict) or not isinstance(record.get("iter"), int):
        return "not a record: a JSON object with an integer iter"
    return None
