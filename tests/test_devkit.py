"""The devkit's labels (ILSVRC2012_ID -> WNID -> sorted-wnid index), class names, class subsets, and every
distribution format rebuilt from real ILSVRC2012 images (../shared/imagenet_sample, where present)."""
from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data import devkit
from data.classnames import names_for, read_class_names, read_synset_mapping
from data.distributions import Tree, write_formats, write_synset_mapping
from data.layouts import DataError, Item, Split, ValLabels
from data.preprocess import Options, preprocess
from data.sources import _no_empty_classes, cap_per_class, choose_classes
from data.synthetic import synthetic_tree
from data.val_labels import read_label_file, read_val_labels
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


# -- the readers by hand (fast: no preprocessing; `make mutants` mutates the label readers against these) ---------

LEAVES = [(3, "n03", "three", 0), (1, "n02", "two, second", 0), (2, "n01", "one", 0)]
INNER = [(4, "n00", "root", 3)]


def _meta_mat(rows) -> bytes:
    """meta.mat as MATLAB saves it, written by scipy.io.savemat (not by the code under test): a struct array
    `synsets` of (ILSVRC2012_ID, WNID, words, num_children)."""
    import scipy.io
    synsets = np.zeros((len(rows), 1), dtype=[(f, object) for f in ("ILSVRC2012_ID", "WNID", "words", "num_children")])
    for k, (i, w, words, kids) in enumerate(rows):
        synsets[k, 0] = (np.uint16(i), w, words, np.uint16(kids))
    buf = io.BytesIO()
    scipy.io.savemat(buf, {"synsets": synsets})
    return buf.getvalue()


def _tar_gz(path: Path, members: dict[str, bytes | None]) -> Path:
    """A .tar.gz written by Python's tarfile; a member whose bytes are None is a directory."""
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return path


GT = "2\n3\n1\n2\n"  # val images 1..4: IDs 2, 3, 1, 2 -> n01, n03, n02, n01
LABELS = {"ILSVRC2012_val_00000001": "n01", "ILSVRC2012_val_00000002": "n03", "ILSVRC2012_val_00000003": "n02",
          "ILSVRC2012_val_00000004": "n01"}
WORDS = {"n03": "three", "n02": "two, second", "n01": "one"}


def test_meta_mat_and_ground_truth_by_hand():
    ids, words = devkit.read_meta(_meta_mat(INNER + LEAVES), "m.mat")
    assert ids == {3: "n03", 1: "n02", 2: "n01"} and words == WORDS  # the inner node left out
    assert devkit.read_ground_truth(GT, "gt.txt", ids) == LABELS
    assert devkit.read_ground_truth(" 3 \n", "gt.txt", ids) == {"ILSVRC2012_val_00000001": "n03"}
    prefix = ("m.mat is not the devkit's meta.mat (a struct array 'synsets' with ILSVRC2012_ID, WNID, words, "
              "num_children)")
    with pytest.raises(DataError) as e:
        devkit.read_meta(b"MATLAB 5.0 MAT-file, not really" + bytes(200), "m.mat")
    assert str(e.value).startswith(prefix + ": ValueError: ")
    other = io.BytesIO()
    __import__("scipy.io").io.savemat(other, {"other": np.zeros(2)})
    with pytest.raises(DataError, match=re.escape(prefix + ": KeyError: 'synsets'")):
        devkit.read_meta(other.getvalue(), "m.mat")
    with pytest.raises(DataError, match=r"^m\.mat: an ILSVRC2012_ID is used by two leaf synsets$"):
        devkit.read_meta(_meta_mat(LEAVES + [(1, "n04", "again", 0)]), "m.mat")
    for text, line, got in (("2\n3\nx\n", 3, "'x'"), ("2\n9\n", 2, "'9'"), ("\n", 1, "''"), ("-1\n", 1, "'-1'")):
        with pytest.raises(DataError) as e:
            devkit.read_ground_truth(text, "gt.txt", ids)
        assert str(e.value) == (f"gt.txt:{line}: expected the ILSVRC2012_ID of a leaf class (one of 3 in meta.mat), "
                                f"got {got}")
    with pytest.raises(DataError, match=r"^gt\.txt is empty$"):
        devkit.read_ground_truth("", "gt.txt", ids)


@pytest.fixture
def kit(tmp_path) -> dict[str, Path]:
    """The devkit in each form: archive (members in a folder), folder, folder with the files at its top, and
    an archive with the two files at its root."""
    mat, gt = _meta_mat(INNER + LEAVES), GT.encode()
    folder = tmp_path / "kit" / "ILSVRC2012_devkit_t12"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "meta.mat").write_bytes(mat)
    (folder / "data" / devkit.GROUND_TRUTH).write_bytes(gt)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "meta.mat").write_bytes(mat)
    (flat / devkit.GROUND_TRUTH).write_bytes(gt)
    archive = _tar_gz(tmp_path / "devkit.tar.gz", {"ILSVRC2012_devkit_t12": None, "ILSVRC2012_devkit_t12/data": None,
                                                   "ILSVRC2012_devkit_t12/COPYING": b"c",
                                                   "ILSVRC2012_devkit_t12/data/meta.mat": mat,
                                                   f"ILSVRC2012_devkit_t12/data/{devkit.GROUND_TRUTH}": gt})
    rooted = _tar_gz(tmp_path / "rooted.TGZ", {"meta.mat": mat, devkit.GROUND_TRUTH: gt})
    return {"folder": folder, "flat": flat, "archive": archive, "rooted": rooted, "mat": folder / "data" / "meta.mat",
            "gt": folder / "data" / devkit.GROUND_TRUTH}


def test_devkit_labels_from_every_form_say_where_they_come_from(kit):
    a = kit["archive"]
    inside = f"{a}:ILSVRC2012_devkit_t12/data/"
    cases = {"archive": ([a], f"{inside}{devkit.GROUND_TRUTH}", f"{inside}meta.mat"),
             "rooted": ([kit["rooted"]], f"{kit['rooted']}:{devkit.GROUND_TRUTH}", f"{kit['rooted']}:meta.mat"),
             "folder": ([kit["folder"]], str(kit["gt"]), str(kit["mat"])),
             "flat": ([kit["flat"]], str(kit["flat"] / devkit.GROUND_TRUTH), str(kit["flat"] / "meta.mat")),
             "mat first": ([kit["mat"], kit["gt"]], str(kit["gt"]), str(kit["mat"])),
             "mat second": ([kit["gt"], kit["mat"]], str(kit["gt"]), str(kit["mat"]))}
    for form, (spec, source, names_source) in cases.items():
        got = devkit.devkit_labels(spec)
        assert got == ValLabels(source, LABELS, True, WORDS, names_source), form
        assert read_val_labels([str(p) for p in spec], ["n01", "n02", "n03"]) == got, form
    for path in (kit["mat"], kit["folder"], kit["archive"], kit["rooted"]):
        assert devkit.devkit_words(path) == WORDS, path
        assert read_class_names(path) == WORDS, path
    upper = kit["mat"].rename(kit["mat"].with_name("META.MAT"))  # told by its suffix, in any case
    assert devkit.devkit_words(upper) == WORDS and read_class_names(upper) == WORDS


def test_devkit_errors_by_hand(kit, tmp_path):
    gt, mat = kit["gt"], kit["mat"]
    with pytest.raises(DataError) as e:
        devkit.devkit_labels([gt, gt])
    assert str(e.value) == f"two --val-labels files must be the devkit's meta.mat and its ground truth, got {gt}, {gt}"
    with pytest.raises(DataError, match=f"^label file {re.escape(str(tmp_path / 'no.mat'))} does not exist$"):
        devkit.devkit_labels([gt, tmp_path / "no.mat"])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "meta.mat").write_bytes(mat.read_bytes())
    with pytest.raises(DataError) as e:
        devkit.devkit_labels([empty])
    assert str(e.value) == (f"{empty} holds no {devkit.GROUND_TRUTH} (expected the ILSVRC2012 devkit: data/meta.mat "
                            f"and data/{devkit.GROUND_TRUTH})")
    with pytest.raises(DataError, match=f"^{re.escape(str(tmp_path))} holds no meta.mat \\(expected the "
                                        "ILSVRC2012 devkit\\)$"):
        devkit.devkit_words(tmp_path)
    bad = tmp_path / "bad.mat"
    bad.write_bytes(b"MATLAB 5.0 MAT-file, not really" + bytes(200))
    with pytest.raises(DataError, match=f"^{re.escape(str(bad))} is not the devkit's meta.mat"):
        devkit.devkit_words(bad)
    # a folder named meta.mat in an archive is not the file
    dirs = _tar_gz(tmp_path / "dirs.tar.gz", {"kit/meta.mat": None, f"kit/{devkit.GROUND_TRUTH}": GT.encode()})
    with pytest.raises(DataError, match="holds no meta.mat"):
        devkit.devkit_labels([dirs])
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(kit["archive"].read_bytes()[:300])
    with pytest.raises(DataError) as e:
        devkit.devkit_labels([cut])
    assert str(e.value).startswith(f"devkit archive {cut} is unreadable or truncated (")
    gt.write_bytes(b"2\n\xff\n")  # not UTF-8: the byte is replaced, and the line named
    with pytest.raises(DataError) as e:
        devkit.devkit_labels([kit["folder"]])
    assert str(e.value) == (f"{gt}:2: expected the ILSVRC2012_ID of a leaf class (one of 3 in meta.mat), got '\ufffd'")


def test_kaggle_csv_and_caffe_txt_by_hand(tmp_path):
    classes = ["n01", "n02", "n03"]
    csv_path = tmp_path / "LOC_val_solution.csv"
    # a byte-order mark, an extra column, CRLF line ends, a blank line, a quoted id holding a bare CR (csv keeps
    # it as read with newline=""), the first wnid of each prediction string
    csv_path.write_bytes(b"\xef\xbb\xbfImageId, PredictionString ,Extra\r\nval_1,n02 1 2 3 4 n03 5 6 7 8\r\n\r\n"
                         b'"val\r2",n01 1 1 1 1\r\nval_3,n03\r\n')
    got = read_label_file(csv_path, classes)
    assert got == ValLabels(str(csv_path), {"val_1": "n02", "val\r2": "n01", "val_3": "n03"}, True, None,
                            str(tmp_path / "LOC_synset_mapping.txt"))
    (tmp_path / "LOC_synset_mapping.txt").write_text("n01 one\nn02 two\n")
    assert read_label_file(csv_path, classes).names == {"n01": "one", "n02": "two"}
    upper = csv_path.rename(tmp_path / "SOLUTION.CSV")
    assert read_label_file(upper, classes).labels == got.labels  # by suffix, any case
    txt = tmp_path / "val.txt"
    txt.write_bytes(b"\xef\xbb\xbfa.JPEG 2\n\nb.JPEG 0\nc.JPEG   1  \n")
    assert read_label_file(txt, classes) == ValLabels(str(txt), {"a.JPEG": "n03", "b.JPEG": "n01", "c.JPEG": "n02"},
                                                      False)


@pytest.mark.parametrize("name,text,message", [
    ("s.csv", "", "{p}: expected the header 'ImageId,PredictionString', got None"),
    ("s.csv", "Id,PredictionString\n",
     "{p}: expected the header 'ImageId,PredictionString', got ['Id', 'PredictionString']"),
    ("s.csv", "ImageId,PredictionString\na,n01 1\n\nb\n", "{p}:4: expected 'ImageId,<wnid> ...', got ['b']"),
    ("s.csv", "ImageId,PredictionString\na,  \n", "{p}:2: expected 'ImageId,<wnid> ...', got ['a', '  ']"),
    ("s.csv", "ImageId,PredictionString\na,n09 1\n", "{p}:2: class 'n09' is not one of the train classes"),
    ("s.csv", "ImageId,PredictionString\na,n01\n\na ,n02\n", "{p}:4: 'a' is listed twice"),
    ("v.txt", "a 0\n\nb\n", "{p}:3: expected '<file> <label index>', got 'b'"),
    ("v.txt", "a 0 1\n", "{p}:1: expected '<file> <label index>', got 'a 0 1'"),
    ("v.txt", "a X1\n", "{p}:1: expected '<file> <label index>', got 'a X1'"),
    ("v.txt", "a 1-\n", "{p}:1: expected '<file> <label index>', got 'a 1-'"),
    ("v.txt", "a -1\n", "{p}:1: label -1 is outside 0..2 (the 3 train classes)"),
    ("v.txt", "\na 3\n", "{p}:2: label 3 is outside 0..2 (the 3 train classes)"),
    ("v.txt", "a 0\n\na 1\n", "{p}:3: 'a' is listed twice"),
    ("v.txt", b"a 0\n\xff 1\n", "label file {p} is not UTF-8 text (byte 4: invalid start byte)"),
])
def test_label_file_errors_by_hand(tmp_path, name, text, message):
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    with pytest.raises(DataError) as e:
        read_label_file(p, ["n01", "n02", "n03"])
    assert str(e.value) == message.format(p=p)


def test_val_labels_routes_and_errors(kit, tmp_path):
    classes = ["n01", "n02", "n03"]
    with pytest.raises(DataError, match=r"^--val-labels takes one label file or devkit, or meta.mat and the ground "
                                        r"truth; got 0 paths$"):
        read_val_labels([], classes)
    with pytest.raises(DataError, match="; got 3 paths$"):
        read_val_labels([kit["gt"]] * 3, classes)
    missing = tmp_path / "missing.mat"
    with pytest.raises(DataError, match=f"^label file {re.escape(str(missing))} does not exist$"):
        read_val_labels([kit["gt"], missing], classes)
    with pytest.raises(DataError) as e:
        read_val_labels([kit["mat"]], classes)
    assert str(e.value) == (f"{kit['mat']}: meta.mat alone gives no labels; pass the ground truth too: --val-labels "
                            f"{kit['mat']} {devkit.GROUND_TRUTH}")
    with pytest.raises(DataError, match=f"^label file {re.escape(str(tmp_path / 'none.txt'))} does not exist$"):
        read_val_labels([tmp_path / "none.txt"], classes)
    plain = _tar_gz(tmp_path / "kit.tar", {"meta.mat": _meta_mat(LEAVES), devkit.GROUND_TRUTH: GT.encode()})
    assert read_val_labels([plain], classes).labels == LABELS  # '.tar': the devkit route too


def test_class_names_file_by_hand(tmp_path):
    p = tmp_path / "words.txt"
    p.write_text("n01  one, first \n\n  n02\tsecond\nn03\n")
    assert read_synset_mapping(p) == {"n01": "one, first", "n02": "second", "n03": ""}
    assert read_class_names(p) == read_synset_mapping(p)
    p.write_text("n01 one\nn02 two\n\nn01 again\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(p))}:4: 'n01' is listed twice$"):
        read_synset_mapping(p)
    p.write_text("n01 same words\nn02 n01\n")  # a word equal to a wnid is no duplicate
    assert read_synset_mapping(p) == {"n01": "same words", "n02": "n01"}
    p.write_text("\n \n")
    with pytest.raises(DataError, match=f"^class names file {re.escape(str(p))} lists no class \\('<wnid> <words>' "
                                        "per line\\)$"):
        read_synset_mapping(p)
    p.write_bytes(b"n01 caf\xe9\n")
    with pytest.raises(DataError) as e:
        read_synset_mapping(p)
    assert str(e.value).startswith(f"class names file {p} is unreadable ('utf-8' codec can't decode byte 0xe9")
    with pytest.raises(DataError, match=f"^class names file {re.escape(str(tmp_path / 'no'))} does not exist$"):
        read_class_names(tmp_path / "no")
    names = {"n01": "one", "n02": "two", "n03": "three", "n04": "four", "n05": "five"}
    assert names_for(["n03", "n01"], names, "src") == ["three", "one"]
    with pytest.raises(DataError, match=r"^src gives no words for class\(es\) n07, n08, n09$"):
        names_for(["n07", "n01", "n08", "n09"], names, "src")
    with pytest.raises(DataError, match=r"^src gives no words for class\(es\) n06, n07, n08 \(and 2 more\)$"):
        names_for(["n06", "n07", "n08", "n09", "n10", "n01"], names, "src")
    with pytest.raises(DataError, match=r"^src gives no words for class\(es\) n06, n07, n08 \(and 1 more\)$"):
        names_for(["n06", "n07", "n08", "n09", "n01"], names, "src")  # four missing: the fourth is counted


# -- class subsets by hand -------------------------------------------------------------------------------------

CLASSES = [f"n{i:02d}" for i in range(10)]


def test_classes_chosen_by_number_are_numpys_seeded_choice():
    assert choose_classes(CLASSES, None, 3) == (CLASSES, None)
    for spec, seed in (("4", 0), (4, 7), ("10", 1), ("1", 2)):
        n = int(spec)
        expected = sorted(np.random.default_rng([seed, 1]).choice(CLASSES, n, replace=False).tolist())
        chosen, subset = choose_classes(CLASSES, spec, seed)
        assert chosen == expected and subset == {"classes": n, "of": 10, "chosen_by": f"seed {seed}"}
    assert choose_classes(CLASSES, "4", 0)[0] != choose_classes(CLASSES, "4", 1)[0]
    for n in ("0", "11"):
        with pytest.raises(DataError, match=f"^--classes {n}: the train source has 10 classes$"):
            choose_classes(CLASSES, n, 0)


def test_classes_chosen_by_a_file(tmp_path):
    p = tmp_path / "subset.txt"
    p.write_bytes(b"\xef\xbb\xbfn05 five\r\n\r\n  n02\n n07 seven, more words\n")
    assert choose_classes(CLASSES, str(p), 0) == (["n02", "n05", "n07"],
                                                  {"classes": 3, "of": 10, "chosen_by": f"list {p}"})
    assert choose_classes(CLASSES, p, 0)[0] == ["n02", "n05", "n07"]  # a Path works too
    p.write_text("n01\n\nn02\nn01 again\n")
    with pytest.raises(DataError, match=f"^--classes {re.escape(str(p))}:4: n01 is listed twice \\(lines 1 and 4\\)$"):
        choose_classes(CLASSES, str(p), 0)
    p.write_text("n01\nn99\nn98 x\n")
    with pytest.raises(DataError, match=f"^--classes {re.escape(str(p))}: wnids not in the train classes: n98, n99$"):
        choose_classes(CLASSES, str(p), 0)
    p.write_text("\n  \n")
    with pytest.raises(DataError, match=f"^--classes {re.escape(str(p))}: lists no wnid$"):
        choose_classes(CLASSES, str(p), 0)
    p.write_bytes(b"n01\n\xff\n")
    with pytest.raises(DataError, match=f"^--classes {re.escape(str(p))} is not UTF-8 text \\(byte 4: invalid start "
                                        "byte\\)$"):
        choose_classes(CLASSES, str(p), 0)
    with pytest.raises(DataError, match=f"^--classes {re.escape(str(tmp_path))}: neither a number nor a file of "
                                        "wnids$"):
        choose_classes(CLASSES, str(tmp_path), 0)
    with pytest.raises(DataError, match="^--classes -2: neither a number nor a file of wnids$"):
        choose_classes(CLASSES, "-2", 0)


def test_images_per_class_and_empty_classes():
    items = [Item(f"{c}/{k}", c) for c, k in ((0, 0), (1, 0), (0, 1), (0, 2), (2, 0), (1, 1), (0, 3))]
    assert cap_per_class(items, None) is items
    assert [it.path for it in cap_per_class(items, 2)] == ["0/0", "1/0", "0/1", "2/0", "1/1"]
    assert [it.path for it in cap_per_class(items, 1)] == ["0/0", "1/0", "2/0"]
    assert cap_per_class(items, 4) == items
    for k in (0, -1):
        with pytest.raises(DataError, match=f"^--train-per-class must be positive, got {k}$"):
            cap_per_class(items, k)
    split = Split("root", items)
    _no_empty_classes(split, ["a", "b", "c"])
    with pytest.raises(DataError) as e:
        _no_empty_classes(split, ["a", "b", "c", "d"])
    assert str(e.value) == ("train dir root: 1 class folder(s) hold no image file: d; remove them, or pass "
                            "--allow-empty-classes to keep them as classes without training images")
    with pytest.raises(DataError) as e:
        _no_empty_classes(Split("r", items[4:5]), [f"c{i}" for i in range(8)])
    assert str(e.value).startswith("train dir r: 7 class folder(s) hold no image file: c0, c1, c3, c4, c5 (and 2 "
                                   "more); remove them")
    with pytest.raises(DataError, match=r"^train dir r: 6 class folder\(s\) hold no image file: c0, c1, c3, c4, c5 "
                                        r"\(and 1 more\); remove them"):
        _no_empty_classes(Split("r", items[4:5]), [f"c{i}" for i in range(7)])
    with pytest.raises(DataError, match=r"^train dir r: 5 class folder\(s\) hold no image file: c0, c1, c3, c4, c5; "):
        _no_empty_classes(Split("r", items[4:5]), [f"c{i}" for i in range(6)])  # five: all named, no "more"
