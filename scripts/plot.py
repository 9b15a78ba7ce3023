#!/usr/bin/env python3
"""Learning curves: validation top-1 error against wall-clock time and against epoch, one line per run.

    python scripts/plot.py runs/demo                                  # -> runs/demo/learning_curve.png
    python scripts/plot.py runs/1gpu runs/2gpu --out compare.png      # as Fig. 1 of Yadan et al. 2013

Reads each run directory's metrics.jsonl. matplotlib is optional: without it this prints how to
install it and exits 0. Exit code 2: a run directory without metrics.jsonl or without validation records.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "plot.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import interrupt_code, late_or, protect_streams, stopping_on_signals  # noqa: E402
from alexnet.metrics import read_metrics  # noqa: E402
from data.domains import InputPath, OneLineParser, OutputPath, holding  # noqa: E402
from data.fsutil import commit, temp_path  # noqa: E402

# (seconds per unit, axis label): the largest unit in which the longest run spans at least 2 units.
_TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))
_PLOTTED = ("top1_err", "time", "epoch")  # what a validation record must hold as numbers to be drawn


# The mark each image carries in its metadata (by format: matplotlib's key for it), by which a later run knows
# an existing --out file as its own to replace; formats without metadata are never replaced.
MARK = "alexnet scripts/plot.py"
_MARK_KEY = {".png": "Software", ".pdf": "Creator", ".svg": "Creator", ".eps": "Creator", ".ps": "Creator"}
OUT = OutputPath("file", earlier=holding(f"an image plot.py wrote (its metadata names {MARK}: "
                                          f"{', '.join(_MARK_KEY)})", MARK.encode()))


class PlotError(ValueError):
    """A run directory that cannot be plotted; names it."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python scripts/plot.py runs/1gpu runs/2gpu --out compare.png")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", type=InputPath("folder"),
                   help="run directories (run.dir of train.py)")
    p.add_argument("--out", type=OUT, help="output image, its format from the suffix (default: <first "
                   "RUN_DIR>/learning_curve.png); an existing file is replaced only where plot.py wrote it (a mark in "
                   f"the metadata of {', '.join(_MARK_KEY)})")
    args = p.parse_args(argv)
    if args.out is None:  # the default is refused as a given --out would be
        args.out = str(Path(args.runs[0]) / "learning_curve.png")
        try:
            OUT(args.out)
        except argparse.ArgumentTypeError as e:
            p.error(f"argument --out (default): {e}")
    return args


def val_curve(run: Path) -> list[dict]:
    """The validation records of a run, in the order written."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run}: no metrics.jsonl (not a run directory of train.py?)")
    records = read_metrics(path, warn=lambda message: print(f"plot.py: warning: {message}", file=sys.stderr))
    val = [r for r in records if r.get("split") == "val" and all(_number(r.get(k)) for k in _PLOTTED)]
    if not val:
        raise PlotError(f"{path}: no validation records yet (validation runs at the end of an epoch)")
    return val


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def labels(runs: list[Path]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name."""
    names = [run.resolve().name for run in runs]
    return names if len(set(names)) == len(names) else [str(run) for run in runs]


def time_unit(curves: list[tuple[str, list[dict]]]) -> tuple[float, str]:
    longest = max(r["time"] for _, recs in curves for r in recs)
    return next(((s, name) for s, name in _TIME_UNITS if longest >= 2 * s), _TIME_UNITS[-1])


def draw(curves: list[tuple[str, list[dict]]], out: Path) -> None:
    """Two panels side by side, written atomically to `out` (format from its suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    seconds, unit = time_unit(curves)
    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, recs in curves:
        err = [r["top1_err"] for r in recs]
        by_time.plot([r["time"] / seconds for r in recs], err, marker=".", label=label)
        by_epoch.plot([r["epoch"] for r in recs], err, marker=".", label=label)
    by_time.set_xlabel(f"wall-clock time ({unit})")
    by_epoch.set_xlabel("epoch")
    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_time.set_ylabel("validation top-1 error")
    for ax in (by_time, by_epoch):
        ax.grid(True, alpha=0.3)
    by_epoch.legend()
    fig.tight_layout()
    tmp = temp_path(out, keep_suffix=True)  # suffix kept: it picks the format
    try:
        key = _MARK_KEY.get(out.suffix.lower())
        fig.savefig(tmp, dpi=120, metadata={key: MARK} if key else None)
        commit(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [Path(r) for r in args.runs]
    try:
        curves = [(label, val_curve(run)) for label, run in zip(labels(runs), runs)]
    except (PlotError, OSError) as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed; pip install matplotlib to draw learning curves")
        return 0
    out = Path(args.out)
    try:
        with stopping_on_signals():  # SIGTERM, SIGHUP: the temporary file is removed as for Ctrl-C
            out.parent.mkdir(parents=True, exist_ok=True)
            draw(curves, out)
    except (OSError, ValueError) as e:  # unwritable folder, or a suffix matplotlib has no format for
        print(f"plot.py: error: cannot write {out} ({e})", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"plot.py: interrupted{late_or(e, f'; {out} not written')}", file=sys.stderr)
        return interrupt_code(e)
    print(f"learning curve of {len(curves)} run(s): {out}")
    return 0


if __name__ == "__main__":
    protect_streams("plot.py")
    sys.exit(main())
