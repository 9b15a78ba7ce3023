"""Faults and bad input in preprocessing (issue 19): one line naming the path and the reason, the right
exit code (2 bad input or path, 1 a failure of the machine), nothing half-written left behind, and
odd-but-valid input (links, names that are not UTF-8, byte-order marks) read like any other."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

import data.batchfile as batchfile
from data.batchfile import read_batch_file
from data.distributions import write_train_tar
from data.preprocess import exclusive
from data.preprocess_cli import main
from data.synthetic import generate, wnid
from tests.conftest import run_script
from tests.test_preprocess import same_batches
from tools.faultcheck.preprocess_cases import png_declaring

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

SIZE = ["--size", "16", "--per-file", "8", "--workers", "1", "--quiet"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """3 classes x 4 clean train images, val in class folders (2 per class)."""
    root = tmp_path_factory.mktemp("tree")
    generate(root, num_classes=3, train_per_class=4, val_per_class=2, quirks=False, val_layout="folders",
             min_side=24, max_side=40)
    return root


@pytest.fixture
def train(tree, tmp_path) -> Path:
    """A private copy of the train folder, to damage."""
    return Path(shutil.copytree(tree / "train", tmp_path / "train"))


def cli(*args) -> subprocess.CompletedProcess:
    return run_script("scripts/preprocess.py", *map(str, args), *SIZE)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def names_in(out: Path, split: str = "train") -> list[str]:
    return sorted(n for f in sorted((out / split).glob("*.h5")) for n in read_batch_file(f)[2])


def first_image(folder: Path) -> Path:
    return sorted(folder.iterdir())[0]


# -- links and empty class folders ---------------------------------------------------------------

@pytest.mark.parametrize("target, expect", [(".", "is the train dir itself"),
                                            (wnid(0), f"the same folder as {wnid(0)}"),
                                            ("..", "holds the train dir")])
def test_a_class_folder_linked_into_the_tree_is_refused_naming_it(train, tmp_path, target, expect):
    (train / "n09999999").symlink_to(target)
    r = cli("--train-dir", train, "--out", tmp_path / "out")
    line = one_line(r.stderr)
    assert r.returncode == 2 and "n09999999" in line and expect in line, line
    assert not (tmp_path / "out").exists()  # before any work


def test_a_link_loop_inside_a_class_folder_is_refused(train, tmp_path):
    (train / wnid(1) / "again").symlink_to("..")
    r = cli("--train-dir", train, "--out", tmp_path / "out")
    assert r.returncode == 2 and f"{wnid(1)}/again" in one_line(r.stderr)


def test_a_class_folder_linked_to_a_folder_elsewhere_is_read(train, tmp_path):
    """A link to another disk is a normal way to assemble a tree: its images count like any others."""
    elsewhere = Path(shutil.move(str(train / wnid(2)), tmp_path / "elsewhere"))
    (train / wnid(2)).symlink_to(elsewhere)
    out = tmp_path / "out"
    r = cli("--train-dir", train, "--out", out)
    assert r.returncode == 0, r.stderr
    assert sum(n.startswith(f"{wnid(2)}/") for n in names_in(out)) == len(list(elsewhere.iterdir())) == 4


def test_an_empty_class_folder_is_refused_unless_allowed(train, tmp_path):
    (train / "n09999999").mkdir()
    (train / "n09999998").mkdir()
    (train / "n09999998" / "notes.txt").write_text("not an image")
    r = cli("--train-dir", train, "--out", tmp_path / "out")
    line = one_line(r.stderr)
    assert r.returncode == 2 and "n09999998, n09999999" in line and "--allow-empty-classes" in line
    assert not (tmp_path / "out").exists()
    r = cli("--train-dir", train, "--out", tmp_path / "out", "--allow-empty-classes")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["classes"][-2:] == ["n09999998", "n09999999"] and meta["splits"]["train"]["count"] == 12


def test_help_documents_allow_empty_classes():
    r = run_script("scripts/preprocess.py", "--help")
    assert "--allow-empty-classes" in r.stdout


# -- file names that are not UTF-8 ----------------------------------------------------------------

def test_names_that_are_not_utf8_are_processed_and_named_escaped(train, tmp_path):
    good, bad = os.fsdecode(b"ok\xfe.JPEG"), os.fsdecode(b"broken\xff.JPEG")
    source = first_image(train / wnid(1))
    shutil.copy(source, train / wnid(1) / good)
    (train / wnid(1) / bad).write_bytes(b"not a jpeg")
    out = tmp_path / "out"
    r = cli("--train-dir", train, "--out", out)
    assert r.returncode == 0, r.stderr
    names = names_in(out)
    assert f"{wnid(1)}/ok\\xfe.JPEG" in names and len(names) == 13
    images = {n: im for f in (out / "train").glob("*.h5") for im, _, n in zip(*read_batch_file(f))}
    np.testing.assert_array_equal(images[f"{wnid(1)}/ok\\xfe.JPEG"], images[f"{wnid(1)}/{source.name}"])
    report = json.loads((out / "report.json").read_text())
    assert [d["path"] for d in report["skipped"]] == [f"train/{wnid(1)}/broken\\xff.JPEG"]
    assert "broken\\xff.JPEG" in report["skipped"][0]["reason"]  # not the surrogate's \udcff
    r = cli("--train-dir", train, "--out", out)  # the plan's digest reads the same names again
    assert r.returncode == 0 and "different arguments" not in r.stderr, r.stderr


def test_a_train_tar_names_them_as_the_folder_does(train, tmp_path):
    shutil.copy(first_image(train / wnid(2)), train / wnid(2) / os.fsdecode(b"caf\xe9.JPEG"))  # Latin-1
    (train / wnid(2) / os.fsdecode(b"x\xff.JPEG")).write_bytes(b"garbage")
    tar = write_train_tar(train, tmp_path / "train.tar")
    for source, out in ((train, tmp_path / "a"), (tar, tmp_path / "b")):
        r = cli("--train-dir", source, "--out", out)
        assert r.returncode == 0, r.stderr
    assert f"{wnid(2)}/caf\\xe9.JPEG" in names_in(tmp_path / "a")
    same_batches(tmp_path / "a", tmp_path / "b", splits=("train",))
    (skipped,) = json.loads((tmp_path / "b" / "report.json").read_text())["skipped"]
    assert skipped["path"] == f"{tar}:{wnid(2)}.tar:x\\xff.JPEG", skipped


# -- the disk, and paths that cannot be written --------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs folder (skips unless this runs as root); unmounted after."""
    made = []

    def mount(options: str) -> Path:
        where = tmp_path / f"mnt{len(made)}"
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (not root?)")
        made.append(where)
        return where

    yield mount
    for where in made:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_disk_full_exits_1_naming_the_file_then_resumes(tree, tmp_path, tmpfs):
    disk = tmpfs("size=40k")
    args = ["--train-dir", tree / "train", "--val-dir", tree / "val", "--out", disk / "out", "--size", "48"]
    r = run_script("scripts/preprocess.py", *map(str, args), "--per-file", "4", "--workers", "1", "--quiet")
    line = one_line(r.stderr)
    assert r.returncode == 1 and "disk full" in line and str(disk / "out") in line, line
    assert not list((disk / "out").rglob(".*.tmp")), "a half-written file was left behind"
    assert not (disk / "out" / "meta.json").exists()
    subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
    r = run_script("scripts/preprocess.py", *map(str, args), "--per-file", "4", "--workers", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert len(names_in(disk / "out")) == 12 and len(names_in(disk / "out", "val")) == 6


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: errno = 28)"),  # from a write
    RuntimeError("Disable slist on flush dest failure failed (file write failed: time = Mon Nov 23 15:53:38 2026, "
                 "filename = 'x.tmp', file descriptor = 16, errno = 28, error message = 'No space left on device')"),
], ids=["write", "close"])
def test_injected_enospc_in_a_worker_names_the_batch_file_and_leaves_no_temporary(train, tmp_path, monkeypatch,
                                                                                 capsys, error):
    def full(f, name, data):  # as HDF5 reports it: an errno (or only its text) and a message naming no file
        raise error
    monkeypatch.setattr(batchfile, "_write_contiguous", full)  # the forked workers inherit it
    out = tmp_path / "out"
    assert main(["--train-dir", str(train), "--out", str(out), *SIZE]) == 1
    line = one_line(capsys.readouterr().err)
    assert "disk full (no space left on device)" in line and str(out / "train") in line and ".h5" in line, line
    assert not list(out.rglob(".*.tmp")) and not list(out.rglob("*.h5"))


def test_a_worker_killed_while_writing_leaves_no_temporary(train, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(batchfile, "_write_contiguous", lambda f, name, data: os.kill(os.getpid(), signal.SIGKILL))
    out = tmp_path / "out"
    assert main(["--train-dir", str(train), "--out", str(out), *SIZE]) == 1
    assert "worker process died" in one_line(capsys.readouterr().err)
    assert not list(out.rglob(".*.tmp")), "the killed worker's unfinished file is still there"


@pytest.mark.parametrize("how", ["read-only", "a file"])
def test_an_out_that_cannot_be_written_exits_2_before_any_work(train, tmp_path, tmpfs, how):
    out = tmpfs("size=1m,ro") / "out" if how == "read-only" else tmp_path / "plain.txt"
    if how == "a file":
        out.write_text("x")
    r = cli("--train-dir", train, "--out", out)
    line = one_line(r.stderr)
    assert r.returncode == 2 and str(out) in line
    assert ("read-only file system" if how == "read-only" else "is a file") in line


def test_an_unreadable_class_folder_is_named_not_taken_for_empty(train, tmp_path, monkeypatch, capsys):
    """As root chmod 000 does not refuse anything, so the refusal is injected where the folder is listed."""
    victim, scandir = str(train / wnid(1)), os.scandir

    def refuse(path="."):
        if os.fspath(path) == victim:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), victim)
        return scandir(path)
    monkeypatch.setattr(os, "scandir", refuse)
    assert main(["--train-dir", str(train), "--out", str(tmp_path / "out"), *SIZE]) == 2
    assert one_line(capsys.readouterr().err) == f"preprocess: error: {victim}: permission denied"


# -- images no decoder should try ----------------------------------------------------------------

def test_a_decompression_bomb_is_skipped_and_listed(train, tmp_path):
    (train / wnid(0) / "bomb.png").write_bytes(png_declaring(60000, 60000))
    out = tmp_path / "out"
    r = cli("--train-dir", train, "--out", out)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert [(d["path"], d["reason"].split(":")[0]) for d in report["skipped"]] == [
        (f"train/{wnid(0)}/bomb.png", "DecompressionBombError")]
    assert len(names_in(out)) == 12


# -- label and class files -----------------------------------------------------------------------

def flat_val(tree: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """The val images in one flat folder, and their Caffe lines."""
    flat, lines = tmp_path / "flat", []
    flat.mkdir()
    for c, folder in enumerate(sorted((tree / "val").iterdir())):
        for image in sorted(folder.iterdir()):
            shutil.copy(image, flat / image.name)
            lines.append(f"{image.name} {c}")
    return flat, lines


@pytest.mark.parametrize("encode", [lambda t: ("\ufeff" + t).encode(), lambda t: t.replace("\n", "\r\n").encode(),
                                    lambda t: ("\ufeff" + t.replace("\n", "\r\n")).encode()],
                         ids=["bom", "crlf", "bom+crlf"])
@pytest.mark.parametrize("kind", ["caffe", "kaggle"])
def test_label_files_with_a_byte_order_mark_or_crlf_read_as_plain_ones(tree, tmp_path, encode, kind):
    flat, lines = flat_val(tree, tmp_path)
    if kind == "caffe":
        text, name = "".join(f"{line}\n" for line in lines), "val.txt"
    else:
        rows = [f"{Path(n).stem},{wnid(int(c))} 1 1 2 2" for n, c in (line.split() for line in lines)]
        text, name = "ImageId,PredictionString\n" + "".join(f"{row}\n" for row in rows), "LOC_val_solution.csv"
    (tmp_path / name).write_bytes(encode(text))
    out = tmp_path / "out"
    r = cli("--train-dir", tree / "train", "--val-dir", flat, "--val-labels", tmp_path / name, "--out", out)
    assert r.returncode == 0, r.stderr
    labels = {n: int(lab) for f in (out / "val").glob("*.h5") for _, lab, n in zip(*read_batch_file(f))}
    assert labels == {n: int(c) for n, c in (line.split() for line in lines)}


def test_a_label_file_that_is_not_utf8_is_named(tree, tmp_path):
    flat, lines = flat_val(tree, tmp_path)
    (tmp_path / "val.txt").write_bytes(b"\xff\xfe" + "\n".join(lines).encode("utf-16-le"))
    r = cli("--train-dir", tree / "train", "--val-dir", flat, "--val-labels", tmp_path / "val.txt",
            "--out", tmp_path / "out")
    assert r.returncode == 2 and f"label file {tmp_path / 'val.txt'} is not UTF-8" in one_line(r.stderr)


def test_classes_file_listing_a_wnid_twice_is_refused_and_a_bom_is_not_a_wnid(tree, tmp_path):
    listed = tmp_path / "classes.txt"
    listed.write_text(f"\ufeff{wnid(0)} tench\n{wnid(2)}\n{wnid(0)}\n")
    r = cli("--train-dir", tree / "train", "--out", tmp_path / "out", "--classes", listed)
    assert r.returncode == 2 and f"{wnid(0)} is listed twice (lines 1 and 3)" in one_line(r.stderr)
    listed.write_text(f"\ufeff{wnid(0)} tench\n{wnid(2)}\n")
    r = cli("--train-dir", tree / "train", "--out", tmp_path / "out", "--classes", listed)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["classes"] == [wnid(0), wnid(2)]


# -- the output folder ---------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"\x00\xff binary", b"[1, 2]", b'{"splits": {"train": 3}}'])
def test_a_damaged_plan_json_is_named(train, tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_bytes(content)
    r = cli("--train-dir", train, "--out", out)
    assert r.returncode == 2 and f"{out / 'plan.json'} is damaged" in one_line(r.stderr)


def test_an_input_folder_where_the_output_goes_is_refused(train, tmp_path):
    r = cli("--train-dir", train, "--out", train.parent)  # out/train would be the train dir itself
    # refused as --out is read: its train/ holds class folders, not batch files (preprocess's own check of
    # the inputs, "is where --out writes its batch files", comes after it)
    assert r.returncode == 2 and "holds 'train', which has this tool's name but is not a folder of preprocess's " \
        "batch files" in one_line(r.stderr)
    assert not list(train.rglob("*.h5"))


def test_a_second_run_into_the_same_out_names_the_first(train, tmp_path):
    out = tmp_path / "out"
    with exclusive(out):
        r = cli("--train-dir", train, "--out", out)
    line = one_line(r.stderr)
    assert r.returncode == 2 and str(out) in line and f"pid {os.getpid()}" in line, line
