"""scripts/preprocess.py: layouts, label formats, quirks, errors, mean, resume, atomicity."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data.batchfile import BatchFileError, read_batch_file, read_file_attrs
from data.decode import load_image
from data.layouts import DataError
from data.preprocess import Options, preprocess
from data.procs import child_pids
from tests import children
from tests.conftest import REPO, pipe_nobody_writes, run_script, sigint_inside_the_pool


def all_files(out: Path, split: str) -> list[tuple[np.ndarray, np.ndarray, list[str]]]:
    meta = json.loads((out / "meta.json").read_text())
    return [read_batch_file(out / split / f["name"]) for f in meta["splits"][split]["files"]]


def concat(out: Path, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    parts = all_files(out, split)
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            [n for p in parts for n in p[2]])


def test_output_layout_and_counts(prep, synth):
    out, summary = prep
    _, manifest = synth
    meta = json.loads((out / "meta.json").read_text())
    assert meta["classes"] == manifest["classes"] == sorted(manifest["classes"])
    assert meta["image_size"] == 64
    for split in ("train", "val"):
        images, labels, names = concat(out, split)
        assert images.dtype == np.uint8 and images.shape[1:] == (64, 64, 3)
        assert len(images) == len(labels) == len(names) == manifest["counts"][split]
        assert meta["splits"][split]["count"] == manifest["counts"][split]
        assert len(set(names)) == len(names)  # no image written twice
        assert all(f["count"] <= 8 for f in meta["splits"][split]["files"])


def test_labels_follow_sorted_wnid_order(prep, synth):
    out, _ = prep
    root, manifest = synth
    _, labels, names = concat(out, "train")
    for label, name in zip(labels, names):
        assert manifest["classes"][label] == name.split("/")[0]
    # val: the label of each file is the class its Caffe line gives (index into sorted wnids)
    caffe = dict(line.split() for line in (root / "val.txt").read_text().splitlines())
    _, vlabels, vnames = concat(out, "val")
    assert [int(caffe[n]) for n in vnames] == list(vlabels)


def test_train_order_shuffled_val_sorted(prep):
    out, _ = prep
    _, labels, _ = all_files(out, "train")[0]
    assert len(set(labels.tolist())) > 1  # the first file mixes classes: shuffled across files
    _, _, vnames = concat(out, "val")
    assert vnames == sorted(vnames)


def test_quirks_converted_skipped_ignored(prep, synth):
    out, summary = prep
    _, manifest = synth
    report = json.loads((out / "report.json").read_text())
    skipped = {d["path"]: d["reason"] for d in report["skipped"]}
    ignored = {d["path"] for d in report["ignored"]}
    written = {f"{s}/{n}" for s in ("train", "val") for n in concat(out, s)[2]}
    assert manifest["quirks"], "the generator made no quirks"
    for q in manifest["quirks"]:
        path = f"{q['split']}/{q['path']}"
        if q["expect"] == "convert":
            assert path in written, (q, "should have been converted")
        elif q["expect"] == "skip":
            assert path in skipped and skipped[path], (q, "should be listed as skipped with a reason")
            assert path not in written
        else:
            assert path in ignored and path not in written
    kinds = {q["kind"] for q in manifest["quirks"]}
    assert {"cmyk", "grayscale", "png_as_jpeg", "rgba_png", "palette", "truncated", "empty", "garbage",
            "stray"} <= kinds
    assert report["counts"]["train"]["skipped"] == sum(
        1 for q in manifest["quirks"] if q["split"] == "train" and q["expect"] == "skip")


def test_converted_quirks_look_like_their_source(prep, synth):
    """A CMYK or grayscale source must come out as the same picture in RGB, not garbage."""
    out, _ = prep
    root, manifest = synth
    images, _, names = concat(out, "train")
    by_name = dict(zip(names, images))
    for q in manifest["quirks"]:
        if q["split"] != "train" or q["expect"] != "convert":
            continue
        with Image.open(root / "train" / q["path"]) as im:
            ref = np.asarray(im.convert("RGBA" if im.mode == "P" else im.mode).convert("RGB").resize(
                (64, 64), Image.Resampling.BILINEAR, box=_center_box(im.size)), dtype=np.float64)
        diff = np.abs(by_name[q["path"]].astype(np.float64) - ref).mean()
        assert diff < 12, (q["kind"], diff)


def _center_box(size):
    w, h = size
    s = min(w, h)
    return ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)


def test_mean_equals_numpy_mean(prep):
    out, _ = prep
    images, _, _ = concat(out, "train")
    mean = np.load(out / "mean.npy")
    assert mean.dtype == np.float32 and mean.shape == (64, 64, 3)
    np.testing.assert_allclose(mean, images.astype(np.float64).mean(axis=0), rtol=0, atol=1e-4)


def test_the_mean_is_tied_to_its_output_by_its_digest(prep, tmp_path, capsys):
    """meta.json records mean.npy's SHA-256 (hashlib by hand here): the mean of another output of the same
    image size (it gave another error rate, exit 0) is refused where it is read, naming the file; the same
    array saved again is the same file."""
    import hashlib

    from data.meta import check_files, read_meta
    from data.reader import SplitData
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    meta = read_meta(out)
    assert meta["mean_sha256"] == hashlib.sha256((out / "mean.npy").read_bytes()).hexdigest()
    mine = np.load(out / "mean.npy")
    np.save(out / "mean.npy", mine)
    check_files(out, meta, ("train", "val"))
    np.testing.assert_array_equal(SplitData(out, "val").mean_image(), mine)
    np.save(out / "mean.npy", np.full_like(mine, 117.0))  # another output's mean: valid, of the same shape
    words = f"{out / 'mean.npy'}: not this output's mean image (its SHA-256 is not meta.json's mean_sha256)"
    for read in (lambda: check_files(out, meta, ("val",)), lambda: SplitData(out, "val").mean_image()):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(words)
    check_files(out, meta, ("val",), mean=False)  # a run that normalises per channel does not read it
    for bad in ("", "0" * 63, "G" * 64, 5):
        (out / "meta.json").write_text(json.dumps({**meta, "mean_sha256": bad}))
        with pytest.raises(DataError, match="mean_sha256 must be the mean image's SHA-256 \\(64 hex digits\\)"):
            read_meta(out)


@pytest.mark.parametrize("name", ["meta.json", "mean.npy"])
def test_a_pipe_in_place_of_meta_or_mean_is_refused_not_read(prep, tmp_path, name):
    """A named pipe blocks its reader until a writer comes: mean.npy as one hung evaluate.py for ever, and
    meta.json as one was reported missing. Refused naming it, unopened."""
    from data.meta import check_files, read_meta
    out = tmp_path / "data"
    shutil.copytree(prep[0], out)
    (out / name).unlink()
    with pipe_nobody_writes(out / name) as opened:
        with pytest.raises(DataError) as e:
            check_files(out, read_meta(out), ("val",)) if name == "mean.npy" else read_meta(out)
    assert str(e.value) == f"{out / name}: not a regular file or folder (a device, pipe or socket)"
    assert not opened


@pytest.mark.processes
def test_pixel_sums_and_mean_of_a_file_of_300_bright_images(tmp_path):
    """--per-file 300 of images near white: each file's pixel_sum reaches 300 x 255 = 76,500 (more than 16
    bits hold) and must equal numpy's uint64 sum of the stored images; the mean image their float mean."""
    rng = np.random.default_rng(0)
    (tmp_path / "train" / "n00000001").mkdir(parents=True)
    for i in range(300):
        Image.fromarray(rng.integers(200, 256, (8, 8, 3), dtype=np.uint8)).save(
            tmp_path / "train" / "n00000001" / f"{i:03d}.png")
    out = tmp_path / "out"
    preprocess(tmp_path / "train", out, opts=Options(size=8, per_file=300), workers=1, quiet=True,
               allow_one_class=True)  # one class of bright images
    images, _, _ = concat(out, "train")
    assert images.shape == (300, 8, 8, 3)
    want = images.sum(axis=0, dtype=np.uint64)
    assert want.max() > 2**16
    np.testing.assert_array_equal(read_file_attrs(out / "train" / "00000.h5")["pixel_sum"], want)
    np.testing.assert_allclose(np.load(out / "mean.npy"), images.astype(np.float64).mean(axis=0), rtol=0,
                               atol=1e-4)


@pytest.mark.processes
@pytest.mark.parametrize("frozen_first", [True, False])
def test_the_collector_is_left_as_found(tmp_path, frozen_first):
    """The pool's run freezes the plan for the workers' sake: what the script had frozen (its imports,
    startup.imported) stays frozen after it, and a heap with nothing frozen is unfrozen again."""
    import gc
    (tmp_path / "train" / "n00000001").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "train" / "n00000001" / f"{i}.png")
    was = gc.get_freeze_count()
    gc.freeze() if frozen_first else gc.unfreeze()
    try:
        before = gc.get_freeze_count()
        preprocess(tmp_path / "train", tmp_path / "out", opts=Options(size=8, per_file=2), workers=1, quiet=True,
                   allow_one_class=True)
        assert gc.get_freeze_count() >= before > 0 if frozen_first else gc.get_freeze_count() == 0
    finally:
        gc.freeze() if was else gc.unfreeze()


@pytest.mark.processes
@pytest.mark.parametrize("layout", ["caffe", "folders"])
def test_val_layouts_agree_with_kaggle(prep, synth, tmp_path, layout):
    """The same val images labelled by val.txt or by class folders give the Kaggle run's output."""
    out, _ = prep
    root, manifest = synth
    if layout == "caffe":
        val_dir, labels = root / "val", root / "val.txt"
    else:
        val_dir, labels = tmp_path / "val", None
        caffe = dict(line.split() for line in (root / "val.txt").read_text().splitlines())
        for name, label in caffe.items():
            dst = val_dir / manifest["classes"][int(label)] / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / "val" / name, dst)
    out2 = tmp_path / "out"
    preprocess(root / "train", out2, val_dir, labels, Options(size=64, per_file=8), workers=1, quiet=True)
    a, b = (_by_file_name(concat(o, "val")) for o in (out, out2))
    assert sorted(a) == sorted(b) and len(a) == manifest["counts"]["val"]
    for name, (image, label) in a.items():
        assert b[name][1] == label
        np.testing.assert_array_equal(b[name][0], image)


def _by_file_name(split: tuple) -> dict:
    images, labels, names = split
    return {n.split("/")[-1]: (i, lab) for i, lab, n in zip(images, labels, names)}


def test_resize_short_crops_center_and_warp_keeps_all(tmp_path):
    """A wide image with red bands at both ends: 'short' crops them away, 'warp' keeps them."""
    arr = np.full((100, 300, 3), 255, np.uint8)
    arr[:, :40] = arr[:, -40:] = (255, 0, 0)
    Image.fromarray(arr).save(tmp_path / "wide.JPEG", quality=95)
    short = load_image(str(tmp_path / "wide.JPEG"), 32, "short").astype(int)
    warp = load_image(str(tmp_path / "wide.JPEG"), 32, "warp").astype(int)
    assert np.abs(short - 255).max() < 20  # all white: the bands were outside the central square
    assert warp[:, 0, 1].mean() < 60 and warp[:, -1, 1].mean() < 60  # red at both edges


def test_draft_decode_matches_full_decode(tmp_path):
    """Draft mode (DCT-domain downscale) stays close to decoding at full size and resizing."""
    rng = np.random.default_rng(0)
    small = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(small).resize((1600, 1200), Image.Resampling.BICUBIC))
    Image.fromarray(big).save(tmp_path / "big.JPEG", quality=95)
    fast = load_image(str(tmp_path / "big.JPEG"), 256).astype(np.float64)
    with Image.open(tmp_path / "big.JPEG") as im:
        ref = np.asarray(im.convert("RGB").resize((256, 256), Image.Resampling.BILINEAR,
                                                  box=_center_box(im.size)), dtype=np.float64)
    assert np.abs(fast - ref).mean() < 3


# -- errors before any work ----------------------------------------------------------------------

def cli(*args):
    return run_script("scripts/preprocess.py", *map(str, args), "--quiet")


@pytest.mark.processes
def test_error_missing_train_dir(tmp_path):
    r = cli("--train-dir", tmp_path / "nope", "--out", tmp_path / "out")
    assert r.returncode == 2 and "does not exist" in r.stderr and str(tmp_path / "nope") in r.stderr


@pytest.mark.processes
def test_error_empty_class_set(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "stray.txt").write_text("x")
    r = cli("--train-dir", tmp_path / "train", "--out", tmp_path / "out")
    assert r.returncode == 2 and "no class folders" in r.stderr


def _flat_val(tmp_path, synth, text: str, name: str) -> tuple[Path, Path]:
    root, _ = synth
    val = tmp_path / "val"
    shutil.copytree(root / "val", val)
    (tmp_path / name).write_text(text)
    return val, tmp_path / name


@pytest.mark.parametrize("case", ["kaggle_unknown_file", "kaggle_unknown_class", "caffe_unknown_file",
                                  "caffe_label_range", "unlabelled_image", "kaggle_bad_header"])
@pytest.mark.processes
def test_error_bad_label_file_before_any_work(tmp_path, synth, case):
    root, manifest = synth
    kaggle = (root / "LOC_val_solution.csv").read_text()
    caffe = (root / "val.txt").read_text()
    text, name, expect = {
        "kaggle_unknown_file": (kaggle + "ILSVRC2012_val_09999999,n01440764 1 1 2 2\n", "sol.csv", "not found"),
        "kaggle_unknown_class": (kaggle.replace(manifest["classes"][1], "n99999999", 1), "sol.csv",
                                 "n99999999"),
        "caffe_unknown_file": (caffe + "missing.JPEG 0\n", "val.txt", "missing.JPEG"),
        "caffe_label_range": (caffe + "x.JPEG 4\n", "val.txt", "outside 0..3"),
        "unlabelled_image": ("\n".join(caffe.splitlines()[1:]) + "\n", "val.txt", "have no label"),
        "kaggle_bad_header": ("Id,Label\n" + "\n".join(kaggle.splitlines()[1:]), "sol.csv", "ImageId"),
    }[case]
    val, labels = _flat_val(tmp_path, synth, text, name)
    out = tmp_path / "out"
    r = cli("--train-dir", root / "train", "--val-dir", val, "--val-labels", labels, "--out", out)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr and str(labels) in r.stderr
    assert not out.exists() or not list(out.rglob("*.h5"))  # no work was done


@pytest.mark.processes
def test_flat_val_without_labels_is_an_error(tmp_path, synth):
    root, _ = synth
    r = cli("--train-dir", root / "train", "--val-dir", root / "val", "--out", tmp_path / "out")
    assert r.returncode == 2 and "--val-labels" in r.stderr


@pytest.mark.processes
def test_rerun_with_other_arguments_refuses(prep, synth):
    out, _ = prep
    root, _ = synth
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (out / "train").iterdir())
    r = cli("--train-dir", root / "train", "--val-dir", root / "val", "--val-labels",
             root / "LOC_val_solution.csv", "--out", out, "--size", "32", "--per-file", "8")
    assert r.returncode == 2 and "different arguments" in r.stderr and "size: 64 there, 32 now" in r.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (out / "train").iterdir()) == before


def test_rerun_same_arguments_redoes_nothing(prep, synth):
    out, _ = prep
    root, _ = synth
    before = {p.name: p.stat().st_mtime_ns for p in (out / "train").glob("*.h5")}
    summary = preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv",
                         Options(size=64, per_file=8), workers=2, quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "train").glob("*.h5")} == before
    assert summary["counts"]["train"]["written"] == sum(read_file_attrs(out / "train" / n)["count"] for n in before)


# -- interruption and resume ---------------------------------------------------------------------

SLOW_RUN = """
import sys, time
sys.path.insert(0, {repo!r})
import data.preprocess as p
_orig = p.load_image
def slow(*a, **k):
    time.sleep(0.03)
    return _orig(*a, **k)
p.load_image = slow
from data.preprocess_cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_slow(args: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW_RUN.format(repo=str(REPO)), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_files(folder: Path, n: int, proc: subprocess.Popen, cpu_s: float = 60) -> None:
    children.wait_until(lambda: len(list(folder.glob("[0-9]*.h5"))) >= n, proc, cpu_s, "no batch file appeared")


def same_batches(a: Path, b: Path, splits=("train", "val")) -> None:
    """The two outputs hold bitwise the same batch files (images, labels, names) and mean image."""
    for split in splits:
        fa, fb = all_files(a, split), all_files(b, split)
        assert len(fa) == len(fb)
        for (ia, la, na), (ib, lb, nb) in zip(fa, fb):
            np.testing.assert_array_equal(ia, ib)
            np.testing.assert_array_equal(la, lb)
            assert na == nb
    np.testing.assert_array_equal(np.load(a / "mean.npy"), np.load(b / "mean.npy"))


def same_output(a: Path, b: Path) -> None:
    """The same content; each output its own identity, which every one of its batch files records."""
    from data.batchfile import read_file_attrs
    same_batches(a, b)
    ja, jb = (json.loads((x / "meta.json").read_text()) for x in (a, b))
    ids = ja.pop("dataset"), jb.pop("dataset")
    assert ja == jb and all(len(i) == 32 for i in ids)
    for out, meta, dataset in ((a, ja, ids[0]), (b, jb, ids[1])):
        for split, entry in meta["splits"].items():
            assert {read_file_attrs(out / split / f["name"])["dataset"] for f in entry["files"]} == {dataset}
    ra, rb = (json.loads((x / "report.json").read_text()) for x in (a, b))
    assert ra["skipped"] == rb["skipped"] and ra["ignored"] == rb["ignored"]


@pytest.mark.processes
@pytest.mark.parametrize("where", ["wait", "submit"])
def test_a_stop_inside_the_pools_own_code_is_raised_between_its_calls(synth, tmp_path, monkeypatch, where):
    """Ctrl-C landing inside concurrent.futures (cf.wait holds the futures' locks) once left a lock held and the
    run hung in the pool's shutdown (the sigint case below, 2026-11-28). The signal is sent from inside the
    pool's call here, every time: the call must return, and the run stop after it, resumable."""
    import data.preprocess as pp
    returned = sigint_inside_the_pool(monkeypatch, pp, where)
    root = synth[0]
    with pytest.raises(KeyboardInterrupt):
        preprocess(root / "train", tmp_path / "out", root / "val", root / "LOC_val_solution.csv",
                   Options(size=64, per_file=2), workers=2, quiet=True)
    assert returned, "the KeyboardInterrupt was raised inside the pool's own call"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back
    monkeypatch.undo()
    preprocess(root / "train", tmp_path / "ref", root / "val", root / "LOC_val_solution.csv",
               Options(size=64, per_file=2), workers=2, quiet=True)
    preprocess(root / "train", tmp_path / "out", root / "val", root / "LOC_val_solution.csv",
               Options(size=64, per_file=2), workers=2, quiet=True)  # resumes
    for split in ("train", "val"):
        names = sorted(p.name for p in (tmp_path / "ref" / split).glob("*.h5"))
        assert names == sorted(p.name for p in (tmp_path / "out" / split).glob("*.h5"))
        for name in names:
            assert read_batch_file(tmp_path / "ref" / split / name)[1].tolist() == \
                read_batch_file(tmp_path / "out" / split / name)[1].tolist()


@pytest.mark.processes
@pytest.mark.parametrize("how", ["kill_worker", "sigint"])
def test_interrupted_run_resumes_to_identical_output(synth, tmp_path, how):
    root, _ = synth
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--train-dir", root / "train", "--val-dir", root / "val", "--val-labels", root / "LOC_val_solution.csv",
            "--out", out, "--size", 64, "--per-file", 2, "--workers", 2, "--quiet"]
    preprocess(root / "train", ref, root / "val", root / "LOC_val_solution.csv", Options(size=64, per_file=2),
               workers=2, quiet=True)
    total = len(list((ref / "train").glob("*.h5")))
    proc = start_slow(args)
    wait_for_files(out / "train", 2, proc)
    if how == "kill_worker":
        workers = [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]
        assert workers, "no worker process found"
        os.kill(workers[0], signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = children.communicate(proc, cpu_s=60)
    if how == "kill_worker":
        assert proc.returncode == 1 and "worker process died" in err, err
    else:
        assert proc.returncode == 130 and "re-run the same command" in err, err
    assert not (out / "meta.json").exists()
    done = list((out / "train").glob("[0-9]*.h5"))
    assert 0 < len(done) < total  # part-way: some files finished, not all
    for f in done:
        read_batch_file(f)  # every file under a final name is complete
    r = cli(*args[:-1])
    assert r.returncode == 0, r.stderr
    same_output(out, ref)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@pytest.mark.processes
def test_stale_temp_file_is_never_read(prep, tmp_path, synth):
    """A half-written file (temporary name) from a crash is removed and redone, never accepted."""
    root, _ = synth
    out = tmp_path / "out"
    shutil.copytree(prep[0], out)
    victim = out / "train" / "00001.h5"
    half = victim.read_bytes()[: victim.stat().st_size // 2]
    victim.unlink()
    (out / "meta.json").unlink()
    (out / "train" / f".00001.h5.{os.getpid() + 1}.tmp").write_bytes(half)
    preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv", Options(size=64, per_file=8),
               workers=1, quiet=True)
    assert not list((out / "train").glob(".*.tmp"))
    same_output(out, prep[0])


@pytest.mark.processes
def test_a_worker_killed_mid_write_leaves_no_file_under_a_final_name(synth, tmp_path, monkeypatch):
    """A batch file is written under a temporary name and renamed once complete: a worker killed after
    writing a file's images (before its labels) leaves nothing under NNNNN.h5, and every file that has
    such a name reads completely."""
    from concurrent.futures.process import BrokenProcessPool

    import data.batchfile as bf
    root, _ = synth
    out, marker = tmp_path / "out", tmp_path / "killed"
    real = bf._write_contiguous

    def write_then_die(f, name, data):
        real(f, name, data)
        if not marker.exists():  # the first file written, in whichever worker
            marker.write_text(f.filename)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(bf, "_write_contiguous", write_then_die)  # the forked workers inherit it
    with pytest.raises(BrokenProcessPool):
        preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv", Options(size=64, per_file=8),
                   workers=2, quiet=True)
    written = Path(marker.read_text())
    assert written.name.startswith(".") and written.name.endswith(".tmp"), f"written in place: {written}"
    finals = list(out.glob("*/[0-9]*.h5"))
    assert written.with_name(written.name.split(".")[1] + ".h5") not in finals  # .NNNNN.h5.<pid>.tmp
    for path in finals:
        read_batch_file(path)  # complete, or not there at all


@pytest.mark.processes
def test_truncated_final_file_is_redone(prep, tmp_path, synth):
    root, _ = synth
    out = tmp_path / "out"
    shutil.copytree(prep[0], out)
    victim = out / "train" / "00002.h5"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(BatchFileError, match="00002.h5"):
        read_batch_file(victim)
    preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv", Options(size=64, per_file=8),
               workers=1, quiet=True)
    same_output(out, prep[0])


@pytest.mark.processes
def test_cli_prints_what_was_written(tmp_path, synth):
    root, _ = synth
    r = cli("--train-dir", root / "train", "--out", tmp_path / "o", "--size", 32, "--per-file", 16)
    assert r.returncode == 0, r.stderr
    assert "train: 48 images written" in r.stdout and "report.json" in r.stdout
