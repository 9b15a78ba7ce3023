"""scripts/predict.py (top classes of any JPEG/PNG, named) and the class names in evaluate.py's CSV and JSON;
expectations computed by hand (numpy crops and normalisation, the model called directly)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from alexnet.models import build_model
from data.classnames import read_synset_mapping
from data.decode import load_image
from data.distributions import write_synset_mapping
from data.preprocess import Options, preprocess
from data.synthetic import synthetic_tree
from tests.conftest import run_script

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

TV_MEAN, TV_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _probs(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """Softmax of the model on float64 N x H x W x 3 inputs, in float64."""
    with torch.no_grad():
        logits = model(torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float32))).double()
    return torch.softmax(logits, 1).numpy()


@pytest.fixture(scope="module")
def named_data(synth, tmp_path_factory) -> Path:
    """The synthetic tree at 72x72 (caffenet's crop 67 fits) with class names from a mapping file."""
    root, _ = synth
    tmp = tmp_path_factory.mktemp("named")
    names = write_synset_mapping(synthetic_tree(root).words, tmp / "LOC_synset_mapping.txt")
    preprocess(root / "train", tmp / "data", root / "val", root / "val.txt", Options(size=72, per_file=16),
               workers=2, quiet=True, class_names=names)
    return tmp / "data"


def test_predict_torchvision_weights_names_and_probabilities(synth, tmp_path):
    root, manifest = synth
    images = [str(root / "train" / manifest["classes"][c] / f"{manifest['classes'][c]}_{i:05d}.JPEG")
              for c, i in ((0, 1), (2, 3))]
    model = build_model("owt", num_classes=7, width=0.125, crop=224, init="torch").eval()
    torch.save(model.state_dict(), tmp_path / "tv.pt")
    wnids = [f"n0{k}000000" for k in (5, 2, 6, 0, 4, 1, 3)]  # listed unsorted: the model's order is sorted
    mapping = tmp_path / "map.txt"
    mapping.write_text("".join(f"{w} words of {w}, {k}\n" for k, w in enumerate(wnids)))
    r = run_script("scripts/predict.py", str(tmp_path / "tv.pt"), *images, "--class-names", str(mapping),
                   "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    # no --data: decoded as torchvision decodes (Resize(256) + CenterCrop(224), tests/test_geometry.py)
    x = np.stack([load_image(p, 256, "torchvision")[16:240, 16:240] for p in images]) / 255.0
    expected = _probs(model, (x - TV_MEAN) / TV_STD)
    words, order = read_synset_mapping(mapping), sorted(wnids)
    records = json.loads((tmp_path / "p.json").read_text())
    for rec, p in zip(records, expected):
        top = np.argsort(-p)[:5]
        assert [t["index"] for t in rec["top"]] == top.tolist()
        np.testing.assert_allclose([t["prob"] for t in rec["top"]], p[top], rtol=1e-4)
        assert [t["wnid"] for t in rec["top"]] == [order[c] for c in top]
        block = r.stdout.split(rec["image"] + "\n")[1].splitlines()[:5]
        for line, c in zip(block, top):
            assert f"{100 * p[c]:.2f} %" in line and f"{order[c]} {words[order[c]]}" in line


def test_predict_mean_image_weights_with_data(named_data, synth, tmp_path):
    root, manifest = synth
    image = str(root / "val" / "ILSVRC2012_val_00000002.JPEG")
    model = build_model("caffenet", num_classes=4, width=0.125, crop=67, init="torch").eval()
    torch.save(model.state_dict(), tmp_path / "c.pt")
    base = ["scripts/predict.py", str(tmp_path / "c.pt"), image, "--arch", "caffenet"]
    r = run_script(*base)
    assert r.returncode == 2 and "--data" in r.stderr  # its mean image is needed
    r = run_script(*base, "--data", str(named_data), "--json", str(tmp_path / "p.json"), "--top", "3")
    assert r.returncode == 0, r.stderr
    mean = np.load(named_data / "mean.npy").astype(np.float64)
    x = (load_image(image, 72, "short").astype(np.float64) - mean)[2:69, 2:69]
    p = _probs(model, x[None])[0]
    top = np.argsort(-p)[:3]
    rec = json.loads((tmp_path / "p.json").read_text())[0]
    meta = json.loads((named_data / "meta.json").read_text())
    assert [t["index"] for t in rec["top"]] == top.tolist()
    np.testing.assert_allclose([t["prob"] for t in rec["top"]], p[top], rtol=1e-4)
    assert [t["name"] for t in rec["top"]] == [meta["class_names"][c] for c in top]
    bad = tmp_path / "broken.JPEG"
    bad.write_bytes(b"\xff\xd8 not really")
    r = run_script(*base, str(bad), "--data", str(named_data))
    assert r.returncode == 2 and str(bad) in r.stderr


def test_evaluate_outputs_name_true_and_predicted_classes(named_data, tmp_path):
    model = build_model("caffenet", num_classes=4, width=0.125, crop=67, init="torch").eval()
    torch.save(model.state_dict(), tmp_path / "c.pt")
    r = run_script("scripts/evaluate.py", "--data", str(named_data), "--weights", str(tmp_path / "c.pt"), "--arch",
                   "caffenet", "--csv", str(tmp_path / "e.csv"), "--json", str(tmp_path / "e.json"), "--device",
                   "cpu", "--no-progress")
    assert r.returncode == 0, r.stderr
    meta = json.loads((named_data / "meta.json").read_text())
    wnids, names = meta["classes"], meta["class_names"]
    with open(tmp_path / "e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        label = int(row["label"])
        assert (row["label_wnid"], row["label_name"]) == (wnids[label], names[label])
        for k in range(1, 5):  # 4 classes: pred5 is empty
            c = int(row[f"pred{k}"])
            assert (row[f"pred{k}_wnid"], row[f"pred{k}_name"]) == (wnids[c], names[c])
        assert row["pred5_wnid"] == row["pred5_name"] == ""
    record = json.loads((tmp_path / "e.json").read_text())
    assert [c["wnid"] for c in record["per_class"]] == wnids and [c["name"] for c in record["per_class"]] == names
    for c, entry in enumerate(record["per_class"]):
        mine = [row for row in rows if int(row["label"]) == c]
        assert entry["n"] == len(mine)
        assert entry["top1_err"] == pytest.approx(np.mean([row["correct1"] == "0" for row in mine]))
        assert entry["top5_err"] == pytest.approx(np.mean([row["correct5"] == "0" for row in mine]))


@pytest.mark.parametrize("kind, expected", [("torchvision", ("torchvision", 256)), ("state_dict", ("short", 256))])
def test_without_data_images_are_decoded_as_the_weights_expect(synth, tmp_path, kind, expected):
    # torchvision weights were measured on torchvision's geometry (pretrained/README.md); a plain state
    # dict of ours states none, so the default (shorter side, central square) applies.
    from tests.conftest import load_script
    root, manifest = synth
    image = str(root / "train" / manifest["classes"][0] / f"{manifest['classes'][0]}_00001.JPEG")
    arch = "owt" if kind == "torchvision" else "caffenet"
    model = build_model(arch, num_classes=4, width=0.125, crop=224 if arch == "owt" else 227, init="torch")
    torch.save(model.state_dict(), tmp_path / "w.pt")
    script, seen = load_script("predict"), []
    real = script._decode
    script._decode = lambda path, size, resize: seen.append((resize, size)) or real(path, size, resize)
    extra = [] if kind == "torchvision" else ["--arch", "caffenet", "--mean", str(tmp_path / "m.npy")]
    if kind != "torchvision":
        np.save(tmp_path / "m.npy", np.zeros((256, 256, 3), np.float32))
    assert script.main([str(tmp_path / "w.pt"), image, *extra]) == 0
    assert seen == [expected]


def test_predict_decodes_as_the_data_was_made_and_averages_ten_crops(synth, tmp_path):
    """--data made with --resize warp: images are warped as its batch files were (not the default shorter
    side); --crops 10: the mean of the softmaxes of the 4 corners and the center, plain and mirrored, by hand."""
    from tests.conftest import load_script
    root, manifest = synth
    preprocess(root / "train", tmp_path / "warp", opts=Options(size=72, per_file=64, resize="warp"), workers=1,
               quiet=True)
    image = str(root / "train" / manifest["classes"][1] / f"{manifest['classes'][1]}_00004.JPEG")
    assert not np.array_equal(load_image(image, 72, "warp"), load_image(image, 72, "short"))
    model = build_model("caffenet", num_classes=4, width=0.125, crop=67, init="torch").eval()
    torch.save(model.state_dict(), tmp_path / "c.pt")
    args = [str(tmp_path / "c.pt"), image, "--arch", "caffenet", "--data", str(tmp_path / "warp"), "--crops", "10",
            "--json", str(tmp_path / "p.json")]
    assert load_script("predict").main(args) == 0
    x = load_image(image, 72, "warp").astype(np.float64) - np.load(tmp_path / "warp" / "mean.npy")
    views = [x[oy:oy + 67, ox:ox + 67] for oy, ox in ((0, 0), (0, 5), (5, 0), (5, 5), (2, 2))]
    views += [v[:, ::-1] for v in views]
    p = _probs(model, np.stack(views)).mean(axis=0)
    top = np.argsort(-p)[:4]
    rec = json.loads((tmp_path / "p.json").read_text())[0]
    assert [t["index"] for t in rec["top"]] == top.tolist()
    np.testing.assert_allclose([t["prob"] for t in rec["top"]], p[top], rtol=1e-4)


@pytest.mark.parametrize("size", ["0", "-3"])
def test_a_size_that_is_no_size_is_refused_in_one_line(tmp_path, capsys, size):
    """--size 0 printed a top-5 and exited 0."""
    from tests.conftest import load_script
    image = tmp_path / "x.png"
    image.write_bytes(b"")
    (tmp_path / "w.pt").write_bytes(b"")  # inputs that exist: the refusal is --size's
    with pytest.raises(SystemExit) as e:
        load_script("predict").main([str(tmp_path / "w.pt"), str(image), "--size", size])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--size" in err and ">= 1" in err, err
