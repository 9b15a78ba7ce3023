#!/usr/bin/env python3
"""Convert weights: Theano .npy folders <-> our .pt files, and BVLC .caffemodel -> our training checkpoints.

Between the Theano reproduction's .npy folders and this repository's .pt files both ways, and from BVLC
Caffe models (.caffemodel) to our training checkpoints.

The direction follows SRC: a folder is read as a Theano folder and written as a .pt file; a .caffemodel
is written as a .pt file; another file (our checkpoint, weights file, or a caffenet state dict) is
written as a Theano folder.

Theano epoch -> our weights file (evaluable with scripts/evaluate.py):

    python scripts/convert_weights.py parameters_releasing pretrained/theano_65.pt

Theano epoch with momentum -> our training checkpoint, then continue the Theano run from epoch E+1
(the weights as they are, dropout scaled at test time: the same SGD dynamics as Theano's):

    python scripts/convert_weights.py theano_run/ theano_20.pt --epoch 20 --momentum
    python train.py configs/theano_continue.yaml run.resume_from=theano_20.pt

Our checkpoint (arch caffenet) -> a Theano folder (weights, mom_* from its velocities, lr_E.npy with
the lr of the next epoch), epoch = the checkpoint's completed epochs unless --epoch:

    python scripts/convert_weights.py runs/caffenet/checkpoints/epoch_020.pt theano_run/

BVLC Caffe model (V1 or V2 file; arch from the layer order: bvlc_alexnet -> alexnet, bvlc_reference_caffenet
-> caffenet; Caffe's LRN as model.lrn=caffe; conv1's channels reversed from BGR to RGB) -> our training
checkpoint at epoch 0 with zero momentum, from which train.py fine-tunes (the schedule starts afresh):

    python scripts/convert_weights.py bvlc_alexnet.caffemodel bvlc_alexnet.pt
    python train.py configs/alexnet_1gpu.yaml run.resume_from=bvlc_alexnet.pt model.lrn=caffe

--theano-conv: the Theano run's lib_conv (cudnn, the default and the released weights' setting, is a
true convolution: kernels are flipped on the way; cudaconvnet is not). --dropout-style: theano (default
when reading a Theano folder: the arrays unchanged) or inverted (x0.5 folded into fc7 and fc8; when
writing, inverted-style weights are unfolded). See alexnet/weights/theano_layout.py for the whole mapping.
Exit codes: 0 done, 2 bad input (missing, unreadable or misshapen files; weights holding NaN or inf; a file
that exists; an unwritable destination), 1 a failure of the machine (disk full), 130 Ctrl-C (every file is
written atomically: those written stay whole).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "convert_weights.py")  # a Ctrl-C while torch imports: one line, not a traceback

import torch  # noqa: E402

from alexnet.checkpoint import CheckpointError, load, refuse_non_finite, save_atomic  # noqa: E402
from alexnet.cli import guarded, protect_streams  # noqa: E402
from alexnet.models import ARCHS  # noqa: E402
from alexnet.weights.caffe import is_caffemodel  # noqa: E402
from alexnet.weights.convert import caffe_checkpoint, theano_checkpoint, to_theano  # noqa: E402
from alexnet.weights.hub import WEIGHTS, resolve  # noqa: E402
from alexnet.weights.theano import read_theano, write_theano  # noqa: E402
from alexnet.weights.theano_layout import THEANO_CONVS  # noqa: E402
from data.domains import NON_NEGATIVE, POSITIVE, OneLineParser, OutputPath  # noqa: E402

# --help's last line
EXAMPLE = "python scripts/convert_weights.py bvlc_alexnet.caffemodel bvlc_alexnet.pt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]) + f"\n\nexample: {EXAMPLE}")
    p.add_argument("src", type=WEIGHTS,
                   help="a Theano weights folder, a BVLC .caffemodel, or our .pt checkpoint / weights / "
                   "caffenet state_dict; or a published set by name, fetched and checked (bvlc_alexnet, "
                   "bvlc_reference_caffenet)")
    p.add_argument("dst", type=OutputPath("either", own=("*.npy",)),
                   help="the .pt file to write (from a folder), or the Theano folder to write into")
    p.add_argument("--epoch", type=NON_NEGATIVE, help="folder -> .pt: the epoch to read (default: the highest); "
                   ".pt -> folder: the epoch to write as (default: the checkpoint's completed epochs)")
    p.add_argument("--theano-conv", choices=THEANO_CONVS, default="cudnn", help="the Theano run's lib_conv "
                   "(default cudnn: kernels flipped)")
    p.add_argument("--dropout-style", choices=("theano", "inverted"),
                   help="folder -> .pt: the model's dropout (default theano); .pt -> folder: that of a plain "
                   "state_dict (default inverted; checkpoints state their own)")
    p.add_argument("--momentum", action="store_true", help="folder -> .pt: a training checkpoint with the "
                   "velocities (mom_*) and lr_E.npy, for train.py run.resume_from=")
    p.add_argument("--arch", choices=ARCHS, help=".pt -> folder: the arch of a plain state_dict (only caffenet "
                   "exports); .caffemodel: the arch it must hold (default: inferred)")
    p.add_argument("--lr", type=POSITIVE, help=".pt -> folder: the lr to write as lr_E.npy (default: the "
                   "checkpoint's lr for the next epoch)")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    return p.parse_args(argv)


def _check_pt_destination(args: argparse.Namespace, what: str) -> Path:
    dst = Path(args.dst)
    if dst.is_dir():
        raise ValueError(f"{dst} is a folder; reading the {what} {args.src} writes a .pt file")
    return dst


def _save_pt(obj: dict, dst: Path, force: bool) -> bool:
    """Write `obj` to `dst`; an existing `dst` is replaced only with --force, unless it already holds
    exactly `obj` (the same conversion run again, e.g. after it was killed once done): then nothing is
    written and False returned."""
    if dst.exists() and not force:
        if _holds(dst, obj):
            return False
        raise ValueError(f"{dst}: exists and holds something else (pass --force to replace it)")
    save_atomic(obj, dst)
    return True


def _holds(path: Path, obj: dict) -> bool:
    try:
        have = load(path)
    except CheckpointError:
        return False
    return _same(have, obj)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.equal(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _refuse(args: argparse.Namespace, names: tuple[str, ...], when: str) -> None:
    given = {name: getattr(args, name.lstrip("-").replace("-", "_")) for name in names}
    misplaced = [name for name, value in given.items() if value is not None and value is not False]
    if misplaced:
        verb = "applies" if len(misplaced) == 1 else "apply"
        raise ValueError(f"{', '.join(misplaced)} {verb} {when}, not when reading {args.src}")


def from_theano(args: argparse.Namespace) -> str:
    """Theano folder -> our .pt; returns the summary line."""
    _refuse(args, ("--arch", "--lr"), "when writing a Theano folder")
    dst = _check_pt_destination(args, "Theano folder")
    style = args.dropout_style or "theano"
    te = read_theano(args.src, args.epoch, momentum=args.momentum)
    obj = theano_checkpoint(te, args.theano_conv, style)
    verb = "wrote" if _save_pt(obj, dst, args.force) else "unchanged (it already holds this conversion)"
    what = "training checkpoint (with momentum)" if args.momentum else "weights file"
    line = (f"{verb} {dst}: {what} of epoch {te.epoch} of {args.src}, caffenet width {te.width:g}, "
            f"{te.num_classes} classes, conv {args.theano_conv}, dropout style {style}")
    if args.momentum:
        line += (f"; next lr {te.lr:g}\ncontinue with: python train.py configs/theano_continue.yaml "
                 f"run.resume_from={dst}" + (f" model.width={te.width:g}" if te.width != 1 else "")
                 + (" model.dropout_style=inverted" if style == "inverted" else ""))
    return line


def to_folder(args: argparse.Namespace) -> str:
    """Our .pt -> a Theano folder; returns the summary line."""
    if args.momentum:
        raise ValueError(f"--momentum applies when reading a Theano folder; {args.src} is a file (its "
                         "velocities are written whenever it has them)")
    obj = load(args.src)
    refuse_non_finite(obj, args.src)
    notes = []
    te = to_theano(obj, args.src, args.theano_conv, arch=args.arch, dropout_style=args.dropout_style,
                   epoch=args.epoch, lr=args.lr, warn=notes.append)
    written = write_theano(args.dst, te, force=args.force)
    for note in notes:
        print(f"convert_weights.py: {note}", file=sys.stderr)
    parts = ["weights", "momentum" if te.velocities is not None else "no momentum (none in the file)",
             f"lr {te.lr:g}" if te.lr is not None else "no lr_E.npy (pass --lr)"]
    return (f"wrote {len(written)} files of epoch {te.epoch} to {args.dst}: {', '.join(parts)}; caffenet width "
            f"{te.width:g}, {te.num_classes} classes, conv {args.theano_conv}")


def from_caffe(args: argparse.Namespace) -> str:
    """BVLC .caffemodel -> our training checkpoint; returns the summary line."""
    _refuse(args, ("--epoch", "--dropout-style", "--momentum", "--lr"), "to Theano folders")
    if args.theano_conv != "cudnn":
        raise ValueError(f"--theano-conv applies to Theano folders, not when reading {args.src}")
    dst = _check_pt_destination(args, "Caffe model")
    obj = caffe_checkpoint(args.src, args.arch)
    refuse_non_finite(obj, args.src)
    verb = "wrote" if _save_pt(obj, dst, args.force) else "unchanged (it already holds this conversion)"
    m = obj["config"]["model"]
    config = "configs/caffenet.yaml" if m["arch"] == "caffenet" else "configs/alexnet_1gpu.yaml"
    return (f"{verb} {dst}: training checkpoint (epoch 0, no momentum) of {args.src} ({obj['source']['version']} "
            f"file), {m['arch']} width {m['width']:g}, {m['num_classes']} classes, LRN caffe, conv1 channels "
            f"reversed to RGB\nfine-tune with: python train.py {config} run.resume_from={dst} model.lrn=caffe"
            + (f" model.width={m['width']:g}" if m["width"] != 1 else ""))


def convert(args: argparse.Namespace) -> str:
    """Convert in the direction SRC gives; returns the summary line."""
    args.src = str(resolve(args.src))  # a published set's name: its checked file in torch's hub cache
    if not Path(args.src).exists():
        raise ValueError(f"{args.src}: no such file or folder")
    if Path(args.src).is_dir():
        return from_theano(args)
    return from_caffe(args) if is_caffemodel(args.src) else to_folder(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, line = guarded("convert_weights.py", lambda: convert(args))
    if code == 0:
        print(line)
    return code


if __name__ == "__main__":
    protect_streams("convert_weights.py")
    sys.exit(main())
