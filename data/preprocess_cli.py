"""The command line of scripts/preprocess.py: arguments, exit codes (0 done, 1 a failure of the machine: a
dead worker, a full disk; 2 bad input, a bad archive or an --out that cannot be written; 130 interrupted)
and the summary printed at the end. Every error is one line naming the path, file or value at fault."""
from __future__ import annotations

import argparse
import signal
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from data.domains import COUNT, COUNT_TEXT, NON_NEGATIVE, POSITIVE, AnyOf, InputPath, OneLineParser

from .archives import ArchiveError
from .decode import RESIZE_MODES
from .fsutil import os_error_exit_code, os_error_message
from .layouts import DataError
from .preprocess import OUTPUT, Options, preprocess


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="preprocess.py", description="Preprocess ImageNet (folders or the archives as downloaded) into "
        "batch files, a mean image, meta.json and report.json.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Re-run the same command to resume an interrupted run. See docs/preprocessing.md for ImageNet.\n\n"
        "example: python scripts/preprocess.py --train-dir ILSVRC2012_img_train.tar --val-dir ILSVRC2012_img_val.tar "
        "--val-labels ILSVRC2012_devkit_t12.tar.gz --out imagenet256")
    p.add_argument("--train-dir", required=True, nargs="+", metavar="TRAIN", type=InputPath("either"),
                   help="ILSVRC2012 train: a <wnid>/<image> folder, ILSVRC2012_img_train.tar (read in place), "
                        "or Hugging Face train_images_*.tar.gz shards")
    p.add_argument("--val-dir", nargs="+", metavar="VAL", type=InputPath("either"),
                   help="val: a folder (<wnid>/<image>, or flat with --val-labels), ILSVRC2012_img_val.tar, "
                        "or Hugging Face val_images.tar.gz")
    p.add_argument("--val-labels", nargs="+", metavar="LABELS", type=InputPath("either"),
                   help="labels of a flat val: LOC_val_solution.csv (Kaggle), val.txt (Caffe), the devkit "
                        "(ILSVRC2012_devkit_t12.tar.gz or its folder), or meta.mat and the ground-truth file")
    p.add_argument("--class-names", metavar="FILE", type=InputPath("either"),
                   help="the words of each wnid: '<wnid> <words>' lines "
                   "(LOC_synset_mapping.txt) or the devkit; default: the devkit or LOC_synset_mapping.txt "
                   "beside a Kaggle CSV, when given")
    p.add_argument("--classes", metavar="N|FILE",
                   type=AnyOf("a count of classes or a file of wnids", COUNT_TEXT, InputPath("file")),
                   help="a subset: N classes chosen with --seed, or the wnids "
                   "listed in FILE; labels 0..N-1 in sorted-wnid order, val restricted to them")
    p.add_argument("--train-per-class", type=COUNT, metavar="K", help="at most K training images per class "
                   "(the first K by name)")
    p.add_argument("--out", required=True, type=OUTPUT, help="output folder")
    p.add_argument("--size", type=COUNT, default=256, help="output side in pixels (default 256)")
    p.add_argument("--per-file", type=COUNT, default=256, help="images per batch file (default 256)")
    p.add_argument("--resize", choices=RESIZE_MODES, default="short",
                   help="short: shorter side to --size then central crop (default); warp: straight resize "
                        "(the Theano weights); caffe: straight resize as OpenCV's cv2.resize (BVLC's Caffe "
                        "weights); torchvision: Resize(--size), window for CenterCrop(224) (torchvision's "
                        "weights). caffe and torchvision decode at full size (slower)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=1, help="seed of the training-order shuffle (default 1)")
    p.add_argument("--workers", type=COUNT, default=None, help="worker processes (default: all cores)")
    p.add_argument("--shard-memory", type=POSITIVE, metavar="GIB", help="gzip shards: GiB of compressed "
                   "images held per streaming pass (default: half the available memory)")
    p.add_argument("--allow-empty-classes", action="store_true", help="keep a class folder without images as a "
                   "class (no training image teaches it); by default such a folder is an error")
    p.add_argument("--allow-one-class", action="store_true", help="accept a train dir of one class, or with a class "
                   "named like a split (train, val, test); by default either is taken for a layout mistake")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = Options(args.size, args.per_file, args.resize, args.seed, args.classes, args.train_per_class)
    # SIGTERM stops like Ctrl-C: finished files are kept and a re-run resumes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    memory = int(args.shard_memory * 2**30) if args.shard_memory else None
    try:
        summary = preprocess(args.train_dir, args.out, args.val_dir, args.val_labels, opts, args.workers,
                             args.quiet, args.class_names, memory, args.allow_empty_classes,
                             args.allow_one_class)
    except ArchiveError as e:
        print(f"preprocess: error: {e}; finished batch files are kept", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"preprocess: error: {e}", file=sys.stderr)
        return 2
    except BrokenProcessPool:
        print("preprocess: error: a worker process died (killed or out of memory); finished files "
              "are kept: re-run the same command to resume", file=sys.stderr)
        return 1
    except OSError as e:  # the operating system refused: unwritable --out, unreadable input, full disk
        code = os_error_exit_code(e)
        kept = "" if code == 2 else "; finished batch files are kept: re-run the same command to resume"
        print(f"preprocess: error: {os_error_message(e)}{kept}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("preprocess: interrupted; finished files are kept: re-run the same command to resume",
              file=sys.stderr)
        return 130
    _print_summary(Path(args.out), summary)
    return 0


def _print_summary(out: Path, summary: dict) -> None:
    for k, c in summary["counts"].items():
        print(f"{k}: {c['written']} images written to {out / k} ({len(summary['meta']['splits'][k]['files'])}"
              f" files), {c['skipped']} skipped")
    print(f"mean image: {out / 'mean.npy'}; meta: {out / 'meta.json'}")
    if summary["skipped"] or summary["ignored"]:
        print(f"{len(summary['skipped'])} unreadable and {len(summary['ignored'])} non-image files are listed "
              f"with the reason in {out / 'report.json'}")
