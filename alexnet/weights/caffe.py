"""BVLC Caffe weights (.caffemodel): bvlc_alexnet -> our ``alexnet``, bvlc_reference_caffenet -> ``caffenet``.

The file (a protobuf NetParameter, V1 ``layers`` or V2 ``layer``) is read by :mod:`caffe_proto`. The arch
comes from the layer names and order: conv1..conv5 and fc6..fc8, with conv -> ReLU -> LRN -> pool in blocks
1 and 2 (bvlc_alexnet: our alexnet) or conv -> ReLU -> pool -> LRN (bvlc_reference_caffenet: our caffenet);
data, softmax, loss, accuracy, split and dropout layers are passed over. Width and crop come from the
shapes, as for state dicts (BVLC's: width 1, crop 227). The model uses Caffe's LRN (``model.lrn: caffe``:
k = 1, alpha / n).

Mapping, without transposes or kernel flips (Caffe's convolution is a cross-correlation, as torch's):
conv{i} blobs (weights O x I/g x kh x kw, bias O) -> ``features.conv{i}``; fc{i} blobs (weights O x I,
bias O; fc6 reads pool5 flattened C x H x W, as torch.flatten does) -> ``classifier.fc{i}``. V1 files give
4-d legacy shapes (fc weights 1 x 1 x O x I, biases 1 x 1 x 1 x O): leading 1s are dropped. Caffe feeds
BGR images; conv1's input channels are reversed here, so the model takes RGB like every model of this
repository (the mean, BGR in Caffe's files, is reversed likewise by mean_image). Pixel values stay 0-255
minus the mean, as Caffe's. The layer parameters a file stores (convolution stride, pad, group; pooling
method, kernel, stride; LRN constants; ReLU slope; inner-product transpose) must equal the model's.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layers import LRN, Dropout, MaxPool

from .caffe_proto import CaffeLayer, Message, WireError, read_net
from .common import PAPER_LAYERS, Contents, FormatError, crop_from_fc6, infer_width, new_model, weights_info

CAFFE_LRN = "caffe"
ARCHS = ("alexnet", "caffenet")
# Layers that leave fc8's output as it is at test time (inputs, splits, dropout) or come after it.
_PASSED_OVER = frozenset({"Input", "Data", "ImageData", "MemoryData", "DummyData", "HDF5Data", "WindowData",
                          "Split", "Silence", "Dropout", "Softmax", "SoftmaxWithLoss", "Accuracy"})
# How a NetParameter starts (Caffe writes fields in number order): its name (field 1), V1 layers (2) or, in a
# net without a name, V2 layer (100). Never the start of a torch zip ("PK") or pickle (0x80).
_NET_MAGIC = (b"\x0a", b"\x12", b"\xa2\x06")


def is_caffemodel(path, contents: Contents | None = None) -> bool:
    """A .caffemodel by its name, or a file that starts like a NetParameter (never torch-loaded)."""
    path = Path(path)
    if path.suffix.lower() == ".caffemodel":
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return any(head.startswith(m) for m in _NET_MAGIC)


def read_caffemodel(path, contents: Contents, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    """load_weights for a .caffemodel."""
    model, info, _ = caffe_model(path, arch, width)
    return model, info


def caffe_model(path: str | os.PathLike, arch: str | None = None,
                width: float | None = None) -> tuple[nn.Module, dict, str]:
    """(model, load_weights' info, "V1" | "V2") of a .caffemodel; FormatError naming the file and the layer."""
    if arch is not None and arch not in ARCHS:
        raise FormatError(f"{path} holds BVLC Caffe weights (alexnet or caffenet), not {arch!r}; omit --arch")
    layers, version = read_net(path)
    arch, matched = _match(path, layers, arch)
    state = _arrays(path, matched)
    num_classes = state["classifier.fc8.weight"].shape[0]
    crop = crop_from_fc6(path, arch, state["features.conv5.weight"].shape[0], state["classifier.fc6.weight"].shape[1])
    if width is None:
        try:
            width = infer_width(path, arch, state, num_classes, crop, PAPER_LAYERS)
        except FormatError:
            raise FormatError(_shape_problem(path, arch, state, num_classes, crop)) from None
    model = new_model(arch, num_classes, width, crop, lrn=CAFFE_LRN)
    misfit = _misfit(model, state)
    if misfit:
        raise FormatError(f"{path}: {misfit}")
    for layer, module in matched:
        _check_params(path, arch, layer, module)
    _copy_into(model, state)
    return model, weights_info(arch, width, crop, "image", num_classes, "caffe"), version


# -- which net ---------------------------------------------------------------------------------------------


def _pattern(arch: str) -> list[tuple[str, str | None, nn.Module]]:
    """(Caffe type, required name or None, our module) of each computing layer of `arch`, in order."""
    with torch.device("meta"):
        model = new_model(arch, 1000, 1.0, 227, lrn=CAFFE_LRN)
    kinds = ((nn.Conv2d, "Convolution"), (nn.Linear, "InnerProduct"), (LRN, "LRN"), (MaxPool, "Pooling"),
             (nn.ReLU, "ReLU"))
    out = []
    for name, module in [*model.features.named_children(), *model.classifier.named_children()]:
        if isinstance(module, Dropout):
            continue
        kind = next(k for cls, k in kinds if isinstance(module, cls))
        out.append((kind, name if kind in ("Convolution", "InnerProduct") else None, module))
    return out


def _match(path, layers: list[CaffeLayer], arch: str | None) -> tuple[str, list[tuple[CaffeLayer, nn.Module]]]:
    """The arch whose layer sequence the file's computing layers follow, and each layer's module."""
    computing = [layer for layer in layers if layer.type not in _PASSED_OVER]
    bn = next((layer for layer in computing if layer.type == "BatchNorm"), None)
    if bn is not None:  # e.g. NVCaffe's models/alexnet_bn: our alexnet_bn, whose statistics are not read here
        raise FormatError(f"{path}: layer {bn.index} {bn.name!r} is a BatchNorm: batch-norm nets (NVCaffe's "
                          "AlexNet-BN, our alexnet_bn) are not read from .caffemodel files, only BVLC AlexNet "
                          "and CaffeNet")
    best = None
    for candidate in ARCHS if arch is None else (arch,):
        pattern = _pattern(candidate)
        n = next((i for i, (layer, (kind, name, _)) in enumerate(zip(computing, pattern))
                  if layer.type != kind or (name is not None and layer.name != name)),
                 min(len(computing), len(pattern)))
        if n == len(computing) == len(pattern):
            return candidate, [(layer, module) for layer, (_, _, module) in zip(computing, pattern)]
        if best is None or n > best[0]:
            best = (n, candidate, pattern)
    n, candidate, pattern = best
    found = (f"layer {computing[n].index} {computing[n].name!r} ({computing[n].type})" if n < len(computing)
             else "the end of the net")
    wanted = ("the end of the net after fc8" if n >= len(pattern)
              else f"{pattern[n][1]} ({pattern[n][0]})" if pattern[n][1] else f"a {pattern[n][0]} layer")
    raise FormatError(f"{path}: not BVLC AlexNet or CaffeNet: {found} where {candidate} has {wanted} (alexnet: "
                      "conv -> ReLU -> LRN -> pool in blocks 1 and 2; caffenet: conv -> ReLU -> pool -> LRN; "
                      "layers conv1..conv5, fc6..fc8)")


# -- the arrays -------------------------------------------------------------------------------------------


def _arrays(path, matched: list[tuple[CaffeLayer, nn.Module]]) -> dict[str, np.ndarray]:
    """Our state-dict keys -> the blobs (views of the file's buffer), legacy leading 1s dropped."""
    state = {}
    for layer, module in matched:
        prefix = ("features." if isinstance(module, nn.Conv2d) else "classifier.") + layer.name
        want = 2 if isinstance(module, (nn.Conv2d, nn.Linear)) else 0
        if len(layer.blobs) != want:
            raise FormatError(f"{path}: layer {layer.name!r} ({layer.type}) has {len(layer.blobs)} blobs, expected "
                              f"{want}" + (" (weights, bias)" if want else ""))
        if not want:
            continue
        for i, (kind, rank) in enumerate((("weight", module.weight.dim()), ("bias", 1))):
            blob = _squeeze(layer.blobs[i], rank)
            if blob.ndim != rank:
                raise FormatError(f"{path}: layer {layer.name!r} blob {i} ({kind}s) has shape {layer.blobs[i].shape}, "
                                  f"expected {rank} dimensions")
            state[f"{prefix}.{kind}"] = blob
    return state


def _squeeze(a: np.ndarray, rank: int) -> np.ndarray:
    """`a` without leading 1-dims beyond `rank` (Caffe's legacy 4-d shapes)."""
    while a.ndim > rank and a.shape[0] == 1:
        a = a[0]
    return a


def _caffe_name(key: str) -> str:
    layer, kind = key.split(".")[1:]
    return f"layer {layer!r} blob {0 if kind == 'weight' else 1} ({kind}s)"


def _shape_problem(path, arch: str, state: dict[str, np.ndarray], num_classes: int, crop: int) -> str:
    """Which blob does not fit `arch` at the width fc6's rows give."""
    width = state["classifier.fc6.weight"].shape[0] / 4096
    with torch.device("meta"):
        model = new_model(arch, num_classes, width, crop, lrn=CAFFE_LRN)
    misfit = _misfit(model, state) or "the blob shapes fit no width"
    return f"{path}: {misfit} ({arch} of width {width:g}, {num_classes} classes)"


def _misfit(model: nn.Module, state: dict[str, np.ndarray]) -> str | None:
    """The first blob whose shape is not its parameter's in `model`, said in Caffe's terms."""
    for key, want in model.state_dict().items():
        if tuple(state[key].shape) != tuple(want.shape):
            return f"{_caffe_name(key)} has shape {tuple(state[key].shape)}, the model needs {tuple(want.shape)}"
    return None


def _copy_into(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Copy the blobs into the model; conv1's input channels reversed (BGR -> RGB). numpy copies straight
    from the file's buffer (any alignment), so nothing else of the file's size is allocated."""
    target = model.state_dict()  # detached tensors sharing the parameters' memory
    if state.keys() != target.keys():  # new_model's memory holds NaN until each tensor is copied
        raise FormatError(f"the blobs {sorted(state)} are not the model's tensors {sorted(target)}")
    for key, array in state.items():
        np.copyto(target[key].numpy(), array[:, ::-1] if key == "features.conv1.weight" else array)


# -- layer parameters ---------------------------------------------------------------------------------------


def _pair(msg: Message, both: int, h: int, w: int, default: int) -> tuple[int, int]:
    """A 2-d size from a repeated field (one value, or height and width) or its _h / _w twins."""
    if h in msg or w in msg:
        return msg.int(h, default), msg.int(w, default)
    values = msg.ints(both)
    return (values[0], values[-1]) if values else (default, default)


def _conv_params(msg: Message, m: nn.Conv2d) -> list[tuple[str, object, object]]:
    dilation = msg.ints(18) or [1]
    return [("stride", _pair(msg, 6, 13, 14, 1), tuple(m.stride)), ("pad", _pair(msg, 3, 9, 10, 0), tuple(m.padding)),
            ("group", msg.int(5, 1), m.groups), ("dilation", tuple(dilation), (1,) * len(dilation)),
            ("bias_term", msg.int(2, 1), 1)]


def _pool_params(msg: Message, m: MaxPool) -> list[tuple[str, object, object]]:
    return [("pool (0: MAX)", msg.int(1, 0), 0), ("kernel", _pair(msg, 2, 5, 6, 0), (m.kernel_size,) * 2),
            ("stride", _pair(msg, 3, 7, 8, 1), (m.stride,) * 2), ("pad", _pair(msg, 4, 9, 10, 0), (0, 0)),
            ("global_pooling", msg.int(12, 0), 0)]


def _lrn_params(msg: Message, m: LRN) -> list[tuple[str, object, object]]:
    return [("local_size", msg.int(1, 5), m.size), ("alpha", msg.float(2, 1.0), m.alpha),
            ("beta", msg.float(3, 0.75), m.beta), ("norm_region (0: ACROSS_CHANNELS)", msg.int(4, 0), 0),
            ("k", msg.float(5, 1.0), m.k)]


_PARAMS = {"Convolution": _conv_params, "Pooling": _pool_params, "LRN": _lrn_params,
           "InnerProduct": lambda msg, m: [("transpose", msg.int(6, 0), 0), ("axis", msg.int(5, 1), 1),
                                           ("bias_term", msg.int(2, 1), 1)],
           "ReLU": lambda msg, m: [("negative_slope", msg.float(1, 0.0), 0.0)]}


def _check_params(path, arch: str, layer: CaffeLayer, module: nn.Module) -> None:
    """The layer's stored parameters (Caffe's defaults where a field is absent) must be the module's."""
    if layer.params is None:
        return  # a file saved without them: the blob shapes and the layer order are all there is
    try:
        checks = _PARAMS[layer.type](layer.params, module)
    except WireError as e:
        raise FormatError(f"{path}: layer {layer.name!r} ({layer.type}): damaged parameters ({e})") from None
    for what, got, want in checks:
        same = math.isclose(got, want, rel_tol=1e-6) if isinstance(want, float) else got == want
        if not same:
            raise FormatError(f"{path}: layer {layer.name!r} ({layer.type}) has {what} {got}, {arch} computes "
                              f"with {want}")
