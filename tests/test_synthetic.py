"""Tests of data/synthetic.py: layout, label files, quirks, determinism, CLI and learnability."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from data.synthetic import HUES, SHAPES, class_style, generate, main, render, wnid
from tests import children

REPO = Path(__file__).resolve().parent.parent
K, TRAIN, VAL = 10, 30, 10


@pytest.fixture(autouse=True)
def _strict_pil(monkeypatch: pytest.MonkeyPatch) -> None:
    # another test module may relax this globally; truncated files must raise here
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("syn") / "tree"
    return root, generate(root, K, TRAIN, VAL, seed=0)


def _decodes(path: Path) -> bool:
    try:
        with Image.open(path) as im:
            im.convert("RGB")
        return True
    except Exception:
        return False


def _digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _val_labels(root: Path) -> dict[str, int]:
    return {name: int(label) for name, label in (line.split() for line in (root / "val.txt").read_text().splitlines())}


def test_wnids_sorted_and_styles_distinct() -> None:
    ids = [wnid(c) for c in range(1000)]
    assert all(re.fullmatch(r"n\d{8}", w) for w in ids)
    assert ids == sorted(ids) and len(set(ids)) == 1000
    n_combo = len(SHAPES) * len(HUES)
    assert n_combo >= 40
    assert len({class_style(c)[:2] for c in range(n_combo)}) == n_combo
    assert len({class_style(c) for c in range(3 * n_combo)}) == 3 * n_combo


@pytest.mark.parametrize("c, textured", [(0, False), (3, False), (48, True), (99, True)])
def test_render_object_and_texture(c: int, textured: bool) -> None:
    img, mask = render(c, np.random.default_rng([0, c]), 96, 320)
    inside = np.asarray(mask) > 0
    assert 0.05 < inside.mean() < 0.6 and img.size == mask.size
    value = np.asarray(img.convert("HSV"))[..., 2][inside].astype(float)
    dark = float((value < 0.7 * value.max()).mean())  # the second, darker shade of stripes/checks
    assert 0.2 < dark < 0.8 if textured else dark < 0.02


def test_layout_and_names(tree: tuple[Path, dict]) -> None:
    root, m = tree
    assert m == json.loads((root / "manifest.json").read_text())
    assert m["classes"] == [wnid(c) for c in range(K)] and m["num_classes"] == K
    assert (m["train_dir"], m["val_dir"], m["val_layout"], m["version"], m["seed"]) == ("train", "val", "flat", 1, 0)
    assert sorted(p.name for p in (root / "train").iterdir() if p.is_dir()) == m["classes"]
    for w in m["classes"]:
        jpegs = sorted(p.name for p in (root / "train" / w).glob("*.JPEG"))
        assert len(jpegs) >= TRAIN
        assert all(re.fullmatch(rf"{w}_\d{{5}}\.JPEG", n) for n in jpegs)
    val = sorted(p.name for p in (root / "val").iterdir())
    assert val == [f"ILSVRC2012_val_{k:08d}.JPEG" for k in range(1, K * VAL + 2)]  # + the truncated extra


def test_label_files_agree(tree: tuple[Path, dict]) -> None:
    root, m = tree
    assert m["label_files"] == {"kaggle": "LOC_val_solution.csv", "caffe": "val.txt"}
    lines = (root / "LOC_val_solution.csv").read_text().splitlines()
    assert lines[0] == "ImageId,PredictionString"
    rows = [line.split(",") for line in lines[1:]]
    ids = [r[0] for r in rows]
    assert ids != sorted(ids)  # shuffled like the real file
    caffe_lines = (root / "val.txt").read_text().splitlines()
    assert caffe_lines == sorted(caffe_lines)
    caffe = _val_labels(root)
    files = {p.name for p in (root / "val").iterdir()}
    assert set(caffe) == files and {i + ".JPEG" for i in ids} == files and len(ids) == len(files)
    labels = [caffe[f"ILSVRC2012_val_{k:08d}.JPEG"] for k in range(1, 21)]
    assert len(set(labels)) > 3  # interleaved, not grouped by class
    for image_id, pred in rows:
        w, *box = pred.split()
        assert m["classes"].index(w) == caffe[image_id + ".JPEG"]
        x0, y0, x1, y1 = map(int, box)
        path = root / "val" / f"{image_id}.JPEG"
        if _decodes(path):
            width, height = Image.open(path).size
            assert 0 <= x0 < x1 < width and 0 <= y0 < y1 < height
            assert 0.33 * min(width, height) <= max(x1 - x0, y1 - y0) + 1 <= 0.76 * min(width, height)


def test_boxes_enclose_the_object(tree: tuple[Path, dict]) -> None:
    root, _ = tree
    for row in (root / "LOC_val_solution.csv").read_text().splitlines()[1:30]:
        image_id, pred = row.split(",")
        path = root / "val" / f"{image_id}.JPEG"
        if not _decodes(path):
            continue
        hsv = np.asarray(Image.open(path).convert("RGB").convert("HSV")).astype(int)
        vivid = (hsv[..., 1] > 150) & (hsv[..., 2] > 150)
        if not vivid.any():  # the grayscale quirk
            continue
        x0, y0, x1, y1 = map(int, pred.split()[1:])
        inside = np.zeros_like(vivid)
        inside[max(y0 - 2, 0):y1 + 3, max(x0 - 2, 0):x1 + 3] = True
        assert vivid[~inside].mean() < 0.01 and vivid[inside].mean() > 0.2


def test_quirks_are_what_they_claim(tree: tuple[Path, dict]) -> None:
    root, m = tree
    q = m["quirks"]
    train_kinds = {e["kind"] for e in q if e["split"] == "train"}
    assert train_kinds == {"cmyk", "grayscale", "png_as_jpeg", "rgba_png", "palette", "truncated", "empty",
                           "garbage", "stray"}
    assert sorted((e["kind"], e["expect"]) for e in q if e["split"] == "val") == [("grayscale", "convert"),
                                                                                ("truncated", "skip")]
    assert len({e["path"].split("/")[0] for e in q if e["split"] == "train" and e["kind"] != "stray"}) >= 5
    want = {"cmyk": ("JPEG", "CMYK"), "grayscale": ("JPEG", "L"), "png_as_jpeg": ("PNG", "RGB"),
            "rgba_png": ("PNG", "RGBA"), "palette": (None, "P")}
    for e in q:
        path = root / e["split"] / e["path"]
        assert path.is_file()
        assert e["expect"] == {"stray": "ignore", "truncated": "skip", "empty": "skip",
                               "garbage": "skip"}.get(e["kind"], "convert")
        if e["expect"] == "convert":
            assert path.suffix == ".JPEG"
            with Image.open(path) as im:
                fmt, mode = want[e["kind"]]
                assert im.mode == mode and (fmt is None or im.format == fmt)
                assert im.convert("RGB").size == im.size
        elif e["expect"] == "skip":
            assert path.suffix == ".JPEG" and not _decodes(path)
            assert (path.stat().st_size == 0) == (e["kind"] == "empty")
        else:
            assert path.suffix == ".txt" and path.read_text().strip()
    assert any(e["path"] == "README.txt" for e in q)
    # convertible quirks hide among the regular names (no gap in numbering)
    for e in q:
        if e["split"] == "train" and e["expect"] == "convert":
            assert int(Path(e["path"]).stem.split("_")[1]) < TRAIN


def test_counts_match_decodable_images(tree: tuple[Path, dict]) -> None:
    root, m = tree
    assert m["counts"] == {"train": K * TRAIN, "val": K * VAL}
    train = [p for p in (root / "train").rglob("*") if p.is_file()]
    assert sum(map(_decodes, train)) == m["counts"]["train"]
    assert sum(map(_decodes, (root / "val").iterdir())) == m["counts"]["val"]
    listed = {(e["split"], e["path"]) for e in m["quirks"]}
    assert len(listed) == len(m["quirks"])
    for p in train:  # every file that is not a plain RGB JPEG is declared
        with open(p, "rb") as f:
            plain = f.read(3) == b"\xff\xd8\xff" and _decodes(p) and Image.open(p).mode == "RGB"
        assert plain or ("train", p.relative_to(root / "train").as_posix()) in listed


def test_sizes_vary_within_bounds(tree: tuple[Path, dict], tmp_path: Path) -> None:
    root, m = tree
    sizes = [Image.open(p).size for p in (root / "train").rglob("*.JPEG") if _decodes(p)]
    assert len(set(sizes)) > 50
    assert all(96 <= min(s) <= 320 and 0.59 <= s[0] / s[1] <= 1.71 for s in sizes)
    assert any(w > h for w, h in sizes) and any(w < h for w, h in sizes)
    small = generate(tmp_path / "s", 2, 5, 2, seed=3, quirks=False, min_side=40, max_side=48)
    sizes = [Image.open(p).size for p in (tmp_path / "s").rglob("*.JPEG")]
    assert len(sizes) == small["counts"]["train"] + small["counts"]["val"]
    assert all(40 <= min(s) <= 48 for s in sizes)


def test_deterministic(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", 3, 6, 3, seed=7)
    b = generate(tmp_path / "b", 3, 6, 3, seed=7)
    assert a == b and _digest(tmp_path / "a") == _digest(tmp_path / "b")
    generate(tmp_path / "a", 3, 6, 3, seed=7)  # regenerating over an earlier tree is exact too
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    generate(tmp_path / "c", 3, 6, 3, seed=8)
    da, dc = _digest(tmp_path / "a"), _digest(tmp_path / "c")
    assert sum(da[k] != dc.get(k) for k in da) > len(da) // 2


def test_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        generate(tmp_path, 2, 2, 1)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError):
        generate(tmp_path / "x", 2, 2, 1, val_layout="nested")


def test_refuses_a_dataset_whose_manifest_is_not_its_own(tmp_path: Path) -> None:
    """train/, val/ and a manifest.json of something else (every name one of the tree's own): generate used to
    take the manifest's name as proof and removed train/ and val/ for its rerun."""
    for split in ("train", "val"):
        (tmp_path / split / "n01440764").mkdir(parents=True)
        (tmp_path / split / "n01440764" / "a.JPEG").write_bytes(b"the user's image")
    (tmp_path / "manifest.json").write_text('{"name": "my dataset", "files": 2}')
    with pytest.raises(FileExistsError, match="holds no synthetic manifest.json"):
        generate(tmp_path, 2, 2, 1)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.JPEG")) == [
        "train/n01440764/a.JPEG", "val/n01440764/a.JPEG"]
    generate(tmp_path / "tree", 2, 2, 1)  # its own tree, run again: replaced
    generate(tmp_path / "tree", 2, 2, 1)


def test_no_quirks_writes_only_plain_jpegs(tmp_path: Path) -> None:
    m = generate(tmp_path, 4, 5, 3, seed=1, quirks=False)
    assert m["quirks"] == []
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path]
    assert len(files) == 4 * 5 + 4 * 3
    for p in files:
        with Image.open(p) as im:
            assert (p.suffix, im.format, im.mode) == (".JPEG", "JPEG", "RGB")
    assert len(_val_labels(tmp_path)) == 12


def test_folders_layout(tmp_path: Path) -> None:
    m = generate(tmp_path, 4, 5, 3, seed=2, val_layout="folders")
    assert m["val_layout"] == "folders" and "label_files" not in m
    assert not (tmp_path / "val.txt").exists() and not (tmp_path / "LOC_val_solution.csv").exists()
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == m["classes"]
    val_q = [e for e in m["quirks"] if e["split"] == "val"]
    assert sorted(e["kind"] for e in val_q) == ["grayscale", "truncated"]
    assert all(e["path"].split("/")[0] in m["classes"] for e in val_q)
    val = list((tmp_path / "val").rglob("*.JPEG"))
    assert len(val) == 4 * 3 + 1 and sum(map(_decodes, val)) == m["counts"]["val"] == 12


@pytest.mark.processes
def test_cli_script_from_other_cwd(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    r = children.run([sys.executable, str(REPO / "scripts" / "make_synthetic.py"), "--out", str(out), "--classes",
                        "3", "--train-per-class", "4", "--val-per-class", "2", "--seed", "5", "--no-quirks"],
                       cwd=tmp_path, cpu_s=60)
    assert r.returncode == 0, r.stderr
    assert "val.txt" in r.stdout and "LOC_val_solution.csv" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"] == {"train": 12, "val": 6} and m["seed"] == 5 and m["quirks"] == []


@pytest.mark.processes
def test_cli_module_and_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = children.run([sys.executable, "-m", "data.synthetic", "--out", str(tmp_path / "mod"), "--classes", "2",
                        "--train-per-class", "3", "--val-per-class", "1", "--val-layout", "folders"],
                       cwd=REPO, cpu_s=60)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "mod" / "manifest.json").read_text())["val_layout"] == "folders"
    assert main(["--out", str(tmp_path / "fn"), "--classes", "2", "--train-per-class", "2",
                 "--val-per-class", "1", "--min-side", "32", "--max-side", "40"]) == 0
    assert "2 classes" in capsys.readouterr().out


def _hue_histogram(path: Path) -> np.ndarray:
    """Hue histogram of the vivid pixels of a 32x32 thumbnail: position-invariant colour cue."""
    thumb = Image.open(path).convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
    hsv = np.asarray(thumb.convert("HSV")).reshape(-1, 3).astype(int)
    vivid = (hsv[:, 1] > 150) & (hsv[:, 2] > 150)
    h = np.bincount(hsv[vivid, 0] * 12 // 256, minlength=12).astype(float)
    return h / max(h.sum(), 1.0)


def test_classes_are_separable(tree: tuple[Path, dict]) -> None:
    root, m = tree
    x, y = [], []
    for c, w in enumerate(m["classes"]):
        for p in sorted((root / "train" / w).glob("*.JPEG")):
            if _decodes(p):
                x.append(_hue_histogram(p))
                y.append(c)
    means = np.stack([np.mean([f for f, t in zip(x, y) if t == c], 0) for c in range(K)])
    val = [(name, c) for name, c in _val_labels(root).items() if _decodes(root / "val" / name)]
    feats = np.stack([_hue_histogram(root / "val" / name) for name, _ in val])
    pred = ((feats[:, None] - means[None]) ** 2).sum(-1).argmin(1)
    acc = float((pred == np.array([c for _, c in val])).mean())
    assert acc > 3.0 / K, acc
