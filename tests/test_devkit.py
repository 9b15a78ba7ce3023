"""The devkit's labels (ILSVRC2012_ID -> WNID -> sorted-wnid index), class names, class subsets, and every
distribution format rebuilt from real ILSVRC2012 images (../shared/imagenet_sample, where present)."""
from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data.classnames import read_class_names
from data.distributions import Tree, write_formats, write_synset_mapping
from data.preprocess import Options, preprocess
from data.synthetic import synthetic_tree
from tests.conftest import REPO
from tests.test_preprocess import cli, concat, same_batches

OPTS = Options(size=64, per_file=8)
SAMPLE = REPO.parent / "shared" / "imagenet_sample"


@pytest.fixture(scope="module")
def formats(synth, tmp_path_factory) -> dict:
    tree = synthetic_tree(synth[0])
    return {**write_formats(tree, tmp_path_factory.mktemp("formats")), "tree": tree}


def _extract(archive: Path, dst: Path) -> Path:
    with tarfile.open(archive) as tf:
        for m in tf.getmembers():
            if m.isfile():
                (dst / m.name).parent.mkdir(parents=True, exist_ok=True)
                (dst / m.name).write_bytes(tf.extractfile(m).read())
    return dst


def _truth(root: Path) -> dict[str, str]:
    """val file stem -> wnid, as the generator drew it (its Kaggle CSV)."""
    rows = (root / "LOC_val_solution.csv").read_text().splitlines()[1:]
    return {r.split(",")[0]: r.split(",")[1].split()[0] for r in rows}


@pytest.mark.parametrize("form", ["archive", "folder", "meta.mat + ground truth"])
def test_devkit_labels_are_sorted_wnid_indices(formats, synth, tmp_path, form):
    root, manifest = synth
    spec = formats["devkit"]
    if form != "archive":
        kit = _extract(formats["devkit"], tmp_path / "kit") / "ILSVRC2012_devkit_t12"
        spec = kit if form == "folder" else [kit / "data" / "ILSVRC2012_validation_ground_truth.txt",
                                             kit / "data" / "meta.mat"]
    out = tmp_path / "out"
    preprocess(root / "train", out, formats["val_tar"], spec, OPTS, workers=2, quiet=True)
    classes, ids, truth = sorted(manifest["classes"]), formats["devkit_ids"], _truth(root)
    # the fixture numbers no class by its sorted position: labels taken from the IDs would all be wrong
    assert all(ids[w] - 1 != classes.index(w) for w in classes)
    _, labels, names = concat(out, "val")
    assert len(names) == manifest["counts"]["val"]
    for name, label in zip(names, labels.tolist()):
        assert label == classes.index(truth[name.split(".")[0]]), name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["class_names"] == [formats["tree"].words[w] for w in classes]


def test_devkit_errors(formats, synth, tmp_path):
    root, _ = synth
    kit = _extract(formats["devkit"], tmp_path / "kit") / "ILSVRC2012_devkit_t12"
    gt = kit / "data" / "ILSVRC2012_validation_ground_truth.txt"
    base = ["--train-dir", root / "train", "--val-dir", formats["val_tar"], "--out", tmp_path / "out"]
    r = cli(*base, "--val-labels", kit / "data" / "meta.mat")
    assert r.returncode == 2 and "ground truth" in r.stderr
    gt.write_text(gt.read_text().replace("\n", "\n999\n", 1))  # an ID no leaf class has
    r = cli(*base, "--val-labels", kit)
    assert r.returncode == 2 and f"{gt}:2" in r.stderr and "'999'" in r.stderr


def test_class_names_from_a_file_and_beside_the_kaggle_csv(synth, formats, tmp_path):
    root, manifest = synth
    words = formats["tree"].words
    out = tmp_path / "a"
    r = cli("--train-dir", root / "train", "--out", out, "--size", 32, "--class-names", formats["synset_mapping"])
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "meta.json").read_text())["class_names"] == [words[w] for w in manifest["classes"]]
    kaggle = tmp_path / "kaggle"
    kaggle.mkdir()
    shutil.copy(root / "LOC_val_solution.csv", kaggle)
    write_synset_mapping({w: f"{words[w]} (kaggle)" for w in words}, kaggle / "LOC_synset_mapping.txt")
    preprocess(root / "train", tmp_path / "b", root / "val", kaggle / "LOC_val_solution.csv", OPTS, workers=2,
               quiet=True)
    names = json.loads((tmp_path / "b" / "meta.json").read_text())["class_names"]
    assert names == [f"{words[w]} (kaggle)" for w in manifest["classes"]]
    partial = write_synset_mapping({w: words[w] for w in manifest["classes"][1:]}, tmp_path / "partial.txt")
    r = cli("--train-dir", root / "train", "--out", tmp_path / "c", "--class-names", partial)
    assert r.returncode == 2 and manifest["classes"][0] in r.stderr and str(partial) in r.stderr


def test_a_class_names_file_saved_with_a_bom_or_crlf_reads_the_same(tmp_path):
    """Saved by a Windows editor: a UTF-8 byte-order mark before the first wnid, CRLF line ends."""
    text = "n01440764 tench, Tinca tinca\r\nn01443537 goldfish, Carassius auratus\r\n"
    path = tmp_path / "names.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_class_names(path) == {"n01440764": "tench, Tinca tinca", "n01443537": "goldfish, Carassius auratus"}


# -- subsets ---------------------------------------------------------------------------------------


def _sources(root: Path, wnid: str) -> list[str]:
    """The image files of a class, sorted by name (what --train-per-class counts)."""
    return sorted(f"{wnid}/{p.name}" for p in (root / "train" / wnid).iterdir() if p.suffix == ".JPEG")


@pytest.mark.parametrize("how", ["number", "file"])
def test_class_subset_and_images_per_class(synth, prep, tmp_path, how):
    root, manifest = synth
    if how == "number":
        spec = "2"
    else:  # the file form: unsorted, with words after the wnid (LOC_synset_mapping.txt's lines work)
        spec = tmp_path / "subset.txt"
        spec.write_text(f"{manifest['classes'][3]} last one\n\n{manifest['classes'][1]} second one\n")
    out = tmp_path / "out"
    preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv",
               Options(size=64, per_file=8, class_subset=str(spec), train_per_class=5), workers=2, quiet=True)
    meta = json.loads((out / "meta.json").read_text())
    chosen = meta["classes"]
    assert len(chosen) == 2 and chosen == sorted(chosen) and set(chosen) <= set(manifest["classes"])
    if how == "file":
        assert chosen == [manifest["classes"][1], manifest["classes"][3]]
    assert meta["subset"]["classes"] == 2 and meta["subset"]["of"] == 4 and meta["subset"]["train_per_class"] == 5
    plan = json.loads((out / "plan.json").read_text())
    assert plan["train_per_class"] == 5 and plan["class_subset"] == ("2" if how == "number" else "listed")
    full = {n: (im, lab) for split in ("train", "val") for im, lab, n in zip(*concat(prep[0], split))}
    full_classes = json.loads((prep[0] / "meta.json").read_text())["classes"]
    images, labels, names = concat(out, "train")
    expected = {n for w in chosen for n in _sources(root, w)[:5]}
    assert set(names) <= expected and len(expected - set(names)) == json.loads(
        (out / "report.json").read_text())["counts"]["train"]["skipped"]  # the first 5 of each, bar undecodable
    truth = _truth(root)
    vimages, vlabels, vnames = concat(out, "val")
    assert vnames == [n for n in concat(prep[0], "val")[2] if truth[n.split(".")[0]] in chosen]
    for im, lab, n in zip([*images, *vimages], [*labels, *vlabels], [*names, *vnames]):
        wnid = full_classes[full[n][1]]
        assert lab == chosen.index(wnid), n  # 0..N-1 in the subset's sorted order
        np.testing.assert_array_equal(im, full[n][0])


def test_subset_errors_and_a_changed_subset_is_refused(synth, tmp_path):
    root, _ = synth
    base = ["--train-dir", root / "train", "--out", tmp_path / "out", "--size", 32]
    r = cli(*base, "--classes", 9)
    assert r.returncode == 2 and "4 classes" in r.stderr
    (tmp_path / "list.txt").write_text("n99999999\n")
    r = cli(*base, "--classes", tmp_path / "list.txt")
    assert r.returncode == 2 and "n99999999" in r.stderr
    assert cli(*base, "--classes", 2).returncode == 0
    r = cli(*base, "--classes", 3)
    assert r.returncode == 2 and "class_subset" in r.stderr


def test_conflicting_labels_for_shard_images_are_refused(formats, synth, tmp_path):
    root, manifest = synth
    csv = root.joinpath("LOC_val_solution.csv").read_text()
    a, b = manifest["classes"][:2]
    swapped = csv.replace(a, "TMP").replace(b, a).replace("TMP", b)
    (tmp_path / "sol.csv").write_text(swapped)
    r = cli("--train-dir", *formats["hf_train"], "--val-dir", *formats["hf_val"], "--val-labels",
            tmp_path / "sol.csv", "--out", tmp_path / "out")
    assert r.returncode == 2 and "drop --val-labels" in r.stderr


# -- real images -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """50 real ILSVRC2012 JPEGs (every 10th class of the sample) as a tree: each image once in train (its
    class folder) and once in a flat val (shuffled numbering), plus a Caffe val.txt and every format."""
    if not SAMPLE.is_dir():
        pytest.skip(f"{SAMPLE} is absent (real ILSVRC2012 images, not part of the repository)")
    root = tmp_path_factory.mktemp("sample")
    files = sorted(SAMPLE.glob("*.JPEG"))[::10]
    wnids = [p.name.split("_", 1)[0] for p in files]
    words = {w: p.stem.split("_", 1)[1].replace("_", " ") for w, p in zip(wnids, files)}
    labels = {}
    for k, (w, p) in enumerate(zip(wnids, files)):
        (root / "train" / w).mkdir(parents=True)
        shutil.copy(p, root / "train" / w / f"{w}_{k}.JPEG")
    (root / "val").mkdir()
    for pos, k in enumerate(np.random.default_rng(0).permutation(len(files)), start=1):
        shutil.copy(files[k], root / "val" / f"ILSVRC2012_val_{pos:08d}.JPEG")
        labels[f"ILSVRC2012_val_{pos:08d}.JPEG"] = wnids[k]
    (root / "val.txt").write_text("".join(f"{n} {sorted(wnids).index(w)}\n" for n, w in sorted(labels.items())))
    tree = Tree(root / "train", root / "val", labels, words)
    return root, tree, write_formats(tree, root / "formats")


def test_real_images_every_route_equals_the_folder_route(sample, tmp_path):
    root, tree, f = sample
    ref = tmp_path / "folder"
    preprocess(root / "train", ref, root / "val", root / "val.txt", OPTS, workers=2, quiet=True)
    for name, (train, val, labels) in {"tar": (f["train_tar"], f["val_tar"], f["devkit"]),
                                       "hf": (f["hf_train"], f["hf_val"], None)}.items():
        out = tmp_path / name
        preprocess(train, out, val, labels, OPTS, workers=2, quiet=True)
        same_batches(out, ref)
    classes = sorted(tree.words)
    _, vlabels, vnames = concat(tmp_path / "tar", "val")
    assert [classes[v] for v in vlabels] == [tree.val_labels[n] for n in vnames]  # the devkit's labels
    assert all(f["devkit_ids"][w] - 1 != classes.index(w) for w in classes)
    meta = json.loads((tmp_path / "tar" / "meta.json").read_text())
    assert meta["class_names"][0] == tree.words[classes[0]] == "tench"
