"""The Theano reproduction's weights: evaluate a folder, convert both ways, continue its run, bad input.

The reference network is written here in plain numpy from the Theano code's semantics (lib/layers.py,
alex_net.py of Ding et al.), not with this project's model code: true convolution with flipped
kernels (lib_conv cudnn) or cross-correlation (cudaconvnet), ReLU, max-pool 3/2, LRN with alpha not
divided by n, x0.5 after fc6 and fc7 at test time, softmax. Networks are width 0.125 with 6 classes
on a dozen synthetic images warped to 256, so every test takes seconds.
"""
from __future__ import annotations

import csv
import json
import math
import shutil

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

import train
from alexnet.checkpoint import CHECKPOINT_KIND, load
from alexnet.config import Config, TrainConfig, to_dict
from alexnet.metrics import read_metrics
from alexnet.models import build_model
from alexnet.optim import PaperSGD, build_optimizer
from data.reader import SplitData
from tests.conftest import load_script, run_script
from tests.test_evaluate import Payload

CLASSES, EPOCH, LR = 6, 3, 0.05
C1, C2, C3, C4, C5, HIDDEN = 12, 32, 48, 48, 32, 512  # caffenet at width 0.125 (half of each even)
ORDER = ("W_0", "b_0", "W0_1", "b0_1", "W1_1", "b1_1", "W_2", "b_2", "W0_3", "b0_3", "W1_3", "b1_3",
         "W0_4", "b0_4", "W1_4", "b1_4", "W_5", "b_5", "W_6", "b_6", "W_7", "b_7")  # = mom_0 .. mom_21
LAYERS = ("features.conv1", "features.conv2", "features.conv3", "features.conv4", "features.conv5",
          "classifier.fc6", "classifier.fc7", "classifier.fc8")
GROUPED = (1, 3, 4)
# PaperSGD's parameter order: the weights group, then the biases group
OPT_KEYS = [f"{m}.weight" for m in LAYERS] + [f"{m}.bias" for m in LAYERS]
CROP, OFFSET = 227, 14


def shapes() -> dict[str, tuple[int, ...]]:
    """Theano's array shapes, written out: conv (in, rows, cols, out), fc (n_in, n_out)."""
    s = {"W_0": (3, 11, 11, C1), "b_0": (C1,), "W_2": (C2, 3, 3, C3), "b_2": (C3,),
         "W_5": (C5 * 6 * 6, HIDDEN), "b_5": (HIDDEN,), "W_6": (HIDDEN, HIDDEN), "b_6": (HIDDEN,),
         "W_7": (HIDDEN, CLASSES), "b_7": (CLASSES,)}
    for i, (cin, k, cout) in {1: (C1, 5, C2), 3: (C3, 3, C4), 4: (C4, 3, C5)}.items():
        for g in "01":
            s[f"W{g}_{i}"], s[f"b{g}_{i}"] = (cin // 2, k, k, cout // 2), (cout // 2,)
    return s


def random_arrays(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """He-scaled weights (fc8 smaller, so the softmax is neither flat nor saturated), small biases."""
    rng = np.random.default_rng(seed)
    out = {}
    for stem, shape in shapes().items():
        if stem.startswith("b"):
            a = rng.normal(0, 0.1, shape)
        else:
            fan_in = int(np.prod(shape[:-1]))
            a = rng.normal(0, (0.3 if stem == "W_7" else 1.4) / math.sqrt(fan_in), shape)
        out[stem] = (a * scale).astype(np.float32)
    return out


def write_folder(folder, epoch: int, seed: int, lr: float = LR, stems=ORDER) -> dict:
    """A Theano weights folder for `epoch`: weights, mom_*, lr_E.npy, val_record.npy; returns the arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    params, moms = random_arrays(seed), random_arrays(seed + 1000, scale=1e-2)
    for stem in stems:
        np.save(folder / f"{stem}_{epoch}.npy", params[stem])
    for k, stem in enumerate(ORDER):
        np.save(folder / f"mom_{k}_{epoch}.npy", moms[stem])
    np.save(folder / f"lr_{epoch}.npy", np.array(lr, dtype=np.float32))
    np.save(folder / "val_record.npy", np.array([[0.9, 4.0], [0.8, 3.5], [0.7, 3.0]][:epoch]))
    return {"params": params, "moms": moms}


# -- the reference: the Theano network in numpy -------------------------------------------------------


def conv(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int, pad: int, true_conv: bool) -> np.ndarray:
    """x (N, C, H, W), w (C, kh, kw, O): out[o, y, x] = sum x[c, y*s+i, x*s+j] * k[c, i, j, o] + b[o].

    true convolution (cudnn's conv_mode 'conv'): k[c, i, j] = w[c, kh-1-i, kw-1-j]; else k = w.
    """
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    kh, kw = w.shape[1:3]
    windows = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    k = w[:, ::-1, ::-1, :] if true_conv else w
    return np.einsum("ncyxij,cijo->noyx", windows, k, optimize=True) + b[None, :, None, None]


def grouped_conv(x, w0, w1, b0, b1, pad: int, true_conv: bool) -> np.ndarray:
    half = x.shape[1] // 2
    return np.concatenate([conv(x[:, :half], w0, b0, 1, pad, true_conv),
                           conv(x[:, half:], w1, b1, 1, pad, true_conv)], axis=1)


def maxpool(x: np.ndarray) -> np.ndarray:
    return sliding_window_view(x, (3, 3), axis=(2, 3))[:, :, ::2, ::2].max(axis=(-1, -2))


def lrn(x: np.ndarray, n: int = 5, k: float = 2.0, alpha: float = 1e-4, beta: float = 0.75) -> np.ndarray:
    """x / (k + alpha * sum of squares over the n channels centred on each, clipped at the edges)^beta."""
    sq, channels = x * x, x.shape[1]
    total = np.stack([sq[:, max(0, c - n // 2):min(channels, c + n // 2 + 1)].sum(axis=1) for c in range(channels)],
                     axis=1)
    return x / (k + alpha * total) ** beta


def theano_probs(p: dict, x: np.ndarray, true_conv: bool) -> np.ndarray:
    """Softmax of the Theano network (test mode) for x (N, 3, 227, 227), in float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    relu = lambda a: np.maximum(a, 0)  # noqa: E731
    h = lrn(maxpool(relu(conv(x, p["W_0"], p["b_0"], 4, 0, true_conv))))
    h = lrn(maxpool(relu(grouped_conv(h, p["W0_1"], p["W1_1"], p["b0_1"], p["b1_1"], 2, true_conv))))
    h = relu(conv(h, p["W_2"], p["b_2"], 1, 1, true_conv))
    h = relu(grouped_conv(h, p["W0_3"], p["W1_3"], p["b0_3"], p["b1_3"], 1, true_conv))
    h = maxpool(relu(grouped_conv(h, p["W0_4"], p["W1_4"], p["b0_4"], p["b1_4"], 1, true_conv)))
    h = h.reshape(len(h), -1)  # (channel, row, col) order
    h = relu(h @ p["W_5"] + p["b_5"]) * 0.5  # dropout at test time: x (1 - 0.5)
    h = relu(h @ p["W_6"] + p["b_6"]) * 0.5
    logits = h @ p["W_7"] + p["b_7"]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference(params: dict, images: np.ndarray, mean_hwc: np.ndarray, true_conv: bool, crops: int) -> np.ndarray:
    """Probabilities averaged over the views: center crop at offset 14, or the 10 crops."""
    return np.mean(view_probs(params, images, mean_hwc, true_conv, crops), axis=0)


def view_probs(params: dict, images: np.ndarray, mean_hwc: np.ndarray, true_conv: bool, crops: int) -> list:
    """The network's probabilities on each view: the center crop, or the four corners and the center
    (views 0-4) and their mirror images (5-9)."""
    far, mid = images.shape[1] - CROP, OFFSET
    views = [(mid, mid, False)] if crops == 1 else [
        (oy, ox, flip) for flip in (False, True) for oy, ox in ((0, 0), (0, far), (far, 0), (far, far), (mid, mid))]
    probs = []
    for oy, ox, flip in views:
        v = (images.astype(np.float64) - mean_hwc)[:, oy:oy + CROP, ox:ox + CROP]
        if flip:
            v = v[:, :, ::-1]
        probs.append(theano_probs(params, v.transpose(0, 3, 1, 2), true_conv))
    return probs


# -- fixtures and helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evaluate_script():
    return load_script("evaluate")


@pytest.fixture(scope="module")
def convert():
    return load_script("convert_weights").main


@pytest.fixture(scope="module")
def data256(tmp_path_factory):
    """6 classes of synthetic images warped to 256 (as the Theano preprocessing): 12 train, 12 val."""
    from data.preprocess import Options, preprocess
    from data.synthetic import generate
    src, out = tmp_path_factory.mktemp("synth256"), tmp_path_factory.mktemp("data256")
    generate(src, num_classes=CLASSES, train_per_class=2, val_per_class=2, seed=3, quirks=False,
             min_side=64, max_side=200)
    preprocess(src / "train", out, src / "val", src / "val.txt", Options(size=256, per_file=8, resize="warp"),
               workers=2, quiet=True)
    return out


@pytest.fixture(scope="module")
def theano_mean(data256, tmp_path_factory):
    """An img_mean.npy (3, 256, 256) unlike the data's own mean, so that using it is visible."""
    mean = SplitData(data256, "train").mean_image().transpose(2, 0, 1)
    mean = mean + np.random.default_rng(5).normal(0, 20, mean.shape)
    path = tmp_path_factory.mktemp("mean") / "img_mean.npy"
    np.save(path, mean.astype(np.float32))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Theano folder with epochs 2 and 3 (3 is the default one)."""
    root = tmp_path_factory.mktemp("theano") / "weights"
    write_folder(root, 2, seed=20)
    arrays = write_folder(root, EPOCH, seed=30)
    return root, arrays


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def val_images(data) -> np.ndarray:
    split = SplitData(data, "val")
    return split.read(np.arange(len(split)))[0]


def assert_csv_matches(rows: list[dict], expected: np.ndarray) -> None:
    """Every row's top-5 classes and their probabilities equal the reference's (to 1e-4)."""
    assert len(rows) == len(expected)
    for row, probs in zip(rows, expected):
        top = np.argsort(-probs)[:5]
        assert [int(row[f"pred{i}"]) for i in range(1, 6)] == top.tolist()
        got = [float(row[f"prob{i}"]) for i in range(1, 6)]
        np.testing.assert_allclose(got, probs[top], atol=1e-4, rtol=0)


# -- evaluating a Theano folder: the numpy reference -------------------------------------------------------


@pytest.mark.parametrize("conv_mode,crops", [("cudnn", 1), ("cudaconvnet", 1), ("cudnn", 10)])
def test_evaluate_equals_the_theano_network(data256, folder, theano_mean, evaluate_script, tmp_path, capsys,
                                            conv_mode, crops):
    root, arrays = folder
    out_csv, out_json = tmp_path / "pred.csv", tmp_path / "eval.json"
    args = ["--data", str(data256), "--weights", str(root), "--mean", str(theano_mean), "--csv", str(out_csv),
            "--json", str(out_json), "--crops", str(crops), "--device", "cpu", "--no-progress", "--batch-size", "5"]
    if conv_mode != "cudnn":  # cudnn is the default
        args += ["--theano-conv", conv_mode]
    assert evaluate_script.main(args) == 0, capsys.readouterr().err
    assert "warning" not in capsys.readouterr().err

    images = val_images(data256)
    n = len(images) if crops == 1 else 4  # the numpy 10-crop reference is slow: the first 4 images
    mean = np.load(theano_mean).transpose(1, 2, 0).astype(np.float64)
    views = view_probs(arrays["params"], images[:n], mean, conv_mode == "cudnn", crops)
    expected = np.mean(views, axis=0)  # the 10-crop prediction is the mean of the views' probabilities
    rows = read_csv(out_csv)
    assert len(rows) == len(images)
    assert_csv_matches(rows[:n], expected)
    record = json.loads(out_json.read_text())
    assert (record["epoch"], record["theano_conv"], record["source"], record["width"]) == (EPOCH, conv_mode,
                                                                                          "theano", 0.125)
    if crops == 1:
        labels = SplitData(data256, "val").read(np.arange(len(images)))[1]
        assert record["top1_err"] == pytest.approx(np.mean(expected.argmax(1) != labels))
    # the test can tell the conventions apart: the other one gives other probabilities
    other = reference(arrays["params"], images[:2], mean, conv_mode != "cudnn", 1)
    center = views[4] if crops == 10 else expected
    assert np.abs(other - center[:2]).max() > 1e-2
    if crops == 10:  # and fewer views than ten: the center alone, or no mirrored view, give others too
        assert np.abs(center - expected).max() > 1e-2
        assert np.abs(np.mean(views[:5], axis=0) - expected).max() > 1e-2


def test_without_mean_the_data_mean_is_used_with_a_warning(data256, folder, evaluate_script, tmp_path, capsys):
    root, arrays = folder
    out_csv = tmp_path / "pred.csv"
    assert evaluate_script.main(["--data", str(data256), "--weights", str(root), "--epoch", "2", "--csv",
                                 str(out_csv), "--device", "cpu", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "--mean img_mean.npy" in err
    params2 = random_arrays(20)  # epoch 2's arrays
    mean = SplitData(data256, "train").mean_image().astype(np.float64)
    assert_csv_matches(read_csv(out_csv), reference(params2, val_images(data256), mean, True, 1))


def test_converted_weights_file_evaluates_the_same(data256, folder, theano_mean, evaluate_script, convert,
                                                   tmp_path, capsys):
    """folder -> weights file (both dropout styles) gives the folder's probabilities."""
    root, _ = folder
    common = ["--data", str(data256), "--mean", str(theano_mean), "--device", "cpu", "--no-progress"]
    assert evaluate_script.main([*common, "--weights", str(root), "--csv", str(tmp_path / "ref.csv")]) == 0
    ref = read_csv(tmp_path / "ref.csv")
    for style in ("theano", "inverted"):
        pt = tmp_path / f"{style}.pt"
        assert convert([str(root), str(pt), "--dropout-style", style]) == 0
        obj = load(pt)
        assert obj["kind"] == "alexnet-weights" and "optimizer" not in obj
        assert evaluate_script.main([*common, "--weights", str(pt), "--csv", str(tmp_path / "c.csv")]) == 0
        for a, b in zip(ref, read_csv(tmp_path / "c.csv")):
            assert [a[f"pred{i}"] for i in range(1, 6)] == [b[f"pred{i}"] for i in range(1, 6)]
            np.testing.assert_allclose([float(a[f"prob{i}"]) for i in range(1, 6)],
                                       [float(b[f"prob{i}"]) for i in range(1, 6)], atol=1e-6)
    capsys.readouterr()


# -- round trips ----------------------------------------------------------------------------------------------


def our_checkpoint(style: str, epoch: int = 30, seed: int = 0) -> dict:
    """A checkpoint with Trainer.state_dict()'s structure: random weights and velocities, caffenet 0.125."""
    torch.manual_seed(seed)
    model = build_model("caffenet", CLASSES, 0.125, 0.5, CROP, init="paper", dropout_style=style)
    optimizer = build_optimizer(model, TrainConfig())
    for v in optimizer.velocities():
        v.normal_(0, 1e-3)
    cfg = Config()
    cfg.model.arch, cfg.model.width, cfg.model.dropout_style = "caffenet", 0.125, style
    return {"kind": CHECKPOINT_KIND, "version": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "schedule": {"auto_factor": 1.0, "auto_last_drop": 0, "val_history": [0.5, 0.4]}, "epoch": epoch,
            "step": 0, "global_step": epoch * 10, "global_batch": 256, "best_top1_err": 0.4, "elapsed": 1.0,
            "meter": torch.zeros(4, dtype=torch.float64), "rng": [], "world": 1, "config": to_dict(cfg),
            "num_classes": CLASSES, "classes": None}


def assert_same_model_and_velocities(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert a["model"][k].dtype == b["model"][k].dtype == torch.float32
        assert torch.equal(a["model"][k], b["model"][k]), k
    va, vb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert va.keys() == vb.keys() and len(va) == len(OPT_KEYS)
    for i in va:
        assert torch.equal(va[i]["velocity"], vb[i]["velocity"]), OPT_KEYS[i]


def folder_arrays(root) -> dict[str, np.ndarray]:
    return {p.name: np.load(p, allow_pickle=False) for p in sorted(root.glob("*.npy"))}


@pytest.mark.parametrize("style", ["theano", "inverted"])
def test_round_trips_are_bitwise(tmp_path, convert, capsys, style):
    src = tmp_path / "ours.pt"
    torch.save(our_checkpoint(style), src)
    exported, again = tmp_path / "theano", tmp_path / "theano_again"
    assert convert([str(src), str(exported)]) == 0
    names = set(folder_arrays(exported))
    assert names == {f"{s}_30.npy" for s in ORDER} | {f"mom_{k}_30.npy" for k in range(22)} | {
        "lr_30.npy", "val_record.npy"}
    assert np.load(exported / "lr_30.npy").dtype == np.float32 and np.load(exported / "lr_30.npy") == np.float32(1e-3)
    assert {k: v.shape for k, v in folder_arrays(exported).items() if k[:-7] in ORDER} == {
        f"{s}_30.npy": shape for s, shape in shapes().items()}

    back = tmp_path / "back.pt"
    assert convert([str(exported), str(back), "--momentum", "--dropout-style", style]) == 0
    obj = load(back)
    assert_same_model_and_velocities(load(src), obj)
    assert (obj["epoch"], obj["next_lr"], obj["step"]) == (30, float(np.float32(1e-3)), 0)
    assert obj["source"]["val_record"][0][0] == pytest.approx(0.5)

    assert convert([str(back), str(again)]) == 0  # Theano -> ours -> Theano
    first, second = folder_arrays(exported), folder_arrays(again)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype and np.array_equal(first[name], second[name],
                                                                          equal_nan=True), name
    capsys.readouterr()


def test_inverted_style_folds_half_into_fc7_and_fc8(folder, convert, tmp_path):
    root, arrays = folder
    theano_pt, inverted_pt = tmp_path / "t.pt", tmp_path / "i.pt"
    assert convert([str(root), str(theano_pt), "--momentum"]) == 0
    assert convert([str(root), str(inverted_pt), "--momentum", "--dropout-style", "inverted"]) == 0
    t, i = load(theano_pt), load(inverted_pt)
    for key in t["model"]:
        factor = 0.5 if key in ("classifier.fc7.weight", "classifier.fc8.weight") else 1.0
        assert torch.equal(i["model"][key], t["model"][key] * factor), key
        idx = OPT_KEYS.index(key)
        assert torch.equal(i["optimizer"]["state"][idx]["velocity"], t["optimizer"]["state"][idx]["velocity"] * factor)
    # the layout by hand: conv1 transposed to (out, in, rows, cols) and flipped (cudnn), conv2 = W0 then W1
    w0 = arrays["params"]["W_0"]
    assert torch.equal(t["model"]["features.conv1.weight"],
                       torch.from_numpy(w0.transpose(3, 0, 1, 2)[:, :, ::-1, ::-1].copy()))
    assert torch.equal(t["model"]["features.conv2.bias"],
                       torch.from_numpy(np.concatenate([arrays["params"]["b0_1"], arrays["params"]["b1_1"]])))
    assert torch.equal(t["model"]["classifier.fc6.weight"], torch.from_numpy(arrays["params"]["W_5"].T.copy()))
    model_cfg = t["config"]["model"]
    assert (model_cfg["arch"], model_cfg["width"], model_cfg["num_classes"], model_cfg["dropout_style"]) == (
        "caffenet", 0.125, CLASSES, "theano")
    assert (t["config"]["data"]["crop"], t["config"]["data"]["mean"], t["rng"], t["epoch"]) == (227, "image", [], 3)


# -- continuing a Theano run ----------------------------------------------------------------------------------


def to_theano_layout(tensors: dict[str, torch.Tensor], flip: bool) -> dict[str, np.ndarray]:
    """Our (out, in, rows, cols) / (out, in) tensors as Theano's arrays, written out for this test."""
    out = {}
    for i, module in enumerate(LAYERS):
        w, b = tensors[f"{module}.weight"].double().numpy(), tensors[f"{module}.bias"].double().numpy()
        if w.ndim == 4:
            w = (w[:, :, ::-1, ::-1] if flip else w).transpose(1, 2, 3, 0)
        else:
            w = w.T
        if i in GROUPED:
            half = b.shape[0] // 2
            out.update({f"W0_{i}": w[..., :half], f"W1_{i}": w[..., half:], f"b0_{i}": b[:half], f"b1_{i}": b[half:]})
        else:
            out.update({f"W_{i}": w, f"b_{i}": b})
    return out


def continue_overrides(data, run_dir, ckpt, **extra) -> list[str]:
    base = {"data.root": str(data), "model.width": 0.125, "train.batch_size": 4, "train.max_steps": 1,
            "data.loading": "inline", "train.log_every": 1, "run.dir": str(run_dir), "run.progress": False,
            "run.tensorboard": False, "run.device": "cpu", "run.resume_from": str(ckpt)}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_one_step_equals_the_theano_update_rule(data256, folder, convert, tmp_path, monkeypatch, capsys):
    """train.py from a converted epoch: one step == Theano's update computed by hand from its arrays.

    model.dropout=0 for this step, so no dropout mask enters the gradient (the Theano and torch masks
    come from different generators); the gradient itself is autograd's, mapped to Theano's layout by
    hand: the test checks the update rule, the velocities' and weights' mapping, and the lr.
    """
    root, arrays = folder
    ckpt = tmp_path / "theano_3.pt"
    assert convert([str(root), str(ckpt), "--momentum"]) == 0
    grads: list[list[torch.Tensor]] = []
    original = PaperSGD.step

    def spy(self, closure=None):
        grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return original(self, closure)

    monkeypatch.setattr(PaperSGD, "step", spy)
    run_dir = tmp_path / "run"
    assert train.main(["configs/theano_continue.yaml",
                       *continue_overrides(data256, run_dir, ckpt, **{"model.dropout": 0.0, "train.lr": LR})]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt}: epoch {EPOCH + 1}, step 0" in out and "warning" not in out
    assert len(grads) == 1

    after = load(run_dir / "checkpoints" / "last.pt")
    assert (after["epoch"], after["step"]) == (EPOCH, 1)
    g = to_theano_layout(dict(zip(OPT_KEYS, grads[0])), flip=True)
    new_w = to_theano_layout(after["model"], flip=True)
    new_v = to_theano_layout({k: after["optimizer"]["state"][i]["velocity"] for i, k in enumerate(OPT_KEYS)},
                             flip=True)
    lr, mu, wd = float(np.float32(LR)), 0.9, 5e-4
    for stem in ORDER:
        w, v = arrays["params"][stem].astype(np.float64), arrays["moms"][stem].astype(np.float64)
        if stem.startswith("W"):
            v_next = mu * v - lr * (g[stem] + wd * w)
        else:
            v_next = mu * v - 2 * lr * g[stem]
        scale = np.abs(v_next).max()
        np.testing.assert_allclose(new_v[stem], v_next, rtol=1e-5, atol=1e-5 * scale, err_msg=stem)
        np.testing.assert_allclose(new_w[stem], w + v_next, rtol=1e-5, atol=1e-5 * scale, err_msg=stem)
        assert np.abs(g[stem]).max() > 0, stem  # every layer took part in the step


@pytest.mark.processes
def test_train_py_continues_at_the_next_epoch(data256, folder, convert, tmp_path, capsys):
    """`train.py configs/theano_continue.yaml run.resume_from=FILE` (inverted style, another lr):
    starts at epoch E+1 from the file's weights, warns about the lr, and its checkpoint exports back."""
    root, _ = folder
    ckpt = tmp_path / "theano_3_inv.pt"
    assert convert([str(root), str(ckpt), "--momentum", "--dropout-style", "inverted"]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "run"
    r = run_script("train.py", "configs/theano_continue.yaml",
                   *continue_overrides(data256, run_dir, ckpt, **{"model.dropout_style": "inverted"}), cpu_s=300)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ckpt}: epoch {EPOCH + 1}, step 0" in r.stdout
    assert f"continues at lr {np.float32(LR):g}, but this config gives lr 0.01" in r.stdout
    train_records = [x for x in read_metrics(run_dir / "metrics.jsonl") if x["split"] == "train"]
    steps = len(SplitData(data256, "train")) // 4
    assert train_records and train_records[0]["epoch"] == EPOCH + 1
    assert train_records[0]["iter"] == EPOCH * steps + 1

    last = run_dir / "checkpoints" / "last.pt"
    # Trainer.state_dict()'s keys + 2; last.pt also says whether it was the best (CheckpointDir.save)
    assert set(load(ckpt)) | {"is_best"} == set(load(last)) | {"next_lr", "source"}
    exported, back = tmp_path / "exported", tmp_path / "back.pt"
    assert convert([str(last), str(exported)]) == 0  # a trainer's own checkpoint, mid-epoch
    assert "stopped at step 1 of epoch 4" in capsys.readouterr().err
    assert np.load(exported / f"lr_{EPOCH}.npy") == np.float32(0.01)  # the config's lr, which training used
    assert convert([str(exported), str(back), "--momentum", "--dropout-style", "inverted"]) == 0
    assert_same_model_and_velocities(load(last), load(back))


# -- bad input -------------------------------------------------------------------------------------------------


def _missing(root):
    (root / "W1_3_3.npy").unlink()
    return "W1_3_3.npy", "missing (expected shape (24, 3, 3, 24))"


def _misshapen(root):
    np.save(root / "W0_4_3.npy", np.zeros((24, 3, 3, 17), np.float32))
    return "W0_4_3.npy", "expected shape (24, 3, 3, 16)"


def _mixed_epochs(root):
    for p in root.glob("*_3.npy"):
        p.unlink()
    np.save(root / "W_0_3.npy", random_arrays(1)["W_0"])  # one file of epoch 3 beside a complete epoch 2
    return "b_0_3.npy", "complete epochs: 2"


def _pickled(root):
    np.save(root / "W_2_3.npy", np.array([Payload(root / "pwned")], dtype=object), allow_pickle=True)
    return "W_2_3.npy", "not a plain .npy array"


def _integers(root):
    np.save(root / "b_6_3.npy", np.zeros(HIDDEN, np.int64))
    return "b_6_3.npy", "dtype int64"


def _nan(root):
    w = random_arrays(30)["W_6"]
    w[3, 4] = np.nan
    np.save(root / "W_6_3.npy", w)
    return "W_6_3.npy", "NaN"


@pytest.mark.parametrize("damage", [_missing, _misshapen, _mixed_epochs, _pickled, _integers, _nan])
def test_bad_folders_exit_2_naming_the_file(data256, folder, evaluate_script, convert, tmp_path, capsys, damage):
    root = tmp_path / "weights"
    shutil.copytree(folder[0], root)
    name, detail = damage(root)
    assert evaluate_script.main(["--data", str(data256), "--weights", str(root), "--no-progress",
                                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evaluate.py: error:") and str(root / name) in err and detail in err, err
    assert convert([str(root), str(tmp_path / "out.pt"), "--momentum"]) == 2
    err = capsys.readouterr().err
    assert str(root / name) in err and detail in err, err
    assert not (tmp_path / "out.pt").exists() and not (root / "pwned").exists()


def test_bad_momentum_lr_and_mean_exit_2(data256, folder, evaluate_script, convert, tmp_path, capsys):
    root = tmp_path / "weights"
    shutil.copytree(folder[0], root)
    (root / "mom_5_3.npy").unlink()
    assert convert([str(root), str(tmp_path / "w.pt")]) == 0  # weights only: mom_* not needed
    assert convert([str(root), str(tmp_path / "m.pt"), "--momentum"]) == 2
    assert f"{root / 'mom_5_3.npy'}: missing (the velocity of b1_1, expected shape (16,)" in capsys.readouterr().err
    np.save(root / "mom_5_3.npy", np.zeros(16, np.float32))
    np.save(root / "lr_3.npy", np.array([0.1, 0.2], np.float32))
    assert convert([str(root), str(tmp_path / "m.pt"), "--momentum"]) == 2
    assert f"{root / 'lr_3.npy'}: [0.1" in capsys.readouterr().err

    bad_mean = tmp_path / "mean.npy"
    np.save(bad_mean, np.zeros((3, 224, 224), np.float32))
    assert evaluate_script.main(["--data", str(data256), "--weights", str(folder[0]), "--mean", str(bad_mean),
                                 "--no-progress", "--device", "cpu"]) == 2
    assert f"{bad_mean}: shape (3, 224, 224), expected (3, 256, 256)" in capsys.readouterr().err
    assert evaluate_script.main(["--data", str(data256), "--weights", str(folder[0]), "--epoch", "7",
                                 "--no-progress", "--device", "cpu"]) == 2
    assert "no files of epoch 7 (epochs present: 2, 3)" in capsys.readouterr().err


def test_export_refusals_exit_2(tmp_path, convert, capsys):
    alexnet = our_checkpoint("inverted")
    alexnet["config"]["model"]["arch"] = "alexnet"
    torch.save(alexnet, tmp_path / "alexnet.pt")
    assert convert([str(tmp_path / "alexnet.pt"), str(tmp_path / "a")]) == 2
    assert "only caffenet is the Theano network" in capsys.readouterr().err

    torch.save(our_checkpoint("theano")["model"], tmp_path / "plain.pt")
    assert convert([str(tmp_path / "plain.pt"), str(tmp_path / "p"), "--epoch", "5"]) == 2
    assert "pass --arch caffenet" in capsys.readouterr().err
    assert convert([str(tmp_path / "plain.pt"), str(tmp_path / "p"), "--arch", "caffenet"]) == 2
    assert "records no epoch: pass --epoch" in capsys.readouterr().err
    assert convert([str(tmp_path / "plain.pt"), str(tmp_path / "p"), "--arch", "caffenet", "--epoch", "5",
                    "--lr", "0.001", "--dropout-style", "theano"]) == 0
    assert "no momentum" in capsys.readouterr().out
    assert convert([str(tmp_path / "plain.pt"), str(tmp_path / "p"), "--arch", "caffenet", "--epoch", "5"]) == 2
    # the first file the second conversion would change (the dropout style scales fc6's input: W_6, b_6);
    # the files it would write alike are no clash (a rerun of the same conversion completes the folder)
    assert f"{tmp_path / 'p' / 'W_6_5.npy'}: exists (2 files of epoch 5" in capsys.readouterr().err

    small = build_model("caffenet", CLASSES, 0.125, crop=99).state_dict()  # fc6 reads 2x2 maps, not 6x6
    torch.save(small, tmp_path / "small.pt")
    assert convert([str(tmp_path / "small.pt"), str(tmp_path / "s"), "--arch", "caffenet", "--epoch", "1"]) == 2
    assert "crop 227" in capsys.readouterr().err
