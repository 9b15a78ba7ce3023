#!/usr/bin/env python3
"""Evaluate weights on a preprocessed validation split: top-1 and top-5 error, center crop or 10-crop.

Our training checkpoint (arch, width, crop and normalisation come from the stored config):

    python scripts/evaluate.py --data demo/data --weights runs/demo/checkpoints/best.pt --crops 10 \\
        --json runs/demo/eval.json --csv runs/demo/predictions.csv

torchvision's published AlexNet (arch owt inferred from the keys; for its published 56.5% top-1 use data
preprocessed with `--resize torchvision --size 256`; on data of another geometry a note says so):

    python scripts/evaluate.py --data imagenet256_tv --weights torchvision   # fetched once, checked, cached

A plain state_dict of our alexnet/caffenet needs `--arch alexnet` or `--arch caffenet` (same keys).

The Theano reproduction's weights (a folder of W_0_65.npy ... files; data preprocessed with
`--resize warp --size 256`, as theirs; their run's mean image img_mean.npy; see pretrained/README.md):

    python scripts/evaluate.py --data imagenet256_warp --weights parameters_releasing --mean img_mean.npy

BVLC's Caffe models, bvlc_alexnet.caffemodel or bvlc_reference_caffenet.caffemodel (arch from the layer
order, Caffe's LRN, crop 227; Caffe's BGR order is taken care of; BVLC's mean image by name, or without --mean
Caffe's per-channel mean (B, G, R) = (104, 117, 123); data preprocessed with `--resize caffe --size 256`):

    python scripts/evaluate.py --data imagenet256_caffe --weights bvlc_alexnet --mean ilsvrc_2012_mean

Exit codes: 0 done, 2 bad input (missing, damaged or unreadable files, weights that do not fit the data or
hold NaN/inf, an unwritable --json/--csv), 1 a failure of the machine (disk full), 130 Ctrl-C (nothing
written; earlier outputs stay as they were).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "evaluate.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import guarded, positive, protect_streams  # noqa: E402
from alexnet.distributed import pick_device  # noqa: E402
from alexnet.evaluation import EARLIER_CSV, EARLIER_JSON, PRECISIONS, evaluate, prepare  # noqa: E402
from alexnet.models import ARCHS  # noqa: E402
from alexnet.weights.hub import MEAN_FILE, MEAN_HELP, NAME_HELP, WEIGHTS  # noqa: E402
from alexnet.weights.theano_layout import THEANO_CONVS  # noqa: E402
from data.batchfile import atomic_write_json  # noqa: E402
from data.domains import DEVICE, InputPath, OneLineParser, OutputPath  # noqa: E402
from data.fsutil import check_writable  # noqa: E402

# --help's last line
EXAMPLE = "python scripts/evaluate.py --data imagenet256 --weights runs/alexnet_1gpu/checkpoints/best.pt --crops 10"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]) + f"\n\nexample: {EXAMPLE}")
    p.add_argument("--data", required=True, type=InputPath("folder"), help="a scripts/preprocess.py output folder")
    p.add_argument("--weights", required=True, type=WEIGHTS,
                   help="checkpoint (.pt), state_dict file, a Theano weights folder, or a "
                   "BVLC .caffemodel" + NAME_HELP)
    p.add_argument("--arch", choices=ARCHS, help="needed only for plain alexnet/caffenet state dicts")
    p.add_argument("--epoch", type=positive, help="Theano folder: the epoch to load (default: the highest)")
    p.add_argument("--theano-conv", choices=THEANO_CONVS, help="Theano folder: the run's lib_conv (default cudnn, "
                   "as the released weights: kernels are flipped; cudaconvnet: not flipped)")
    p.add_argument("--mean", type=MEAN_FILE,
                   help="a mean image .npy, (3, S, S) as Theano's img_mean.npy or (S, S, 3), or a Caffe "
                   ".binaryproto (BGR, e.g. imagenet_mean.binaryproto), subtracted instead of the data's mean.npy "
                   "(weights normalised by a mean image only)" + MEAN_HELP)
    p.add_argument("--crops", type=int, choices=(1, 10), default=1, help="1: center crop; 10: corners+center, "
                   "plain and mirrored, probabilities averaged (default 1)")
    p.add_argument("--json", type=OutputPath("file", earlier=EARLIER_JSON),
                   help="write the results as JSON to this file")
    p.add_argument("--csv", type=OutputPath("file", earlier=EARLIER_CSV),
                   help="write one row per image (name, label, top-5 predictions, correct1/5, "
                   "prob1..prob5: the probability of each prediction, averaged over the crops; then the wnid "
                   "and words of the true class and of each prediction)")
    p.add_argument("--batch-size", type=positive, default=100, help="images per forward pass (default 100)")
    p.add_argument("--device", type=DEVICE, default="auto", help="auto (cuda if present) | cpu | cuda | cuda:N")
    p.add_argument("--split", choices=("val", "train"), default="val", help="the split to evaluate (default val)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Load, check, evaluate; the JSON record."""
    try:
        device = pick_device(args.device)
    except RuntimeError as e:  # cuda asked for but absent
        raise ValueError(str(e)) from None
    for out in (args.json, args.csv):
        if out:
            check_writable(out)  # fail now, not after the whole split
    model, info, data, normalizer, mean = prepare(args.weights, args.data, args.split, arch=args.arch, epoch=args.epoch,
                                                  theano_conv=args.theano_conv, mean=args.mean, device=device)
    result = evaluate(model, data, info["crop"], normalizer, crops=args.crops, batch_size=args.batch_size,
                      device=device, csv_path=args.csv, progress=not args.no_progress, precision=args.precision)
    return {**result, "weights": str(args.weights), "data": str(args.data), "split": args.split,
            "arch": info["arch"], "width": info["width"], "crop": info["crop"], "source": info["source"],
            "precision": args.precision, "device": str(device),
            "mean": mean,
            **{k: info[k] for k in ("epoch", "theano_conv") if k in info}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, record = guarded("evaluate.py", lambda: run(args),
                           interrupted="; nothing written (earlier outputs are unchanged)")
    if code:
        return code
    views = "1 crop" if record["crops"] == 1 else f"{record['crops']} crops"
    print(f"top-1 error {record['top1_err']:.4f}, top-5 error {record['top5_err']:.4f} on {record['n']} images "
          f"({views})")
    if args.json:
        code, _ = guarded("evaluate.py", lambda: atomic_write_json(args.json, record))
    return code


if __name__ == "__main__":
    protect_streams("evaluate.py")
    sys.exit(main())
