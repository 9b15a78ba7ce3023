"""alexnet/evaluation.py, scripts/evaluate.py, scripts/plot.py: numbers by hand, formats, errors."""
from __future__ import annotations

import csv
import json
import math
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from alexnet.checkpoint import CheckpointError
from alexnet.evaluation import (
    CSV_HEADER,
    check_compatible,
    crop_for_side,
    evaluate,
    load_weights,
    make_normalizer,
    predict_log_probs,
    read_names,
)
from alexnet.metrics import read_metrics
from alexnet.models import build_model
from data.augment import Normalizer
from data.batchfile import read_batch_file
from data.reader import SplitData
from tests.conftest import load_script, run_script
from train import main as train_main

CROP = 56  # of the 64x64 test images: corners and center are all different views
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class PixelLinear(nn.Module):
    """logits_k = <x, W_k> + b_k with a weight per pixel, so every crop and flip gives other logits."""

    def __init__(self, num_classes: int, crop: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # scaled so that logits are a few units: softmax neither saturated nor flat
        self.weight = nn.Parameter(torch.randn(num_classes, 3, crop, crop, generator=g) * 4e-4)
        self.bias = nn.Parameter(torch.randn(num_classes, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nchw,kchw->nk", x, self.weight) + self.bias


def views(size: int, crop: int, crops: int) -> list[tuple[int, int, bool]]:
    """(top, left, mirrored) of every test view, written out independently of data.augment."""
    far, mid = size - crop, (size - crop) // 2
    if crops == 1:
        return [(mid, mid, False)]
    return [(oy, ox, flip) for flip in (False, True) for oy, ox in ((0, 0), (0, far), (far, 0), (far, far),
                                                                     (mid, mid))]


def hand_probs(model: PixelLinear, images: np.ndarray, mean: np.ndarray, crop: int, crops: int) -> np.ndarray:
    """Softmax probabilities averaged over the views, in float64 numpy, one view at a time."""
    weight = model.weight.detach().double().numpy().transpose(0, 2, 3, 1)  # k x h x w x c like the images
    bias = model.bias.detach().double().numpy()
    probs = []
    for oy, ox, flip in views(images.shape[1], crop, crops):
        v = images[:, oy:oy + crop, ox:ox + crop].astype(np.float64) - mean[oy:oy + crop, ox:ox + crop]
        if flip:
            v = v[:, :, ::-1]  # mirror each image's columns (N x H x W x C)
        logits = np.einsum("nhwc,khwc->nk", v, weight) + bias
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs.append(e / e.sum(axis=1, keepdims=True))
    return np.mean(probs, axis=0)


def split_contents(root, split: str = "val") -> tuple[np.ndarray, np.ndarray, list[str]]:
    parts = [read_batch_file(p) for p in SplitData(root, split).paths]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            [n for p in parts for n in p[2]])


@pytest.fixture(scope="module")
def trained(prep, tmp_path_factory):
    """A one-epoch owt run on the 64x64 test data: checkpoints and metrics.jsonl with a val record."""
    out, _ = prep
    run = tmp_path_factory.mktemp("run") / "owt_tiny"
    assert train_main(["configs/demo.yaml", f"data.root={out}", "model.arch=owt", "data.crop=64",
                       "model.width=0.125", "train.epochs=1", "train.batch_size=8", "run.progress=false",
                       f"run.dir={run}", "run.tensorboard=false", "run.device=cpu"]) == 0
    return run


# -- the numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("crops", [1, 10])
def test_evaluate_equals_hand_computation(prep, crops):
    out, _ = prep
    data = SplitData(out, "val")
    images, labels = data.read(np.arange(len(data)))
    model = PixelLinear(data.num_classes, CROP)
    expected = hand_probs(model, images, data.mean_image().astype(np.float64), CROP, crops)
    normalizer = Normalizer("image", data.mean_image())

    with torch.no_grad():
        got = predict_log_probs(model, torch.from_numpy(images), CROP, normalizer, crops).exp().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
    if crops == 10:  # the views really differ, so averaging was exercised
        center = hand_probs(model, images, data.mean_image().astype(np.float64), CROP, 1)
        assert np.abs(center - expected).max() > 1e-3

    result = evaluate(model, data, CROP, normalizer, crops=crops, batch_size=5, progress=False)  # short last batch
    truth = expected[np.arange(len(labels)), labels]
    rank = (expected > truth[:, None]).sum(axis=1)  # classes more probable than the true one
    assert result["n"] == len(data) and result["crops"] == crops
    assert result["top1_err"] == pytest.approx(np.mean(rank >= 1))
    assert result["top5_err"] == pytest.approx(np.mean(rank >= 5))
    assert result["loss"] == pytest.approx(-np.mean(np.log(truth)), rel=1e-4)


def test_top5_with_more_classes_than_five(prep, tmp_path):
    """With 4 classes every label is in the top 5: here the data declares 12 classes (its labels stay
    0..3) for a 12-way model, so top-5 error is a hand-computed rank >= 5, neither 0 nor top-1's."""
    import shutil
    root = tmp_path / "data"
    shutil.copytree(prep[0], root)
    meta = json.loads((root / "meta.json").read_text())
    meta["classes"] += [f"n9{i:07d}" for i in range(8)]
    meta["num_classes"] = 12
    meta.pop("class_names", None)
    (root / "meta.json").write_text(json.dumps(meta))
    data = SplitData(root, "val")
    images, labels = data.read(np.arange(len(data)))
    model = PixelLinear(12, CROP, seed=6)
    expected = hand_probs(model, images, data.mean_image().astype(np.float64), CROP, 1)
    rank = (expected > expected[np.arange(len(labels)), labels][:, None]).sum(axis=1)
    assert {0, 4, 5} <= set(rank.tolist())  # true classes ranked 5th and 6th: a top-4 or top-6 count differs
    result = evaluate(model, data, CROP, Normalizer("image", data.mean_image()), crops=1, batch_size=5,
                      progress=False)
    assert result["top1_err"] == pytest.approx(np.mean(rank >= 1))
    assert result["top5_err"] == pytest.approx(np.mean(rank >= 5))
    assert 0 < result["top5_err"] < result["top1_err"]
    for c, record in enumerate(result["per_class"][:4]):
        mine = rank[labels == c]
        assert record["n"] == len(mine) > 0
        assert record["top5_err"] == pytest.approx(np.mean(mine >= 5)) and record["top1_err"] == pytest.approx(
            np.mean(mine >= 1))
    assert [r["n"] for r in result["per_class"][4:]] == [0] * 8


def _variant(prep, root, classes: int, names: str):
    """The test data copied with meta.json declaring `classes` classes (labels stay 0..3); class names for
    every class ("all"), none, or a list of another length ("short": not used)."""
    import shutil
    shutil.copytree(prep[0], root)
    meta = json.loads((root / "meta.json").read_text())
    wnids = meta["classes"] + [f"n9{i:07d}" for i in range(classes - 4)]
    meta["num_classes"], meta["classes"] = classes, wnids
    meta["class_names"] = {"all": [f"words of {w}, more" for w in wnids], "none": None,
                           "short": ["a", "b", "c"]}[names]
    (root / "meta.json").write_text(json.dumps(meta))
    return wnids


@pytest.mark.parametrize("classes,names,split", [(12, "all", "train"), (4, "none", "val"), (4, "short", "val")])
def test_csv_rows_per_class_and_confusions_by_hand(prep, tmp_path, classes, names, split):
    """Every CSV row (top-5 classes, correct flags, view-averaged probabilities, wnids and words), the
    per-class records and the confusion pairs, against hand_probs: 12 classes (8 without images) on the
    train split (12 images a class: shares like 1/12), 4 (fewer than 5: empty prediction columns), without
    class names or with a list that does not fit. The loss is the float64 sum of the batches' log-probs."""
    wnids = _variant(prep, tmp_path / "data", classes, names)
    data = SplitData(tmp_path / "data", split)
    named = names == "all"
    images, labels = data.read(np.arange(len(data)))
    n_cls = data.num_classes
    model = PixelLinear(n_cls, CROP, seed=6)
    expected = hand_probs(model, images, data.mean_image().astype(np.float64), CROP, 10)
    out = tmp_path / "eval.csv"
    result = evaluate(model, data, CROP, Normalizer("image", data.mean_image()), crops=10, batch_size=5,
                      csv_path=out, progress=False)
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER) and len(rows) == len(data) + 1
    _, _, names = split_contents(data.root, split)
    word = (lambda c: f"words of {wnids[c]}, more") if named else (lambda c: "")
    k = min(5, n_cls)
    for row, name, label, p in zip(rows[1:], names, labels.tolist(), expected):
        top = np.argsort(-p, kind="stable")[:k].tolist()
        pad = [""] * (5 - k)
        assert row[:9] == [name, str(label), *map(str, top), *pad, str(int(top[0] == label)), str(int(label in top))]
        np.testing.assert_allclose([float(v) for v in row[9:9 + k]], p[top], rtol=1e-5)
        assert row[9 + k:14] == pad
        assert row[14:] == [wnids[label], word(label), *(v for c in top for v in (wnids[c], word(c))), *pad, *pad]
    top1 = expected.argmax(axis=1)
    for c, record in enumerate(result["per_class"]):
        mine = labels == c
        n = int(mine.sum())
        assert record == {"index": c, "wnid": wnids[c], "name": word(c), "n": n,
                          "top1_err": pytest.approx(np.mean(top1[mine] != c)) if n else None,
                          "top5_err": pytest.approx(np.mean([c not in np.argsort(-q)[:5] for q in expected[mine]]))
                          if n else None}
    pairs = {}
    for t, p in zip(labels.tolist(), top1.tolist()):
        if t != p:
            pairs[t, p] = pairs.get((t, p), 0) + 1
    assert len(pairs) >= 2
    want = [{"label": t, "label_wnid": wnids[t], "label_name": word(t), "pred": p, "pred_wnid": wnids[p],
             "pred_name": word(p), "count": m,
             "share": m / int((labels == t).sum())}
            for (t, p), m in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))]
    assert result["confusions"] == want
    assert result["top1_err"] == np.mean(top1 != labels) and result["n"] == len(data) and result["crops"] == 10
    # one image a batch: each image's loss is one float32 value, and their sum must be float64's
    normalizer = Normalizer("image", data.mean_image())
    single = evaluate(model, data, CROP, normalizer, batch_size=1, progress=False)
    with torch.no_grad():
        nll = [-float(predict_log_probs(model, torch.from_numpy(images[i:i + 1]), CROP, normalizer)[0, label])
               for i, label in enumerate(labels.tolist())]
    assert single["loss"] == pytest.approx(math.fsum(nll) / len(data), rel=1e-13, abs=0)


def test_more_images_than_pixels_a_side_and_the_defaults():
    """A batch of 70 images of 64 x 64 (more images than pixels on a side), one center view by default,
    against hand_probs; no warning; 5 views is an error."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (70, 64, 64, 3), dtype=np.uint8)
    mean = rng.uniform(0, 255, (64, 64, 3)).astype(np.float32)
    model = PixelLinear(7, CROP, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            got = predict_log_probs(model, torch.from_numpy(images), CROP, Normalizer("image", mean))
    np.testing.assert_allclose(got.exp().numpy(), hand_probs(model, images, mean.astype(np.float64), CROP, 1),
                               rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="^crops must be 1 or 10, got 5$"):
        predict_log_probs(model, torch.from_numpy(images), CROP, Normalizer("image", mean), crops=5)


def test_evaluate_refuses_an_empty_split_and_a_crop_too_large(prep, tmp_path, capfd):
    import shutil
    root = tmp_path / "data"
    shutil.copytree(prep[0], root)
    meta = json.loads((root / "meta.json").read_text())
    meta["splits"]["empty"] = {"count": 0, "files": []}
    (root / "meta.json").write_text(json.dumps(meta))
    model = PixelLinear(4, CROP)
    normalizer = Normalizer("image", SplitData(root, "val").mean_image())
    with pytest.raises(ValueError, match=f"^{re.escape(str(root / 'empty'))} holds no images$"):
        evaluate(model, SplitData(root, "empty"), CROP, normalizer, progress=False)
    too_large = f"^crop 65 is larger than the 64x64 images of {re.escape(str(root / 'val'))}$"
    with pytest.raises(ValueError, match=too_large):
        evaluate(model, SplitData(root, "val"), 65, normalizer, progress=False)
    capfd.readouterr()
    evaluate(model, SplitData(root, "val"), CROP, normalizer)  # a progress bar unless told otherwise
    assert "evaluate: 100%" in capfd.readouterr().err


def test_bf16_is_close_to_fp32(prep):
    out, _ = prep
    data = SplitData(out, "val")
    model, normalizer = PixelLinear(data.num_classes, CROP), Normalizer("image", data.mean_image())
    fp32 = evaluate(model, data, CROP, normalizer, progress=False)
    bf16 = evaluate(model, data, CROP, normalizer, progress=False, precision="bf16")
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.1)
    with pytest.raises(ValueError, match="precision"):
        evaluate(model, data, CROP, normalizer, progress=False, precision="fp8")


def test_read_names_follows_global_indices(prep):
    out, _ = prep
    data = SplitData(out, "val")
    _, _, names = split_contents(out)
    idx = np.array([len(data) - 1, 0, 9, 3, 8])  # across files, out of order
    assert read_names(data, idx) == [names[i] for i in idx]


# -- loading weights ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [0.125, 0.3])
def test_torchvision_state_dict_loads_with_inferred_width(tmp_path, width):
    src = build_model("owt", num_classes=4, width=width, crop=64, init="torch").eval()
    path = tmp_path / "tv.pt"
    torch.save(src.state_dict(), path)
    model, info = load_weights(path)
    assert (info["arch"], info["mean"], info["source"], info["crop"], info["num_classes"]) == \
        ("owt", "channel", "torchvision", 224, 4)
    assert info["channel_mean"] == [0.485, 0.456, 0.406] and info["classes"] is None
    assert info["width"] == pytest.approx(width, abs=1e-3)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
    assert not model.training


def test_wrapped_and_prefixed_state_dict(tmp_path):
    src = build_model("owt", num_classes=4, width=0.125, crop=64, init="torch").eval()
    path = tmp_path / "ddp.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}, "epoch": 3}, path)
    model, info = load_weights(path)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="owt"):
        load_weights(path, arch="alexnet")


def test_strict_loading_names_file_and_keys(tmp_path):
    state = build_model("owt", num_classes=4, width=0.125, crop=64).state_dict()
    path = tmp_path / "cut.pt"
    del state["features.3.bias"]
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"cut\.pt.*features\.3\.bias"):
        load_weights(path, width=0.125)
    torch.save({"conv.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="unrecognised"):
        load_weights(path)


@pytest.mark.parametrize("arch,crop", [("alexnet", 67), ("caffenet", 67), ("alexnet", 224), ("caffenet", 227)])
def test_our_plain_state_dict_needs_arch_and_infers_crop(tmp_path, arch, crop):
    src = build_model(arch, num_classes=4, width=0.125, crop=crop, init="torch").eval()
    path = tmp_path / f"{arch}.pt"
    torch.save({"model": src.state_dict()}, path)
    with pytest.raises(ValueError, match="--arch alexnet or --arch caffenet"):
        load_weights(path)
    model, info = load_weights(path, arch=arch)
    assert (info["arch"], info["crop"], info["width"], info["mean"], info["source"]) == \
        (arch, crop, 0.125, "image", "state_dict")
    assert type(model) is type(src)  # caffenet's pool-before-norm order, not alexnet's
    x = torch.randn(1, 3, crop, crop)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)


def test_crop_for_side():
    assert (crop_for_side("alexnet", 6), crop_for_side("alexnet", 5), crop_for_side("alexnet", 1)) == (227, 224, 67)
    assert crop_for_side("caffenet", 2) == 99  # smallest crop with 2x2 features: (99-11)//4+1 = 23 -> 11 -> 5 -> 2
    assert build_model("alexnet", crop=99).classifier.fc6.in_features == 256 * 2 * 2
    assert build_model("alexnet", crop=98).classifier.fc6.in_features == 256 * 1 * 1


class Payload:
    """Unpickling this would create `marker`: the test that loading never runs code from a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_code_is_refused(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"model": Payload(marker), "note": "not weights"}, path)
    with pytest.raises(CheckpointError, match="evil.pt"):
        load_weights(path)
    assert not marker.exists()


# -- data and model together --------------------------------------------------------------------------


def test_checks_against_the_data(prep, trained, tmp_path):
    out, _ = prep
    data = SplitData(out, "val")
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    state["classes"] = list(reversed(state["classes"]))
    swapped = tmp_path / "swapped.pt"
    torch.save(state, swapped)
    _, info = load_weights(swapped)
    with pytest.raises(ValueError, match=r"swapped\.pt.*classes differ"):
        check_compatible(info, data, swapped)

    five = tmp_path / "five.pt"
    torch.save(build_model("owt", num_classes=5, width=0.125, crop=64).state_dict(), five)
    _, info = load_weights(five)
    with pytest.raises(ValueError, match="5 classes.* 4"):
        check_compatible(info, data, five)

    tv = tmp_path / "tv.pt"
    torch.save(build_model("owt", num_classes=4, width=0.125, crop=64).state_dict(), tv)
    _, info = load_weights(tv)
    with pytest.raises(ValueError, match="224x224 crops, larger than the 64x64"):
        check_compatible(info, data, tv)


def test_checkpoint_info_and_trainer_agreement(prep, trained):
    """Our center-crop numbers on last.pt equal the trainer's own validation at the same weights."""
    out, _ = prep
    data = SplitData(out, "val")
    model, info = load_weights(trained / "checkpoints" / "last.pt")
    assert (info["arch"], info["crop"], info["width"], info["mean"], info["source"]) == \
        ("owt", 64, 0.125, "image", "checkpoint")
    assert info["classes"] == data.meta["classes"]
    check_compatible(info, data)
    result = evaluate(model, data, info["crop"], make_normalizer(info, data), progress=False)
    val = [r for r in read_metrics(trained / "metrics.jsonl") if r["split"] == "val"][-1]
    assert result["n"] == val["n"] == len(data)
    assert result["top1_err"] == pytest.approx(val["top1_err"])
    assert result["top5_err"] == pytest.approx(val["top5_err"])
    assert result["loss"] == pytest.approx(val["loss"], rel=1e-5)


# -- scripts/evaluate.py ---------------------------------------------------------------------------


@pytest.mark.processes
def test_cli_end_to_end_on_a_checkpoint(prep, trained, tmp_path):
    out, _ = prep
    weights = trained / "checkpoints" / "last.pt"
    js, cs = tmp_path / "res" / "eval.json", tmp_path / "rows" / "pred.csv"  # folders made by the writes
    r = run_script("scripts/evaluate.py", "--data", str(out), "--weights", str(weights), "--crops", "10",
                   "--json", str(js), "--csv", str(cs), "--batch-size", "5", "--device", "cpu", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert re.search(r"top-1 error \d\.\d{4}, top-5 error \d\.\d{4} on 16 images \(10 crops\)", r.stdout)

    images, labels, names = split_contents(out)
    record = json.loads(js.read_text())
    assert {"top1_err", "top5_err", "n", "crops", "loss", "weights", "arch", "data"} <= set(record)
    assert (record["n"], record["crops"], record["arch"], record["weights"]) == (len(images), 10, "owt", str(weights))

    with open(cs, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:14] == ["name", "label", "pred1", "pred2", "pred3", "pred4", "pred5", "correct1",
                                  "correct5", "prob1", "prob2", "prob3", "prob4", "prob5"]  # then class names
    assert len(rows) == record["n"]
    assert [row["name"] for row in rows] == names
    assert [int(row["label"]) for row in rows] == labels.tolist()
    assert all(int(row["correct1"]) == (row["pred1"] == row["label"]) for row in rows)
    assert record["top1_err"] == pytest.approx(np.mean([row["correct1"] == "0" for row in rows]))
    assert record["top5_err"] == pytest.approx(np.mean([row["correct5"] == "0" for row in rows]))
    assert not list(tmp_path.glob(".*tmp"))  # temporary files renamed away

    # the same numbers through the library; prob1..5: the 10-crop averaged probabilities of pred1..5
    model, info = load_weights(weights)
    data = SplitData(out, "val")
    lib = evaluate(model, data, info["crop"], make_normalizer(info, data), crops=10, progress=False)
    assert lib["top1_err"] == pytest.approx(record["top1_err"]) and lib["loss"] == pytest.approx(record["loss"])
    with torch.no_grad():
        probs = predict_log_probs(model, torch.from_numpy(images), info["crop"], make_normalizer(info, data),
                                  crops=10).exp().numpy()
    for row, p in zip(rows, probs):
        preds = [int(row[f"pred{i}"]) for i in range(1, 5)]  # 4 classes: pred5 and prob5 are empty
        np.testing.assert_allclose([float(row[f"prob{i}"]) for i in range(1, 5)], p[preds], rtol=1e-5)
        assert row["pred5"] == row["prob5"] == ""


@pytest.fixture(scope="module")
def evaluate_script():
    return load_script("evaluate")


def test_cli_bad_input_exits_2_naming_the_file(prep, trained, tmp_path, evaluate_script, capsys):
    out, _ = prep
    truncated = tmp_path / "truncated.pt"
    data = (trained / "checkpoints" / "last.pt").read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    cases = [("--data", str(out), "--weights", str(tmp_path / "missing.pt")),
             ("--data", str(out), "--weights", str(truncated)),
             ("--data", str(tmp_path / "nodata"), "--weights", str(trained / "checkpoints" / "last.pt"))]
    for args in cases:  # a missing path is refused by the parser (SystemExit), a bad file when read
        try:
            code = evaluate_script.main([*args, "--no-progress", "--device", "cpu"])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        named = args[1] if "nodata" in args[1] else args[3]
        # the tool's own "evaluate.py: error: ..." or, for a missing path, argparse's (prog is argv[0] here)
        assert (err.startswith("evaluate.py: error:") or "error: argument " in err) and named in err, err


def test_cli_refuses_a_checkpoint_for_other_classes(prep, trained, tmp_path, evaluate_script, capsys):
    out, _ = prep
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    state["classes"] = ["n0", "n1", "n2", "n3"]
    path = tmp_path / "other.pt"
    torch.save(state, path)
    js = tmp_path / "never.json"
    assert evaluate_script.main(["--data", str(out), "--weights", str(path), "--json", str(js),
                                 "--no-progress", "--device", "cpu"]) == 2
    assert "classes differ" in capsys.readouterr().err and not js.exists()


# -- scripts/plot.py ----------------------------------------------------------------------------------


@pytest.mark.processes
def test_plot_learning_curve(trained, tmp_path):
    pytest.importorskip("matplotlib")
    r = run_script("scripts/plot.py", str(trained))
    assert r.returncode == 0, r.stderr
    png = trained / "learning_curve.png"
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert not list(trained.glob(".*tmp*"))


@pytest.fixture(scope="module")
def plot_script():
    return load_script("plot")


def test_plot_two_runs_to_out(trained, tmp_path, plot_script, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs" / "compare.png"
    assert plot_script.main([str(trained), str(trained), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert str(out) in capsys.readouterr().out


def test_plot_errors_exit_2(trained, tmp_path, plot_script, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert plot_script.main([str(trained), str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err
    train_only = tmp_path / "train_only"
    train_only.mkdir()
    (train_only / "metrics.jsonl").write_text(json.dumps({"split": "train", "epoch": 1, "iter": 5,
                                                          "top1_err": 0.9, "time": 1.0}) + "\n")
    assert plot_script.main([str(train_only)]) == 2
    assert "no validation records" in capsys.readouterr().err


def test_plot_without_matplotlib_is_not_an_error(trained, tmp_path, plot_script, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    out = tmp_path / "never.png"
    assert plot_script.main([str(trained), "--out", str(out)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not out.exists()
