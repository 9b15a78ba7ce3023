"""scripts/figures.py: conv1's kernels, top-5 predictions and fc7 neighbours, from any weights.

Checked against what the test sets or computes itself: kernels written into a checkpoint and read back
from the PNG's pixels; evaluate.py's CSV for the same images; fc7 features computed here layer by layer
and ranked by brute force; the Theano folder's own arrays.
"""
from __future__ import annotations

import csv
import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from alexnet.checkpoint import load
from alexnet.evaluation import load_weights
from alexnet.figures.filters import MIN_WIDTH as FILTERS_MIN_WIDTH
from alexnet.figures.filters import draw_filters
from alexnet.figures.neighbours import MIN_WIDTH
from alexnet.figures.predictions import draw_predictions
from data.reader import SplitData
from tests import figure_runs
from tests.conftest import load_script


@pytest.fixture(scope="module")
def figures():
    return load_script("figures").main


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return figure_runs.named_data(tmp_path_factory)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return figure_runs.demo_run(tmp_path_factory)


@pytest.fixture(scope="module")
def columns(tmp_path_factory):
    return figure_runs.columns_run(tmp_path_factory)


def expected_colours(kernel: np.ndarray) -> np.ndarray:
    """3 x k x k -> k x k x 3 uint8, the kernel's own min at 0 and max at 255."""
    k = kernel.astype(np.float64)
    if k.max() == k.min():  # a constant kernel: mid grey
        return np.full(k.shape[1:] + (3,), 128.0)
    return np.round((k - k.min()) / (k.max() - k.min()) * 255).transpose(1, 2, 0)


def assert_even_margins(png: np.ndarray, boxes: list[dict], min_width: int, frame: int = 0) -> None:
    """White margins around the boxes (and their frames), the same on the left, the right and the bottom (the
    right one wider only where the figure was widened to `min_width` for its title): nothing cut off, nothing
    but white beyond the pictures."""
    left = min(b["left"] for b in boxes) - frame
    right = png.shape[1] - max(b["left"] + b["size"] for b in boxes) - frame
    bottom = png.shape[0] - max(b["top"] + b["size"] for b in boxes) - frame
    assert left > 0 and bottom == left and (right == left or (right > left and png.shape[1] == min_width))
    assert (png[-bottom:] == 255).all() and (png[min(b["top"] for b in boxes) - frame:, -right:] == 255).all()


def with_kernels(src, dst, seed: int) -> np.ndarray:
    """Copy checkpoint `src` to `dst` with conv1's kernels replaced by random ones; returns them."""
    state = load(src)
    w = state["model"]["features.conv1.weight"]
    kernels = torch.from_numpy(np.random.default_rng(seed).normal(size=tuple(w.shape)).astype(np.float32))
    state["model"]["features.conv1.weight"] = kernels
    torch.save(state, dst)
    return kernels.numpy()


def read_png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int64)


def assert_kernels_drawn(out, kernels: np.ndarray, groups: int) -> None:
    """filters.png shows kernel i in box i (filters.json's boxes), `groups` groups."""
    record = json.loads((out / "filters.json").read_text())
    assert record["groups"] == groups
    assert_boxes_show(out / "filters.png", record["boxes"], kernels, groups)


def assert_boxes_show(png_path, boxes: list[dict], kernels: np.ndarray, groups: int) -> None:
    """Kernel i's colours in box i; boxes row by row within a group, groups one above the other."""
    png = read_png(png_path)
    assert len(boxes) == len(kernels)
    per_group, k = len(kernels) // groups, kernels.shape[-1]
    for g in range(groups):
        mine = boxes[g * per_group:(g + 1) * per_group]
        if g:
            assert min(b["top"] for b in mine) > max(b["top"] + b["size"] for b in boxes[:g * per_group])
        for a, b in zip(mine, mine[1:]):  # reading order: right on the same row, or down to a new row
            assert (b["top"] == a["top"] and b["left"] > a["left"] + a["size"]) or (
                b["top"] > a["top"] + a["size"] and b["left"] <= mine[0]["left"]), (a, b)
    assert_even_margins(png, boxes, FILTERS_MIN_WIDTH)
    for i, (box, kernel) in enumerate(zip(boxes, kernels)):
        scale = box["size"] // k
        centres = box["top"] + scale // 2 + scale * np.arange(k), box["left"] + scale // 2 + scale * np.arange(k)
        drawn = png[np.ix_(centres[0], centres[1])]
        assert np.abs(drawn - expected_colours(kernel)).max() <= 1, f"kernel {i}"


@pytest.mark.parametrize("n, groups", [(96, 2), (64, 1), (20, 2)])
def test_kernels_fill_rows_in_reading_order(tmp_path, n, groups):
    """The paper's 2 x 48 (3 rows of 16 each), owt's 64, and a group shorter than a row."""
    kernels = np.random.default_rng(n).normal(size=(n, 3, 11, 11))
    kernels[1] = 0.7  # a constant kernel
    boxes = draw_filters(kernels, groups, "title", tmp_path / "f.png")
    rows = {b.top for b in boxes}
    assert len(rows) == groups * -(-n // groups // 16)
    assert_boxes_show(tmp_path / "f.png", [b._asdict() for b in boxes], kernels, groups)


def test_filters_show_the_kernels_set_in_a_single_device_checkpoint(demo, data, figures, tmp_path, capsys):
    weights = tmp_path / "set.pt"
    kernels = with_kernels(demo / "checkpoints" / "best.pt", weights, seed=1)
    assert figures(["--weights", str(weights), "--data", str(data), "--out", str(tmp_path / "fig"), "--only",
                    "filters"]) == 0
    assert_kernels_drawn(tmp_path / "fig", kernels, groups=1)
    title = json.loads((tmp_path / "fig" / "filters.json").read_text())["title"]
    assert "12 kernels of a single-device alexnet" in title


@pytest.mark.processes  # its fixture trains two processes (figure_runs.columns_run)
def test_filters_show_two_columns_for_a_columns_checkpoint(columns, data, figures, tmp_path):
    weights = tmp_path / "set.pt"
    assert load(columns / "checkpoints" / "best.pt")["config"]["parallel"]["model"] == "columns"
    kernels = with_kernels(columns / "checkpoints" / "best.pt", weights, seed=2)
    assert figures(["--weights", str(weights), "--data", str(data), "--out", str(tmp_path / "fig")]) == 0
    assert_kernels_drawn(tmp_path / "fig", kernels, groups=2)
    record = json.loads((tmp_path / "fig" / "filters.json").read_text())
    assert "2 columns x 6 kernels (parallel.model=columns)" in record["title"]
    for name in ("predictions", "neighbours"):  # the other two figures from the same checkpoint
        assert Image.open(tmp_path / "fig" / f"{name}.png").size[0] > 100


def read_csv(path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def test_predictions_equal_evaluate_top5(demo, data, figures, tmp_path):
    weights, out = demo / "checkpoints" / "best.pt", tmp_path / "fig"
    evaluate = load_script("evaluate").main
    for crops in ("1", "10"):
        assert evaluate(["--data", str(data), "--weights", str(weights), "--crops", crops, "--csv",
                         str(tmp_path / f"eval{crops}.csv"), "--no-progress"]) == 0
        assert figures(["--weights", str(weights), "--data", str(data), "--out", str(out), "--only", "predictions",
                        "--n-images", "6", "--crops", crops]) == 0
        rows = read_csv(tmp_path / f"eval{crops}.csv")
        records = json.loads((out / "predictions.json").read_text())["images"]
        assert len(records) == 6 and len({r["name"] for r in records}) == 6
        for rec in records:
            row = rows[rec["name"]]
            assert [t["class"] for t in rec["top"]] == [int(row[f"pred{k}"]) for k in range(1, 5)]
            assert [t["name"] for t in rec["top"]] == [figure_runs.WORDS[row[f"pred{k}_wnid"]].split(",")[0]
                                                       for k in range(1, 5)]
            assert rec["label"] == int(row["label"]) and rec["label_name"] == figure_runs.WORDS[
                row["label_wnid"]].split(",")[0]
            np.testing.assert_allclose([t["prob"] for t in rec["top"]], [float(row[f"prob{k}"]) for k in range(1, 5)],
                                       rtol=1e-5)


def test_chosen_images_and_the_drawn_labels(demo, data, figures, tmp_path):
    names = list(read_csv_names(demo, data, tmp_path))
    out = tmp_path / "fig"
    assert figures(["--weights", str(demo / "checkpoints" / "best.pt"), "--data", str(data), "--out", str(out),
                    "--only", "predictions", "--images", names[5], "2"]) == 0
    records = json.loads((out / "predictions.json").read_text())["images"]
    assert [r["name"] for r in records] == [names[5], names[2]]
    images = np.zeros((2, 8, 8, 3), np.uint8)
    drawn = draw_predictions(records, images, "t", tmp_path / "p.png")
    assert drawn == [[t["name"] for t in r["top"]] for r in records]  # the bars' labels, most probable on top
    assert figures(["--weights", str(demo / "checkpoints" / "best.pt"), "--data", str(data), "--out", str(out),
                    "--only", "predictions", "--images", "no_such.JPEG"]) == 2


def read_csv_names(demo, data, tmp_path) -> list[str]:
    """The validation images' names in file order (evaluate.py's CSV rows)."""
    path = tmp_path / "names.csv"
    assert load_script("evaluate").main(["--data", str(data), "--weights", str(demo / "checkpoints" / "best.pt"),
                                         "--csv", str(path), "--no-progress"]) == 0
    with open(path, newline="") as f:
        return [row["name"] for row in csv.DictReader(f)]


def fc7_by_hand(model, data: SplitData, indices, crop: int) -> np.ndarray:
    """fc7 after its ReLU, layer by layer from the state dict: center crop minus the mean image."""
    images, _ = data.read(np.asarray(indices))
    o = (data.image_size - crop) // 2
    mean = np.load(data.root / "mean.npy")[o:o + crop, o:o + crop]
    x = torch.from_numpy(images[:, o:o + crop, o:o + crop].astype(np.float32) - mean).permute(0, 3, 1, 2)
    with torch.no_grad():
        h = model.features(x).flatten(1)
        h = torch.relu(model.classifier.fc6(h))
        return torch.relu(model.classifier.fc7(h)).numpy().astype(np.float64)


def center_crops_by_hand(data: SplitData, indices, crop: int) -> np.ndarray:
    images, _ = data.read(np.asarray(indices))
    o = (data.image_size - crop) // 2
    return images[:, o:o + crop, o:o + crop].astype(np.int64)


FRAME_RGB = {"query": (214, 39, 40), "same": (44, 160, 44), "other": (128, 128, 128)}  # tab:red, tab:green, 0.5


def assert_neighbours_drawn(png_path, record: dict, train: SplitData, val: SplitData, crop: int) -> None:
    """Each query's row: the query's center crop in its box (neighbours.json's), then each neighbour's, pixel
    for pixel, left to right; each box framed red (the query), green (the query's class) or grey."""
    png = read_png(png_path)
    tops = []
    for q, shown in zip(record["queries"], center_crops_by_hand(val, [q["index"] for q in record["queries"]], crop)):
        near = q["neighbours"]
        cells = [(q["box"], shown, "query")] + [
            (n["box"], image, "same" if n["label"] == q["label"] else "other")
            for n, image in zip(near, center_crops_by_hand(train, [n["index"] for n in near], crop))]
        lefts = [box["left"] for box, _, _ in cells]
        assert lefts == sorted(lefts) and len({box["top"] for box, _, _ in cells}) == 1
        tops.append(q["box"]["top"])
        for box, image, kind in cells:
            t, left, size = box["top"], box["left"], box["size"]
            assert size == crop
            np.testing.assert_array_equal(png[t:t + size, left:left + size], image, err_msg=str(box))
            ring = np.ones((size + 6, size + 6), bool)  # the 3-pixel frame around the image
            ring[3:-3, 3:-3] = False
            assert (png[t - 3:t + size + 3, left - 3:left + size + 3][ring] == FRAME_RGB[kind]).all(), (box, kind)
            assert (png[t - 4, left - 4:left + size + 4] == 255).all()  # the background beyond it: white
    assert all(b - a > crop for a, b in zip(tops, tops[1:]))  # a row per query, top to bottom
    boxes = [q["box"] for q in record["queries"]] + [n["box"] for q in record["queries"] for n in q["neighbours"]]
    assert_even_margins(png, boxes, MIN_WIDTH, frame=3)


def test_neighbours_equal_a_brute_force_ranking_and_are_cached(demo, data, figures, tmp_path, capsys):
    weights, out = demo / "checkpoints" / "best.pt", tmp_path / "fig"
    args = ["--weights", str(weights), "--data", str(data), "--out", str(out), "--only", "neighbours",
            "--queries", "3", "--neighbours", "5", "--train-images", "1000"]
    assert figures(args) == 0
    record = json.loads((out / "neighbours.json").read_text())
    model, info = load_weights(weights)
    train, val = SplitData(data, "train"), SplitData(data, "val")
    assert record["train_images"] == len(train) and not record["features_cached"]
    feats = fc7_by_hand(model, train, np.arange(len(train)), info["crop"])
    queries = [q["index"] for q in record["queries"]]
    assert len(set(queries)) == 3
    for q, qf in zip(record["queries"], fc7_by_hand(model, val, queries, info["crop"])):
        dist = np.sqrt(((feats - qf) ** 2).sum(axis=1))
        order = np.argsort(dist, kind="stable")[:5]
        assert [n["index"] for n in q["neighbours"]] == order.tolist()
        np.testing.assert_allclose([n["distance"] for n in q["neighbours"]], dist[order], rtol=1e-4)
        assert [n["label"] for n in q["neighbours"]] == train.read(order)[1].tolist()
    assert_neighbours_drawn(out / "neighbours.png", record, train, val, info["crop"])
    assert {n["label"] == q["label"] for q in record["queries"] for n in q["neighbours"]} == {True, False}

    capsys.readouterr()
    assert figures(args) == 0  # the same inputs: the cached features
    assert "from the cache" in capsys.readouterr().out
    assert json.loads((out / "neighbours.json").read_text())["queries"] == record["queries"]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # "another" weights file
    try:
        assert figures(args) == 0
        assert "from the cache" not in capsys.readouterr().out
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # another mean image (--mean) gives other features: never those cached for the data's mean
    np.save(tmp_path / "zero.npy", np.zeros((data_size(data), data_size(data), 3), np.float32))
    assert figures([*args, "--mean", str(tmp_path / "zero.npy")]) == 0
    assert "from the cache" not in capsys.readouterr().out
    zero = json.loads((out / "neighbours.json").read_text())["queries"]
    assert [n["distance"] for n in zero[0]["neighbours"]] != [n["distance"] for n in record["queries"][0]["neighbours"]]


def data_size(data) -> int:
    return json.loads((data / "meta.json").read_text())["image_size"]


def test_a_training_subset_is_seeded(demo, data, figures, tmp_path):
    common = ["--weights", str(demo / "checkpoints" / "best.pt"), "--data", str(data), "--only", "neighbours",
              "--train-images", "15", "--queries", "2", "--neighbours", "15", "--no-progress"]
    found = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        assert figures([*common, "--out", str(tmp_path / name), "--seed", str(seed)]) == 0
        record = json.loads((tmp_path / name / "neighbours.json").read_text())
        assert record["train_images"] == 15 and record["seed"] == seed and record["layer"] == "fc7"
        found.append({n["index"] for q in record["queries"] for n in q["neighbours"]})
    assert len(found[0]) == 15 and found[0] == found[1] and found[0] != found[2]
    # 16 images a row: wider than the title needs, so every margin is the same
    crop = load_weights(demo / "checkpoints" / "best.pt")[1]["crop"]
    assert (1 + 15) * crop > MIN_WIDTH
    assert_neighbours_drawn(tmp_path / "c" / "neighbours.png", record, SplitData(data, "train"), SplitData(data, "val"),
                            crop)


@pytest.mark.processes
def test_figures_from_a_theano_folder(tmp_path_factory, figures, tmp_path, capsys):
    folder, data, _, arrays = figure_runs.theano(tmp_path_factory)
    out = tmp_path / "fig"
    assert figures(["--weights", str(folder), "--data", str(data), "--out", str(out), "--train-images", "20"]) == 0
    assert "was trained with its run's own mean image" in capsys.readouterr().err
    # cudnn's true convolution: the torch kernel is Theano's (in, rows, cols, out) array flipped
    kernels = arrays["W_0"][:, ::-1, ::-1, :].transpose(3, 0, 1, 2)
    assert_kernels_drawn(out, kernels, groups=1)
    assert "12 kernels of a single-device caffenet" in json.loads((out / "filters.json").read_text())["title"]
    assert len(json.loads((out / "predictions.json").read_text())["images"]) == 8


@pytest.mark.processes
def test_bad_input_exits_2_naming_the_file(tmp_path_factory, data, demo, figures, tmp_path, capsys):
    folder = figure_runs.theano(tmp_path_factory)[0]
    assert figures(["--weights", str(folder), "--data", str(data), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"{folder}: the model has 6 classes but {data / 'val'} has 4" in err
    missing = tmp_path / "none.pt"
    with pytest.raises(SystemExit) as e:  # refused by the parser: argparse's one line
        figures(["--weights", str(missing), "--data", str(data), "--out", str(tmp_path / "b")])
    assert e.value.code == 2 and f"argument --weights: {missing} does not exist" in capsys.readouterr().err
    no_train = tmp_path / "val_only"
    shutil.copytree(data, no_train)
    meta = json.loads((no_train / "meta.json").read_text())
    del meta["splits"]["train"]
    (no_train / "meta.json").write_text(json.dumps(meta))
    assert figures(["--weights", str(demo / "checkpoints" / "best.pt"), "--data", str(no_train), "--out",
                    str(tmp_path / "c"), "--only", "neighbours"]) == 2
    assert "has no 'train' split" in capsys.readouterr().err


# -- the curves and the bars, by hand --------------------------------------------------------------


def _captured(monkeypatch, module) -> list:
    """The figures `module` saves, kept open for their axes instead of written."""
    figs = []
    monkeypatch.setattr(module, "save_png", lambda fig, out, **kw: figs.append(fig))
    return figs


def test_curves_place_records_at_their_fraction_of_an_epoch_and_pick_the_time_unit(monkeypatch, tmp_path):
    """6 steps an epoch, a record at steps 4 and 6 of each: global steps 4, 6, 10, 12 lie at epochs 2/3, 1,
    1 + 2/3, 2. A run of 100 s is drawn in seconds (< 2 minutes), of 150 s in minutes, of 2 h in hours."""
    from alexnet.figures import curves
    train = [{"split": "train", "epoch": e, "iter": i, "loss": 1.0, "lr": 0.01, "img_per_s": 5.0, "time": t}
             for e, i, t in ((1, 4, 10.0), (1, 6, 20.0), (2, 10, 60.0), (2, 12, 70.0))]
    np.testing.assert_allclose(curves.fractional_epochs(train), [2 / 3, 1, 1 + 2 / 3, 2])
    # continued from another run's checkpoint (converted weights): the epochs before have no record
    assert curves.fractional_epochs(train[2:]) == pytest.approx([1 + 2 / 3, 2])
    later = [{**r, "epoch": r["epoch"] + 3, "iter": r["iter"] + 18} for r in train]  # from epoch 3 on
    assert curves.fractional_epochs(later) == pytest.approx([3 + 2 / 3, 4, 4 + 2 / 3, 5])
    for longest, unit in ((100.0, "seconds"), (119.0, "seconds"), (150.0, "minutes"), (7199.0, "minutes"),
                          (7200.0, "hours")):
        assert curves.time_unit([{"time": longest}]) == ({"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}[unit],
                                                          unit)
    figs = _captured(monkeypatch, curves)
    val = [{"split": "val", "epoch": e, "iter": i, "loss": 2.0, "top1_err": 0.5, "top5_err": 0.2, "time": t}
           for e, i, t in ((1, 6, 30.0), (2, 12, 150.0))]
    curves.draw_curves(train + val, "t", tmp_path / "c.png")
    loss, by_epoch, by_time, lr = figs[0].axes
    np.testing.assert_allclose(loss.lines[0].get_xdata(), [2 / 3, 1, 1 + 2 / 3, 2])
    np.testing.assert_allclose(loss.lines[1].get_xdata(), [1, 2])
    np.testing.assert_allclose(by_time.lines[0].get_xdata(), [0.5, 2.5])  # minutes
    assert by_time.get_xlabel() == "wall-clock time (minutes)"
    np.testing.assert_allclose(lr.lines[0].get_xdata(), [2 / 3, 1, 1 + 2 / 3, 2])


def test_the_true_class_bar_is_red_and_only_it(monkeypatch, tmp_path):
    from matplotlib.colors import to_rgba

    from alexnet.figures import predictions
    figs = _captured(monkeypatch, predictions)
    top = [{"class": c, "name": f"c{c}", "prob": p} for c, p in ((0, 0.5), (2, 0.3), (1, 0.2))]
    records = [{"label": 2, "label_name": "two", "top": top}, {"label": 3, "label_name": "three", "top": top}]
    predictions.draw_predictions(records, np.zeros((2, 8, 8, 3), np.uint8), "t", tmp_path / "p.png")
    bars = [ax for ax in figs[0].axes if ax.patches]
    red, blue = to_rgba(predictions.TRUE_COLOUR), to_rgba(predictions.OTHER_COLOUR)
    assert [[p.get_facecolor() for p in ax.patches] for ax in bars] == [[blue, red, blue], [blue, blue, blue]]
    assert [[p.get_width() for p in ax.patches] for ax in bars] == [[0.5, 0.3, 0.2]] * 2


def test_a_figure_write_removes_what_a_killed_writer_left(tmp_path):
    """report.py killed by SIGKILL while it wrote a figure left figures/.filters.<pid>.tmp.png behind for good;
    the next figure written there removes a dead writer's temporary (a live writer's stays)."""
    import matplotlib.pyplot as plt

    from alexnet.figures.common import save_png
    folder = tmp_path / "figures"
    folder.mkdir()
    dead, live = folder / ".filters.999999999.tmp.png", folder / f".curve.{os.getpid()}.tmp.png"
    dead.write_bytes(b"half a png")
    live.write_bytes(b"being written")
    save_png(plt.figure(), folder / "filters.png")
    assert (folder / "filters.png").is_file() and not dead.exists() and live.exists()


def test_class_labels_are_unique_where_first_words_repeat():
    """ImageNet has two classes whose first word is "crane" (the bird n02012849, the machine n03126707): a
    figure tells them apart by their wnids; a unique first word stays alone; no words: the wnid."""
    from alexnet.figures.common import class_labels
    meta = {"classes": ["n02012849", "n03126707", "n01440764", "n09999999"],
            "class_names": ["crane", "crane", "tench, Tinca tinca", ""]}
    assert class_labels(meta, 4) == ["crane (n02012849)", "crane (n03126707)", "tench", "n09999999"]
    assert class_labels({"classes": []}, 2) == ["class 0", "class 1"]
