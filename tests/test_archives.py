"""ImageNet as downloaded (issue 15): the train tar of per-class tars, the val tar with the devkit, Hugging
Face gzip shards, read in place; bad archives; the index kept with the output; kill -9 and resume.

Every distribution format is rebuilt from the synthetic tree (data.distributions), so a user's clone tests
every route; the folder route (the session's `prep`: Kaggle CSV labels) is the reference.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import data.archives as archives
from data.distributions import write_formats, write_val_tar
from data.preprocess import Options, preprocess
from data.procs import child_pids
from data.synthetic import synthetic_tree
from tests import children
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


@pytest.mark.processes
@pytest.mark.parametrize("route", ["tar+devkit", "hf", "hf+kaggle val", "folder+val tar"])
def test_every_route_gives_the_folder_routes_batch_files(route, route_out, prep):
    out = route_out(route)
    same_batches(out, prep[0])  # bitwise: images, labels, names; and the mean image
    a, b = (json.loads((o / "report.json").read_text())["counts"] for o in (out, prep[0]))
    assert a == b
    assert json.loads((out / "meta.json").read_text())["classes"] == json.loads(
        (prep[0] / "meta.json").read_text())["classes"]


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
def test_archive_truncated_mid_run_stops_keeps_files_and_resumes(formats, route_out, tmp_path):
    tar = tmp_path / "ILSVRC2012_img_train.tar"
    shutil.copy(formats["train_tar"], tar)
    good = tar.read_bytes()
    out = tmp_path / "out"
    args = _args(tar, formats["val_tar"], formats["devkit"], out)
    proc = start_slow([*args, "--quiet"])
    wait_for_files(out / "train", 2, proc)
    os.truncate(tar, len(good) // 2)
    _, err = children.communicate(proc, cpu_s=60)
    assert proc.returncode == 2, err
    assert str(tar) in err and "finished batch files are kept" in err
    done = list((out / "train").glob("[0-9]*.h5"))
    assert done and not (out / "meta.json").exists()
    tar.write_bytes(good)  # downloaded again: a new mtime, so it is indexed again
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "changed since it was indexed" in r.stderr
    same_batches(out, route_out("tar+devkit"))


@pytest.mark.processes
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


@pytest.mark.processes
@pytest.mark.parametrize("route", ["tar+devkit", "hf"])
def test_kill9_mid_run_then_rerun_equals_an_uninterrupted_run(route, formats, synth, route_out, tmp_path):
    """The hf run holds ~10 KB per streaming pass: one batch file per pass, so windows are exercised too."""
    out = tmp_path / "out"
    args = _args(*route_inputs(route, formats, synth[0]), out, *(["--shard-memory", 1e-5] if route == "hf" else []))
    proc = start_slow([*args, "--quiet"])
    wait_for_files(out / "train", 2, proc)
    workers = [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]
    proc.send_signal(signal.SIGKILL)
    children.communicate(proc, cpu_s=60)
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


@pytest.mark.processes
def test_ctrl_c_while_streaming_shards_stops_at_once(formats, tmp_path):
    """A pass over a shard takes ~5 s here; Ctrl-C must not wait for the passes to finish."""
    args = _args(formats["hf_train"], formats["hf_val"], None, tmp_path / "out", "--quiet")
    started = tmp_path / "started"  # the first member of a pass is read: a pass has ~5 s to go
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SHARDS.format(repo=str(REPO), started=str(started)),
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.wait_until(started.exists, proc, cpu_s=60, what="no member was read")
    start = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = children.communicate(proc, cpu_s=30)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert time.time() - start < 2.5


@pytest.mark.processes
def test_make_synthetic_formats_cli(tmp_path):
    r = run_script("scripts/make_synthetic.py", "--out", str(tmp_path / "src"), "--classes", "3", "--train-per-class",
                   "3", "--val-per-class", "2", "--min-side", "48", "--max-side", "64", "--formats")
    assert r.returncode == 0, r.stderr
    kit = tmp_path / "src" / "formats"
    r = cli("--train-dir", kit / "ILSVRC2012_img_train.tar", "--val-dir", kit / "ILSVRC2012_img_val.tar",
            "--val-labels", kit / "ILSVRC2012_devkit_t12.tar.gz", "--out", tmp_path / "out", "--size", 32)
    assert r.returncode == 0, r.stderr
    assert "train: 9 images written" in r.stdout and "val: 6 images written" in r.stdout


@pytest.mark.processes
def test_benchmark_routes_table(synth, tmp_path):
    """benchmark.py preprocess --routes: one row per route with its rates (the numbers are docs/preprocessing.md's)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench.preprocess_routes import route_rows
    rows = route_rows({"synthetic": synth[0] / "train"}, tmp_path, repeat=1)
    assert [r["what"] for r in rows] == [f"pipeline, synthetic, {k}" for k in
                                         ("folder", "train tar (pread)", "gzip shards (streamed)")]
    assert rows[0]["vs_folder"] == 1.0
    assert all(r["img_per_s"] > 0 and r["worker_cpu_img_per_s"] > 0 and r["run_cpu_img_per_s"] > 0 for r in rows)


# -- the index and the member reads by hand (fast: small archives written with Python's tarfile, which also
# gives the expected offsets and bytes; `make mutants` mutates data/archives.py against these) ------------------

MTIME = 1_300_000_000


def _ti(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size, ti.mtime = kind, link, size, MTIME
    return ti


def _write_tar(path: Path, members: list, mode: str = "w") -> Path:
    """members: (name, bytes) for a regular file, or a TarInfo as it is (no data); names' lone surrogates are
    written as the bytes they stand for (GNU format: no PAX header to hold them as UTF-8)."""
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT, errors="surrogateescape") as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                tf.addfile(_ti(m[0], size=len(m[1])), io.BytesIO(m[1]))
    return path


def _inner_tar(members: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for m in members:
            tf.addfile(m) if isinstance(m, tarfile.TarInfo) else tf.addfile(_ti(m[0], size=len(m[1])), io.BytesIO(m[1]))
    return buf.getvalue()


@pytest.fixture
def hand_tar(tmp_path) -> Path:
    inner = _inner_tar([("c.JPEG", b"ccc"), _ti("sub", tarfile.DIRTYPE), ("./d.JPEG", b"dddd"),
                        _ti("f", tarfile.FIFOTYPE)])
    return _write_tar(tmp_path / "train.tar", [
        _ti("n01", tarfile.DIRTYPE), ("./n01/b.JPEG", b"bbbbb"), ("n01/a.JPEG", b"a" * 600),
        _ti("n01/s.JPEG", tarfile.SYMTYPE, "b.JPEG"), _ti("n01/t.JPEG", tarfile.SYMTYPE, "../n09/x.JPEG"),
        _ti("n01/0.JPEG", tarfile.LNKTYPE, "./n01/b.JPEG"), _ti("n01/z.JPEG", tarfile.LNKTYPE, "n01/missing.JPEG"),
        _ti("n01/p.JPEG", tarfile.FIFOTYPE), _ti("n01/c.JPEG", tarfile.CHRTYPE), _ti("n01/k.JPEG", tarfile.BLKTYPE),
        _ti("n01/u.JPEG", b"Z"), ("n03.tar", inner), ("n02/e.JPEG", b"e")])


def _offsets(path: Path) -> dict:
    """name -> (data offset, size) by Python's tarfile; inner tars' members as (outer, inner)."""
    out = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            out[ti.name] = (ti.offset_data, ti.size)
            if ti.name.endswith(".tar"):
                with tarfile.open(fileobj=tf.extractfile(ti)) as inner:
                    for iti in inner:
                        out[ti.name, iti.name] = (ti.offset_data + iti.offset_data, iti.size)
    return out


def test_index_tar_by_hand(hand_tar):
    data, at = hand_tar.read_bytes(), _offsets(hand_tar)

    def row(name, key):
        offset, size = at[key]
        return [name, offset, size, zlib.crc32(data[offset - 512:offset])]

    rows, others = archives.index_tar(str(hand_tar))
    where = f"archive {hand_tar}"
    assert rows == [row("n01/0.JPEG", "./n01/b.JPEG"), row("n01/a.JPEG", "n01/a.JPEG"),
                    row(["n03.tar", "c.JPEG"], ("n03.tar", "c.JPEG")),
                    row(["n03.tar", "d.JPEG"], ("n03.tar", "./d.JPEG")),
                    row("n02/e.JPEG", "n02/e.JPEG")]
    assert others == [
        ["n01/z.JPEG", f"hard link to n01/missing.JPEG, which {where} does not hold as a file before it: not read"],
        ["n01/p.JPEG", "not a regular file (FIFO): not read"],
        ["n01/c.JPEG", "not a regular file (character device): not read"],
        ["n01/k.JPEG", "not a regular file (block device): not read"],
        ["n01/u.JPEG", "not a regular file (tar type b'Z'): not read"],
        ["n01/b.JPEG", "hard link to the same file as n01/0.JPEG: read once, under that name"],
        ["n01/s.JPEG", "symbolic link to the same file as n01/0.JPEG: read once, under that name"],
        ["n01/t.JPEG", f"symbolic link to ../n09/x.JPEG, which {where} does not hold as a file: not read"],
        [["n03.tar", "f"], "not a regular file (FIFO): not read"]]
    stamp = archives.stamp(str(hand_tar))
    st = hand_tar.stat()
    assert stamp == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    for (name, offset, size, crc), want in zip(rows, (b"bbbbb", b"a" * 600, b"ccc", b"dddd", b"e")):
        shown = name if isinstance(name, str) else ":".join(name)
        got = archives.read_member(archives.TarMember(str(hand_tar), shown, offset, size, crc), tuple(stamp))
        assert type(got) is bytearray and got == want, name


def test_sort_members_by_hand():
    sparse = _ti("s.JPEG", tarfile.GNUTYPE_SPARSE, size=10)
    sparse.sparse = [(0, 5)]
    members = [_ti("b.JPEG", size=1), _ti("./a.JPEG", tarfile.LNKTYPE, "b.JPEG"), sparse,
               _ti("d/c.JPEG", tarfile.SYMTYPE, "../b.JPEG"), _ti("x.JPEG", tarfile.LNKTYPE, "s.JPEG")]
    kept, others = archives.sort_members(members, "W")
    assert [(n, ti.name) for n, ti in kept] == [("a.JPEG", "b.JPEG")]  # read under the first name in name order
    assert others == [["s.JPEG", "sparse file (its data is not one run of bytes): not read"],
                      ["x.JPEG", "hard link to s.JPEG, which W does not hold as a file before it: not read"],
                      ["b.JPEG", "hard link to the same file as a.JPEG: read once, under that name"],
                      ["d/c.JPEG", "symbolic link to the same file as a.JPEG: read once, under that name"]]
    kept, others = archives.sort_members(members, "W", read_links=False)
    assert [(n, ti.name) for n, ti in kept] == [("b.JPEG", "b.JPEG")]
    assert others[2] == ["a.JPEG", "hard link to the same file as b.JPEG: read once, under that name"]
    # a name held twice stays twice; a hard link means the latest member of its target's name
    twice = [_ti("b.JPEG", size=1), _ti("b.JPEG", size=2), _ti("a.JPEG", tarfile.LNKTYPE, "b.JPEG")]
    kept, others = archives.sort_members(twice, "W")
    assert [(n, ti.size) for n, ti in kept] == [("b.JPEG", 1), ("a.JPEG", 2)]
    assert others == [["b.JPEG", "hard link to the same file as a.JPEG: read once, under that name"]]
    assert archives._clean("././x/./y") == "x/./y" and archives._clean(".x") == ".x"


def test_a_member_read_checks_the_archive(hand_tar, tmp_path):
    rows, _ = archives.index_tar(str(hand_tar))
    name, offset, size, crc = rows[1]
    stamp = tuple(archives.stamp(str(hand_tar)))
    member = archives.TarMember(str(hand_tar), name, offset, size, crc)
    changed = stamp[:1] + (stamp[1] + 1,) + stamp[2:]
    with pytest.raises(archives.ArchiveError) as e:
        archives.read_member(member, changed)
    assert str(e.value) == (f"archive {hand_tar} changed since it was indexed (size, mtime, inode or ctime); "
                            "re-run the same command to index it again")
    past = archives.TarMember(str(hand_tar), "n01/far.JPEG", stamp[0] - 100, 600, crc)
    with pytest.raises(archives.ArchiveError) as e:
        archives.read_member(past, stamp)
    assert str(e.value) == f"archive {hand_tar} is truncated: n01/far.JPEG needs bytes up to {stamp[0] + 500}"
    other = archives.TarMember(str(hand_tar), name, offset, size, rows[0][3])  # the header of another member
    with pytest.raises(archives.ArchiveError) as e:
        archives.read_member(other, stamp)
    assert str(e.value) == (f"archive {hand_tar}: member n01/a.JPEG changed since it was indexed (the header "
                            "before its data now holds 'n01/a.JPEG', 600 bytes; indexed: 600 bytes): "
                            f"{archives.CHANGED}")
    inside = archives.TarMember(str(hand_tar), "n01/\udcff.JPEG", offset + 512, 10, crc)  # a block of data, no header
    with pytest.raises(archives.ArchiveError) as e:
        archives.read_member(inside, stamp)
    assert str(e.value).startswith(f"archive {hand_tar}: member n01/\\xff.JPEG changed since it was indexed (the "
                                   "header before its data now holds no tar header (")
    folder = tmp_path / "folder.tar"  # opens, but reads fail
    folder.mkdir()
    with pytest.raises(archives.ArchiveError, match=f"^cannot read {re.escape(str(folder))}:x \\(Is a directory\\)$"):
        archives.read_member(archives.TarMember(str(folder), "x", 512, 1, 0), tuple(archives.stamp(str(folder))))
    odd = _write_tar(tmp_path / "odd.tar", [("n01/\udcff.JPEG", b"odd")])  # a name that is not UTF-8
    odd_rows, _ = archives.index_tar(str(odd))
    assert odd_rows[0][0] == "n01/\udcff.JPEG"
    with pytest.raises(archives.ArchiveError) as e:
        archives.read_member(archives.TarMember(str(odd), odd_rows[0][0], odd_rows[0][1], 3, 0),
                             tuple(archives.stamp(str(odd))))
    assert "the header before its data now holds 'n01/\\\\xff.JPEG', 3 bytes; indexed: 3 bytes" in str(e.value)
    gone = tmp_path / "gone.tar"
    with pytest.raises(archives.ArchiveError, match=f"^cannot read archive {re.escape(str(gone))} \\(No such file or "
                                                    "directory\\)$"):
        archives.read_member(archives.TarMember(str(gone), name, offset, size, crc), stamp)
    with pytest.raises(archives.ArchiveError, match=f"^cannot read archive {re.escape(str(gone))} \\(No such file"):
        archives.stamp(str(gone))


def test_member_reads_reopen_a_replaced_archive_and_forget_descriptors_after_fork(hand_tar, tmp_path, monkeypatch):
    rows, _ = archives.index_tar(str(hand_tar))
    member = archives.TarMember(str(hand_tar), *rows[1])
    assert archives.read_member(member, tuple(archives.stamp(str(hand_tar)))) == b"a" * 600
    first = archives._fds[str(hand_tar)]
    assert first[1:] == (hand_tar.stat().st_dev, hand_tar.stat().st_ino)
    assert archives.read_member(member, tuple(archives.stamp(str(hand_tar)))) == b"a" * 600
    assert archives._fds[str(hand_tar)] == first  # kept open between reads: a read opens nothing
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    assert archives.read_member(member, tuple(archives.stamp(str(hand_tar)))) == b"a" * 600
    assert opened == []
    monkeypatch.undo()
    copy = tmp_path / "copy.tar"
    shutil.copy(hand_tar, copy)
    os.replace(copy, hand_tar)  # the same bytes under another inode
    assert archives.read_member(member, tuple(archives.stamp(str(hand_tar)))) == b"a" * 600
    second = archives._fds[str(hand_tar)]
    assert second[2] == hand_tar.stat().st_ino != first[2]
    try:  # the old descriptor was closed (its number may have been given to the new one)
        leaked = os.fstat(first[0]).st_ino == first[2]
    except OSError:
        leaked = False
    assert not leaked
    archives._reset_after_fork()  # what a forked child runs: the parent's descriptors closed, none kept
    assert archives._fds == {}
    with pytest.raises(OSError):
        os.fstat(second[0])


def test_a_window_is_a_readable_seekable_file(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(50)))
    fd = os.open(path, os.O_RDONLY)
    try:
        window = archives._Window(fd, 10, 20)
        f = io.BufferedReader(window, buffer_size=4)  # refuses a raw file that is not readable
        assert f.read(5) == bytes(range(10, 15)) and f.seek(-3, io.SEEK_END) == 17 and f.read() == bytes(range(27, 30))
        assert f.seek(2) == 2 and f.read(2) == bytes([12, 13]) and f.read(0) == b"" and window.seekable()
        assert window.seek(5, io.SEEK_CUR) == window.tell() and f.seek(100) == 100 and f.read() == b""
    finally:
        os.close(fd)


NOISE = np.random.default_rng(0).bytes(20_000)  # does not compress: a cut 5 kB before the end falls inside it


def _shard(path: Path) -> Path:
    return _write_tar(path, [("b.JPEG", b"b" * 100), _ti("a.JPEG", tarfile.LNKTYPE, "b.JPEG"),
                             _ti("d", tarfile.DIRTYPE), ("c.JPEG", NOISE), _ti("l.JPEG", tarfile.SYMTYPE, "zz.JPEG"),
                             ("e.JPEG", b"e")], mode="w:gz")


def _stream_error(path: Path) -> str:
    """What Python's tarfile says reading the whole stream."""
    try:
        with tarfile.open(path, "r|gz") as tf:
            for ti in tf:
                tf.extractfile(ti).read() if ti.isreg() else None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{path} reads whole")


def test_index_shard_and_collect_by_hand(tmp_path):
    shard = _shard(tmp_path / "s.tar.gz")
    at = _offsets(shard)
    rows, others = archives.index_shard(str(shard))
    assert rows == [["b.JPEG", *at["b.JPEG"]], ["c.JPEG", *at["c.JPEG"]], ["e.JPEG", *at["e.JPEG"]]]
    assert others == [["a.JPEG", "hard link to the same file as b.JPEG: read once, under that name"],
                      ["l.JPEG", f"symbolic link to zz.JPEG, which gzip shard {shard} does not hold as a file: not "
                                 "read"]]
    assert archives.collect(str(shard), {"c.JPEG": at["c.JPEG"], "e.JPEG": at["e.JPEG"]}) == {
        "c.JPEG": NOISE, "e.JPEG": b"e"}
    off_c = at["c.JPEG"][0]
    with pytest.raises(archives.ArchiveError) as e:
        archives.collect(str(shard), {"c.JPEG": (off_c, 19_999)})
    assert str(e.value) == (f"gzip shard {shard}: member c.JPEG changed since it was indexed (now 20000 bytes at "
                            f"{off_c} of the stream, indexed 19999 at {off_c}): {archives.CHANGED}")
    with pytest.raises(archives.ArchiveError) as e:  # a hard link is not the member it names
        archives.collect(str(shard), {"b.JPEG": at["b.JPEG"], "w.JPEG": (0, 1), "a.JPEG": at["b.JPEG"]})
    assert str(e.value) == (f"gzip shard {shard} no longer holds 2 member(s) it was indexed with (e.g. a.JPEG): it "
                            f"changed since it was indexed; {archives.CHANGED}")
    stop = threading.Event()
    stop.set()
    with pytest.raises(archives.Stopped):
        archives.index_shard(str(shard), stop)
    with pytest.raises(archives.Stopped):
        archives.collect(str(shard), {"e.JPEG": at["e.JPEG"]}, stop)
    assert archives.index_shard(str(shard), threading.Event())[0] == rows


def test_a_cut_shard_is_named_and_collect_stops_once_it_has_its_members(tmp_path):
    shard = _shard(tmp_path / "s.tar.gz")
    at = _offsets(shard)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(shard.read_bytes()[:-5000])  # from inside c.JPEG on
    message = f"gzip shard {cut} is unreadable or truncated ({_stream_error(cut)}); download it again"
    with pytest.raises(archives.ArchiveError) as e:
        archives.index_shard(str(cut))
    assert str(e.value) == message
    with pytest.raises(archives.ArchiveError) as e:
        archives.collect(str(cut), {"e.JPEG": at["e.JPEG"], "zz.JPEG": (0, 1)})
    assert str(e.value) == message
    assert archives.collect(str(cut), {"b.JPEG": at["b.JPEG"]}) == {"b.JPEG": b"b" * 100}  # no full pass


def test_fingerprints_by_hand(hand_tar, tmp_path):
    big = tmp_path / "big.tar.gz"
    big.write_bytes(os.urandom(200_000))
    data = big.read_bytes()
    assert archives._edges(str(big)) == [zlib.crc32(data[:65536]), zlib.crc32(data[-65536:])]
    small = tmp_path / "small.tgz"
    small.write_bytes(b"0123456789")
    assert archives._edges(str(small)) == [zlib.crc32(b"0123456789")] * 2
    rows, others = archives.index_tar(str(hand_tar))
    now = archives.stamp(str(hand_tar))
    entry = {"kind": "tar", "stamp": now, "members": rows, "others": others}
    assert archives._changed(str(hand_tar), entry, now) is None
    assert archives._changed(str(hand_tar), entry, [now[0] + 1, *now[1:]]) == "size, mtime, inode or ctime"
    with open(hand_tar, "r+b") as f:  # the headers between the first and the last: not looked at
        for row in rows[1:-1]:
            f.seek(row[1] - 512)
            f.write(b"X")
    assert archives._changed(str(hand_tar), entry, now) is None
    with open(hand_tar, "r+b") as f:
        f.seek(rows[-1][1] - 512)
        f.write(b"X")
    assert archives._changed(str(hand_tar), entry, now) == "the header of its first or last member"
    assert archives._changed(str(hand_tar), {"stamp": now}, now) == "cannot be checked ('kind')"
    gone = str(tmp_path / "gone.tar")
    assert archives._changed(gone, entry, now) == (f"cannot be checked ([Errno 2] No such file or directory: "
                                                   f"'{gone}')")


def test_with_stop_runs_side_by_side_and_stops_the_others():
    assert archives.with_stop(lambda x, stop: x * 2, [3, 1, 2], 2) == [6, 2, 4]
    assert archives.with_stop(lambda x, stop: x, [5], 0) == [5]  # at least one thread
    barrier = threading.Barrier(2, timeout=10)
    assert archives.with_stop(lambda x, stop: (barrier.wait(), x)[1], [1, 2], 2) == [1, 2]
    waited = []

    def fn(x, stop):
        if x == 0:
            raise ValueError("boom")
        waited.append(stop.wait(10))
        return x
    with pytest.raises(ValueError, match="boom"):
        archives.with_stop(fn, [0, 1], 2)
    assert waited == [True]


def test_bad_tars_and_archive_kinds_by_hand(hand_tar, tmp_path):
    gone = tmp_path / "gone.tar"
    with pytest.raises(archives.ArchiveError, match=f"^cannot open archive {re.escape(str(gone))} \\(No such file or "
                                                    "directory\\)$"):
        archives.index_tar(str(gone))
    data, at = hand_tar.read_bytes(), _offsets(hand_tar)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:at["n01/a.JPEG"][0] - 512])  # ends at a header boundary: tarfile stops quietly
    with pytest.raises(archives.ArchiveError) as e:
        archives.index_tar(str(cut))
    assert str(e.value) == (f"{cut} ends without tar's end-of-archive block after 2 members: truncated? (download it "
                            "again)")
    inner = _inner_tar([("c.JPEG", b"ccc")])
    short = tmp_path / "short.tar"  # an inner tar cut at a block boundary inside a complete outer one
    _write_tar(short, [("n04.tar", inner[:1024])])
    with pytest.raises(archives.ArchiveError) as e:
        archives.index_tar(str(short))
    assert str(e.value) == (f"{short}:n04.tar ends without tar's end-of-archive block after 1 members: truncated? "
                            "(download it again)")
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 64)
    try:
        tarfile.open(junk, "r:").close()  # plain tar, as an uncompressed archive is read
    except tarfile.TarError as err:
        expected = str(err)
    with pytest.raises(archives.ArchiveError) as e:
        archives.index_tar(str(junk))
    assert str(e.value) == f"archive {junk} is unreadable or truncated ({expected}); download it again"
    for name, kind in (("a.tar.gz", "shard"), ("A.TGZ", "shard"), ("x.Tar", "tar"), ("x.tar.bz2", None),
                       ("x.zip", None), (tmp_path / "p.tar", "tar")):
        assert archives.archive_kind(name) == kind, name


@pytest.mark.processes
@pytest.mark.parametrize("route", ["tar", "folder"])
def test_a_train_folder_inside_a_tar_or_a_folder_is_taken_for_its_class_folders(route, synth, prep, tmp_path):
    """`tar cf train.tar -C SRC train` (members train/<wnid>/<image>), and the folder SRC holding train/: the
    class folders inside are the source, as given directly (the tar became one class 'train', every label 0,
    and training it reported loss 0.0 and error 0.0)."""
    root = synth[0]
    if route == "tar":
        train = tmp_path / "train.tar"
        with tarfile.open(train, "w") as t:
            t.add(root / "train", arcname="train")
    else:
        train = tmp_path / "src"
        shutil.copytree(root / "train", train / "train")
    out = tmp_path / "out"
    preprocess(train, out, root / "val", root / "LOC_val_solution.csv", OPTS, workers=2, quiet=True)
    same_batches(out, prep[0])
    assert json.loads((out / "meta.json").read_text())["classes"] == json.loads(
        (prep[0] / "meta.json").read_text())["classes"]


@pytest.mark.processes  # preprocess's workers and the scripts
@pytest.mark.parametrize("layout, words", [
    ({"n01440764": 2}, "gives one class, 'n01440764'"),
    ({"train": 2, "val": 1}, "gives a class named 'train', like a split"),
])
def test_one_class_or_a_class_named_like_a_split_is_taken_for_a_layout_mistake(tmp_path, layout, words):
    from PIL import Image

    from data.layouts import DataError
    for folder, n in layout.items():
        (tmp_path / "train" / folder).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (8, 8)).save(tmp_path / "train" / folder / f"{i}.png")
    with pytest.raises(DataError, match=words + ".*pass --allow-one-class"):
        preprocess(tmp_path / "train", tmp_path / "out", opts=Options(size=8, per_file=4), workers=1, quiet=True)
    assert not (tmp_path / "out" / "meta.json").exists()
    preprocess(tmp_path / "train", tmp_path / "out", opts=Options(size=8, per_file=4), workers=1, quiet=True,
               allow_one_class=True)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["classes"] == sorted(layout)


def test_a_ctrl_c_during_a_shard_pass_inside_preprocess_pools_block_stops_the_pass():
    """preprocess runs its shard passes inside its process pool's stops_between_calls block: a Ctrl-C there
    stops the pass (each shard gives up at its next member), not only after every shard was read whole."""
    from data.procs import stops_between_calls
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    read = []

    def one_pass(shard: str, stop: threading.Event) -> str:
        for member in range(500):  # 5 s a shard, unless asked to give up
            if stop.is_set():
                return shard
            if shard == "a" and member == 3:
                os.kill(os.getpid(), signal.SIGINT)
            read.append(member)
            time.sleep(0.01)
        return shard
    with stops_between_calls():  # preprocess's pool's block
        with pytest.raises(KeyboardInterrupt):
            archives.with_stop(one_pass, ["a", "b"], 2)
    assert len(read) < 2 * 500  # neither pass ran to its end (before: both did, then the Ctrl-C came)
