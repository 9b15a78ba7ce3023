#!/usr/bin/env python3
"""Top-5 classes of JPEG/PNG images, with names and probabilities, for weights in any format evaluate.py takes.

Our checkpoint, with the preprocessed folder it was trained on (its image size, mean image, wnids and
class names):

    python scripts/predict.py runs/alexnet_1gpu/checkpoints/best.pt photo.jpg --data imagenet256

torchvision's AlexNet (per-channel normalisation, 1,000 classes in sorted-wnid order), named by Kaggle's
LOC_synset_mapping.txt or the devkit:

    python scripts/predict.py alexnet_tv.pt cat.png dog.jpg --class-names LOC_synset_mapping.txt

Each image is decoded as preprocessing does (data.decode: shorter side to --size, central square; or
the straight resize of --resize warp), then center-cropped (or 10 crops) and normalised as the weights
expect. Exit codes: 0 done, 2 bad input (weights, data, or an image that cannot be decoded; weights holding
NaN or inf; an unwritable --json), 1 a failure of the machine (disk full), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "predict.py")  # a Ctrl-C while torch imports: one line, not a traceback

import torch  # noqa: E402

from alexnet.checkpoint import refuse_non_finite  # noqa: E402
from alexnet.cli import OneLineParser, guarded, positive, protect_streams  # noqa: E402
from alexnet.evaluation import load_weights, predict_log_probs  # noqa: E402
from alexnet.models import ARCHS  # noqa: E402
from alexnet.weights.geometry import expected_geometry  # noqa: E402
from alexnet.weights.hub import MEAN_FILE, MEAN_HELP, NAME_HELP, WEIGHTS, resolve  # noqa: E402
from data.augment import Normalizer  # noqa: E402
from data.batchfile import atomic_write_json  # noqa: E402
from data.classnames import read_class_names  # noqa: E402
from data.decode import RESIZE_MODES, load_image  # noqa: E402
from data.domains import NON_NEGATIVE, InputPath, OutputPath, device, json_holding  # noqa: E402
from data.fsutil import check_writable  # noqa: E402
from data.meta import read_mean, read_meta  # noqa: E402

# --help's last line
EXAMPLE = "python scripts/predict.py runs/alexnet_1gpu/checkpoints/best.pt photo.jpg --data imagenet256"

# What an existing --json file must be for a new run to replace it: what predict() returns, as JSON.
EARLIER_JSON = json_holding("an earlier predict.py --json output (a list of {image, top})", ("image", "top"),
                            many=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]) + f"\n\nexample: {EXAMPLE}")
    p.add_argument("weights", type=WEIGHTS,
                   help="checkpoint (.pt), state_dict file, or a Theano weights folder" + NAME_HELP)
    p.add_argument("images", nargs="+", type=InputPath("file"), help="JPEG/PNG files")
    p.add_argument("--data", type=InputPath("folder"),
                   help="the scripts/preprocess.py folder the weights were trained on: image size, resize "
                   "mode, mean image, wnids and class names")
    p.add_argument("--class-names", metavar="FILE", type=InputPath("either"),
                   help="'<wnid> <words>' lines (LOC_synset_mapping.txt) or the "
                   "devkit; without wnids from the weights or --data, a file of exactly as many wnids as the "
                   "model has classes numbers them in sorted order")
    p.add_argument("--arch", choices=ARCHS, help="needed only for plain alexnet/caffenet state dicts")
    p.add_argument("--epoch", type=NON_NEGATIVE, help="Theano folder: the epoch to load (default: the highest)")
    p.add_argument("--theano-conv", choices=("cudnn", "cudaconvnet"), help="Theano folder: its lib_conv")
    p.add_argument("--mean", type=MEAN_FILE, help="a mean image .npy, (3, S, S) or (S, S, 3), or a Caffe "
                   ".binaryproto (BGR), for weights normalised by a mean image" + MEAN_HELP)
    p.add_argument("--size", type=positive, help="decoded side (default: --data's image size, else 256)")
    p.add_argument("--resize", choices=RESIZE_MODES, help="default: --data's mode, else warp for Theano weights "
                   "and short for the rest")
    p.add_argument("--crops", type=int, choices=(1, 10), default=1, help="1: center crop; 10: corners+center, "
                   "plain and mirrored, probabilities averaged (default 1)")
    p.add_argument("--top", type=positive, default=5, help="how many classes to print (default 5)")
    p.add_argument("--json", type=OutputPath("file", earlier=EARLIER_JSON),
                   help="also write the predictions as JSON to this file")
    p.add_argument("--device", type=device(auto=False), default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    return p.parse_args(argv)


def _read_data(folder: str | None) -> tuple[dict | None, Path | None]:
    """--data's meta.json, checked as train.py and evaluate.py check it (DataError naming the file and key)."""
    if folder is None:
        return None, None
    return read_meta(folder), Path(folder)


def class_table(info: dict, meta: dict | None, names_file: str | None) -> list[tuple[str, str]]:
    """(wnid, words) of each output of the model, '' where unknown."""
    n = info["num_classes"]
    wnids = info.get("classes") or (meta or {}).get("classes")
    words: dict[str, str] = {}
    if meta and isinstance(meta.get("class_names"), list):
        words.update((c, w) for c, w in zip(meta["classes"], meta["class_names"]) if isinstance(w, str))
    if names_file:
        from_file = read_class_names(names_file)
        words.update(from_file)
        if wnids is None and len(from_file) == n:
            wnids = sorted(from_file)  # torchvision's and Caffe's numbering: the sorted wnids
    if wnids is None:
        return [("", "")] * n
    if len(wnids) != n:
        raise ValueError(f"the model has {n} classes but its class list has {len(wnids)}")
    if meta and info.get("classes") and list(info["classes"]) != list(meta["classes"]):
        raise ValueError("the weights' classes differ from those of --data: its names would be wrong")
    return [(w, words.get(w, "")) for w in wnids]


def _normalizer(info: dict, meta: dict | None, root: Path | None, mean_file: str | None, size: int,
                device: torch.device) -> Normalizer:
    """The normalisation the weights were trained with: per-channel constants or a mean image."""
    if info["mean"] != "image":
        return Normalizer(info["mean"], None, info["channel_mean"], info["channel_std"], device)
    if mean_file:
        from alexnet.weights.mean_image import read_mean_image
        return Normalizer("image", read_mean_image(mean_file, size), device=device)
    if root is None:
        raise ValueError("these weights subtract their training set's mean image: pass --data DIR (its mean.npy) "
                         "or --mean FILE")
    # finite and of the data's shape: the check train.py and evaluate.py make (NaN would print "nan %")
    mean = read_mean(root / meta.get("mean", "mean.npy"), meta["image_size"], meta.get("mean_sha256"))
    if mean.shape != (size, size, 3):
        raise ValueError(f"{root}'s mean image is {mean.shape}, the images are decoded at {size}x{size}")
    return Normalizer("image", mean, device=device)


def predict(args: argparse.Namespace) -> list[dict]:
    """One record per image: its file and the top classes (index, wnid, name, probability)."""
    args.weights = resolve(args.weights)  # a published set's name: its checked file in torch's hub cache
    model, info = load_weights(args.weights, args.arch, epoch=args.epoch, theano_conv=args.theano_conv)
    refuse_non_finite(model.state_dict(), args.weights)
    meta, root = _read_data(args.data)
    # Without --data, decode as the weights' own preprocessing did (torchvision, Caffe, Theano, ours).
    expected = expected_geometry(info) or {}
    size = args.size or int((meta or {}).get("image_size") or expected.get("image_size") or 256)
    resize = args.resize or (meta or {}).get("resize") or expected.get("resize") or "short"
    if info["crop"] > size:
        raise ValueError(f"the weights take {info['crop']}x{info['crop']} crops, larger than --size {size}")
    table = class_table(info, meta, args.class_names)
    device = torch.device(args.device)
    normalizer = _normalizer(info, meta, root, args.mean, size, device)
    images = np.stack([_decode(p, size, resize) for p in args.images])
    with torch.no_grad():
        probs = predict_log_probs(model.to(device), torch.from_numpy(images).to(device), info["crop"], normalizer,
                                  args.crops)
    probs = probs.exp().double().cpu()
    bad = [path for path, row in zip(args.images, probs) if not bool(torch.isfinite(row).all())]
    if bad:  # never "nan %" with exit 0, whatever the cause
        raise ValueError(f"{bad[0]}: the model's probabilities are NaN or inf (weights, mean image or input out "
                         "of range): no prediction")
    top = probs.topk(min(args.top, probs.shape[1]), dim=1)
    return [{"image": str(path), "top": [{"index": int(c), "wnid": table[c][0], "name": table[c][1],
                                          "prob": float(p)} for p, c in zip(values.tolist(), indices.tolist())]}
            for path, values, indices in zip(args.images, top.values, top.indices)]


def _decode(path: str, size: int, resize: str) -> np.ndarray:
    try:
        return load_image(path, size, resize)
    except Exception as e:  # whatever Pillow raises for a missing, empty or undecodable file
        raise ValueError(f"{path}: cannot decode the image ({type(e).__name__}: {e})") from None


def run(args: argparse.Namespace) -> None:
    """Predict, print the top classes of each image, and write --json."""
    if args.json:
        check_writable(args.json)  # fail before the model runs, not after
    records = predict(args)
    for rec in records:
        print(rec["image"])
        for k, t in enumerate(rec["top"], start=1):
            label = " ".join(v for v in (t["wnid"], t["name"]) if v) or f"class {t['index']}"
            print(f"  {k}. {100 * t['prob']:6.2f} %  {label}" + (f"  (class {t['index']})" if t["wnid"] else ""))
    if args.json:
        atomic_write_json(args.json, records)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return guarded("predict.py", lambda: run(args))[0]


if __name__ == "__main__":
    protect_streams("predict.py")
    sys.exit(main())
