"""Which format a weights path holds, and the model it holds (any format, for evaluation).

A new file format is one module with a test (``claims``) and a reader (``read``), and one line in
``FILE_FORMATS``. A format torch.load cannot read (e.g. a protobuf) is told by its path without
calling ``contents`` and goes first, so that no other format's test has tried to load it.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from ..checkpoint import load
from ..models import ARCHS
from . import caffe, checkpoint_file, state_dict, theano, torchvision
from .common import Contents, FormatError, first_few, unwrap_state
from .hub import resolve


class FileFormat(NamedTuple):
    """A file format of load_weights: `claims(path, contents)` tells it, `read(path, contents, arch, width)`
    returns (the model, its info) or raises FormatError naming the file."""

    name: str
    claims: Callable[[str | os.PathLike, Contents], bool]
    read: Callable[[str | os.PathLike, Contents, str | None, float | None], tuple[nn.Module, dict]]


# Tried in this order: the first format whose test accepts a file reads it.
FILE_FORMATS = (
    FileFormat("caffe", caffe.is_caffemodel, caffe.read_caffemodel),  # protobuf: told by name or first bytes
    FileFormat("checkpoint", checkpoint_file.is_checkpoint, checkpoint_file.read_checkpoint),
    FileFormat("weights", checkpoint_file.is_weights_file, checkpoint_file.read_weights_file),
    FileFormat("torchvision", torchvision.is_torchvision, torchvision.read_torchvision),
    FileFormat("state_dict", state_dict.is_state_dict, state_dict.read_state_dict),
)
FORMATS = (*(f.name for f in FILE_FORMATS), "theano")  # a folder is a Theano folder


def detect(path: str | os.PathLike, obj: dict | None = None) -> str:
    """The format of `path` (a folder, or the loaded dict `obj` of a file): one of FORMATS."""
    if theano.is_theano_folder(path):
        return "theano"
    return _file_format(path, lambda: obj).name


def _file_format(path: str | os.PathLike, contents: Contents) -> FileFormat:
    for fmt in FILE_FORMATS:
        if fmt.claims(path, contents):
            return fmt
    raise FormatError(f"{path}: unrecognised weights: keys {first_few(list(unwrap_state(path, contents())))} are "
                      "neither torchvision AlexNet's (features.0.weight ...) nor ours (features.conv1.weight ...)")


def load_weights(path: str | os.PathLike, arch: str | None = None, width: float | None = None, *,
                 epoch: int | None = None, theano_conv: str | None = None,
                 loaded: dict | None = None) -> tuple[nn.Module, dict]:
    """The model (eval mode, CPU) and its info dict for weights in any of FORMATS, or named in hub.PUBLISHED.

    info: arch, width, crop, mean ("image" | "channel"), channel_mean, channel_std, num_classes,
    classes (list or None), source (the format); for a Theano folder also epoch and theano_conv.
    epoch, theano_conv: a Theano folder's epoch (default the highest) and convolution (default cudnn).
    loaded: the file's contents where the caller has read them (torch.load of `path`), read again otherwise.
    Raises CheckpointError (not a weights file: damaged, code or objects in it, a zip bomb) or ValueError
    (readable, but not usable), naming `path`; the OSError of a file the system will not read (permission
    denied: every .pt goes through checkpoint.load, every .npy through common.load_npy).
    """
    if arch is not None and arch not in ARCHS:
        raise FormatError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    path = resolve(path)  # a published set's name: its checked file in torch's hub cache
    if theano.is_theano_folder(path):
        return theano.read_folder(path, arch, width, epoch, theano_conv or "cudnn")
    if epoch is not None or theano_conv is not None:
        raise FormatError(f"{path} is a file: --epoch and --theano-conv apply to a Theano weights folder")
    # weights_only=True: never runs code from the file; `loaded`: what a caller read of it already
    contents = functools.cache(lambda: load(path) if loaded is None else loaded)
    model, info = _file_format(path, contents).read(path, contents, arch, width)
    return model.eval(), info
