"""A run's learning curves and throughput from its metrics.jsonl records (for the report page)."""
from __future__ import annotations

import os

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from .common import save_png

_TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))  # the largest spanning 2 units


def split_records(records: list[dict], split: str) -> list[dict]:
    """The records of one split ("train" or "val"), in the order written."""
    return [r for r in records if r.get("split") == split]


def fractional_epochs(train: list[dict]) -> list[float]:
    """Each training record's position in epochs: epoch e's records spread over (e-1, e] by their step,
    from the last step of epoch e-1 to the last step logged in epoch e.

    Where epoch e-1 has no record (a run continued from another run's checkpoint, e.g. converted weights
    at epoch 3, logs from epoch 4 on), epoch e-1 ended at global step (e-1) x S: S, the steps of an epoch,
    is the last step of the first epoch that is followed by another (the trainer logs every epoch's last
    step) divided by its number; of the only epoch, when there is one.
    """
    last: dict[int, int] = {}
    for r in train:
        last[r["epoch"]] = max(last.get(r["epoch"], 0), r["iter"])
    if not last:
        return []
    done = min((e for e in last if e < max(last)), default=max(last))
    steps = last[done] / done
    out = []
    for r in train:
        e = r["epoch"]
        start = last[e - 1] if e - 1 in last else (e - 1) * steps
        span = last[e] - start
        out.append(e - 1 + ((r["iter"] - start) / span if span > 0 else 1.0))
    return out


def time_unit(records: list[dict]) -> tuple[float, str]:
    """(seconds per unit, its name): the largest unit the run spans at least twice."""
    longest = max((r["time"] for r in records), default=0.0)
    return next(((s, name) for s, name in _TIME_UNITS if longest >= 2 * s), _TIME_UNITS[-1])


def draw_curves(records: list[dict], title: str, out: str | os.PathLike) -> None:
    """Four panels: train and val loss by epoch; val top-1/top-5 error by epoch and by time; the lr."""
    train, val = split_records(records, "train"), split_records(records, "val")
    seconds, unit = time_unit(records)
    fig, ((loss, by_epoch), (by_time, lr)) = plt.subplots(2, 2, figsize=(11, 7))
    x_train = fractional_epochs(train)
    loss.plot(x_train, [r["loss"] for r in train], lw=1, label="train (log window means)")
    loss.plot([r["epoch"] for r in val], [r["loss"] for r in val], marker="o", label="validation")
    loss.set_ylabel("loss")
    for key, style in (("top1_err", "-o"), ("top5_err", "--s")):
        name = key.replace("_err", "").replace("top", "top-")
        by_epoch.plot([r["epoch"] for r in val], [r[key] for r in val], style, label=f"val {name} error")
        by_time.plot([r["time"] / seconds for r in val], [r[key] for r in val], style, label=f"val {name} error")
    by_epoch.set_ylabel("error")
    by_time.set_ylabel("error")
    by_time.set_xlabel(f"wall-clock time ({unit})")
    lr.plot(x_train, [r["lr"] for r in train], lw=1)
    lr.set_ylabel("learning rate")
    if train and min(r["lr"] for r in train) > 0:
        lr.set_yscale("log")
    for ax in (loss, by_epoch, lr):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (loss, by_epoch, by_time, lr):
        ax.grid(True, alpha=0.3)
    for ax in (loss, by_epoch, by_time):
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, out)


def draw_throughput(records: list[dict], title: str, out: str | os.PathLike) -> None:
    """Training images per second of each log window against wall-clock time."""
    train = split_records(records, "train")
    seconds, unit = time_unit(records)
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.plot([r["time"] / seconds for r in train], [r["img_per_s"] for r in train], marker=".", lw=1)
    ax.set_xlabel(f"wall-clock time ({unit})")
    ax.set_ylabel("training images / s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, out)
