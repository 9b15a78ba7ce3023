"""alexnet/evaluation.py's records, names and progress bar at their edges: class lists shorter than the model's
outputs (or none), index dtypes, the default batch size, the bar's unit, count and width. Fast: no training,
no subprocess; the data is the session's `prep` split or a few images in memory."""
from __future__ import annotations

import csv
import fcntl
import io
import os
import re
import select
import struct
import sys
import termios
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from alexnet.evaluation import CSV_HEADER, class_words, evaluate, predict_log_probs, read_names
from data.augment import Normalizer
from data.batchfile import read_batch_file
from data.reader import SplitData

CROP = 56


class Fixed(nn.Module):
    """The same logits for every image whatever its pixels, so every prediction is known by hand; records
    the size of each batch it sees and can run `hook` before each (to change the world mid-evaluation)."""

    def __init__(self, logits, hook=None):
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits, dtype=torch.float32))
        self.sizes, self.hook = [], hook

    def forward(self, x):
        self.sizes.append(x.shape[0])
        if self.hook is not None:
            self.hook()
        return self.logits.expand(x.shape[0], -1).clone()


class MemorySplit:
    """What evaluate reads of a SplitData, held in memory: any number of images, any meta dict."""

    def __init__(self, n, side, num_classes, meta=None):
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)
        self.labels = np.arange(n, dtype=np.int64) % num_classes
        self.root, self.split, self.image_size, self.num_classes = Path("memory"), "val", side, num_classes
        self.meta = {} if meta is None else meta
        self.counts = np.array([n], dtype=np.int64)

    def __len__(self):
        return len(self.images)

    def read(self, indices):
        return self.images[indices], self.labels[indices]


def names_by_hand(root, split="val"):
    """Every image's source name in file order, read straight from the batch files."""
    return [n for p in SplitData(root, split).paths for n in read_batch_file(p)[2]]


def softmax(logits):
    e = np.exp(np.asarray(logits, dtype=np.float64) - max(logits))
    return e / e.sum()


def prep_split(prep, meta_update, drop=(), num_classes=None):
    """The `prep` val split with its meta dict changed in memory (read_meta insists on a full class list,
    but evaluate must cope with whatever meta dict the data object carries)."""
    data = SplitData(prep[0], "val")
    meta = {k: v for k, v in data.meta.items() if k not in drop}
    data.meta = {**meta, **meta_update}
    if num_classes is not None:
        data.num_classes = num_classes
    return data


def check_records(result, labels, logits, wnids, words):
    """per_class, confusions against the hand expectation: every image predicted as argmax(logits)."""
    c_all, pred = len(logits), int(np.argmax(logits))
    name = (lambda c: wnids[c] if c < len(wnids) else "", lambda c: words[c] if c < len(words) else "")  # wnid, words
    counts = np.bincount(labels, minlength=c_all)
    want = [{"index": c, "wnid": name[0](c), "name": name[1](c), "n": int(counts[c]),
             "top1_err": (0.0 if c == pred else 1.0) if counts[c] else None,
             "top5_err": (0.0 if c in np.argsort(-np.asarray(logits))[:5] else 1.0) if counts[c] else None}
            for c in range(c_all)]
    assert result["per_class"] == want
    pairs = sorted((-int(counts[t]), t) for t in range(c_all) if t != pred and counts[t])
    assert result["confusions"] == [
        {"label": t, "label_wnid": name[0](t), "label_name": name[1](t), "pred": pred, "pred_wnid": name[0](pred),
         "pred_name": name[1](pred), "count": -m, "share": 1.0} for m, t in pairs]


def check_csv(path, names, labels, logits, wnids, words):
    """Every CSV row from the header's meaning: top-5 by hand from softmax(logits), classes named where known."""
    p = softmax(logits)
    top = np.argsort(-p, kind="stable")[:5].tolist()
    pad = [""] * (5 - len(top))

    def named(c):
        return [wnids[c], words[c]] if c < len(wnids) else ["", ""]
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER) and len(rows) == len(names) + 1
    for row, name, label in zip(rows[1:], names, labels.tolist()):
        assert row[:9] == [name, str(label), *map(str, top), *pad, str(int(top[0] == label)), str(int(label in top))]
        np.testing.assert_allclose([float(v) for v in row[9:9 + len(top)]], p[top], rtol=1e-6)
        assert row[9 + len(top):14] == pad
        assert row[14:] == [*named(label), *(v for c in top for v in named(c)), *pad, *pad]


# -- class lists that do not cover the model's classes -------------------------------------------------


def test_records_and_csv_without_a_class_list(prep, tmp_path):
    """meta without "classes" (nor class_names): every wnid and name column is empty, nothing fails; class 3
    predicted always, so the confusions name class 0 (index 0 = len of an empty list)."""
    data = prep_split(prep, {}, drop=("classes", "class_names"))
    logits = [0.0, 1.0, 0.5, 5.0]
    out = tmp_path / "eval.csv"
    result = evaluate(Fixed(logits), data, CROP, Normalizer("image", data.mean_image()), batch_size=5,
                      csv_path=out, progress=False)
    _, labels = data.read(np.arange(len(data)))
    check_records(result, labels, logits, [], [])
    check_csv(out, names_by_hand(prep[0]), labels, logits, [], [])


def test_records_and_csv_with_fewer_wnids_than_outputs(prep, tmp_path):
    """A 5-way model on data whose meta lists 4 classes (with words): class 4, exactly one past the list,
    has an empty wnid and name; the listed classes keep theirs. Class 4 is every image's top-1."""
    wnids = list(SplitData(prep[0], "val").meta["classes"])
    words = [f"words of {w}" for w in wnids]
    data = prep_split(prep, {"class_names": words}, num_classes=5)
    logits = [0.5, 2.0, 1.0, 1.5, 6.0]
    out = tmp_path / "eval.csv"
    result = evaluate(Fixed(logits), data, CROP, Normalizer("image", data.mean_image()), batch_size=5,
                      csv_path=out, progress=False)
    _, labels = data.read(np.arange(len(data)))
    check_records(result, labels, logits, wnids, words)
    assert result["per_class"][4]["wnid"] == result["per_class"][4]["name"] == ""  # the case that matters
    check_csv(out, names_by_hand(prep[0]), labels, logits, wnids, words)


def test_class_words_defaults():
    """No class list: none; words that do not fit the list (or are no list): empty words, one a class."""
    assert class_words({}) == ([], [])
    assert class_words({"class_names": ["a"]}) == ([], [])
    assert class_words({"classes": ["n1", "n2"], "class_names": ["a"]}) == (["n1", "n2"], ["", ""])
    assert class_words({"classes": ["n1", "n2"], "class_names": "ab"}) == (["n1", "n2"], ["", ""])
    assert class_words({"classes": ["n1", "n2"], "class_names": ["a", 2]}) == (["n1", "n2"], ["a", "2"])


def test_model_with_other_outputs_is_refused_with_its_count(prep):
    data = SplitData(prep[0], "val")
    expected = f"^the model outputs 3 classes but {re.escape(str(prep[0]))} has 4$"
    with pytest.raises(ValueError, match=expected):
        evaluate(Fixed([0.0, 1.0, 2.0]), data, CROP, Normalizer("image", data.mean_image()), progress=False)


# -- read_names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "int32", "uint64", "empty"])
def test_read_names_takes_any_integer_indices(prep, kind):
    """uint64 indices (h5py hands them out) must not turn the row arithmetic into floats."""
    data = SplitData(prep[0], "val")
    names = names_by_hand(prep[0])
    idx = [len(data) - 1, 0, 9, 3, 8, 8]  # across files, out of order, one repeated
    given = {"list": idx, "int32": np.array(idx, np.int32), "uint64": np.array(idx, np.uint64),
             "empty": np.array([], np.uint64)}[kind]
    assert read_names(data, given) == ([] if kind == "empty" else [names[i] for i in idx])


# -- predict_log_probs' views ------------------------------------------------------------------------


class SpecCheck(Normalizer):
    """A Normalizer that records how many images each view it is handed describes."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lengths = []

    def __call__(self, images, spec, crop, **kw):
        self.lengths.append((len(spec.oy), len(spec.ox), len(spec.flip)))
        return super().__call__(images, spec, crop, **kw)


@pytest.mark.parametrize("n,crops", [(3, 1), (3, 10), (20, 1)])
def test_every_view_describes_each_image_of_the_batch(n, crops):
    """Fewer images (3) and more (20) than the 16 pixels a side: each view is one entry per image. (Normalizer
    reads only the first n entries, so a view of `side` entries gives the same numbers: hence the spy.)"""
    images = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8))
    normalizer = SpecCheck("image", np.zeros((16, 16, 3), np.float32))
    with torch.no_grad():
        got = predict_log_probs(Fixed([0.0, 1.0]), images, 12, normalizer, crops)
    assert normalizer.lengths == [(n, n, n)] * crops
    np.testing.assert_allclose(got.exp().numpy(), np.tile(softmax([0.0, 1.0]), (n, 1)), rtol=1e-6)


# -- evaluate's defaults and device --------------------------------------------------------------------


def test_default_batch_size_is_100():
    """150 images: batches of 100 and 50 (not 101 and 49), each image once."""
    data = MemorySplit(150, 8, 2)
    model = Fixed([0.0, 1.0])
    result = evaluate(model, data, 8, Normalizer("image", np.zeros((8, 8, 3), np.float32)), progress=False)
    assert model.sizes == [100, 50]
    assert result["n"] == 150 and result["top1_err"] == pytest.approx(0.5)


def test_explicit_cpu_wins_over_torch_default_device():
    """With torch's default device elsewhere ("meta" here, "cuda" for a user), device="cpu" keeps every
    accumulator on the CPU: a tensor made without the device would land on the default one."""
    data = MemorySplit(6, 8, 3)
    normalizer, model = Normalizer("image", np.zeros((8, 8, 3), np.float32)), Fixed([0.0, 1.0, 3.0])
    torch.set_default_device("meta")
    try:
        result = evaluate(model, data, 8, normalizer, device="cpu", progress=False)
    finally:
        torch.set_default_device(None)
    assert result["top1_err"] == pytest.approx(4 / 6)  # labels 0,1,2,0,1,2; class 2 always predicted
    assert result["loss"] == pytest.approx(-np.mean(np.log(softmax([0.0, 1.0, 3.0])[[0, 1, 2, 0, 1, 2]])))
    assert [r["n"] for r in result["per_class"]] == [2, 2, 2]
    assert [(c["label"], c["pred"], c["count"]) for c in result["confusions"]] == [(0, 2, 2), (1, 2, 2)]


# -- the progress bar --------------------------------------------------------------------------------


def test_progress_bar_counts_images(prep, capfd):
    data = SplitData(prep[0], "val")
    normalizer = Normalizer("image", data.mean_image())
    capfd.readouterr()
    evaluate(Fixed([0.0, 1.0, 2.0, 3.0]), data, CROP, normalizer, batch_size=5)
    err = capfd.readouterr().err
    # the count is of images (16), not of batches (4), and the unit says so: a rate in img/s or s/img
    assert re.search(r"evaluate: 100%.* 16/16 \[[^\]]*(\dimg/s|s/img)\]", err), err
    evaluate(Fixed([0.0, 1.0, 2.0, 3.0]), data, CROP, normalizer, batch_size=5, progress=False)
    assert capfd.readouterr().err == ""


def _set_size(fd, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))


def _drain(fd):
    """All that is waiting on a pty's master (a read may return only part of it)."""
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_progress_bar_follows_a_terminal_resize(prep, monkeypatch):
    """On a terminal (a pty here) the bar is redrawn at the width the terminal has now: it starts 60 wide
    and is resized to 100 during the run, so the final bar is 99 columns (tqdm leaves the last one)."""
    master, slave = os.openpty()
    try:
        _set_size(slave, 60)
        term = io.TextIOWrapper(io.FileIO(slave, "w", closefd=False), encoding="utf-8", write_through=True)
        monkeypatch.setattr(sys, "stderr", term)
        data = SplitData(prep[0], "val")
        model = Fixed([0.0, 1.0, 2.0, 3.0], hook=lambda: _set_size(slave, 100))
        evaluate(model, data, CROP, Normalizer("image", data.mean_image()), batch_size=5)
        monkeypatch.undo()
        term.flush()
        out = _drain(master)
    finally:
        os.close(slave)
        os.close(master)
    bars = [b for b in re.split(r"[\r\n]+", out) if b.startswith("evaluate:")]
    assert len(bars[0]) == 59 and "0/16" in bars[0], bars
    assert len(bars[-1]) == 99 and "16/16" in bars[-1], bars
