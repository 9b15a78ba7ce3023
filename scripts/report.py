#!/usr/bin/env python3
"""One self-contained page per training run: config, curves, checkpoints, the paper's figures, per-class results.

    python scripts/report.py demo/run                       # -> demo/run/report.html (+ report.json, figures/)
    python scripts/report.py runs/alexnet_1gpu --data /data/imagenet256 --train-images 10000

The page (report.html, no network needed: pictures embedded, no scripts) shows the resolved config
(config.yaml), the learning curves (train and validation loss, validation top-1/top-5 error against
epoch and time, the lr), the training throughput, the checkpoints, the three figures of
scripts/figures.py for the best checkpoint, and per-class results of the best checkpoint on the
validation split (the best and worst 10 classes by top-1 error, the most confused pairs), from the
same evaluation as `scripts/evaluate.py --json`. report.json beside it holds the tables; the figures
and their JSON go to figures/ beside it. The data folder defaults to the run config's data.root.

Exit codes: 0 done, 2 bad input (a run directory without metrics or checkpoints, data that does not fit).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "report.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import guarded, positive, protect_streams  # noqa: E402
from alexnet.distributed import pick_device  # noqa: E402
from alexnet.evaluation import prepare  # noqa: E402
from alexnet.figures.make import FigureOptions  # noqa: E402
from alexnet.figures.report import PAGE, data_root, outputs, read_run, write_report  # noqa: E402
from data.domains import DEVICE, NON_NEGATIVE, InputPath, OneLineParser  # noqa: E402

# --help's last line
EXAMPLE = "python scripts/report.py runs/alexnet_1gpu --data imagenet256"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]) + f"\n\nexample: {EXAMPLE}")
    p.add_argument("run", metavar="RUN_DIR", type=InputPath("folder"), help="a run directory of train.py (run.dir)")
    p.add_argument("--data", type=InputPath("folder"),
                   help="the preprocessed data folder (default: the run config's data.root)")
    p.add_argument("--out", type=PAGE, help="the page (default RUN_DIR/report.html; its record (.json) and figures/ "
                   "go beside it)")
    p.add_argument("--train-images", type=positive, default=2000, help="neighbours figure: the seeded subset of "
                   "training images searched (default 2000)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help="seeds the choice of images in the figures (default 0)")
    p.add_argument("--batch-size", type=positive, default=100, help="images per forward pass (default 100)")
    p.add_argument("--device", type=DEVICE, default="auto", help="auto (cuda if present) | cpu | cuda | cuda:N")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def check_outputs(page: str, default: bool) -> None:
    """The page, its record and its figures (beside it): each is refused as a given --out is (someone else's
    file or folder there), before any work; so is a page named .json, which its record would replace."""
    flag = "--out (default)" if default else "--out"
    where = outputs(page)
    for what, path, domain in where:
        try:
            domain(path)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"argument {flag}: {what}: {e}") from None
    if len({Path(path).resolve() for _, path, _ in where}) < len(where):
        raise ValueError(f"argument {flag}: {page} ends in .json, the name of the page's record beside it: give "
                         "the page another suffix (.html)")


def run(args: argparse.Namespace) -> Path:
    the_run = read_run(args.run)  # first: RUN_DIR that is no run's is the fault, not what lies beside it
    check_outputs(args.out or str(the_run.root / "report.html"), default=args.out is None)
    try:
        device = pick_device(args.device)
    except RuntimeError as e:  # cuda asked for but absent
        raise ValueError(str(e)) from None
    prep = prepare(the_run.best, data_root(the_run, args.data), device=device, prog="report.py")
    out = Path(args.out or the_run.root / "report.html")
    opts = FigureOptions(train_images=args.train_images, seed=args.seed, batch_size=args.batch_size,
                         progress=not args.no_progress)
    write_report(the_run, prep, out, opts, device)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, out = guarded("report.py", lambda: run(args))
    if code:
        return code
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    protect_streams("report.py")
    sys.exit(main())
