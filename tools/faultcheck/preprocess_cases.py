"""Faults and bad input for scripts/preprocess.py."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import zlib
from pathlib import Path

from .core import READ_ONLY, Case, Work, inject, read_json, wait_for

CLASS = "n01441764"  # one of the synthetic tree's four classes
EXTRA = "n01449999"  # a wnid the tree does not have


def pp(*args, size: int = 32, workers: int = 1) -> list[str]:
    """scripts/preprocess.py with `args`, small and quiet."""
    return ["scripts/preprocess.py", *map(str, args), "--size", str(size), "--per-file", "16", "--workers",
            str(workers), "--quiet"]


def _train(work: Work) -> Path:
    return work.copy(work.ctx.src / "train", "train")


def _out_args(work: Work, train: Path | None = None) -> list[str]:
    return ["--train-dir", train or work.ctx.src / "train", "--out", work.w / "out"]


def nothing_written(work: Work) -> str | None:
    written = list((work.w / "out").rglob("*.h5"))
    return f"{len(written)} batch file(s) written before the error" if written else None


def no_temporaries(work: Work) -> str | None:
    left = [p for p in work.w.rglob(".*.tmp")]
    return f"{len(left)} temporary file(s) left behind, e.g. {left[0].name}" if left else None


def _report(work: Work) -> dict:
    return read_json(work.w / "out" / "report.json")


# -- setups ----------------------------------------------------------------------------------------

def _linked(target: str):
    def setup(work: Work) -> list[str]:
        train = _train(work)
        (train / EXTRA).symlink_to(target)
        return pp(*_out_args(work, train))
    return setup


def _empty_class(*flags: str):
    def setup(work: Work) -> list[str]:
        train = _train(work)
        (train / EXTRA).mkdir()
        return pp(*_out_args(work, train), *flags)
    return setup


def _has_extra_class(work: Work) -> str | None:
    meta = read_json(work.w / "out" / "meta.json")
    return None if EXTRA in meta["classes"] else f"meta.json's classes lack {EXTRA}"


def _odd_names(work: Work) -> list[str]:
    train = _train(work)
    image = sorted((train / CLASS).glob("*_00000.JPEG"))[0]
    (train / CLASS / os.fsdecode(b"caf\xe9.JPEG")).write_bytes(image.read_bytes())  # Latin-1, not UTF-8
    (train / CLASS / os.fsdecode(b"bad\xff.JPEG")).write_bytes(b"not a jpeg")
    return pp(*_out_args(work, train))


def _odd_names_escaped(work: Work) -> str | None:
    import h5py
    names = {n.decode() for f in (work.w / "out" / "train").glob("*.h5") for n in h5py.File(f, "r")["names"][:]}
    skipped = [d["path"] for d in _report(work)["skipped"]]
    if f"{CLASS}/caf\\xe9.JPEG" not in names:
        return "the image named in Latin-1 is not in the batch files as caf\\xe9.JPEG"
    return None if f"train/{CLASS}/bad\\xff.JPEG" in skipped else "bad\\xff.JPEG is not listed as skipped"


def _disk_full(work: Work) -> list[str]:
    disk = work.mount("disk", "size=100k")
    return pp("--train-dir", work.ctx.src / "train", "--out", disk / "out")


ENOSPC = """import errno, data.batchfile as b
def full(*a):  # as HDF5 reports it: an errno and a long message naming no file
    raise OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: errno = 28)")
b._write_contiguous = full"""


def _read_only(work: Work) -> list[str]:
    return pp("--train-dir", work.ctx.src / "train", "--out", work.mount("ro", "size=1m,ro") / "out")


def _out_is_file(work: Work) -> list[str]:
    (work.w / "file.txt").write_text("x")
    return pp("--train-dir", work.ctx.src / "train", "--out", work.w / "file.txt")


def _unreadable_class(work: Work) -> list[str]:
    train = _train(work)
    code = f"""import errno, os
_scandir = os.scandir
def refuse(path="."):  # as chmod 000 would, for a user other than root
    if os.fspath(path) == {str(train / CLASS)!r}:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
    return _scandir(path)
os.scandir = refuse"""
    return inject(code, *pp(*_out_args(work, train)))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG header of the given size and no pixels: a decompression bomb to Pillow."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _bomb(work: Work) -> list[str]:
    train = _train(work)
    (train / CLASS / "bomb.png").write_bytes(png_declaring(60000, 60000))
    return pp(*_out_args(work, train))


def _bomb_listed(work: Work) -> str | None:
    reasons = {d["path"]: d["reason"] for d in _report(work)["skipped"]}
    reason = reasons.get(f"train/{CLASS}/bomb.png", "")
    return None if reason.startswith("DecompressionBombError") else f"bomb.png not skipped as a bomb: {reason!r}"


def _labels(encode):
    def setup(work: Work) -> list[str]:
        text = (work.ctx.src / "val.txt").read_text()
        (work.w / "val.txt").write_bytes(encode(text))
        return pp(*_out_args(work), "--val-dir", work.ctx.src / "val", "--val-labels", work.w / "val.txt")
    return setup


def _val_complete(work: Work) -> str | None:
    lines = len((work.ctx.src / "val.txt").read_text().splitlines())
    r = _report(work)["counts"]["val"]
    return None if r["sources"] == lines else f"{r['sources']} val images listed, val.txt has {lines}"


def _classes_twice(work: Work) -> list[str]:
    (work.w / "classes.txt").write_text(f"{CLASS}\nn01440764\n{CLASS}\n")
    return pp(*_out_args(work), "--classes", work.w / "classes.txt")


def _plan_damaged(work: Work) -> list[str]:
    (work.w / "out").mkdir()
    (work.w / "out" / "plan.json").write_bytes(b"\x00\xff\x13 not json")
    return pp(*_out_args(work))


def _out_in_use(work: Work) -> list[str]:
    from data.preprocess import exclusive
    work.stack.enter_context(exclusive(work.w / "out"))
    return pp(*_out_args(work))


SLOW_IMAGES = """import time, data.preprocess as p
_load = p.load_image
def slow(*a, **k):
    time.sleep(0.05)
    return _load(*a, **k)
p.load_image = slow"""


def _interrupt_when_a_file_is_written(work: Work, proc: subprocess.Popen) -> None:
    wait_for(lambda: any((work.w / "out" / "train").glob("0*.h5")), proc)
    proc.send_signal(signal.SIGINT)


def _interrupt_while_listing(work: Work, proc: subprocess.Popen) -> None:
    wait_for((work.w / "listing").exists, proc)
    proc.send_signal(signal.SIGINT)


def _slow_listing(work: Work) -> list[str]:
    code = f"""import pathlib, time, data.preprocess as p
_gather = p.gather
def slow(*a, **k):
    pathlib.Path({str(work.w / "listing")!r}).touch()
    time.sleep(60)
    return _gather(*a, **k)
p.gather = slow"""
    return inject(code, *pp(*_out_args(work)))


def _kill_a_worker(work: Work, proc: subprocess.Popen) -> None:
    from data.procs import child_pids
    wait_for(lambda: any((work.w / "out" / "train").glob("0*.h5")), proc)
    workers = [p for p in child_pids(proc.pid) if b"resource_tracker" not in _cmdline(p)]
    if workers:
        os.kill(workers[0], signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _other_size(work: Work) -> list[str]:
    src, out = work.ctx.src, work.copy(work.ctx.data(), "out")
    return ["scripts/preprocess.py", "--train-dir", str(src / "train"), "--val-dir", str(src / "val"),
            "--val-labels", str(src / "val.txt"), "--out", str(out), "--size", "64", "--per-file", "16", "--quiet"]


CASES = [
    Case("preprocess-class-link-to-root", "silent", f"class folder train/{EXTRA} -> . (the train folder)", 2,
         (EXTRA, "link"), _linked("."), nothing_written, listed=True),
    Case("preprocess-class-link-to-class", "silent", f"class folder train/{EXTRA} -> n01440764", 2,
         (EXTRA, "n01440764"), _linked("n01440764"), nothing_written),
    Case("preprocess-empty-class", "silent", f"an empty class folder train/{EXTRA}", 2,
         (EXTRA, "--allow-empty-classes"), _empty_class(), nothing_written, listed=True),
    Case("preprocess-empty-class-allowed", "accepted", "the same with --allow-empty-classes", 0, ("written",),
         _empty_class("--allow-empty-classes"), _has_extra_class, line="images written"),
    Case("preprocess-name-not-utf8", "traceback", "file names that are not UTF-8 (one decodable, one not)", 0,
         ("report.json",), _odd_names, _odd_names_escaped, line="listed with the reason", listed=True),
    Case("preprocess-disk-full", "traceback", "--out on a 100 KiB tmpfs", 1, ("{w}/disk/out/", "disk full"),
         _disk_full, no_temporaries, listed=True),
    Case("preprocess-disk-full-injected", "traceback", "ENOSPC injected into every batch-file write", 1,
         ("{w}/out/train/", "disk full"), lambda work: inject(ENOSPC, *pp(*_out_args(work))), no_temporaries),
    Case("preprocess-out-read-only", "traceback", "--out on a read-only tmpfs", 2, ("{w}/ro/out", READ_ONLY),
         _read_only, listed=True),
    Case("preprocess-out-is-a-file", "traceback", "--out names a file", 2, ("{w}/file.txt",), _out_is_file),
    Case("preprocess-train-dir-is-a-file", "traceback", "--train-dir names a file", 2, ("val.txt",),
         lambda work: pp("--train-dir", work.ctx.src / "val.txt", "--out", work.w / "out")),
    Case("preprocess-class-unreadable", "silent", "a class folder that cannot be listed (EACCES injected)", 2,
         (f"{{w}}/train/{CLASS}", "permission denied"), _unreadable_class, nothing_written),
    Case("preprocess-decompression-bomb", "traceback", "a PNG declaring 60000x60000 pixels", 0, ("report.json",),
         _bomb, _bomb_listed, line="listed with the reason"),
    Case("preprocess-labels-bom-crlf", "accepted", "val.txt with a byte-order mark and CRLF line ends", 0,
         ("written",), _labels(lambda t: ("\ufeff" + t.replace("\n", "\r\n")).encode()), _val_complete,
         line="images written"),
    Case("preprocess-labels-not-utf8", "traceback", "val.txt in UTF-16", 2, ("{w}/val.txt", "UTF-8"),
         _labels(lambda t: t.encode("utf-16"))),
    Case("preprocess-classes-listed-twice", "silent", "--classes FILE naming a wnid twice", 2,
         (CLASS, "twice"), _classes_twice),
    Case("preprocess-plan-damaged", "traceback", "--out holding a binary plan.json", 2, ("{w}/out/plan.json",),
         _plan_damaged),
    Case("preprocess-out-inside-train", "silent", "--out inside --train-dir", 2, ("--out", "train"),
         lambda work: pp("--train-dir", _train(work), "--out", work.w / "train" / "out")),
    Case("preprocess-out-in-use", "silent", "a second run into the same --out", 2, ("{w}/out", "pid"),
         _out_in_use),
    Case("preprocess-rerun-other-size", "silent", "re-run into a finished --out with --size 64 (72 there)", 2,
         ("size: 72 there, 64 now",), _other_size),
    Case("preprocess-size-zero", "silent", "--size 0", 2, ("--size",), lambda work: pp(*_out_args(work), size=0)),
    Case("preprocess-ctrl-c-while-listing", "traceback", "Ctrl-C before the worker pool starts", 130,
         ("interrupted",), _slow_listing, during=_interrupt_while_listing, listed=True),
    Case("preprocess-ctrl-c", "lost", "Ctrl-C once a batch file is written", 130, ("re-run",),
         lambda work: inject(SLOW_IMAGES, *pp(*_out_args(work), workers=2)), no_temporaries,
         during=_interrupt_when_a_file_is_written),
    Case("preprocess-worker-killed", "lost", "kill -9 of a worker once a batch file is written", 1,
         ("worker",), lambda work: inject(SLOW_IMAGES, *pp(*_out_args(work), workers=2)), no_temporaries,
         during=_kill_a_worker),
]
