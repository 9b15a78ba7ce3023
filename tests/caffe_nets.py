"""BVLC's two nets written as Caffe files by a small protobuf wire-format writer of our own (caffe.proto's
field numbers), their deploy prototxt, and OpenCV's Caffe importer run on them (the tests' oracle).

Both file layouts: V1 (NetParameter ``layers`` = 2, enum types, legacy 4-d blob shapes) and V2 (``layer`` =
100, string types, BlobShape).
"""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

# -- a protobuf writer (wire format: https://protobuf.dev/programming-guides/encoding/) ----------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def pb_int(field: int, n: int) -> bytes:
    return varint(field << 3) + varint(n)


def pb_bytes(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def pb_float(field: int, x: float) -> bytes:
    return varint(field << 3 | 5) + struct.pack("<f", x)


def pb_str(field: int, s: str) -> bytes:
    return pb_bytes(field, s.encode())


def _field(field: int, parts: list) -> list:
    """A length-delimited field as a list of parts (bytes, or a memoryview of an array's memory): a
    full-size net's blobs are copied once, when the file is joined, not once per level of nesting."""
    size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    return [varint(field << 3 | 2) + varint(size), *parts]


def _blob_parts(a: np.ndarray, legacy: bool, packed: bool = True, double: bool = False) -> list:
    if legacy:
        dims = (1,) * (4 - a.ndim) + a.shape
        head = b"".join(pb_int(f, d) for f, d in zip((1, 2, 3, 4), dims))
    else:
        head = pb_bytes(7, pb_bytes(1, b"".join(varint(d) for d in a.shape)))
    if not packed and not double:
        return [head, b"".join(pb_float(5, float(v)) for v in a.ravel())]
    data = np.ascontiguousarray(a, "<f8" if double else "<f4")
    return [head, *_field(8 if double else 5, [memoryview(data).cast("B")])]


def blob(a: np.ndarray, legacy: bool, packed: bool = True, double: bool = False) -> bytes:
    """A BlobProto: legacy num/channels/height/width (1-4, leading 1s) or shape (7); data (5) or double_data (8)."""
    return b"".join(_blob_parts(a, legacy, packed, double))


# V1LayerParameter's type enum (caffe.proto)
V1_ENUM = {"Convolution": 4, "Data": 5, "Dropout": 6, "InnerProduct": 14, "LRN": 15, "Pooling": 17, "ReLU": 18,
           "Softmax": 20, "SoftmaxWithLoss": 21, "Split": 22, "Accuracy": 1}
# (V2 field, V1 field) of each type's parameter message
PARAM_FIELD = {"Convolution": (106, 10), "InnerProduct": (117, 17), "LRN": (118, 18), "Pooling": (121, 19),
               "Dropout": (108, 12)}


def _layer_parts(version: str, name: str, kind: str, bottom: str, top: str, blobs: tuple = (),
                 params: bytes | None = None, legacy: bool | None = None) -> list:
    v1 = version == "V1"
    legacy = v1 if legacy is None else legacy
    body = [pb_str(2, bottom) + pb_str(3, top) + pb_str(4, name) + pb_int(5, V1_ENUM[kind]) if v1
            else pb_str(1, name) + pb_str(2, kind) + pb_str(3, bottom) + pb_str(4, top)]
    for b in blobs:
        body += _field(6 if v1 else 7, _blob_parts(b, legacy))
    if params is not None:
        body += _field(PARAM_FIELD[kind][1 if v1 else 0], [params])
    return _field(2 if v1 else 100, body)


def layer(version: str, name: str, kind: str, bottom: str, top: str, blobs: tuple = (), params: bytes | None = None,
          legacy: bool | None = None) -> bytes:
    """One layer of a NetParameter, as its field of the net (V1: ``layers`` 2, V2: ``layer`` 100)."""
    return b"".join(_layer_parts(version, name, kind, bottom, top, blobs, params, legacy))


# -- BVLC's two nets, written out from their deploy.prototxt -------------------------------------------------

# conv i: (kernel, stride, pad, group)
CONV = {1: (11, 4, 0, 1), 2: (5, 1, 2, 2), 3: (3, 1, 1, 1), 4: (3, 1, 1, 2), 5: (3, 1, 1, 2)}


def bvlc_sequence(arch: str) -> list[tuple[str, str]]:
    """(name, type) of the deploy net's layers after the input, bvlc_alexnet or bvlc_reference_caffenet."""
    out = []
    for i in range(1, 6):
        out += [(f"conv{i}", "Convolution"), (f"relu{i}", "ReLU")]
        if i in (1, 2):
            pair = [(f"norm{i}", "LRN"), (f"pool{i}", "Pooling")]
            out += pair if arch == "alexnet" else pair[::-1]
        if i == 5:
            out.append(("pool5", "Pooling"))
    for i in (6, 7):
        out += [(f"fc{i}", "InnerProduct"), (f"relu{i}", "ReLU"), (f"drop{i}", "Dropout")]
    return out + [("fc8", "InnerProduct")]


def side_after(crop: int) -> int:
    """pool5's side: conv1 11/4, pools 3/2, the rest keep the side (every step exact at 227 and 67)."""
    s = (crop - 11) // 4 + 1
    for _ in range(3):
        s = (s - 3) // 2 + 1
    return s


def random_blobs(channels: tuple[int, ...], hidden: int, classes: int, crop: int, seed: int) -> dict[str, list]:
    """Weights (He-scaled, so activations keep their size) and biases of every conv and fc layer: uniform,
    which numpy draws five times as fast as normal (a full-size net has 61 million)."""
    rng = np.random.default_rng(seed)

    def he(shape: tuple, fan_in: int) -> np.ndarray:  # variance 2 / fan_in, as He's normal
        return (rng.random(shape, np.float32) - np.float32(0.5)) * np.float32(2 * math.sqrt(6 / fan_in))

    out, prev = {}, 3
    for i, c in enumerate(channels, 1):
        k, _, _, g = CONV[i]
        out[f"conv{i}"] = [he((c, prev // g, k, k), prev // g * k * k),
                           rng.standard_normal(c, np.float32) * np.float32(0.1)]
        prev = c
    inputs = prev * side_after(crop) ** 2
    for name, n in (("fc6", hidden), ("fc7", hidden), ("fc8", classes)):
        out[name] = [he((n, inputs), inputs), rng.standard_normal(n, np.float32) * np.float32(0.1)]
        inputs = n
    return out


def params_of(name: str, kind: str, blobs: dict) -> bytes | None:
    if kind == "Convolution":
        k, s, p, g = CONV[int(name[-1])]
        return (pb_int(1, blobs[name][0].shape[0]) + (pb_int(3, p) if p else b"") + pb_int(4, k)
                + (pb_int(5, g) if g > 1 else b"") + (pb_int(6, s) if s > 1 else b""))
    if kind == "Pooling":
        return pb_int(1, 0) + pb_int(2, 3) + pb_int(3, 2)
    if kind == "LRN":
        return pb_int(1, 5) + pb_float(2, 1e-4) + pb_float(3, 0.75)
    if kind == "InnerProduct":
        return pb_int(1, blobs[name][0].shape[0])
    if kind == "Dropout":
        return pb_float(1, 0.5)
    return None


def caffemodel(arch: str, version: str, blobs: dict, train_val: bool = False, params=params_of) -> bytes:
    """A NetParameter as Caffe writes it (layers with their parameters and blobs); `train_val`: also the
    data, split, loss and accuracy layers of a training net, as the released files hold. params(name, kind,
    blobs): each layer's parameter message (default: BVLC's)."""
    out = [pb_str(1, "AlexNet" if arch == "alexnet" else "CaffeNet")]  # joined once: a full-size net is 244 MB
    if train_val:
        out += [layer(version, "data", "Data", "", "data"), layer(version, "label_split", "Split", "label", "l1")]
    bottom = "data"
    for name, kind in bvlc_sequence(arch):
        out += _layer_parts(version, name, kind, bottom, name, tuple(blobs.get(name, ())), params(name, kind, blobs))
        bottom = name
    if train_val:
        out += [layer(version, "loss", "SoftmaxWithLoss", "fc8", "loss"), layer(version, "acc", "Accuracy", "fc8", "a")]
    return b"".join(out)


def prototxt(arch: str, blobs: dict, crop: int) -> str:
    """The deploy net in Caffe's text format, for OpenCV."""
    lines = [f'name: "{arch}"', 'input: "data"', f"input_shape {{ dim: 1 dim: 3 dim: {crop} dim: {crop} }}"]
    bottom = "data"
    for name, kind in bvlc_sequence(arch):
        if kind == "Convolution":
            k, s, p, g = CONV[int(name[-1])]
            extra = (f"convolution_param {{ num_output: {blobs[name][0].shape[0]} kernel_size: {k} stride: {s} "
                     f"pad: {p} group: {g} }}")
        elif kind == "Pooling":
            extra = "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"
        elif kind == "LRN":
            extra = "lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }"
        elif kind == "InnerProduct":
            extra = f"inner_product_param {{ num_output: {blobs[name][0].shape[0]} }}"
        elif kind == "Dropout":
            extra = "dropout_param { dropout_ratio: 0.5 }"
        else:
            extra = ""
        lines.append(f'layer {{ name: "{name}" type: "{kind}" bottom: "{bottom}" top: "{name}" {extra} }}')
        bottom = name
    return "\n".join(lines) + "\n"


SMALL = dict(channels=(12, 32, 48, 48, 32), hidden=512, classes=10)  # = our width 0.125


def small_blobs(seed: int = 0, crop: int = 227, classes: int = 10) -> dict:
    return random_blobs(SMALL["channels"], SMALL["hidden"], classes, crop, seed)


def write_model(tmp_path, arch: str, version: str, blobs: dict, name: str | None = None, **kw):
    path = tmp_path / (name or f"{arch}_{version}.caffemodel")
    path.write_bytes(caffemodel(arch, version, blobs, **kw))
    return path


def opencv_logits(tmp_path, arch: str, path, blobs: dict, crop: int, x_bgr: np.ndarray) -> np.ndarray:
    cv2 = pytest.importorskip("cv2")
    if not hasattr(cv2, "dnn") or not hasattr(cv2.dnn, "readNetFromCaffe"):
        pytest.skip("this OpenCV has no Caffe importer (dropped in 5.x)")
    deploy = tmp_path / f"{arch}_deploy.prototxt"
    deploy.write_text(prototxt(arch, blobs, crop))
    net = cv2.dnn.readNetFromCaffe(str(deploy), str(path))
    out = []
    for image in x_bgr:  # one image per forward pass: the deploy net's input is 1 x 3 x crop x crop
        net.setInput(np.ascontiguousarray(image[None], dtype=np.float32))
        out.append(net.forward().reshape(-1))
    return np.stack(out)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def input_images(n: int, crop: int, seed: int = 1) -> np.ndarray:
    """Mean-subtracted pixels, RGB, N x 3 x crop x crop: large enough that Caffe's LRN is far from 1."""
    return np.random.default_rng(seed).uniform(-120, 120, (n, 3, crop, crop)).astype(np.float32)


def our_logits(model, x_rgb: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x_rgb)).numpy()
