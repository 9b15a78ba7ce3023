"""BVLC Caffe weights: the .caffemodel reader, the mapping onto alexnet/caffenet, Caffe's LRN, the mean
files, evaluate.py and convert_weights.py; OpenCV's Caffe importer is the oracle (skipped without cv2).

The caffemodels are written by tests/caffe_nets.py's own protobuf writer, V1 and V2.
"""
from __future__ import annotations

import csv
import json
import re
import sys
import tracemalloc

import numpy as np
import pytest
import torch

import train
from alexnet.checkpoint import load
from alexnet.config import ConfigError, load_config
from alexnet.weights import caffe_proto
from alexnet.weights import load as weights_load
from alexnet.weights.common import FormatError
from alexnet.weights.convert import to_theano
from alexnet.weights.mean_image import caffe_channel_mean, read_mean_image
from data.reader import SplitData
from layers import LRN, lrn_with_halo, make_lrn
from tests import children
from tests.caffe_nets import (
    SMALL,
    blob,
    bvlc_sequence,
    caffemodel,
    input_images,
    layer,
    opencv_logits,
    our_logits,
    params_of,
    pb_float,
    pb_int,
    prototxt,
    random_blobs,
    rel_err,
    small_blobs,
    write_model,
)
from tests.conftest import REPO, load_script

# -- OpenCV's importer as the oracle ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["alexnet", "caffenet"])
@pytest.mark.parametrize("version", ["V1", "V2"])
def test_logits_equal_opencv(tmp_path, arch, version):
    """Both BVLC nets, both file layouts: our logits (RGB input) == OpenCV's (BGR input) to 1e-4."""
    blobs = small_blobs(seed=3)
    path = write_model(tmp_path, arch, version, blobs)
    x = input_images(2, 227)
    want = opencv_logits(tmp_path, arch, path, blobs, 227, x[:, ::-1])
    model, info = weights_load.load_weights(path)
    assert (info["arch"], info["width"], info["crop"], info["num_classes"], info["source"]) == (
        arch, 0.125, 227, 10, "caffe")
    assert rel_err(our_logits(model, x), want) <= 1e-4
    # the oracle sees the LRN constants and the channel order: either wrong is far off
    other = make_lrn("paper")
    model.features.norm1, model.features.norm2 = other, make_lrn("paper")
    assert rel_err(our_logits(model, x), want) > 1e-3
    model, _ = weights_load.load_weights(path)
    assert rel_err(our_logits(model, x[:, ::-1].copy()), want) > 1e-3


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """The real shapes (conv1 96x3x11x11 ... fc6 4096x9216, fc8 1000x4096) in bvlc_alexnet's layout: a V1
    file, as released in 2014, with its training net's data, split, loss and accuracy layers."""
    blobs = random_blobs((96, 256, 384, 384, 256), 4096, 1000, 227, seed=7)
    return write_model(tmp_path_factory.mktemp("full"), "alexnet", "V1", blobs, train_val=True), blobs


def test_full_size_logits_equal_opencv(tmp_path, full_size):
    """bvlc_alexnet's shapes and layout, one image through both importers."""
    path, blobs = full_size
    x = input_images(1, 227)
    want = opencv_logits(tmp_path, "alexnet", path, blobs, 227, x[:, ::-1])
    model, info = weights_load.load_weights(path)
    assert (info["arch"], info["width"], info["crop"], info["num_classes"]) == ("alexnet", 1.0, 227, 1000)
    assert rel_err(our_logits(model, x), want) <= 1e-4


# -- the reader ---------------------------------------------------------------------------------------------



def test_training_net_and_deploy_net_give_the_same_model(tmp_path):
    blobs = small_blobs(seed=4)
    x = input_images(1, 227)
    outs = []
    for i, train_val in enumerate((False, True)):
        path = write_model(tmp_path, "caffenet", "V1", blobs, name=f"{i}.caffemodel", train_val=train_val)
        outs.append(our_logits(weights_load.load_weights(path)[0], x))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_told_by_name_or_first_bytes_never_torch_loaded(tmp_path):
    blobs = small_blobs()
    for version in ("V1", "V2"):
        path = write_model(tmp_path, "alexnet", version, blobs, name=f"w_{version}.bin")  # no .caffemodel suffix
        assert weights_load.detect(path) == "caffe"
        assert weights_load.FILE_FORMATS[0].name == "caffe"
    pt = tmp_path / "w.pt"
    torch.save(weights_load.load_weights(path)[0].state_dict(), pt)
    assert weights_load.detect(pt, torch.load(pt)) == "state_dict"


def test_arch_asked_for_must_be_the_files(tmp_path):
    path = write_model(tmp_path, "alexnet", "V2", small_blobs())
    assert weights_load.load_weights(path, "alexnet")[1]["arch"] == "alexnet"
    with pytest.raises(FormatError, match="layer 2 'norm1' \\(LRN\\) where caffenet has a Pooling layer"):
        weights_load.load_weights(path, "caffenet")
    with pytest.raises(FormatError, match="BVLC Caffe weights .* not 'owt'"):
        weights_load.load_weights(path, "owt")


def test_reading_allocates_the_file_once(tmp_path):
    """The parser's own allocations (tracemalloc sees numpy and Python, not torch): the buffer, no copies."""
    blobs = random_blobs((24, 64, 96, 96, 64), 1024, 1000, 227, seed=1)  # width 0.25: 10 MB of fc6
    path = write_model(tmp_path, "alexnet", "V2", blobs)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        layers, version = caffe_proto.read_net(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert version == "V2" and [x.name for x in layers][:2] == ["conv1", "relu1"]
    assert peak < 1.05 * size + 2**20, (peak, size)


# -- bad files: exit 2 naming the file and the layer ----------------------------------------------------------


def _cut_in_fc6(tmp_path):
    data = caffemodel("alexnet", "V2", small_blobs())
    path = tmp_path / "cut.caffemodel"
    path.write_bytes(data[:data.index(b"fc6") + 500])
    return path, "truncated: the file ends inside layer 15 'fc6'"


def _edited(tmp_path, edit):
    blobs = small_blobs()
    edit(blobs)  # in place
    return write_model(tmp_path, "alexnet", "V1", blobs, name="edited.caffemodel")


def _bad_file(tmp_path, case):
    """(path, what the error must say) for each kind of bad file."""
    if case == "text":
        path = tmp_path / "deploy.caffemodel"
        path.write_text(prototxt("alexnet", small_blobs(), 227))
        return path, "not a Caffe model (protobuf NetParameter): wire type"
    if case == "empty":
        path = tmp_path / "empty.caffemodel"
        path.write_bytes(b"")
        return path, "NetParameter without layers"
    if case == "truncated":
        return _cut_in_fc6(tmp_path)
    if case == "other_net":  # VGG-like: no LRN
        path = tmp_path / "other.caffemodel"
        blobs = small_blobs()
        net = b"".join(layer("V2", n, k, "x", n, tuple(blobs.get(n, ()))) for n, k in bvlc_sequence("alexnet")
                       if k != "LRN")
        path.write_bytes(net)
        return path, "not BVLC AlexNet or CaffeNet: layer 3 'conv2' (Convolution) where caffenet has a LRN layer"
    if case == "blob_count":
        return _edited(tmp_path, lambda b: b["conv3"].pop()), "layer 'conv3' (Convolution) has 1 blobs, expected 2"
    if case == "shape":
        def ungrouped(b):
            b["conv2"][0] = np.zeros((32, 12, 5, 5), np.float32)
        return _edited(tmp_path, ungrouped), "layer 'conv2' blob 0 (weights) has shape (32, 12, 5, 5)"
    if case == "blob_damaged":
        data = bytearray(caffemodel("alexnet", "V2", small_blobs()))
        at = data.index(b"conv2") + 40  # into conv2's first blob: a packed float length made too long
        data[at:at + 1] = b"\xff"
        path = tmp_path / "damaged.caffemodel"
        path.write_bytes(bytes(data))
        return path, "conv2"
    raise AssertionError(case)


BAD = ["text", "empty", "truncated", "other_net", "blob_count", "shape", "blob_damaged"]


@pytest.mark.parametrize("case", BAD)
def test_bad_files_exit_2_naming_file_and_layer(tmp_path, capsys, case):
    path, message = _bad_file(tmp_path, case)
    evaluate, convert = load_script("evaluate").main, load_script("convert_weights").main
    assert evaluate(["--data", str(tmp_path), "--weights", str(path), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err, err
    assert convert([str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err, err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("field,value,message", [
    ("local_size", 3, "layer 'norm1' (LRN) has local_size 3, alexnet computes with 5"),
    ("k", 2.0, "layer 'norm1' (LRN) has k 2.0, alexnet computes with 1.0"),
    ("stride", 2, "layer 'conv1' (Convolution) has stride (2, 2), alexnet computes with (4, 4)"),
    ("pool", 1, "layer 'pool1' (Pooling) has pool (0: MAX) 1, alexnet computes with 0"),
])
def test_layer_parameters_must_be_the_models(tmp_path, field, value, message):
    def changed(name, kind, blobs):
        if field in ("local_size", "k") and name == "norm1":
            return pb_int(1, value if field == "local_size" else 5) + pb_float(2, 1e-4) + pb_float(3, 0.75) + (
                pb_float(5, value) if field == "k" else b"")
        if field == "stride" and name == "conv1":
            return pb_int(1, 12) + pb_int(4, 11) + pb_int(6, value)
        if field == "pool" and name == "pool1":
            return pb_int(1, value) + pb_int(2, 3) + pb_int(3, 2)
        return params_of(name, kind, blobs)

    path = write_model(tmp_path, "alexnet", "V2", small_blobs(), params=changed)
    with pytest.raises(FormatError, match=re.escape(message)):
        weights_load.load_weights(path)


# -- mean files ----------------------------------------------------------------------------------------------


def test_binaryproto_mean_is_read_as_rgb(tmp_path):
    bgr = np.random.default_rng(2).uniform(0, 255, (3, 8, 8)).astype(np.float32)
    want = np.stack([bgr[2], bgr[1], bgr[0]], axis=-1)  # H x W x (R, G, B)
    for name, body in (("legacy", blob(bgr[None], legacy=True)), ("shape", blob(bgr, legacy=False))):
        path = tmp_path / f"{name}.binaryproto"
        path.write_bytes(body)
        np.testing.assert_array_equal(read_mean_image(path, 8), want)
    with pytest.raises(FormatError, match="shape \\(1, 3, 8, 8\\)"):
        read_mean_image(tmp_path / "legacy.binaryproto", 16)
    junk = tmp_path / "junk.binaryproto"
    junk.write_bytes(b"\xff\xff\xff")
    with pytest.raises(FormatError, match="not a Caffe BlobProto"):
        read_mean_image(junk, 8)
    np.save(tmp_path / "m.npy", want)
    np.testing.assert_array_equal(read_mean_image(tmp_path / "m.npy", 8), want)


def test_caffe_channel_mean():
    m = caffe_channel_mean(4)
    assert m.shape == (4, 4, 3) and m.dtype == np.float32
    assert (m[..., 0] == 123).all() and (m[..., 1] == 117).all() and (m[..., 2] == 104).all()


# -- evaluate.py on data, against OpenCV ----------------------------------------------------------------------


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("with_mean_file", [True, False])
def test_evaluate_equals_opencv_on_the_data(train_data, tmp_path, capsys, with_mean_file):
    """evaluate.py --weights X.caffemodel [--mean M.binaryproto]: each image's top-5 and probabilities equal
    OpenCV's on the BGR image minus the BGR mean (BVLC's file, or Caffe's 104, 117, 123), center crop."""
    split = SplitData(train_data, "val")
    size, crop = split.image_size, 67  # alexnet's smallest crop: fc6 reads 1 x 1 pool5 maps
    blobs = random_blobs(SMALL["channels"], SMALL["hidden"], split.num_classes, crop, seed=11)
    path = write_model(tmp_path, "alexnet", "V2", blobs)
    mean_bgr = np.random.default_rng(3).uniform(60, 180, (3, size, size)).astype(np.float32)
    args = ["--data", str(train_data), "--weights", str(path), "--device", "cpu", "--no-progress",
            "--csv", str(tmp_path / "p.csv"), "--json", str(tmp_path / "r.json")]
    if with_mean_file:
        (tmp_path / "mean.binaryproto").write_bytes(blob(mean_bgr[None], legacy=True))
        args += ["--mean", str(tmp_path / "mean.binaryproto")]
    else:
        mean_bgr = np.broadcast_to(np.array([104, 117, 123], np.float32)[:, None, None], (3, size, size))
    assert load_script("evaluate").main(args) == 0
    err = capsys.readouterr().err
    assert ("Caffe's per-channel mean (B, G, R) = (104.0, 117.0, 123.0)" in err) != with_mean_file
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["mean"] == (str(tmp_path / "mean.binaryproto") if with_mean_file else "caffe_channel")

    images = split.read(np.arange(len(split)))[0]  # N x S x S x 3, RGB, file order as the CSV
    o = (size - crop) // 2
    x_bgr = images[:, o:o + crop, o:o + crop, ::-1].transpose(0, 3, 1, 2) - mean_bgr[None, :, o:o + crop, o:o + crop]
    probs = softmax(opencv_logits(tmp_path, "alexnet", path, blobs, crop, x_bgr).astype(np.float64))
    with open(tmp_path / "p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(probs)
    k = min(5, probs.shape[1])
    for row, p in zip(rows, probs):
        top = np.argsort(-p)[:k]
        assert [int(row[f"pred{i}"]) for i in range(1, k + 1)] == top.tolist()
        np.testing.assert_allclose([float(row[f"prob{i}"]) for i in range(1, k + 1)], p[top], atol=1e-4)


# -- Caffe's LRN -----------------------------------------------------------------------------------------------


def numpy_lrn(x: np.ndarray, k: float, alpha_per_term: float, n: int = 5, beta: float = 0.75) -> np.ndarray:
    """b_c = a_c / (k + alpha_per_term * sum of a_j^2 over the n channels centred on c), by loops."""
    out = np.empty_like(x)
    channels = x.shape[1]
    for c in range(channels):
        lo, hi = max(0, c - n // 2), min(channels - 1, c + n // 2)
        s = sum(x[:, j] ** 2 for j in range(lo, hi + 1))
        out[:, c] = x[:, c] / (k + alpha_per_term * s) ** beta
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_caffe_lrn_equals_the_hand_computation(deterministic):
    x = np.random.default_rng(4).normal(0, 150, (2, 9, 3, 2))
    want_caffe = numpy_lrn(x, k=1.0, alpha_per_term=1e-4 / 5)
    want_paper = numpy_lrn(x, k=2.0, alpha_per_term=1e-4)
    assert np.abs(want_caffe - want_paper).max() > 0.1 * np.abs(want_caffe).max()  # two different functions
    torch.use_deterministic_algorithms(deterministic)
    try:
        caffe, paper = make_lrn("caffe"), make_lrn("paper")
        t = torch.from_numpy(x)
        np.testing.assert_allclose(caffe(t).numpy(), want_caffe, rtol=1e-12)
        np.testing.assert_allclose(paper(t).numpy(), want_paper, rtol=1e-12)
    finally:
        torch.use_deterministic_algorithms(False)
    # a model-parallel column: channels 3..5 with two halo channels each side
    halo = lrn_with_halo(t[:, 3:6], t[:, 1:3], t[:, 6:8], caffe)
    np.testing.assert_allclose(halo.numpy(), want_caffe[:, 3:6], rtol=1e-12)
    assert isinstance(caffe, LRN) and "caffe form" in repr(caffe)
    with pytest.raises(ValueError, match="unknown LRN form"):
        make_lrn("pylearn2")


# -- model.lrn: config, checkpoints, conversion, training ---------------------------------------------------


def test_model_lrn_setting(tmp_path):
    root = f"data.root={tmp_path}"
    assert load_config(None, [root]).model.lrn == "paper"
    assert load_config(None, [root, "model.lrn=caffe"]).model.lrn == "caffe"
    with pytest.raises(ConfigError, match="model.lrn must be one of paper, caffe"):
        load_config(None, [root, "model.lrn=bvlc"])


def continue_overrides(data, run_dir, ckpt, **extra) -> list[str]:
    base = {"data.root": str(data), "data.crop": 67, "model.width": 0.125, "train.batch_size": 8,
            "train.max_steps": 1, "data.loading": "inline", "train.log_every": 1, "run.dir": str(run_dir),
            "run.progress": False, "run.tensorboard": False, "run.device": "cpu", "run.resume_from": str(ckpt)}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_converted_checkpoint_evaluates_alike_and_train_py_fine_tunes_it(train_data, tmp_path, capsys):
    split = SplitData(train_data, "val")
    blobs = random_blobs(SMALL["channels"], SMALL["hidden"], split.num_classes, 67, seed=12)
    path = write_model(tmp_path, "caffenet", "V1", blobs)
    ckpt = tmp_path / "bvlc.pt"
    convert = load_script("convert_weights").main
    assert convert([str(path), str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"fine-tune with: python train.py configs/caffenet.yaml run.resume_from={ckpt} model.lrn=caffe" in out
    state = load(ckpt)
    assert state["kind"] == "alexnet-checkpoint" and state["config"]["model"]["lrn"] == "caffe"
    assert state["source"] == {"format": "caffe", "file": str(path), "version": "V1"}
    direct, _ = weights_load.load_weights(path)
    converted, info = weights_load.load_weights(ckpt)
    x = input_images(2, 67)
    np.testing.assert_array_equal(our_logits(converted, x), our_logits(direct, x))
    assert info["arch"] == "caffenet" and converted.features.norm1.divide_by_size
    assert convert([str(path), str(tmp_path / "again.pt"), "--momentum"]) == 2
    assert "--momentum applies to Theano folders" in capsys.readouterr().err

    with pytest.raises(FormatError, match="model.lrn=caffe"):  # the Theano network computes the paper's LRN
        to_theano(state, ckpt, "cudnn")

    run_dir = tmp_path / "run"
    overrides = continue_overrides(train_data, run_dir, ckpt, **{"model.arch": "caffenet"})
    assert train.main([str(REPO / "configs" / "caffenet.yaml"), *overrides]) == 2
    assert "was trained with model.lrn='caffe', this config has 'paper'" in capsys.readouterr().err
    assert train.main([str(REPO / "configs" / "caffenet.yaml"), *overrides, "model.lrn=caffe"]) == 0
    assert f"resumed from {ckpt}: epoch 1, step 0" in capsys.readouterr().out
    after = load(run_dir / "checkpoints" / "last.pt")
    assert after["config"]["model"]["lrn"] == "caffe" and after["step"] == 1


@pytest.mark.processes
def test_peak_memory_of_a_full_size_import_is_about_twice_the_file(full_size):
    """load_weights of a full-size file in a fresh process: peak RSS growth <= 2.2 x the file (the file's
    buffer and the model). VmHWM, not ru_maxrss, which keeps the forked test process's peak across exec."""
    path = full_size[0]
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from alexnet.weights.load import load_weights\n"
            "def kib(key):\n"
            "    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(key))\n"
            "base = kib('VmRSS:'); load_weights(sys.argv[1]); print((kib('VmHWM:') - base) * 1024)")
    r = children.run([sys.executable, "-c", code, str(path), str(REPO)], cpu_s=300)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) <= 2.2 * path.stat().st_size, (int(r.stdout), path.stat().st_size)
