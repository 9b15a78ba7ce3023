"""alexnet/weights/mean_image.py by hand: every layout a mean image file comes in (Theano's channel-first .npy,
ours, Caffe's .binaryproto of 3 or 4 dimensions in BGR, Caffe's published BGR .npy by name) read as the RGB
pixel array, each pixel checked against the file's own numbers; every refusal's words. In-process and fast:
`make mutants` mutates mean_image.py against this file and tests/test_weights_hub.py."""
from __future__ import annotations

import io

import numpy as np
import pytest

from alexnet.weights.common import FormatError
from alexnet.weights.mean_image import CAFFE_CHANNEL_MEAN_BGR, caffe_channel_mean, read_mean_image
from data.fsutil import SPECIAL
from tests.caffe_nets import blob
from tests.conftest import pipe_nobody_writes

S = 5
PLANES = np.random.default_rng(7).uniform(80, 140, size=(3, S, S)).astype(np.float32)  # planes[c, y, x]


def _npy(path, array):
    with open(path, "wb") as f:  # np.save would add .npy to a name without it
        np.save(f, array)
    return path


def _pixel(planes: np.ndarray, y: int, x: int, bgr: bool) -> tuple:
    """(R, G, B) of pixel (y, x), read off the planes by hand."""
    order = (2, 1, 0) if bgr else (0, 1, 2)
    return tuple(float(planes[c, y, x]) for c in order)


def _check(got: np.ndarray, planes: np.ndarray, bgr: bool) -> None:
    assert got.shape == (S, S, 3) and got.dtype == np.float32 and got.flags.c_contiguous
    for y in range(S):
        for x in range(S):
            assert tuple(float(v) for v in got[y, x]) == _pixel(planes, y, x, bgr), (y, x)


def test_theanos_channel_first_npy_is_rgb_planes(tmp_path):
    _check(read_mean_image(_npy(tmp_path / "img_mean.npy", PLANES), S), PLANES, bgr=False)


def test_a_pixel_last_npy_is_taken_as_it_is(tmp_path):
    pixels = np.ascontiguousarray(PLANES.transpose(1, 2, 0))
    got = read_mean_image(_npy(tmp_path / "mean.npy", pixels), S)
    _check(got, PLANES, bgr=False)


@pytest.mark.parametrize("legacy, dims", [(True, 4), (False, 4), (False, 3)])
def test_a_binaryproto_is_bgr_planes(tmp_path, legacy, dims):
    """Caffe writes (1, 3, S, S) (legacy num/channels/height/width or a BlobShape); (3, S, S) is read too."""
    path = tmp_path / "mean.binaryproto"
    path.write_bytes(blob(PLANES[None] if dims == 4 else PLANES, legacy=legacy))
    _check(read_mean_image(path, S), PLANES, bgr=True)


def test_the_published_name_is_caffes_bgr_npy_fetched_once(server, published, tmp_path, monkeypatch, capsys):
    """A name of hub.MEANS is fetched (a bar on stderr only when asked) and read as BGR planes; a file that
    exists under that name wins, as for weights."""
    buf = io.BytesIO()
    np.save(buf, PLANES.astype(np.float64))  # Caffe's file holds float64
    url, files = server
    files.files["m-file.bin"] = buf.getvalue()
    published("m", buf.getvalue(), f"{url}/good", table="MEANS")
    _check(read_mean_image("m", S, progress=False), PLANES, bgr=True)
    assert "m-file.bin" not in capsys.readouterr().err
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "cache"))  # an empty cache: fetched again, with a bar
    _check(read_mean_image("m", S), PLANES, bgr=True)
    assert "m-file.bin" in capsys.readouterr().err and len(files.log) == 2
    monkeypatch.chdir(tmp_path)
    _npy(tmp_path / "m", PLANES)  # a file named m in the working directory: read as a plain .npy (RGB)
    _check(read_mean_image("m", S), PLANES, bgr=False)
    assert len(files.log) == 2


def test_caffes_channel_mean_is_a_constant_rgb_image():
    got = caffe_channel_mean(S)
    b, g, r = CAFFE_CHANNEL_MEAN_BGR
    assert CAFFE_CHANNEL_MEAN_BGR == (104.0, 117.0, 123.0)  # Caffe's examples' B, G, R
    assert got.shape == (S, S, 3) and got.dtype == np.float32 and got.flags.c_contiguous
    assert (got == np.array([r, g, b], dtype=np.float32)).all()


def test_every_refusal_names_the_file_and_what_was_expected(tmp_path):
    def refused(path, size=S) -> str:
        with pytest.raises(FormatError) as e:
            read_mean_image(path, size)
        return str(e.value)

    wrong = _npy(tmp_path / "wrong.npy", np.zeros((3, S, S + 1), np.float32))
    assert refused(wrong) == (f"{wrong}: shape (3, 5, 6), expected (3, 5, 5) (Theano's img_mean, channel first) "
                              "or (5, 5, 3) to match the 5x5 images")
    assert refused(_npy(tmp_path / "img.npy", PLANES), 4).startswith(f"{tmp_path / 'img.npy'}: shape (3, 5, 5), "
                                                                     "expected (3, 4, 4)")
    nan = _npy(tmp_path / "nan.npy", np.full((3, S, S), np.nan, np.float32))
    assert refused(nan) == f"{nan}: holds NaN or infinite values"
    proto = tmp_path / "wrong.binaryproto"
    proto.write_bytes(blob(np.zeros((2, 3, S, S), np.float32), legacy=True))
    assert refused(proto) == (f"{proto}: neither an .npy array nor a Caffe mean of shape (1, 3, 5, 5) to match the "
                              "5x5 images (read as a .binaryproto: shape (2, 3, 5, 5))")
    nan_proto = tmp_path / "nan.binaryproto"
    nan_proto.write_bytes(blob(np.full((1, 3, S, S), np.inf, np.float32), legacy=True))
    assert refused(nan_proto) == f"{nan_proto}: holds NaN or infinite values"
    assert refused(tmp_path / "none.npy") == f"{tmp_path / 'none.npy'}: missing"
    assert refused(tmp_path) == f"{tmp_path}: cannot be read (Is a directory)"  # the OS's words
    with pipe_nobody_writes(tmp_path / "pipe.npy") as opened:
        assert refused(tmp_path / "pipe.npy") == f"{tmp_path / 'pipe.npy'}: {SPECIAL}"
    assert not opened
    text = tmp_path / "notes.txt"
    text.write_text("not a mean\n")
    assert refused(text).startswith(f"{text}: not a Caffe BlobProto (.binaryproto)")
