"""Caffe's protobuf files read without protobuf: a small wire-format reader, NetParameter and BlobProto.

Only what a .caffemodel (NetParameter) and a mean .binaryproto (BlobProto) need, by caffe.proto's field
numbers: NetParameter ``layer`` (100, LayerParameter: type a string) and the older ``layers`` (2,
V1LayerParameter: type an enum); BlobProto ``shape`` (7, BlobShape ``dim`` 1), the legacy num / channels /
height / width (1-4), float ``data`` (5) and ``double_data`` (8), packed or not. Unknown fields are
skipped, as protobuf does.

Speed and memory: the file is read once into a bytearray and parsed by offsets; blob data become numpy
views of that buffer (no copy, no per-float Python work), so a 233 MB file costs its size once.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .common import FormatError


class WireError(ValueError):
    """Bytes that are not protobuf (or are cut short); `pos` is where reading stopped, `cut` the number of
    the length-delimited field that runs past the end of its message, if that was the problem."""

    def __init__(self, message: str, pos: int, cut: int | None = None):
        super().__init__(f"{message} at byte {pos}")
        self.pos, self.cut = pos, cut


class Span(NamedTuple):
    """The payload of a length-delimited field: buf[start:end]."""

    start: int
    end: int


class Run(NamedTuple):
    """Consecutive fixed-size values of one field (an unpacked repeated float is one run, not one per value)."""

    offset: int  # of the first value
    count: int
    stride: int  # bytes from one value to the next (key + value)
    size: int    # bytes of one value: 4 (fixed32, float) or 8 (fixed64, double)


def read_varint(buf: bytearray, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`."""
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint", pos)
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes", pos)


def fields(buf: bytearray, start: int, end: int) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of the message buf[start:end].

    value: an int (varint), a Span (length-delimited), or a Run (fixed32 / fixed64).
    """
    pos = start
    while pos < end:
        key_at = pos
        key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0", key_at)
        if wire == 0:
            value, pos = read_varint(buf, pos, end)
        elif wire == 2:
            n, pos = read_varint(buf, pos, end)
            if n > end - pos:
                raise WireError(f"field {number} of {n} bytes runs past the end ({end - pos} left)", pos, number)
            value, pos = Span(pos, pos + n), pos + n
        elif wire in (1, 5):
            value = _run(buf, key_at, pos, end, 8 if wire == 1 else 4)
            pos = key_at + value.count * value.stride
        else:  # 3, 4: groups, which caffe.proto does not use; 6, 7: not protobuf
            raise WireError(f"wire type {wire}", key_at)
        yield number, wire, value


def _run(buf: bytearray, key_at: int, value_at: int, end: int, size: int) -> Run:
    """The run of values with the key at buf[key_at:value_at] that starts there.

    Checked in chunks doubling from 64 records: a single value costs little, a long run O(its length).
    """
    key_len = value_at - key_at
    stride = key_len + size
    if end - value_at < size:
        raise WireError(f"a {size}-byte value runs past the end", value_at)
    key = np.frombuffer(buf, np.uint8, count=key_len, offset=key_at)
    count, chunk, most = 0, 64, (end - key_at) // stride
    while count < most:
        n = min(chunk, most - count)
        records = np.frombuffer(buf, np.uint8, count=n * stride, offset=key_at + count * stride).reshape(n, stride)
        same = (records[:, :key_len] == key).all(axis=1)
        if not same.all():
            count += int(np.argmin(same))
            break
        count, chunk = count + n, chunk * 2
    return Run(value_at, count, stride, size)


class Message:
    """The fields of one message, by number: each a list of values as `fields` yields them."""

    def __init__(self, buf: bytearray, span: tuple[int, int]):
        self.buf = buf
        self.values: dict[int, list] = {}
        for number, _, value in fields(buf, *span):
            self.values.setdefault(number, []).append(value)

    def __contains__(self, number: int) -> bool:
        return number in self.values

    def string(self, number: int, default: str = "") -> str:
        spans = self.values.get(number)
        if not spans:
            return default
        start, end = _span(spans[-1], number)
        return bytes(self.buf[start:end]).decode("utf-8", "replace")

    def ints(self, number: int) -> list[int]:
        """A repeated (or optional) integer field: varints, packed or not."""
        out: list[int] = []
        for v in self.values.get(number, []):
            if isinstance(v, int):
                out.append(v)
            elif isinstance(v, Span):
                pos, end = v
                while pos < end:
                    n, pos = read_varint(self.buf, pos, end)
                    out.append(n)
            else:
                raise WireError(f"field {number} holds fixed-size values, expected integers", v.offset)
        return out

    def int(self, number: int, default: int) -> int:
        values = self.ints(number)
        return values[-1] if values else default  # protobuf: the last occurrence wins

    def float(self, number: int, default: float) -> float:
        values = self.values.get(number)
        if not values:
            return default
        v = values[-1]
        if not isinstance(v, Run):
            raise WireError(f"field {number} is not a float", 0)
        return struct.unpack_from("<f" if v.size == 4 else "<d", self.buf, v.offset + (v.count - 1) * v.stride)[0]

    def messages(self, number: int) -> list[Span]:
        return [_span(v, number) for v in self.values.get(number, [])]


def _span(v: object, number: int) -> Span:
    if not isinstance(v, Span):
        raise WireError(f"field {number} should be length-delimited", v.offset if isinstance(v, Run) else 0)
    return v


# -- BlobProto ---------------------------------------------------------------------------------------------


def read_blob(buf: bytearray, span: tuple[int, int]) -> np.ndarray:
    """A BlobProto as an array of its shape: float32, a view of `buf` where its data are packed floats."""
    msg = Message(buf, span)
    if 7 in msg:
        shapes = msg.messages(7)
        dims = tuple(Message(buf, shapes[-1]).ints(1))
    else:  # Caffe's legacy 4-d shape: num, channels, height, width
        dims = tuple(msg.int(k, 0) for k in (1, 2, 3, 4))
    chunks = [_numbers(buf, v, "<f4") for v in msg.values.get(5, [])]
    chunks += [_numbers(buf, v, "<f8").astype(np.float32) for v in msg.values.get(8, [])]
    data = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if data.size != int(np.prod(dims, dtype=np.int64)):
        raise ValueError(f"a blob of shape {dims} holds {data.size} values")
    return data.reshape(dims)


def _numbers(buf: bytearray, v: object, dtype: str) -> np.ndarray:
    """The values of one packed chunk or unpacked run of a repeated float / double field."""
    size = np.dtype(dtype).itemsize
    if isinstance(v, Span):
        start, end = v
        if (end - start) % size:
            raise WireError(f"packed {dtype} data of {end - start} bytes", start)
        return np.frombuffer(buf, dtype, count=(end - start) // size, offset=start)
    if not isinstance(v, Run) or v.size != size:
        raise WireError(f"blob data of the wrong wire type for {dtype}", getattr(v, "offset", 0))
    records = np.frombuffer(buf, np.dtype([("key", f"V{v.stride - size}"), ("value", dtype)]), count=v.count,
                            offset=v.offset - (v.stride - size))
    return records["value"].copy()  # strided: one copy, as large as the values


# -- NetParameter --------------------------------------------------------------------------------------------

# V1LayerParameter's type enum -> LayerParameter's type string (the types an AlexNet file may hold).
V1_TYPES = {1: "Accuracy", 4: "Convolution", 5: "Data", 6: "Dropout", 9: "HDF5Data", 12: "ImageData",
            14: "InnerProduct", 15: "LRN", 17: "Pooling", 18: "ReLU", 20: "Softmax", 21: "SoftmaxWithLoss",
            22: "Split", 24: "WindowData", 29: "MemoryData", 32: "DummyData", 36: "Silence"}
# Field numbers: name, type, blobs, and each type's parameter message, in LayerParameter (V2) and V1.
_V2 = {"name": 1, "type": 2, "blobs": 7, "Convolution": 106, "InnerProduct": 117, "LRN": 118, "Pooling": 121,
       "ReLU": 123}
_V1 = {"name": 4, "type": 5, "blobs": 6, "Convolution": 10, "InnerProduct": 17, "LRN": 18, "Pooling": 19,
       "ReLU": 30}
NET_LAYER, NET_LAYERS_V1 = 100, 2


@dataclass
class CaffeLayer:
    """One layer of a NetParameter: its name, type, blobs and type parameters (None where absent)."""

    index: int
    name: str
    type: str
    blobs: list[np.ndarray] = field(default_factory=list)
    params: Message | None = None


def read_net(path: str | os.PathLike) -> tuple[list[CaffeLayer], str]:
    """The layers of a .caffemodel and its format ("V1": ``layers`` field, "V2": ``layer``).

    FormatError naming the file (and the layer, where one was being read) for anything that is not a
    NetParameter holding layers.
    """
    buf = read_bytes(path)
    layers: list[CaffeLayer] = []
    kinds = set()
    try:
        for number, wire, value in fields(buf, 0, len(buf)):
            if number in (NET_LAYER, NET_LAYERS_V1) and wire == 2:
                kinds.add(number)
                layers.append(_layer(path, buf, value, len(layers), number == NET_LAYERS_V1))
    except WireError as e:
        if e.cut in (NET_LAYER, NET_LAYERS_V1):
            name = _partial_name(buf, (e.pos, len(buf)), e.cut == NET_LAYERS_V1)
            raise FormatError(f"{path}: truncated: the file ends inside layer {len(layers)} {name!r} "
                              f"({len(buf)} bytes)") from None
        after = f", after layer {len(layers) - 1} {layers[-1].name!r}" if layers else ""
        raise FormatError(f"{path}: not a Caffe model (protobuf NetParameter): {e}{after}") from None
    if not layers:
        raise FormatError(f"{path}: not a Caffe model: a protobuf NetParameter without layers")
    if len(kinds) > 1:
        raise FormatError(f"{path}: holds both V1 'layers' and V2 'layer' fields; Caffe refuses such files too")
    return layers, "V1" if NET_LAYERS_V1 in kinds else "V2"


def read_bytes(path: str | os.PathLike) -> bytearray:
    """The whole file in one writable buffer (numpy views of it need no copy)."""
    try:
        with open(path, "rb") as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(buf)
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    if got != len(buf):
        raise FormatError(f"{path}: changed while being read")
    return buf


def _partial_name(buf: bytearray, span: tuple[int, int], v1: bool) -> str:
    """The name of a layer whose bytes may be damaged or cut short, as far as it can be read ("?" if not)."""
    want = (_V1 if v1 else _V2)["name"]
    try:
        for number, wire, value in fields(buf, *span):
            if number == want and wire == 2:
                return bytes(buf[value[0]:value[1]]).decode("utf-8", "replace")
    except WireError:
        pass
    return "?"


def _layer(path, buf: bytearray, span: tuple[int, int], index: int, v1: bool) -> CaffeLayer:
    nums = _V1 if v1 else _V2
    name = _partial_name(buf, span, v1)
    try:
        msg = Message(buf, span)
        if v1:
            code = msg.int(nums["type"], 0)
            kind = V1_TYPES.get(code, f"V1 type {code}")
        else:
            kind = msg.string(nums["type"])
        params = Message(buf, msg.messages(nums[kind])[-1]) if kind in nums and nums[kind] in msg else None
        blobs = [read_blob(buf, s) for s in msg.messages(nums["blobs"])]
    except ValueError as e:  # WireError, or a blob whose data do not fill its shape
        raise FormatError(f"{path}: layer {index} {name!r} is damaged ({e})") from None
    return CaffeLayer(index, name if name != "?" else f"#{index}", kind, blobs, params)


def read_blobproto(path: str | os.PathLike) -> np.ndarray:
    """A .binaryproto file (one BlobProto, e.g. a mean image) as a float32 array of its shape."""
    buf = read_bytes(path)
    try:
        return read_blob(buf, (0, len(buf)))
    except (WireError, ValueError) as e:
        raise FormatError(f"{path}: not a Caffe BlobProto (.binaryproto): {e}") from None
