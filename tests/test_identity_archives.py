"""Issue 26, classes 2 and 3: archive members are trusted by what they are, not by their names, and an
archive's index by its content, not by the archive's name, size and mtime.

Every archive here is hand-made with Python's tarfile; what it must give is what the intact tree gives.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import zlib
from pathlib import Path

import pytest

import data.archives as archives
from data.archives import ArchiveError
from data.distributions import write_train_tar, write_val_tar
from data.preprocess import Options, preprocess
from tests.test_preprocess import cli, same_batches

OPTS = Options(size=32, per_file=8)
CLASS = "n01440764"


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size, ti.mtime = kind, link, len(data), 1_300_000_000
    tf.addfile(ti, io.BytesIO(data) if data else None)


def _image(synth) -> bytes:
    return sorted((synth[0] / "train" / CLASS).glob("*_00001.JPEG"))[0].read_bytes()


def _train_tar_with(synth, tmp_path: Path, extra) -> Path:
    """The synthetic train tree as ImageNet's train tar (inner per-class tars), `extra(tf)` appended."""
    path = write_train_tar(synth[0] / "train", tmp_path / "ILSVRC2012_img_train.tar")
    with tarfile.open(path, "a") as tf:
        extra(tf)
    return path


def _inner(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        _add(tf, name, data)
    return buf.getvalue()


def _shard(synth, tmp_path: Path, name: str) -> Path:
    path = tmp_path / "train_images_0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for wnid in (CLASS, "n01443537"):
            for p in sorted((synth[0] / "train" / wnid).glob("*.JPEG"))[:3]:
                _add(tf, f"{p.stem}_{wnid}.JPEG", p.read_bytes())
        _add(tf, name, _image(synth))
    return path


# -- class 2: names ----------------------------------------------------------------------------------

BAD_NAMES = {  # member as the archive holds it -> how the archive is made
    "../evil.JPEG": lambda s, t: _train_tar_with(s, t, lambda tf: _add(tf, "../evil.JPEG", _image(s))),
    "/abs/evil.JPEG": lambda s, t: _train_tar_with(s, t, lambda tf: _add(tf, "/abs/evil.JPEG", _image(s))),
    f"{CLASS}/../../evil.JPEG": lambda s, t: _train_tar_with(
        s, t, lambda tf: _add(tf, f"{CLASS}/../../evil.JPEG", _image(s))),
    f"{CLASS}\\evil.JPEG": lambda s, t: _train_tar_with(s, t, lambda tf: _add(tf, f"{CLASS}\\evil.JPEG", _image(s))),
    f"{CLASS}/./evil.JPEG": lambda s, t: _train_tar_with(s, t, lambda tf: _add(tf, f"{CLASS}/./evil.JPEG", _image(s))),
    "nEVIL.tar:../evil.JPEG": lambda s, t: _train_tar_with(
        s, t, lambda tf: _add(tf, "nEVIL.tar", _inner("../evil.JPEG", _image(s)))),
    f"../evil_{CLASS}.JPEG": lambda s, t: _shard(s, t, f"../evil_{CLASS}.JPEG"),
}


@pytest.mark.processes
@pytest.mark.parametrize("member", BAD_NAMES)
def test_a_member_name_leading_out_refuses_the_archive_before_any_work(synth, tmp_path, member):
    archive = BAD_NAMES[member](synth, tmp_path)
    r = cli("--train-dir", archive, "--out", tmp_path / "out", "--size", 32, "--workers", 1)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and f"archive {archive}: member {member!r}" in line and "Traceback" not in line
    assert not list((tmp_path / "out").rglob("*.h5"))


def _linked_tree(synth, tmp_path: Path) -> Path:
    """The synthetic train tree plus a symbolic link and a hard link to its images, and an image whose
    name is too long for a tar header's 100 bytes (its member needs a pax record)."""
    train = Path(shutil.copytree(synth[0] / "train", tmp_path / "tree" / "train"))
    images = sorted((train / CLASS).glob("*.JPEG"))
    (train / CLASS / "zz_link.JPEG").symlink_to(images[1].name)
    os.link(images[2], train / CLASS / "aa_hard.JPEG")  # sorts first: read under this name in both routes
    (train / CLASS / ("long_" * 30 + ".JPEG")).write_bytes(images[3].read_bytes()[:-1] + b"\xd9")
    return train


def _tar_of(tree: Path, path: Path) -> Path:
    """`tree` as tar stores it: links as link members; reverse name order, so that the hard link's
    target (archived first, as the regular member) is not the name that sorts first."""
    with tarfile.open(path, "w") as tf:
        for p in sorted(tree.rglob("*"), reverse=True):
            tf.add(p, p.relative_to(tree).as_posix(), recursive=False)
    return path


def _ignored(out: Path) -> dict[str, str]:
    """report.json's ignored, by name within the source (the route's prefix taken off)."""
    return {d["path"].split(":", 1)[-1].removeprefix("train/"): d["reason"]
            for d in json.loads((out / "report.json").read_text())["ignored"]}


@pytest.mark.processes
def test_links_are_listed_and_the_folder_and_tar_routes_agree(synth, tmp_path, prep):
    tree = _linked_tree(synth, tmp_path)
    images = sorted(p.name for p in (tree / CLASS).glob("*_0000*.JPEG"))
    routes = {"folder": tree, "tar": _tar_of(tree, tmp_path / "train.tar")}
    outs = {}
    for route, source in routes.items():
        outs[route] = tmp_path / route
        preprocess(source, outs[route], opts=OPTS, workers=2, quiet=True)
        ignored = _ignored(outs[route])
        assert ignored[f"{CLASS}/zz_link.JPEG"] == f"symbolic link to the same file as {CLASS}/{images[1]}: read " \
                                                   "once, under that name", route
        assert ignored[f"{CLASS}/{images[2]}"] == f"hard link to the same file as {CLASS}/aa_hard.JPEG: read " \
                                                  "once, under that name", route
        counts = json.loads((outs[route] / "report.json").read_text())["counts"]["train"]
        intact = json.loads((prep[0] / "report.json").read_text())["counts"]["train"]
        assert counts["sources"] == intact["sources"] + 1, route  # the long-named image only
    same_batches(outs["folder"], outs["tar"], splits=("train",))


@pytest.mark.processes
def test_members_that_are_not_files_are_listed_with_the_reason(synth, tmp_path):
    def extra(tf: tarfile.TarFile) -> None:
        _add(tf, "fifo.JPEG", kind=tarfile.FIFOTYPE)
        _add(tf, "device.JPEG", kind=tarfile.CHRTYPE)
        _add(tf, "out.JPEG", kind=tarfile.SYMTYPE, link="/etc/passwd")
        _add(tf, "nowhere.JPEG", kind=tarfile.LNKTYPE, link="missing.JPEG")
    archive = _train_tar_with(synth, tmp_path, extra)
    intact = tmp_path / "intact"
    preprocess(write_train_tar(synth[0] / "train", tmp_path / "intact.tar"), intact, opts=OPTS, workers=2, quiet=True)
    out = tmp_path / "out"
    preprocess(archive, out, opts=OPTS, workers=2, quiet=True)
    ignored = _ignored(out)
    assert ignored["fifo.JPEG"] == "not a regular file (FIFO): not read"
    assert ignored["device.JPEG"] == "not a regular file (character device): not read"
    assert ignored["out.JPEG"].startswith("symbolic link to /etc/passwd, which archive ")
    assert ignored["nowhere.JPEG"].startswith("hard link to missing.JPEG, which archive ")
    same_batches(out, intact, splits=("train",))


@pytest.mark.processes
def test_a_fifo_in_a_class_folder_is_listed_not_opened(synth, tmp_path):
    train = Path(shutil.copytree(synth[0] / "train", tmp_path / "train"))
    os.mkfifo(train / CLASS / "fifo.JPEG")  # opening it would wait for a writer forever
    r = cli("--train-dir", train, "--out", tmp_path / "out", "--size", 32, "--workers", 1)  # run_script: 120 s
    assert r.returncode == 0, r.stderr
    assert _ignored(tmp_path / "out")[f"{CLASS}/fifo.JPEG"] == "not a regular file (FIFO): not read"


# -- class 3: an archive replaced between two runs -----------------------------------------------------


def _interrupted(synth, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(reference output, resumable output, its val tar): the same run, the second one cut short after
    its train files (meta.json and the val files gone)."""
    val_tar = write_val_tar(synth[0] / "val", tmp_path / "ILSVRC2012_img_val.tar")
    ref, out = tmp_path / "ref", tmp_path / "out"
    for o in (ref, out):
        preprocess(synth[0] / "train", o, val_tar, synth[0] / "val.txt", OPTS, workers=2, quiet=True)
    (out / "meta.json").unlink()
    for f in (out / "val").glob("*.h5"):
        f.unlink()
    return ref, out, val_tar


def _replace(val_tar: Path, synth, how: str) -> None:
    """The same images in another member order (other offsets), same size, the old mtime put back."""
    st = val_tar.stat()
    if how == "written over":
        write_val_tar(synth[0] / "val", val_tar, seed=7)
    else:
        os.replace(write_val_tar(synth[0] / "val", val_tar.with_name("new.tar"), seed=7), val_tar)
    os.utime(val_tar, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (val_tar.stat().st_size, val_tar.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.mark.processes
@pytest.mark.parametrize("how", ["written over", "renamed over"])
def test_a_tar_replaced_with_the_same_size_and_mtime_is_indexed_again(synth, tmp_path, how, capfd):
    ref, out, val_tar = _interrupted(synth, tmp_path)
    _replace(val_tar, synth, how)
    capfd.readouterr()
    preprocess(synth[0] / "train", out, val_tar, synth[0] / "val.txt", OPTS, workers=2, quiet=True)
    same_batches(out, ref)  # the old code read the old offsets: other bytes, other images, exit 0
    assert "changed since it was indexed" in capfd.readouterr().err


def _forge_index(out: Path, archive: Path, monkeypatch) -> None:
    """An index the fingerprint cannot tell from the archive's (its stamp made the new one's, the first
    and last headers taken on trust): only the per-member header check is left to notice."""
    path = out / archives.INDEX_NAME
    index = json.loads(path.read_text())
    st = archive.stat()
    index["archives"][str(archive)]["stamp"] = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    path.write_text(json.dumps(index))
    monkeypatch.setattr(archives, "_changed", lambda *a: None, raising=False)


@pytest.mark.processes
def test_a_replaced_tar_the_fingerprint_misses_stops_at_the_member_header(synth, tmp_path, monkeypatch):
    ref, out, val_tar = _interrupted(synth, tmp_path)
    _replace(val_tar, synth, "renamed over")
    _forge_index(out, val_tar, monkeypatch)
    done = sorted((out / "train").glob("*.h5"))
    with pytest.raises(ArchiveError) as e:
        preprocess(synth[0] / "train", out, val_tar, synth[0] / "val.txt", OPTS, workers=2, quiet=True)
    assert str(e.value).startswith(f"archive {val_tar}: member ") and "changed since it was indexed" in str(e.value)
    assert "sources_index.json" in str(e.value)
    assert sorted((out / "train").glob("*.h5")) == done and not (out / "meta.json").exists()


def _shard_with(synth, path: Path, swap: bool) -> Path:
    """A validation shard of the flat val images (<stem>_<wnid> names); `swap`: two members of other
    sizes trade their bytes, names unchanged (other images under the indexed names)."""
    labels = dict(line.split() for line in (synth[0] / "val.txt").read_text().splitlines())
    classes = sorted(p.name for p in (synth[0] / "train").iterdir() if p.is_dir())
    members = [(f"{Path(n).stem}_{classes[int(k)]}.JPEG", (synth[0] / "val" / n).read_bytes())
               for n, k in sorted(labels.items())]
    if swap:
        (a, da), (b, db) = members[0], members[1]
        assert len(da) != len(db)
        members[0], members[1] = (a, db), (b, da)
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members:
            _add(tf, name, data)
    return path


@pytest.mark.processes
def test_a_replaced_shard_the_fingerprint_misses_stops_at_the_member(synth, tmp_path, monkeypatch):
    shard = _shard_with(synth, tmp_path / "val_images.tar.gz", swap=False)
    out = tmp_path / "out"
    preprocess(synth[0] / "train", out, shard, None, OPTS, workers=2, quiet=True)
    (out / "meta.json").unlink()
    for f in (out / "val").glob("*.h5"):
        f.unlink()
    _shard_with(synth, shard, swap=True)
    _forge_index(out, shard, monkeypatch)
    with pytest.raises(ArchiveError) as e:
        preprocess(synth[0] / "train", out, shard, None, OPTS, workers=2, quiet=True)
    assert str(e.value).startswith(f"gzip shard {shard}: member ") and "changed since it was indexed" in str(e.value)


def test_a_shards_fingerprint_reads_its_ends(tmp_path):
    """Same stamp, other bytes: the shard's first or last 64 KiB tell (gzip cannot be read at an offset)."""
    shard = tmp_path / "s.tar.gz"
    shard.write_bytes(os.urandom(200_000))
    stamp = archives.stamp(str(shard))
    entry = {"kind": "shard", "stamp": stamp, "edges": archives._edges(str(shard)), "members": []}
    assert archives._changed(str(shard), entry, stamp) is None
    with open(shard, "r+b") as f:
        f.seek(199_000)
        f.write(b"x")
    assert archives._changed(str(shard), entry, stamp) == "its first or last 64 KiB"


@pytest.mark.processes
def test_a_name_held_twice_is_still_refused(synth, tmp_path):
    """Two regular members of one name (tar allows it): both are listed, so the listing refuses them as
    before; neither is dropped for the other."""
    archive = _train_tar_with(synth, tmp_path, lambda tf: (_add(tf, f"{CLASS}/twice.JPEG", _image(synth)),
                                                          _add(tf, f"{CLASS}/twice.JPEG", _image(synth))))
    r = cli("--train-dir", archive, "--out", tmp_path / "out", "--size", 32, "--workers", 1)
    assert r.returncode == 2 and "appear more than once" in r.stderr and f"{CLASS}/twice.JPEG" in r.stderr, r.stderr


def _member_bytes(name: str, data: bytes) -> bytes:
    """One regular member as tar writes it (header, data padded to 512 bytes), without the archive's end."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
        end = tf.offset
    return buf.getvalue()[:end]


def test_an_archive_ending_with_one_zero_block_is_whole_and_without_it_is_cut(tmp_path):
    """tar's end is a zero block: one that ends the file exactly is enough; none at all is a cut archive."""
    body = _member_bytes("n01/a.JPEG", b"x" * 700)  # 512 header + 1024 data
    whole = tmp_path / "whole.tar"
    whole.write_bytes(body + bytes(512))
    rows, others = archives.index_tar(str(whole))
    assert rows == [["n01/a.JPEG", 512, 700, zlib.crc32(body[:512])]] and others == []
    cut = tmp_path / "cut.tar"
    cut.write_bytes(body)
    with pytest.raises(archives.ArchiveError) as e:
        archives.index_tar(str(cut))
    assert str(e.value) == (f"{cut} ends without tar's end-of-archive block after 1 members: truncated? "
                            "(download it again)")


def test_a_link_inside_an_inner_tar_is_named_with_the_inner_tar(tmp_path):
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tf:
        ti = tarfile.TarInfo("a.JPEG")
        ti.size = 3
        tf.addfile(ti, io.BytesIO(b"abc"))
        link = tarfile.TarInfo("b.JPEG")
        link.type, link.linkname = tarfile.SYMTYPE, "gone.JPEG"
        tf.addfile(link)
    path = tmp_path / "train.tar"
    with tarfile.open(path, "w") as tf:
        ti = tarfile.TarInfo("n01.tar")
        ti.size = len(inner.getvalue())
        tf.addfile(ti, io.BytesIO(inner.getvalue()))
    rows, others = archives.index_tar(str(path))
    assert [r[0] for r in rows] == [["n01.tar", "a.JPEG"]]
    assert others == [[["n01.tar", "b.JPEG"],
                       f"symbolic link to gone.JPEG, which {path}:n01.tar does not hold as a file: not read"]]


def _tar_file(path: Path, mode: str, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def test_the_index_says_what_it_indexes_and_keeps_it_compact(tmp_path, capfd):
    """A tar and a gzip shard indexed into an output folder that does not exist yet: one line naming
    both, the shard's fingerprint (crc32 of its ends) kept, compact JSON; a second look reads the file."""
    tar = _tar_file(tmp_path / "a.tar", "w", {"n01/x.JPEG": b"abc"})
    shard = _tar_file(tmp_path / "b.tar.gz", "w:gz", {"n02_y.JPEG": b"defg"})
    out = tmp_path / "not" / "yet" / "out"
    got = archives.SourceIndex(out).members([str(tar), str(shard)])
    err = capfd.readouterr().err
    assert err == (f"preprocess: indexing 2 archive(s) once (kept in {out / archives.INDEX_NAME}): "
                   "a.tar, b.tar.gz\n")
    blob = shard.read_bytes()
    assert got[str(shard)]["kind"] == "shard" and got[str(shard)]["edges"] == [zlib.crc32(blob), zlib.crc32(blob)]
    assert got[str(tar)]["kind"] == "tar" and "edges" not in got[str(tar)]
    text = (out / archives.INDEX_NAME).read_text()
    assert text.startswith('{"version":2,"archives":{') and ", " not in text and ": " not in text
    again = archives.SourceIndex(out, quiet=True).members([str(tar), str(shard)])
    assert again == got and capfd.readouterr().err == ""
    from data.preprocess import OUTPUT
    assert OUTPUT.unknown(out) == []  # --out knows the index it wrote (a user's file of that name: refused)


def test_an_archive_changed_while_indexed_is_refused(tmp_path, monkeypatch):
    tar = _tar_file(tmp_path / "a.tar", "w", {"n01/x.JPEG": b"abc"})
    real = archives.index_tar

    def index_then_touch(path):
        out = real(path)
        os.utime(path, ns=(1, 1))  # another mtime: the stamp taken before indexing no longer holds
        return out
    monkeypatch.setattr(archives, "index_tar", index_then_touch)
    with pytest.raises(ArchiveError) as e:
        archives.SourceIndex(tmp_path / "out", quiet=True).members([str(tar)])
    assert str(e.value) == f"archive {tar} changed while it was being indexed"


@pytest.mark.parametrize("kept", [b'{"version":1,"archives":{"ARCHIVE":{"kind":"tar","stamp":STAMP,"members":[],'
                                  b'"others":[]}}}', b'{"version":2,"archi', b'{"version":2}'],
                         ids=["older", "cut-short", "no-archives"])
def test_an_index_this_version_cannot_use_is_made_again(tmp_path, capfd, kept):
    """An older index, or one cut short or missing its archives (still this tool's file: it begins as one), is
    not read for members: every archive is indexed again and the file replaced by this version's."""
    tar = _tar_file(tmp_path / "a.tar", "w", {"n01/x.JPEG": b"abc"})
    out = tmp_path / "out"
    out.mkdir()
    # the older entry otherwise whole (its stamp current): only its version says it must not be used
    stamp = json.dumps(archives.stamp(str(tar))).encode()
    (out / archives.INDEX_NAME).write_bytes(kept.replace(b"ARCHIVE", str(tar).encode()).replace(b"STAMP", stamp))
    got = archives.SourceIndex(out).members([str(tar)])
    assert "indexing 1 archive(s) once" in capfd.readouterr().err
    assert [m[0] for m in got[str(tar)]["members"]] == ["n01/x.JPEG"]
    assert json.loads((out / archives.INDEX_NAME).read_text())["version"] == 2
