"""Which input geometry (``scripts/preprocess.py --resize``, ``--size``) each weight set expects.

==============  ==========================  ======================================================
weights         expects                     because
==============  ==========================  ======================================================
torchvision     ``torchvision``, 256        its eval transform: Resize(256), CenterCrop(224)
BVLC Caffe      ``caffe``, 256              convert_imageset: OpenCV's bilinear warp to 256 x 256
Theano folder   ``warp``, 256               make_hkl.py: scipy.misc.imresize to 256 x 256
our checkpoint  its training data's         ``resize`` and ``image_size`` stored by the trainer;
                                            converted files: their source's; older checkpoints:
                                            the meta.json of their config's data.root, if readable
plain state     unknown (no notice)         nothing records it
dict
==============  ==========================  ======================================================

evaluation.prepare prints :func:`geometry_notice` when the data's meta.json says otherwise.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

PUBLIC_SIZE = 256  # every released weight set was evaluated on 256-pixel images
# load_weights' source (and a converted file's source format) -> the --resize its authors' pixels match
FORMAT_GEOMETRY = {"torchvision": "torchvision", "caffe": "caffe", "theano": "warp"}
_MEANING = {"short": "shorter side scaled, central square", "warp": "Pillow's bilinear warp, as the Theano "
            "reproduction's make_hkl.py", "caffe": "OpenCV's bilinear warp, as BVLC's convert_imageset",
            "torchvision": "torchvision's Resize, then CenterCrop(224)"}


def checkpoint_geometry(state: dict) -> dict | None:
    """{"resize", "image_size"} of the data a checkpoint or weights file (a loaded dict) was made for.

    The trainer stores both; a converted file without them (image_size None) takes its source format's;
    an older checkpoint, its config's data.root meta.json where that still reads. None if unknown.
    """
    if isinstance(state.get("resize"), str):
        return {"resize": state["resize"], "image_size": state.get("image_size")}
    source = state.get("source")
    fmt = source.get("format") if isinstance(source, dict) else None
    if fmt in FORMAT_GEOMETRY:
        return {"resize": FORMAT_GEOMETRY[fmt], "image_size": PUBLIC_SIZE}
    return _data_root_geometry(state.get("config"))


def _data_root_geometry(config) -> dict | None:
    root = config.get("data", {}).get("root") if isinstance(config, dict) else None
    if not isinstance(root, str) or not root:
        return None
    try:
        meta = json.loads((Path(root) / "meta.json").read_bytes())
    except (OSError, ValueError):  # moved, deleted or damaged since: unknown, not an error
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("resize"), str):
        return None
    return {"resize": meta["resize"], "image_size": meta.get("image_size")}


def expected_geometry(info: dict) -> dict | None:
    """{"resize", "image_size"} that load_weights' `info` expects (image_size may be None), or None."""
    if info.get("geometry") is not None:
        return info["geometry"]
    resize = FORMAT_GEOMETRY.get(info.get("source"))
    return None if resize is None else {"resize": resize, "image_size": PUBLIC_SIZE}


def geometry_notice(weights: str | os.PathLike, info: dict, meta: dict, root: str | os.PathLike) -> str | None:
    """One line when the data at `root` (its meta.json `meta`) was preprocessed otherwise than `weights`
    expect, naming the preprocess command that fits; None when it fits or either side is unknown."""
    want, have = expected_geometry(info), meta.get("resize")
    if want is None or not isinstance(have, str):
        return None
    size = want.get("image_size") or meta.get("image_size")
    if have == want["resize"] and size == meta.get("image_size"):
        return None
    want_resize = want["resize"]
    meaning = f" ({_MEANING[want_resize]})" if want_resize in _MEANING else ""
    return (f"{weights} expects --resize {want_resize} --size {size} images{meaning}; {root} holds --resize {have} "
            f"--size {meta.get('image_size')} images, so the numbers will differ: preprocess with "
            f"scripts/preprocess.py --resize {want_resize} --size {size} (same inputs, another --out)")
