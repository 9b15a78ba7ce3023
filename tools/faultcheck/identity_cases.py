"""Faults of issue 26 ("trust nothing from outside by its name alone"): batch files that are links to or
copies of other batch files (train.py, evaluate.py), archive members whose names lead out of their
folder, link and device members (scripts/preprocess.py), and an archive replaced between two runs by
another of the same size and mtime."""
from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

from .core import Case, Ctx, Work, inject, must, read_json
from .preprocess_cases import CLASS, nothing_written, pp
from .tool_cases import ev
from .train_cases import nothing_trained, tr


def data5(ctx: Ctx) -> Path:
    """The synthetic tree at 72 px, 5 images per file: several files of one count, so that a link or a
    copy is not told apart by the count meta.json lists."""
    return ctx.once("data72-pf5", lambda p: must(
        ["scripts/preprocess.py", "--train-dir", str(ctx.src / "train"), "--val-dir", str(ctx.src / "val"),
         "--val-labels", str(ctx.src / "val.txt"), "--out", str(p), "--size", "72", "--per-file", "5",
         "--workers", "2", "--quiet"]))


def _files(data: Path, split: str) -> dict[str, int]:
    return {f["name"]: f["count"] for f in read_json(data / "meta.json")["splits"][split]["files"]}


def _pair(data: Path, at: str, source: str) -> tuple[str, str]:
    """(a file of split `at`, another of split `source`) holding as many images."""
    there = _files(data, source)
    return next((a, b) for a, n in _files(data, at).items() for b, m in there.items()
                if n == m and (at, a) != (source, b))


def _damaged(work: Work, damage) -> Path:
    data = work.copy(data5(work.ctx), "data")
    damage(data)
    return data


def _symlink(split: str):
    def damage(data: Path) -> None:
        a, b = _pair(data, split, split)
        (data / split / a).unlink()
        (data / split / a).symlink_to(b)
    return damage


def _hard_link(data: Path) -> None:
    a, b = _pair(data, "train", "train")
    (data / "train" / a).unlink()
    os.link(data / "train" / b, data / "train" / a)


def _train_file_in_val(data: Path) -> None:
    a, b = _pair(data, "val", "train")
    shutil.copyfile(data / "train" / b, data / "val" / a)


# -- archives ------------------------------------------------------------------------------------------

def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.mtime = kind, len(data), 1_300_000_000
    tf.addfile(ti, io.BytesIO(data) if data else None)


def _image(ctx: Ctx) -> bytes:
    return sorted((ctx.src / "train" / CLASS).glob("*_00001.JPEG"))[0].read_bytes()


def _train_tar(work: Work, extra=None) -> Path:
    from data.distributions import write_train_tar
    path = write_train_tar(work.ctx.src / "train", work.w / "train.tar")
    if extra is not None:
        with tarfile.open(path, "a") as tf:
            extra(tf)
    return path


def _bad_member(name: str):
    def setup(work: Work) -> list[str]:
        tar = _train_tar(work, lambda tf: _add(tf, name, _image(work.ctx)))
        return pp("--train-dir", tar, "--out", work.w / "out")
    return setup


def _linked_tree(work: Work) -> Path:
    """The train tree with a symbolic link and a hard link to two of its images."""
    train = work.copy(work.ctx.src / "train", "tree")
    images = sorted((train / CLASS).glob("*.JPEG"))
    (train / CLASS / "zz_link.JPEG").symlink_to(images[1].name)
    os.link(images[2], train / CLASS / "aa_hard.JPEG")
    return train


def _tar_of(tree: Path, path: Path) -> Path:
    with tarfile.open(path, "w") as tf:
        for p in sorted(tree.rglob("*"), reverse=True):  # the hard link's target archived first
            tf.add(p, p.relative_to(tree).as_posix(), recursive=False)
    return path


def _links_listed(work: Work) -> str | None:
    """Both links in report.json's ignored, and as many images as the tree without them."""
    report = read_json(work.w / "out" / "report.json")
    reasons = {d["path"].split(":", 1)[-1].removeprefix("train/"): d["reason"] for d in report["ignored"]}
    images = sorted((work.ctx.src / "train" / CLASS).glob("*.JPEG"))
    want = {f"{CLASS}/zz_link.JPEG": "symbolic link", f"{CLASS}/{images[2].name}": "hard link"}
    for name, kind in want.items():
        if not reasons.get(name, "").startswith(f"{kind} to the same file as"):
            return f"{name} is not listed in report.json's ignored as a {kind}"
    from data.layouts import is_image_name
    intact = sum(1 for p in (work.ctx.src / "train").glob("*/*") if is_image_name(p.name))
    got = report["counts"]["train"]["sources"]
    return None if got == intact else f"{got} train images listed, the tree without links has {intact}"


def _special_members(work: Work) -> list[str]:
    def extra(tf: tarfile.TarFile) -> None:
        _add(tf, f"{CLASS}.fifo.JPEG", kind=tarfile.FIFOTYPE)
        _add(tf, f"{CLASS}.dev.JPEG", kind=tarfile.CHRTYPE)
    return pp("--train-dir", _train_tar(work, extra), "--out", work.w / "out")


def _specials_listed(work: Work) -> str | None:
    reasons = {d["path"].rsplit(":", 1)[-1]: d["reason"] for d in read_json(work.w / "out" / "report.json")["ignored"]}
    for name, kind in ((f"{CLASS}.fifo.JPEG", "FIFO"), (f"{CLASS}.dev.JPEG", "character device")):
        if reasons.get(name) != f"not a regular file ({kind}): not read":
            return f"{name} is not listed in report.json's ignored as a {kind}"
    return None


# -- a val tar replaced between two runs -----------------------------------------------------------------

def _resume_args(work: Work) -> list[str]:
    src = work.ctx.src
    return pp("--train-dir", src / "train", "--val-dir", work.w / "val.tar", "--val-labels", src / "val.txt",
              "--out", work.w / "out")


def _replaced_val_tar(work: Work) -> list[str]:
    """A finished run (and a reference copy), cut back to its train files; its val tar then replaced by
    the same images in another order: other offsets, the same size, the old mtime put back."""
    from data.distributions import write_val_tar
    tar = write_val_tar(work.ctx.src / "val", work.w / "val.tar")
    args = _resume_args(work)
    must(args)
    shutil.copytree(work.w / "out", work.w / "ref")
    (work.w / "out" / "meta.json").unlink()
    for f in (work.w / "out" / "val").glob("*.h5"):
        f.unlink()
    st = tar.stat()
    os.replace(write_val_tar(work.ctx.src / "val", work.w / "new.tar", seed=7), tar)
    os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))
    return args


def _same_as_reference(work: Work) -> str | None:
    import h5py
    import numpy as np
    for ref in sorted((work.w / "ref").glob("*/*.h5")):
        got = work.w / "out" / ref.relative_to(work.w / "ref")
        with h5py.File(ref, "r") as a, h5py.File(got, "r") as b:
            if not (np.array_equal(a["images"][...], b["images"][...])
                    and np.array_equal(a["labels"][...], b["labels"][...])):
                return f"{got.relative_to(work.w)} differs from the run on the intact archive"
    return None


def _forged_index(work: Work) -> list[str]:
    """The same, with the index's stamp made the new archive's and the fingerprint check taken on trust."""
    args = _replaced_val_tar(work)
    path = work.w / "out" / "sources_index.json"
    index = json.loads(path.read_text())
    st = (work.w / "val.tar").stat()
    index["archives"][str(work.w / "val.tar")]["stamp"] = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    path.write_text(json.dumps(index))
    return inject("import data.archives as a\na._changed = lambda *args: None", *args)


def _train_files_kept(work: Work) -> str | None:
    kept = sorted(p.name for p in (work.w / "out" / "train").glob("*.h5"))
    want = sorted(p.name for p in (work.w / "ref" / "train").glob("*.h5"))
    if kept != want:
        return f"finished train files lost: {sorted(set(want) - set(kept))}"
    return "meta.json written after the error" if (work.w / "out" / "meta.json").exists() else None


CASES = [
    Case("identity-train-file-symlinked", "silent", "a train file replaced by a link to another of the same count",
         2, ("{w}/data/train/", "the same file as"), lambda w: tr(w, data=_damaged(w, _symlink("train"))),
         nothing_trained),
    Case("identity-train-file-hard-linked", "silent", "a train file hard-linked to another listed one", 2,
         ("{w}/data/train/", "the same file as"), lambda w: tr(w, data=_damaged(w, _hard_link)), nothing_trained),
    Case("identity-train-file-in-val", "silent", "a train file copied over a val file of the same count", 2,
         ("{w}/data/val/", "records split 'train'"), lambda w: ev(w, data=_damaged(w, _train_file_in_val))),
    Case("identity-val-file-symlinked", "silent", "a val file replaced by a link to another of the same count", 2,
         ("{w}/data/val/", "the same file as"), lambda w: ev(w, data=_damaged(w, _symlink("val")))),
    Case("identity-tar-member-dotdot", "silent", "a train tar holding a member ../evil.JPEG", 2,
         ("{w}/train.tar", "'../evil.JPEG'"), _bad_member("../evil.JPEG"), nothing_written),
    Case("identity-tar-member-absolute", "silent", "a train tar holding a member /abs/evil.JPEG", 2,
         ("{w}/train.tar", "'/abs/evil.JPEG'"), _bad_member("/abs/evil.JPEG"), nothing_written),
    Case("identity-tar-link-members", "silent", "a tar of a tree holding a symbolic and a hard link", 0,
         ("report.json",), lambda w: pp("--train-dir", _tar_of(_linked_tree(w), w.w / "train.tar"),
                                        "--out", w.w / "out"), _links_listed, line="listed with the reason"),
    Case("identity-folder-link-files", "silent", "the same tree as a folder", 0, ("report.json",),
         lambda w: pp("--train-dir", _linked_tree(w), "--out", w.w / "out"), _links_listed,
         line="listed with the reason"),
    Case("identity-tar-fifo-device-members", "silent", "a train tar holding a FIFO and a device member", 0,
         ("report.json",), _special_members, _specials_listed, line="listed with the reason"),
    Case("identity-tar-replaced-on-resume", "silent", "val tar replaced before a resume: same size and mtime", 0,
         ("written",), _replaced_val_tar, _same_as_reference, line="images written"),
    Case("identity-tar-replaced-index-forged", "silent", "the same, the index's fingerprint forged to match", 2,
         ("{w}/val.tar", "changed since it was indexed", "sources_index.json"), _forged_index, _train_files_kept),
    Case("identity-mean-of-another-output", "silent", "mean.npy replaced by another output's of the same size", 2,
         ("{w}/data/mean.npy", "not this output's mean image"), lambda w: ev(w, data=_damaged(w, _other_mean))),
]


def _other_mean(data: Path) -> None:
    import numpy as np
    np.save(data / "mean.npy", np.full((72, 72, 3), 117.0, np.float32))  # valid, finite, the same shape
