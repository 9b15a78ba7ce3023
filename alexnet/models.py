"""AlexNet variants: the 2012 paper / BVLC AlexNet, BVLC CaffeNet, torchvision's "one weird trick", and
You, Gitman & Ginsburg (2017)'s AlexNet-BN for large batches.

``alexnet``, ``caffenet`` and ``alexnet_bn`` use readable layer names (``features.conv1``,
``features.bn2``, ``classifier.fc6``); ``owt`` keeps torchvision's integer indices so torchvision state
dicts load strictly.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from layers import LRN_FORMS, AdaptiveAvgPool, Dropout, MaxPool, make_lrn

ARCHS = ("alexnet", "caffenet", "owt", "alexnet_bn")
INITS = ("paper", "torch")

# (kernel, stride, padding) of every layer that changes the spatial side, in forward order.
_TAIL_GEOMETRY = ((3, 2, 0), (5, 1, 2), (3, 2, 0), (3, 1, 1), (3, 1, 1), (3, 1, 1), (3, 2, 0))
_PAPER_GEOMETRY = ((11, 4, 0), *_TAIL_GEOMETRY)  # conv1 unpadded: 227 -> 55
_OWT_GEOMETRY = ((11, 4, 2), *_TAIL_GEOMETRY)  # conv1 padded by 2: 224 -> 55
_GEOMETRY = {"alexnet": _PAPER_GEOMETRY, "caffenet": _PAPER_GEOMETRY, "owt": _OWT_GEOMETRY,
             "alexnet_bn": _PAPER_GEOMETRY}  # batch norm keeps the side

_GROUPS = 2  # the two GPU columns of the paper, kept as grouped convolutions
_OWT_POOL = 6  # torchvision's AdaptiveAvgPool2d output side


class PaperInit(NamedTuple):
    """model.init=paper, by position: N(0, conv_std) and conv_bias for conv1..conv5, then fc_std, fc_bias
    for fc6..fc8."""

    conv_std: float
    conv_bias: tuple[float, ...]
    fc_std: tuple[float, ...]
    fc_bias: tuple[float, ...]


THEANO_INIT = PaperInit(0.01, (0.0, 0.1, 0.0, 0.1, 0.0), (0.005, 0.005, 0.01), (0.1, 0.1, 0.0))
# NVCaffe's models/alexnet_bn/train_val2.prototxt: every conv bias 0.01, fc8's too.
BN_INIT = PaperInit(0.01, (0.01,) * 5, (0.005, 0.005, 0.01), (0.1, 0.1, 0.01))
# The prototxt's BatchNorm: eps 1e-4, moving_average_fraction 0.9, scale_bias false. NVCaffe's cuDNN layer
# updates its statistics as s <- 0.9 s + 0.1 batch (exponentialAverageFactor 1 - 0.9; variance unbiased),
# which is torch's momentum 0.1; only its first iteration differs (factor 1: it copies the first batch's
# statistics, where torch mixes 0.1 of them into mean 0, variance 1: a weight of 0.9^t after t steps).
BN_EPS = 1e-4
BN_MOMENTUM = 0.1


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown model.arch {arch!r}; valid archs: {', '.join(ARCHS)}")


def feature_side(arch: str, crop: int) -> int:
    """Spatial side after the last max-pool for a ``crop`` x ``crop`` input (0 if it collapses)."""
    _check_arch(arch)
    side = crop
    for kernel, stride, pad in _GEOMETRY[arch]:
        side = (side + 2 * pad - kernel) // stride + 1
        if side < 1:
            return 0
    return side


def min_crop(arch: str) -> int:
    """Smallest input side for which ``arch`` still yields at least 1x1 before the classifier."""
    # feature_side is monotonic in crop and the answer is < 100: a scan is exact and cheap.
    return next(crop for crop in itertools.count(1) if feature_side(arch, crop) >= 1)


def _channels(base: int, width: float, multiple: int = 1) -> int:
    """Scale a layer width: round half up, at least ``multiple``, then up to a multiple of it."""
    n = max(multiple, math.floor(base * width + 0.5))
    return -(-n // multiple) * multiple


def _relu() -> nn.ReLU:
    return nn.ReLU(inplace=True)


class AlexNet(nn.Module):
    """Krizhevsky et al. (2012) / BVLC AlexNet: conv, ReLU, LRN, max-pool in blocks 1 and 2.

    lrn: the LRN constants, "paper" (k=2, alpha not divided by n) or "caffe" (k=1, alpha / n; the BVLC weights).
    """

    pool_before_norm = False

    def __init__(
        self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5, crop: int = 227,
        dropout_style: str = "inverted", lrn: str = "paper",
    ) -> None:
        super().__init__()
        self.crop, self.lrn = crop, lrn
        # Every conv either is grouped or feeds a grouped conv, so all widths stay even.
        c1, c2, c3, c4, c5 = (_channels(c, width, _GROUPS) for c in (96, 256, 384, 384, 256))
        hidden = _channels(4096, width)
        side = feature_side("alexnet", crop)
        self.features = nn.Sequential(OrderedDict(self._features(c1, c2, c3, c4, c5)))
        self.classifier = nn.Sequential(OrderedDict([
            ("fc6", nn.Linear(c5 * side * side, hidden)),
            ("relu6", _relu()),
            ("drop6", Dropout(dropout, dropout_style)),
            ("fc7", nn.Linear(hidden, hidden)),
            ("relu7", _relu()),
            ("drop7", Dropout(dropout, dropout_style)),
            ("fc8", nn.Linear(hidden, num_classes)),
        ]))

    def _features(self, c1: int, c2: int, c3: int, c4: int, c5: int) -> list[tuple[str, nn.Module]]:
        return [
            *self._block(1, nn.Conv2d(3, c1, 11, stride=4), norm=True, pool=True),
            *self._block(2, nn.Conv2d(c1, c2, 5, padding=2, groups=_GROUPS), norm=True, pool=True),
            *self._block(3, nn.Conv2d(c2, c3, 3, padding=1)),
            *self._block(4, nn.Conv2d(c3, c4, 3, padding=1, groups=_GROUPS)),
            *self._block(5, nn.Conv2d(c4, c5, 3, padding=1, groups=_GROUPS), pool=True),
        ]

    def _block(
        self, i: int, conv: nn.Conv2d, norm: bool = False, pool: bool = False
    ) -> list[tuple[str, nn.Module]]:
        tail: list[tuple[str, nn.Module]] = []
        if norm:
            tail.append((f"norm{i}", make_lrn(self.lrn)))
        if pool:
            tail.append((f"pool{i}", MaxPool(3, 2)))
        if self.pool_before_norm:
            tail.reverse()
        return [(f"conv{i}", conv), (f"relu{i}", _relu()), *tail]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.classifier(torch.flatten(x, 1))


class CaffeNet(AlexNet):
    """BVLC CaffeNet / Theano reproduction: max-pool before LRN in blocks 1 and 2."""

    pool_before_norm = True


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """AlexNet-BN's normalisation: batch statistics in training, running ones in eval mode; no learned
    scale or shift (the prototxt's scale_bias: false)."""
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM, affine=False)


class AlexNetBN(AlexNet):
    """You, Gitman & Ginsburg (2017)'s AlexNet-BN (NVCaffe models/alexnet_bn/train_val2.prototxt): no LRN;
    batch norm at the input of conv2..conv5 (after pool1, pool2, relu3, relu4), none at conv1 or the fc
    layers; conv2, conv4 and conv5 grouped (group: 2) as in the prototxt. No LRN: `lrn` is accepted for a
    uniform signature and has no effect."""

    paper_init = BN_INIT

    def _features(self, c1: int, c2: int, c3: int, c4: int, c5: int) -> list[tuple[str, nn.Module]]:
        return [
            ("conv1", nn.Conv2d(3, c1, 11, stride=4)), ("relu1", _relu()), ("pool1", MaxPool(3, 2)),
            ("bn2", batch_norm(c1)), ("conv2", nn.Conv2d(c1, c2, 5, padding=2, groups=_GROUPS)),
            ("relu2", _relu()), ("pool2", MaxPool(3, 2)),
            ("bn3", batch_norm(c2)), ("conv3", nn.Conv2d(c2, c3, 3, padding=1)), ("relu3", _relu()),
            ("bn4", batch_norm(c3)), ("conv4", nn.Conv2d(c3, c4, 3, padding=1, groups=_GROUPS)), ("relu4", _relu()),
            ("bn5", batch_norm(c4)), ("conv5", nn.Conv2d(c4, c5, 3, padding=1, groups=_GROUPS)), ("relu5", _relu()),
            ("pool5", MaxPool(3, 2)),
        ]


class OWTAlexNet(nn.Module):
    """torchvision's AlexNet (Krizhevsky 2014, "one weird trick"); same state-dict keys. No LRN: `lrn` is
    accepted for a uniform signature and has no effect."""

    def __init__(
        self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5, crop: int = 224,
        dropout_style: str = "inverted", lrn: str = "paper",
    ) -> None:
        super().__init__()
        self.crop = crop  # informational: the adaptive pool makes the layers crop-independent
        c1, c2, c3, c4, c5 = (_channels(c, width) for c in (64, 192, 384, 256, 256))
        hidden = _channels(4096, width)
        # fmt: off
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 11, stride=4, padding=2), _relu(), MaxPool(3, 2),
            nn.Conv2d(c1, c2, 5, padding=2), _relu(), MaxPool(3, 2),
            nn.Conv2d(c2, c3, 3, padding=1), _relu(),
            nn.Conv2d(c3, c4, 3, padding=1), _relu(),
            nn.Conv2d(c4, c5, 3, padding=1), _relu(), MaxPool(3, 2),
        )
        self.avgpool = AdaptiveAvgPool((_OWT_POOL, _OWT_POOL))
        self.classifier = nn.Sequential(
            Dropout(dropout, dropout_style), nn.Linear(c5 * _OWT_POOL * _OWT_POOL, hidden), _relu(),
            Dropout(dropout, dropout_style), nn.Linear(hidden, hidden), _relu(),
            nn.Linear(hidden, num_classes),
        )
        # fmt: on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


_CLASSES: dict[str, type[nn.Module]] = {
    "alexnet": AlexNet, "caffenet": CaffeNet, "owt": OWTAlexNet, "alexnet_bn": AlexNetBN
}


def init_paper_(model: nn.Module) -> nn.Module:
    """The paper init in place, by position (5 convs, 3 linears): the model's `paper_init` (AlexNet-BN's
    prototxt), else the Theano reproduction's; uses the global RNG."""
    init: PaperInit = getattr(model, "paper_init", THEANO_INIT)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if len(convs) != len(init.conv_bias) or len(fcs) != len(init.fc_bias):
        raise ValueError(f"paper init needs 5 convs and 3 linears, got {len(convs)}, {len(fcs)}")
    for conv, bias in zip(convs, init.conv_bias):
        nn.init.normal_(conv.weight, 0.0, init.conv_std)
        nn.init.constant_(conv.bias, bias)
    for fc, std, bias in zip(fcs, init.fc_std, init.fc_bias):
        nn.init.normal_(fc.weight, 0.0, std)
        nn.init.constant_(fc.bias, bias)
    return model


def _check_int(key: str, value: object, low: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if n < low:
        raise ValueError(f"{key} must be >= {low}, got {n}")
    return n


def _validate(
    arch: str, num_classes: int, width: float, dropout: float, crop: int, init: str, lrn: str
) -> None:
    _check_arch(arch)
    if init not in INITS:
        raise ValueError(f"unknown model.init {init!r}; valid: {', '.join(INITS)}")
    if lrn not in LRN_FORMS:
        raise ValueError(f"unknown model.lrn {lrn!r}; valid: {', '.join(LRN_FORMS)}")
    _check_int("model.num_classes", num_classes, 1)
    if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
        raise ValueError(f"model.width must be a positive finite number, got {width!r}")
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise ValueError(f"model.dropout must be in [0, 1), got {dropout!r}")
    smallest = min_crop(arch)
    if _check_int("data.crop", crop, 1) < smallest:
        raise ValueError(f"data.crop={crop} is too small for {arch!r}: the minimum is {smallest}")


def build_model(
    arch: str = "alexnet",
    num_classes: int = 1000,
    width: float = 1.0,
    dropout: float = 0.5,
    crop: int = 227,
    init: str = "paper",
    dropout_style: str = "inverted",
    lrn: str = "paper",
) -> nn.Module:
    """Build ``arch`` for ``crop`` x ``crop`` inputs; ``init``: "paper" (default) or "torch";
    ``dropout_style``: "inverted" (PyTorch's) or "theano" (scaled at test time; layers/dropout.py);
    ``lrn``: "paper" (default) or "caffe" (layers/lrn.py; owt and alexnet_bn have no LRN)."""
    _validate(arch, num_classes, width, dropout, crop, init, lrn)
    model = _CLASSES[arch](int(num_classes), float(width), float(dropout), int(crop), dropout_style, lrn)
    if init == "paper":
        init_paper_(model)
    return model


def count_params(model: nn.Module) -> int:
    """Number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
