#!/usr/bin/env python3
"""The paper's figures from any weights evaluate.py takes: conv1's kernels, top-5 predictions, fc7 neighbours.

    python scripts/figures.py --weights demo/run/checkpoints/best.pt --data demo/data --out demo/run/figures

writes, under --out:
  filters.png      conv1's kernels (Krizhevsky et al. 2012, Fig. 3), each scaled to its own range: two
                   columns (column 1 above) for an alexnet/caffenet trained with parallel.model=columns,
                   else all kernels of the single-device model; the title says which
  predictions.png  --n-images validation images (seeded by --seed, or those of --images), each with its
                   five most probable classes as bars, the true class's bar in red (Fig. 4 left)
  neighbours.png   --queries validation images, each followed by the --neighbours training images nearest
                   in fc7 features among a seeded subset of --train-images (Fig. 4 right); the features
                   are cached under --cache (default <out>/cache), so a re-run is fast
and a JSON beside each figure with what it shows (classes, probabilities, neighbours and distances).

Weights: our checkpoints of every layout, weights files, torchvision and plain state dicts (--arch), the
Theano reproduction's folder (--epoch, --theano-conv, --mean img_mean.npy), BVLC .caffemodel files.
Classes are named by meta.json's class_names where the data has them, else by wnid.
Exit codes: 0 done, 2 bad input (missing or unreadable files, weights that do not fit the data).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "figures.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import guarded, positive, protect_streams  # noqa: E402
from alexnet.distributed import pick_device  # noqa: E402
from alexnet.evaluation import prepare  # noqa: E402
from alexnet.figures.make import CACHE_FOLDER, FIGURES, FIGURES_FOLDER, FigureOptions, make_figures  # noqa: E402
from alexnet.models import ARCHS  # noqa: E402
from alexnet.weights.hub import MEAN_FILE, MEAN_HELP, NAME_HELP, WEIGHTS, resolve  # noqa: E402
from alexnet.weights.theano_layout import THEANO_CONVS  # noqa: E402
from data.domains import DEVICE, NON_NEGATIVE, InputPath, OneLineParser, text  # noqa: E402

# --help's last line
EXAMPLE = "python scripts/figures.py --weights demo/run/checkpoints/best.pt --data demo/data --out demo/run/figures"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]) + f"\n\nexample: {EXAMPLE}")
    p.add_argument("--weights", required=True, type=WEIGHTS,
                   help="checkpoint (.pt), state_dict file, a Theano weights folder, or a "
                   "BVLC .caffemodel" + NAME_HELP)
    p.add_argument("--data", required=True, type=InputPath("folder"),
                   help="a scripts/preprocess.py output folder (val and train splits)")
    p.add_argument("--out", required=True, type=FIGURES_FOLDER,
                   help="folder for the figures")
    p.add_argument("--arch", choices=ARCHS, help="needed only for plain alexnet/caffenet state dicts")
    p.add_argument("--epoch", type=positive, help="Theano folder: the epoch to load (default: the highest)")
    p.add_argument("--theano-conv", choices=THEANO_CONVS, help="Theano folder: the run's lib_conv")
    p.add_argument("--mean", type=MEAN_FILE,
                   help="a mean image file subtracted instead of the data's mean.npy (as evaluate.py)" + MEAN_HELP)
    p.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES), help="draw only these figures")
    p.add_argument("--n-images", type=positive, default=8, help="predictions: validation images (default 8)")
    p.add_argument("--images", nargs="+", metavar="IMAGE", type=text("an index or a name"),
                   help="predictions: these validation images (indices "
                   "in file order, or names as in evaluate.py's CSV) instead of a seeded choice")
    p.add_argument("--queries", type=positive, default=4, help="neighbours: validation images (default 4)")
    p.add_argument("--neighbours", type=positive, default=6, help="neighbours: training images per query "
                   "(default 6)")
    p.add_argument("--train-images", type=positive, default=2000, help="neighbours: the seeded subset of training "
                   "images searched (default 2000; all if fewer)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=0, help="seeds the choice of images (default 0)")
    p.add_argument("--crops", type=int, choices=(1, 10), default=1, help="predictions: 1 (center) or 10 crops")
    p.add_argument("--batch-size", type=positive, default=100, help="images per forward pass (default 100)")
    p.add_argument("--device", type=DEVICE, default="auto", help="auto (cuda if present) | cpu | cuda | cuda:N")
    p.add_argument("--cache", type=CACHE_FOLDER,
                   help="folder of the cached fc7 features (default <out>/cache)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def options(args: argparse.Namespace) -> FigureOptions:
    return FigureOptions(images=args.n_images, chosen=args.images, queries=args.queries, neighbours=args.neighbours,
                         train_images=args.train_images, seed=args.seed, batch_size=args.batch_size, crops=args.crops,
                         progress=not args.no_progress, cache=Path(args.cache) if args.cache else None,
                         only=tuple(args.only))


def run(args: argparse.Namespace) -> dict:
    try:
        device = pick_device(args.device)
    except RuntimeError as e:  # cuda asked for but absent
        raise ValueError(str(e)) from None
    args.weights = resolve(args.weights)  # a published set's name: its checked file in torch's hub cache
    prep = prepare(args.weights, args.data, arch=args.arch, epoch=args.epoch, theano_conv=args.theano_conv,
                   mean=args.mean, device=device, prog="figures.py")
    return make_figures(args.weights, prep, args.out, options(args), device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, done = guarded("figures.py", lambda: run(args))
    if code:
        return code
    for name, paths in done.items():
        cached = " (training features from the cache)" if paths.get("cached") else ""
        print(f"{name}: {paths['png']}{cached}")
    return 0


if __name__ == "__main__":
    protect_streams("figures.py")
    sys.exit(main())
