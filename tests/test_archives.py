"""ImageNet as downloaded (issue 15): the train tar of per-class tars, the val tar with the devkit, Hugging
Face gzip shards, read in place; bad archives; the index kept with the output; kill -9 and resume.

Every distribution format is rebuilt from the synthetic tree (data.distributions), so a user's clone tests
every route; the folder route (the session's `prep`: Kaggle CSV labels) is the reference.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import data.archives as archives
from data.distributions import write_formats, write_val_tar
from data.preprocess import Options, preprocess
from data.procs import child_pids
from data.synthetic import synthetic_tree
from tests.conftest import REPO, run_script
from tests.test_preprocess import cli, cmdline, same_batches, same_output, start_slow, wait_for_files

OPTS = Options(size=64, per_file=8)


@pytest.fixture(scope="module")
def formats(synth, tmp_path_factory) -> dict:
    tree = synthetic_tree(synth[0])
    return {**write_formats(tree, tmp_path_factory.mktemp("formats")), "tree": tree}


def route_inputs(name: str, f: dict, root: Path) -> tuple:
    """(train, val, val labels) of a route; the tree's own folders serve the Kaggle parts."""
    return {"tar+devkit": (f["train_tar"], f["val_tar"], f["devkit"]),
            "hf": (f["hf_train"], f["hf_val"], None),
            "hf+kaggle val": (f["hf_train"], root / "val", root / "LOC_val_solution.csv"),
            "folder+val tar": (root / "train", f["val_tar"], root / "val.txt")}[name]


@pytest.fixture(scope="module")
def route_out(formats, synth, tmp_path_factory):
    """The output of a route, run once per module (2 workers, as `prep`)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            out = tmp_path_factory.mktemp(name.replace(" ", "_").replace("+", "_"))
            train, val, labels = route_inputs(name, formats, synth[0])
            preprocess(train, out, val, labels, OPTS, workers=2, quiet=True)
            done[name] = out
        return done[name]
    return get


@pytest.mark.parametrize("route", ["tar+devkit", "hf", "hf+kaggle val", "folder+val tar"])
def test_every_route_gives_the_folder_routes_batch_files(route, route_out, prep):
    out = route_out(route)
    same_batches(out, prep[0])  # bitwise: images, labels, names; and the mean image
    a, b = (json.loads((o / "report.json").read_text())["counts"] for o in (out, prep[0]))
    assert a == b
    assert json.loads((out / "meta.json").read_text())["classes"] == json.loads(
        (prep[0] / "meta.json").read_text())["classes"]


def test_members_are_reported_as_archive_colon_member(route_out, formats, synth):
    _, manifest = synth
    skips = [q for q in manifest["quirks"] if q["expect"] == "skip" and q["split"] == "train"]
    tar, (shard0, shard1) = str(formats["train_tar"]), map(str, formats["hf_train"])
    report = json.loads((route_out("tar+devkit") / "report.json").read_text())
    skipped = {d["path"]: d["reason"] for d in report["skipped"]}
    for q in skips:  # a truncated, an empty and a garbage JPEG inside the per-class tars
        wnid, name = q["path"].split("/")
        assert skipped[f"{tar}:{wnid}.tar:{name}"]
    assert all("0x" not in r and "BytesIO" not in r for r in skipped.values())  # no memory addresses
    ignored = {d["path"] for d in report["ignored"]}
    assert f"{tar}:README.txt" in ignored and any(p.startswith(f"{tar}:") and p.endswith(":notes.txt") for p in ignored)
    hf = {d["path"] for d in json.loads((route_out("hf") / "report.json").read_text())["skipped"]}
    for q in skips:
        wnid, name = q["path"].split("/")
        member = f"{name[:-len('.JPEG')]}_{wnid}.JPEG"
        assert f"{shard0}:{member}" in hf or f"{shard1}:{member}" in hf


# -- bad archives ----------------------------------------------------------------------------------


def _truncate(src: Path, dst: Path, keep: int | None = None) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2 if keep is None else keep])
    return dst


def _member_boundary(tar: Path) -> int:
    """The end of the second-to-last member: a whole class is missing and only the absent end-of-archive
    blocks tell (tarfile itself stops there without a word)."""
    with tarfile.open(tar) as tf:
        member = tf.getmembers()[-2]
    return ((member.offset_data + member.size + 511) // 512) * 512


@pytest.mark.parametrize("which", ["train tar", "train tar at a member boundary", "val tar", "shard"])
def test_truncated_archive_exits_2_naming_it(formats, tmp_path, which):
    f = dict(formats)
    if which == "train tar":
        bad = f["train_tar"] = _truncate(f["train_tar"], tmp_path / "train.tar")
    elif which == "train tar at a member boundary":
        bad = f["train_tar"] = _truncate(f["train_tar"], tmp_path / "train.tar", _member_boundary(f["train_tar"]))
    elif which == "val tar":
        bad = f["val_tar"] = _truncate(f["val_tar"], tmp_path / "val.tar")
    else:
        bad = tmp_path / "train_images_0.tar.gz"
        f["hf_train"] = [_truncate(f["hf_train"][0], bad), f["hf_train"][1]]
    route = "hf" if which == "shard" else "tar+devkit"
    out = tmp_path / "out"
    r = cli(*_args(*route_inputs(route, f, Path()), out))
    assert r.returncode == 2, r.stderr
    assert str(bad) in r.stderr and "truncated" in r.stderr
    assert not list(out.rglob("*.h5"))  # found while indexing, before any work


def _args(train, val, labels, out: Path, *extra) -> list:
    """A preprocess.py command line (without --quiet, which cli() adds)."""
    trains = train if isinstance(train, list) else [train]
    vals = val if isinstance(val, list) else [val]
    return ["--train-dir", *trains, "--val-dir", *vals, *(["--val-labels", labels] if labels else []),
            "--out", out, "--size", 64, "--per-file", 8, "--workers", 2, *extra]


def test_archive_truncated_mid_run_stops_keeps_files_and_resumes(formats, route_out, tmp_path):
    tar = tmp_path / "ILSVRC2012_img_train.tar"
    shutil.copy(formats["train_tar"], tar)
    good = tar.read_bytes()
    out = tmp_path / "out"
    args = _args(tar, formats["val_tar"], formats["devkit"], out)
    proc = start_slow([*args, "--quiet"])
    wait_for_files(out / "train", 2, proc)
    os.truncate(tar, len(good) // 2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert str(tar) in err and "finished batch files are kept" in err
    done = list((out / "train").glob("[0-9]*.h5"))
    assert done and not (out / "meta.json").exists()
    tar.write_bytes(good)  # downloaded again: a new mtime, so it is indexed again
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "changed since it was indexed" in r.stderr
    same_batches(out, route_out("tar+devkit"))


def test_index_is_reused_and_a_changed_archive_indexed_again(formats, route_out, tmp_path, monkeypatch, capfd):
    names = ("train_tar", "val_tar", "devkit")
    copies = {k: tmp_path / Path(formats[k]).name for k in names}
    for k in names:
        shutil.copy(formats[k], copies[k])
    out = tmp_path / "out"
    preprocess(copies["train_tar"], out, copies["val_tar"], copies["devkit"], OPTS, workers=2, quiet=True)
    index = json.loads((out / archives.INDEX_NAME).read_text())
    assert set(index["archives"]) == {str(copies["train_tar"]), str(copies["val_tar"])}

    def no_rescan(path):
        raise AssertionError(f"{path} was indexed again")
    monkeypatch.setattr(archives, "index_tar", no_rescan)
    (out / "meta.json").unlink()
    preprocess(copies["train_tar"], out, copies["val_tar"], copies["devkit"], OPTS, workers=2, quiet=True)
    monkeypatch.undo()
    # the same val images in another member order: other offsets; a stale index would read wrong bytes
    write_val_tar(formats["tree"].val, copies["val_tar"], seed=7)
    for f in (out / "val").glob("*.h5"):
        f.unlink()
    capfd.readouterr()
    preprocess(copies["train_tar"], out, copies["val_tar"], copies["devkit"], OPTS, workers=2, quiet=True)
    assert "changed since it was indexed" in capfd.readouterr().err
    same_batches(out, route_out("tar+devkit"))  # (report.json names the copies, not the originals)


# -- kill -9 and resume ----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["tar+devkit", "hf"])
def test_kill9_mid_run_then_rerun_equals_an_uninterrupted_run(route, formats, synth, route_out, tmp_path):
    """The hf run holds ~10 KB per streaming pass: one batch file per pass, so windows are exercised too."""
    out = tmp_path / "out"
    args = _args(*route_inputs(route, formats, synth[0]), out, *(["--shard-memory", 1e-5] if route == "hf" else []))
    proc = start_slow([*args, "--quiet"])
    wait_for_files(out / "train", 2, proc)
    workers = [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.time() + 30
    while any(Path(f"/proc/{p}").exists() for p in workers):  # they follow their parent (PDEATHSIG)
        assert time.time() < deadline, "workers outlived the killed run"
        time.sleep(0.05)
    assert not (out / "meta.json").exists()
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    same_output(out, route_out(route))


SLOW_SHARDS = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
import data.archives as a
import data.preprocess as p
_orig = a._members_of
def slow(tf, stop):
    for ti in _orig(tf, stop):
        time.sleep(0.2)
        Path({started!r}).touch()
        yield ti
a._members_of = slow
from data.preprocess_cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_streaming_shards_stops_at_once(formats, tmp_path):
    """A pass over a shard takes ~5 s here; Ctrl-C must not wait for the passes to finish."""
    args = _args(formats["hf_train"], formats["hf_val"], None, tmp_path / "out", "--quiet")
    started = tmp_path / "started"  # the first member of a pass is read: a pass has ~5 s to go
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SHARDS.format(repo=str(REPO), started=str(started)),
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not started.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    start = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert time.time() - start < 2.5


def test_make_synthetic_formats_cli(tmp_path):
    r = run_script("scripts/make_synthetic.py", "--out", str(tmp_path / "src"), "--classes", "3", "--train-per-class",
                   "3", "--val-per-class", "2", "--min-side", "48", "--max-side", "64", "--formats")
    assert r.returncode == 0, r.stderr
    kit = tmp_path / "src" / "formats"
    r = cli("--train-dir", kit / "ILSVRC2012_img_train.tar", "--val-dir", kit / "ILSVRC2012_img_val.tar",
            "--val-labels", kit / "ILSVRC2012_devkit_t12.tar.gz", "--out", tmp_path / "out", "--size", 32)
    assert r.returncode == 0, r.stderr
    assert "train: 9 images written" in r.stdout and "val: 6 images written" in r.stdout


def test_benchmark_routes_table(synth, tmp_path):
    """benchmark.py preprocess --routes: one row per route with its rates (the numbers are docs/preprocessing.md's)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench.preprocess_routes import route_rows
    rows = route_rows({"synthetic": synth[0] / "train"}, tmp_path, repeat=1)
    assert [r["what"] for r in rows] == [f"pipeline, synthetic, {k}" for k in
                                         ("folder", "train tar (pread)", "gzip shards (streamed)")]
    assert rows[0]["vs_folder"] == 1.0
    assert all(r["img_per_s"] > 0 and r["worker_cpu_img_per_s"] > 0 and r["run_cpu_img_per_s"] > 0 for r in rows)
