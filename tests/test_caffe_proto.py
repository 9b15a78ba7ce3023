"""The caffemodel wire reader (alexnet/weights/caffe_proto.py) by hand: varints, fields, runs, messages,
blobs and nets, from small messages written by tests/caffe_nets.py's own protobuf writer.

Fast (no model, no OpenCV): `make mutants` mutates caffe_proto.py against this file alone; the importer
and OpenCV's oracle are in tests/test_caffe.py.
"""
from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest

from alexnet.weights import caffe_proto
from alexnet.weights.common import FormatError
from tests.caffe_nets import blob, layer, pb_bytes, pb_float, pb_int, pb_str, varint


def test_blob_layouts_read_alike(tmp_path):
    """Packed, unpacked, double, legacy 4-d and BlobShape blobs, and data split over two fields."""
    a = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
    layouts = {"packed": blob(a, legacy=False), "unpacked": blob(a, legacy=False, packed=False),
               "double": blob(a, legacy=False, double=True), "legacy": blob(a, legacy=True),
               "split": pb_bytes(7, pb_bytes(1, b"".join(varint(d) for d in a.shape)))
               + pb_bytes(5, a.ravel()[:7].tobytes()) + pb_int(99, 1) + pb_bytes(5, a.ravel()[7:].tobytes())}
    for name, body in layouts.items():
        buf = bytearray(body)
        got = caffe_proto.read_blob(buf, (0, len(buf)))
        assert got.dtype == np.float32, name
        assert got.shape == ((1, 4, 3, 2) if name == "legacy" else a.shape), name
        np.testing.assert_array_equal(got.reshape(a.shape), a, err_msg=name)
    # unpacked floats are read as one run (numpy), not value by value
    buf = bytearray(layouts["unpacked"])
    assert [(n, w) for n, w, _ in caffe_proto.fields(buf, 0, len(buf))] == [(7, 2), (5, 5)]



# -- the wire reader by hand (fast: small messages from tests/caffe_nets.py's writer; `make mutants` mutates
# alexnet/weights/caffe_proto.py against these) ----------------------------------------------------------------

Span, Run, WireError = caffe_proto.Span, caffe_proto.Run, caffe_proto.WireError


def _fixed64(field: int, x: float) -> bytes:
    return varint(field << 3 | 1) + struct.pack("<d", x)


def _fields(data: bytes, start: int = 0, end: int | None = None) -> list:
    return list(caffe_proto.fields(bytearray(data), start, len(data) if end is None else end))


def _wire_error(fn, *args) -> WireError:
    with pytest.raises(WireError) as e:
        fn(*args)
    return e.value


def test_varints_as_the_protobuf_encoding_guide_spells_them():
    for n, enc in ((0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (150, b"\x96\x01"),
                   (300, b"\xac\x02"), (2 ** 63 - 1, b"\xff" * 8 + b"\x7f"), (2 ** 64 - 1, b"\xff" * 9 + b"\x01")):
        assert varint(n) == enc
        buf = bytearray(b"\x07" + enc + b"\x07")
        assert caffe_proto.read_varint(buf, 1, len(buf)) == (n, 1 + len(enc))
    e = _wire_error(caffe_proto.read_varint, bytearray(b"\x80\x80"), 0, 2)
    assert str(e) == "truncated varint at byte 2" and (e.pos, e.cut) == (2, None)
    e = _wire_error(caffe_proto.read_varint, bytearray(b"\x05\x80\x01"), 1, 2)  # the end, not the buffer, counts
    assert str(e) == "truncated varint at byte 2"
    e = _wire_error(caffe_proto.read_varint, bytearray(b"\xff" * 10 + b"\x01"), 0, 11)
    assert str(e) == "varint longer than 10 bytes at byte 10" and e.pos == 10


# field 1 = 150 (bytes 0-2), field 2 = "hi" (3-6, payload 5-6), field 5: three unpacked floats (7-21: key 7,
# values at 8, 13, 18), field 3 = 7 (22-23), field 4: a double (key 24, value 25-32)
MESSAGE = (pb_int(1, 150) + pb_str(2, "hi") + pb_float(5, 1.5) + pb_float(5, -2.0) + pb_float(5, 0.25) + pb_int(3, 7)
           + _fixed64(4, 2.5))


def test_fields_by_hand():
    assert len(MESSAGE) == 33
    assert _fields(MESSAGE) == [(1, 0, 150), (2, 2, Span(5, 7)), (5, 5, Run(8, 3, 5, 4)), (3, 0, 7),
                                (4, 1, Run(25, 1, 9, 8))]
    assert _fields(MESSAGE, 7, 17) == [(5, 5, Run(8, 2, 5, 4))]  # a run stops at its message's end
    assert _fields(MESSAGE, 3, 7) == [(2, 2, Span(5, 7))]
    # 200 floats of field 5 (past the first chunks of 64 and 128 records), then field 6's floats, then field
    # 16's, whose key takes two bytes (stride 6)
    floats = np.arange(200, dtype=np.float32)
    data = (b"".join(pb_float(5, float(v)) for v in floats) + pb_float(6, 1.0) + pb_float(6, 2.0)
            + pb_float(16, 3.0) + pb_float(16, 4.0))
    assert _fields(data) == [(5, 5, Run(1, 200, 5, 4)), (6, 5, Run(1001, 2, 5, 4)), (16, 5, Run(1012, 2, 6, 4))]
    exact = b"".join(pb_float(5, float(v)) for v in floats[:64])  # a run ending exactly at the end of a chunk
    assert _fields(exact) == [(5, 5, Run(1, 64, 5, 4))]


def test_wire_errors_by_hand():
    e = _wire_error(_fields, pb_int(1, 1) + b"\x00\x01")
    assert str(e) == "field number 0 at byte 2" and e.pos == 2
    e = _wire_error(_fields, pb_int(1, 1) + varint(2 << 3 | 2) + varint(10) + b"abc")
    assert str(e) == "field 2 of 10 bytes runs past the end (3 left) at byte 4" and (e.pos, e.cut) == (4, 2)
    e = _wire_error(_fields, MESSAGE[:3] + pb_bytes(2, b"hi")[:3], 0, 5)  # the message's end, not the buffer's
    assert str(e) == "field 2 of 2 bytes runs past the end (0 left) at byte 5" and e.cut == 2
    for wire in (3, 4, 6, 7):
        e = _wire_error(_fields, pb_int(1, 1) + varint(9 << 3 | wire))
        assert str(e) == f"wire type {wire} at byte 2" and (e.pos, e.cut) == (2, None)
    for size, wire in ((4, 5), (8, 1)):
        e = _wire_error(_fields, pb_int(1, 1) + varint(9 << 3 | wire) + bytes(size - 1))
        assert str(e) == f"a {size}-byte value runs past the end at byte 3"
    e = _wire_error(_fields, pb_float(5, 1.0) + pb_float(5, 2.0)[:3])  # a run, then a cut value: read as such
    assert str(e) == "a 4-byte value runs past the end at byte 6"
    e = _wire_error(_fields, pb_int(1, 1) + b"\x08")
    assert str(e) == "truncated varint at byte 3"


def test_message_accessors_by_hand():
    data = MESSAGE + pb_int(1, 9) + pb_bytes(8, b"a\xffb")
    msg = caffe_proto.Message(bytearray(data), (0, len(data)))
    assert 1 in msg and 2 in msg and 9 not in msg
    assert msg.string(2) == "hi" and msg.string(9) == "" and msg.string(9, "dflt") == "dflt"
    assert msg.string(8) == "a\ufffdb"  # not UTF-8: replaced, not an error
    assert msg.ints(1) == [150, 9] and msg.int(1, 0) == 9 and msg.int(9, 42) == 42 and msg.ints(9) == []
    assert msg.float(5, 0.0) == 0.25 and msg.float(4, 0.0) == 2.5 and msg.float(9, 1.5) == 1.5
    assert msg.messages(2) == [Span(5, 7)] and msg.messages(9) == []
    assert str(_wire_error(msg.string, 1)) == "field 1 should be length-delimited at byte 0"
    assert str(_wire_error(msg.string, 5)) == "field 5 should be length-delimited at byte 8"
    assert str(_wire_error(msg.messages, 4)) == "field 4 should be length-delimited at byte 25"
    e = _wire_error(msg.ints, 5)
    assert str(e) == "field 5 holds fixed-size values, expected integers at byte 8" and e.pos == 8
    e = _wire_error(msg.float, 1, 0.0)
    assert str(e) == "field 1 is not a float at byte 0" and e.pos == 0
    data = pb_bytes(8, varint(1) + varint(300) + varint(0)) + pb_int(8, 5) + pb_str(2, "x") + pb_str(2, "last")
    packed = caffe_proto.Message(bytearray(data), (0, len(data)))
    assert packed.ints(8) == [1, 300, 0, 5] and packed.int(8, 0) == 5 and packed.string(2) == "last"
    doubles = caffe_proto.Message(bytearray(_fixed64(4, 1.0) + _fixed64(4, -0.125)), (0, 18))
    assert doubles.float(4, 0.0) == -0.125


def _blob_head(shape: tuple[int, ...]) -> bytes:
    return pb_bytes(7, pb_bytes(1, b"".join(varint(d) for d in shape)))


def _read_blob(data: bytes) -> np.ndarray:
    return caffe_proto.read_blob(bytearray(data), (0, len(data)))


def test_blobs_by_hand():
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 4 - 0.5
    for data in (blob(a, legacy=False), blob(a, legacy=False, packed=False), blob(a, legacy=False, double=True),
                 _blob_head((2, 3)) + b"".join(_fixed64(8, float(v)) for v in a.ravel()),
                 _blob_head((2, 3)) + pb_bytes(5, a.ravel()[:2].tobytes()) + pb_bytes(5, a.ravel()[2:].tobytes()),
                 _blob_head((2, 3)) + pb_bytes(8, a.ravel()[3:].astype("<f8").tobytes())  # floats first, then doubles
                 + pb_bytes(5, a.ravel()[:3].tobytes())):
        got = _read_blob(data)
        assert got.dtype == np.float32 and got.shape == (2, 3)
        np.testing.assert_array_equal(got, a)
    legacy = _read_blob(blob(a[None], legacy=True))
    assert legacy.shape == (1, 1, 2, 3) and (legacy[0, 0] == a).all()
    assert _read_blob(pb_int(3, 2) + pb_int(4, 3) + pb_int(1, 1) + pb_int(2, 1) + pb_bytes(5, a.tobytes())).shape == (
        1, 1, 2, 3)  # the legacy dims in any order
    buf = bytearray(blob(a, legacy=False))
    view = caffe_proto.read_blob(buf, (0, len(buf)))
    assert np.shares_memory(view, np.frombuffer(buf, np.uint8))  # packed floats: a view, no copy
    assert _read_blob(_blob_head((2, 0))).shape == (2, 0) and _read_blob(b"").shape == (0, 0, 0, 0)
    assert _read_blob(_blob_head((1, 2)) + _blob_head((3,)) + pb_bytes(5, a.ravel()[:3].tobytes())).shape == (3,)
    for data, message in (
            (_blob_head((2, 3)) + pb_bytes(5, a.ravel()[:5].tobytes()), "a blob of shape (2, 3) holds 5 values"),
            (pb_int(3, 2) + pb_int(4, 3) + pb_bytes(5, a.tobytes()), "a blob of shape (0, 0, 2, 3) holds 6 values"),
            (_blob_head((6,)) + pb_bytes(5, bytes(22)), "packed <f4 data of 22 bytes at byte 7"),
            (_blob_head((3,)) + pb_bytes(8, bytes(20)), "packed <f8 data of 20 bytes at byte 7"),
            (_blob_head((1,)) + pb_int(5, 3), "blob data of the wrong wire type for <f4 at byte 0"),
            (_blob_head((1,)) + _fixed64(5, 1.0), "blob data of the wrong wire type for <f4 at byte 6"),
            (_blob_head((1,)) + pb_float(8, 1.0), "blob data of the wrong wire type for <f8 at byte 6")):
        with pytest.raises(ValueError) as e:
            _read_blob(data)
        assert str(e.value) == message, data


def _net_file(tmp_path, data: bytes, name: str = "net.caffemodel"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


LATE = pb_bytes(100, pb_str(2, "ReLU") + pb_str(1, "late"))  # a layer whose name comes after its type


def test_nets_by_hand(tmp_path):
    w, b = np.ones((4, 3, 1, 1), np.float32), np.arange(4, dtype=np.float32)
    v2 = (pb_str(1, "tiny") + layer("V2", "c1", "Convolution", "data", "c1", (w, b), pb_int(1, 4))
          + layer("V2", "r1", "ReLU", "c1", "c1") + pb_int(100, 5))  # a field 100 that is not a message: skipped
    layers, version = caffe_proto.read_net(_net_file(tmp_path, v2))
    assert version == "V2"
    assert [(x.index, x.name, x.type) for x in layers] == [(0, "c1", "Convolution"), (1, "r1", "ReLU")]
    np.testing.assert_array_equal(layers[0].blobs[0], w)
    np.testing.assert_array_equal(layers[0].blobs[1], b)
    assert layers[0].params.int(1, 0) == 4 and layers[1].params is None and layers[1].blobs == []
    v1 = (layer("V1", "c1", "Convolution", "data", "c1", (w, b), pb_int(1, 4) + pb_int(4, 1))
          + pb_bytes(2, pb_str(4, "odd") + pb_int(5, 99)) + pb_bytes(2, pb_int(5, 15) + pb_bytes(18, pb_int(1, 3))
                                                                     + pb_bytes(18, pb_int(1, 5))))
    layers, version = caffe_proto.read_net(_net_file(tmp_path, v1))
    assert version == "V1" and [(x.name, x.type) for x in layers] == [("c1", "Convolution"), ("odd", "V1 type 99"),
                                                                       ("#2", "LRN")]
    assert layers[0].params.int(4, 0) == 1 and layers[0].blobs[0].shape == (4, 3, 1, 1)
    assert layers[2].params.int(1, 0) == 5  # the last parameter message counts
    bad = {
        "both": (v2 + v1, "holds both V1 'layers' and V2 'layer' fields; Caffe refuses such files too"),
        "no layers": (pb_str(1, "tiny") + pb_int(100, 5), "not a Caffe model: a protobuf NetParameter without layers"),
        "cut V2": (v2[:v2.index(b"r1") + 3],
                   f"truncated: the file ends inside layer 1 'r1' ({v2.index(b'r1') + 3} bytes)"),
        "cut V1": (v1[:30], "truncated: the file ends inside layer 0 'c1' (30 bytes)"),
        "cut before the name": (LATE[:-6], "truncated: the file ends inside layer 0 '?' (9 bytes)"),
        "garbage after": (v2[:-3] + b"\x0f", "not a Caffe model (protobuf NetParameter): wire type 7 at byte "
                                             f"{len(v2) - 3}, after layer 1 'r1'"),
        "garbage": (b"\x0f" + v2, "not a Caffe model (protobuf NetParameter): wire type 7 at byte 0"),
        "damaged": (pb_bytes(100, pb_str(1, "c1") + pb_bytes(7, _blob_head((2, 3)) + pb_bytes(5, bytes(20)))),
                    "layer 0 'c1' is damaged (a blob of shape (2, 3) holds 5 values)"),
        "damaged, no name": (pb_bytes(100, pb_int(9, 1) + b"\x0f"), "layer 0 '?' is damaged (wire type 7 at byte 5)"),
    }
    for case, (data, message) in bad.items():
        path = _net_file(tmp_path, data, f"{case}.caffemodel")
        with pytest.raises(FormatError) as e:
            caffe_proto.read_net(path)
        assert str(e.value) == f"{path}: {message}", case
    missing = tmp_path / "missing.caffemodel"
    with pytest.raises(FormatError, match=f"^{re.escape(str(missing))}: cannot be read \\(No such file or "
                                          "directory\\)$"):
        caffe_proto.read_net(missing)
    mean = _net_file(tmp_path, blob(np.ones((3, 2, 2), np.float32), legacy=False), "mean.binaryproto")
    assert caffe_proto.read_blobproto(mean).shape == (3, 2, 2)
    junk = _net_file(tmp_path, _blob_head((2,)) + pb_bytes(5, bytes(4)), "junk.binaryproto")
    with pytest.raises(FormatError) as e:
        caffe_proto.read_blobproto(junk)
    assert str(e.value) == f"{junk}: not a Caffe BlobProto (.binaryproto): a blob of shape (2,) holds 1 values"


def test_a_v1_layer_without_a_type_and_a_name_that_is_not_utf8(tmp_path):
    """A V1 layer with no type field is type 0 (protobuf's default), named so; a name's bytes that are not
    UTF-8 are replaced in the damaged-layer message, not an error of their own."""
    v1 = pb_bytes(2, pb_str(4, "untyped")) + pb_bytes(2, pb_str(4, "relu") + pb_int(5, 18))
    layers, version = caffe_proto.read_net(_net_file(tmp_path, v1))
    assert version == "V1" and [(x.name, x.type) for x in layers] == [("untyped", "V1 type 0"), ("relu", "ReLU")]
    path = _net_file(tmp_path, pb_bytes(100, pb_bytes(1, b"c\xff1") + b"\x0f"), "badname.caffemodel")
    with pytest.raises(FormatError) as e:
        caffe_proto.read_net(path)
    assert str(e.value) == f"{path}: layer 0 'c\ufffd1' is damaged (wire type 7 at byte 8)"  # 3 + 5 bytes before it


def test_garbage_after_three_layers_names_the_last_good_one(tmp_path):
    net = b"".join(layer("V2", f"r{i}", "ReLU", "x", "x") for i in range(3))
    path = _net_file(tmp_path, net + b"\x0f")
    with pytest.raises(FormatError) as e:
        caffe_proto.read_net(path)
    assert str(e.value) == (f"{path}: not a Caffe model (protobuf NetParameter): wire type 7 at byte {len(net)}, "
                            "after layer 2 'r2'")


def test_unpacked_values_followed_by_other_fields_and_an_empty_blob():
    """A run of unpacked floats ends where another field starts (the values after it are not read as
    floats); a blob of shape (0,) without data is an empty float32 array."""
    a = np.arange(5, dtype=np.float32)
    body = blob(a, legacy=False, packed=False) + pb_int(99, 7) + pb_str(98, "tail bytes: 13")
    buf = bytearray(body)
    got = caffe_proto.read_blob(buf, (0, len(buf)))
    assert got.dtype == np.float32 and got.tolist() == a.tolist()
    empty = bytearray(pb_bytes(7, pb_bytes(1, varint(0))))
    got = caffe_proto.read_blob(empty, (0, len(empty)))
    assert got.dtype == np.float32 and got.shape == (0,)


def test_a_file_that_shrinks_while_read(tmp_path, monkeypatch):
    """fstat says one size, the read gets fewer bytes (the file was cut meanwhile): named, one line."""
    path = _net_file(tmp_path, layer("V2", "r", "ReLU", "x", "x"))
    real = caffe_proto.os.fstat

    def larger(fd):
        st = real(fd)
        return os.stat_result((*st[:6], st.st_size + 10, *st[7:]))
    monkeypatch.setattr(caffe_proto.os, "fstat", larger)
    with pytest.raises(FormatError) as e:
        caffe_proto.read_bytes(path)
    assert str(e.value) == f"{path}: changed while being read"
