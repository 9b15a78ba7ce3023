"""scripts/upgrade_data.py: format-1 folders converted in place, resumable, bad input named."""
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

import data.upgrade as upgrade_mod
from data.batchfile import read_batch_file, read_file_attrs
from data.preprocess import Options, preprocess
from data.reader import SplitData
from data.upgrade import upgrade
from tests import children
from tests.conftest import REPO, run_script, sigint_inside_the_pool
from tests.test_fastread import flip_byte, format_1_copy

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def old(prep, tmp_path_factory) -> Path:
    """The session's preprocessed folder as format 1 (never modified: tests copy it)."""
    return format_1_copy(prep[0], tmp_path_factory.mktemp("old_up") / "data")


def versions(root: Path) -> list[int]:
    meta = json.loads((root / "meta.json").read_text())
    return [read_file_attrs(root / s / f["name"])["format_version"] for s, v in meta["splits"].items()
            for f in v["files"]]


def same_as_reference(root: Path, ref: Path) -> None:
    """Every file's content and attributes, meta.json and mean.npy equal those of `ref` (format 2)."""
    meta, ref_meta = (json.loads((r / "meta.json").read_text()) for r in (root, ref))
    assert meta == ref_meta
    for split, s in ref_meta["splits"].items():
        for f in s["files"]:
            a, b = root / split / f["name"], ref / split / f["name"]
            for x, y in zip(read_batch_file(a), read_batch_file(b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            attrs, ref_attrs = read_file_attrs(a), read_file_attrs(b)
            for k in ("split", "index", "count", "image_size", "skipped", "format_version"):
                assert attrs[k] == ref_attrs[k], (a, k)
            if ref_attrs["pixel_sum"] is None:
                assert attrs["pixel_sum"] is None
            else:
                np.testing.assert_array_equal(attrs["pixel_sum"], ref_attrs["pixel_sum"])
    assert (root / "mean.npy").read_bytes() == (ref / "mean.npy").read_bytes()
    assert not list(root.rglob(".*.tmp"))


def test_upgrade_cli_converts_in_place_to_the_new_format(old, prep, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(old, root)
    assert set(versions(root)) == {1}
    r = run_script("scripts/upgrade_data.py", str(root), "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"{len(versions(root))} files converted to format 2" in r.stdout
    assert set(versions(root)) == {2}
    same_as_reference(root, prep[0])
    r = run_script("scripts/upgrade_data.py", str(root), "--quiet")  # nothing left to do
    assert r.returncode == 0 and "0 files converted" in r.stdout, r.stderr


def test_upgrade_resumes_after_a_failure(old, prep, tmp_path, monkeypatch):
    """A failure mid-way (disk full after 3 files, a half-written temporary left behind) keeps a
    readable mixed folder; the same command then finishes it, identical to an uninterrupted upgrade."""
    root = tmp_path / "data"
    shutil.copytree(old, root)
    real_write, calls = upgrade_mod.write_batch_file, []

    def failing_write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 4:
            Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp").write_bytes(b"half")
            raise OSError(28, "No space left on device")
        real_write(path, *args, **kwargs)
    monkeypatch.setattr(upgrade_mod, "write_batch_file", failing_write)
    with pytest.raises(OSError, match="No space left"):
        upgrade(root, quiet=True)
    assert sorted(versions(root)).count(2) == 3
    assert json.loads((root / "meta.json").read_text())["format_version"] == 1  # updated only at the end
    for split in ("train", "val"):  # mixed formats read as one folder, as the reference
        a, b = SplitData(root, split), SplitData(prep[0], split)
        idx = np.arange(len(b))[::-1]
        for x, y in zip(a.read(idx), b.read(idx)):
            np.testing.assert_array_equal(x, y)
    monkeypatch.setattr(upgrade_mod, "write_batch_file", real_write)
    result = upgrade(root, quiet=True)
    assert result["converted"] == len(versions(root)) - 3 and not result["problems"]
    same_as_reference(root, prep[0])


SLOW_UPGRADE = """
import sys, time
sys.path.insert(0, {repo!r})
import data.upgrade as u
_orig = u.write_batch_file
def slow(*a, **k):
    time.sleep(0.2)
    return _orig(*a, **k)
u.write_batch_file = slow
sys.exit(u.main(sys.argv[1:]))
"""


def test_upgrade_killed_resumes_to_identical_output(old, prep, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(old, root)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_UPGRADE.format(repo=str(REPO)), str(root), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.wait_until(lambda: versions(root).count(2) >= 2, proc, cpu_s=60, what="no file was converted")
    proc.send_signal(signal.SIGKILL)
    children.communicate(proc, cpu_s=60)
    assert 2 <= versions(root).count(2) < len(versions(root))
    r = run_script("scripts/upgrade_data.py", str(root), "--quiet")
    assert r.returncode == 0, r.stderr
    same_as_reference(root, prep[0])


@pytest.mark.parametrize("where", ["wait", "submit"])
def test_a_stop_inside_the_pools_own_code_is_raised_between_its_calls(old, prep, tmp_path, monkeypatch, where):
    """As preprocess's (tests/test_preprocess.py): Ctrl-C sent from inside the pool's call is raised after it
    returns (inside, as_completed's taking of the futures' locks could leave one held and hang the shutdown);
    the run stops, and a rerun finishes the conversion."""
    root = tmp_path / "data"
    shutil.copytree(old, root)
    returned = sigint_inside_the_pool(monkeypatch, upgrade_mod, where)
    with pytest.raises(KeyboardInterrupt):
        upgrade(root, quiet=True, workers=2)
    assert returned, "the KeyboardInterrupt was raised inside the pool's own call"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    upgrade(root, quiet=True, workers=2)
    same_as_reference(root, prep[0])


def test_upgrade_names_missing_and_corrupt_files(old, tmp_path):
    """Bad files are listed with the reason (the corrupt image by row and name), the rest converted."""
    root = tmp_path / "data"
    shutil.copytree(old, root)
    (root / "train" / "00001.h5").unlink()
    name = flip_byte(root / "val" / "00000.h5", row=2)
    r = run_script("scripts/upgrade_data.py", str(root), "--quiet")
    assert r.returncode == 1
    assert "train/00001.h5: batch file is missing" in r.stderr
    assert f"val/00000.h5: image 2 ({name}) fails its Fletcher-32 checksum" in r.stderr
    assert "could not be converted" in r.stdout and "re-run scripts/preprocess.py" in r.stderr
    left = [read_file_attrs(p)["format_version"] for p in sorted(root.glob("*/[0-9]*.h5"))]
    assert left.count(1) == 1 and len(left) == len(versions(old)) - 1  # only the corrupt one stays old
    assert json.loads((root / "meta.json").read_text())["format_version"] == 1


@pytest.mark.parametrize("case", ["no_folder", "not_an_output"])
def test_upgrade_refuses_what_is_not_a_preprocessed_folder(tmp_path, case):
    root = tmp_path / "x"
    if case == "not_an_output":
        root.mkdir()
    r = run_script("scripts/upgrade_data.py", str(root), "--quiet")
    assert r.returncode == 2 and str(root) in r.stderr
    assert ("does not exist" if case == "no_folder" else "holds no batch files") in r.stderr


def test_preprocess_finishes_a_run_started_in_the_old_format(old, prep, synth, tmp_path):
    """An unfinished format-1 output: preprocess resumes it (new files in format 2, meta says the oldest
    format), and the upgrade then converts the rest; the data stays the reference's throughout."""
    root = tmp_path / "data"
    shutil.copytree(old, root)
    (root / "meta.json").unlink()
    (root / "train" / "00002.h5").unlink()
    src, _ = synth
    preprocess(src / "train", root, src / "val", src / "LOC_val_solution.csv", Options(size=64, per_file=8),
               workers=1, quiet=True)
    assert read_file_attrs(root / "train" / "00002.h5")["format_version"] == 2
    assert json.loads((root / "meta.json").read_text())["format_version"] == 1
    upgrade(root, quiet=True)
    same_as_reference(root, prep[0])


def _without_mean_digest(src: Path, dst: Path) -> Path:
    """A copy of `src` as an output written before meta.json recorded its mean image's digest."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    del meta["mean_sha256"]
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


def test_an_older_output_gets_its_mean_images_digest(prep, train_data, tmp_path, capsys):
    """Recorded once (the SHA-256 of the file's bytes, computed here with hashlib), and from then on a mean
    image of another output of the same size is refused where the mean is read; nothing else changes."""
    import hashlib

    from data.layouts import DataError
    from data.meta import check_files
    root = _without_mean_digest(prep[0], tmp_path / "data")
    before = json.loads((root / "meta.json").read_text())
    assert upgrade_mod.main([str(root), "--quiet", "--workers", "1"]) == 0
    assert "meta.json now records the mean image's SHA-256 (mean_sha256)" in capsys.readouterr().out
    meta = json.loads((root / "meta.json").read_text())
    assert meta == {**before, "mean_sha256": hashlib.sha256((root / "mean.npy").read_bytes()).hexdigest()}
    written = (root / "meta.json").read_bytes()
    assert upgrade_mod.main([str(root), "--quiet", "--workers", "1"]) == 0  # once: the second run says nothing
    assert "mean_sha256" not in capsys.readouterr().out and (root / "meta.json").read_bytes() == written
    check_files(root, meta, ("train", "val"))
    other = np.load(train_data / "mean.npy")[:64, :64]  # another output's mean, cut to this size
    np.save(root / "mean.npy", other)
    with pytest.raises(DataError, match="not this output's mean image"):
        check_files(root, meta, ("train", "val"))


@pytest.mark.parametrize("damage", ["nan", "shape", "missing"])
def test_a_mean_image_that_does_not_read_is_not_blessed(prep, tmp_path, capsys, damage):
    """No digest is recorded for a mean image that is not one of this output's: listed as a problem (exit 1),
    meta.json left as it was."""
    root = _without_mean_digest(prep[0], tmp_path / "data")
    mean = np.load(root / "mean.npy")
    if damage == "missing":
        (root / "mean.npy").unlink()
    else:
        np.save(root / "mean.npy", np.full_like(mean, np.nan) if damage == "nan" else mean[:10])
    before = (root / "meta.json").read_bytes()
    assert upgrade_mod.main([str(root), "--quiet", "--workers", "1"]) == 1
    out, err = capsys.readouterr()
    assert f"{root / 'mean.npy'}: " in err and "0 could not be converted" in out, (out, err)
    assert (root / "meta.json").read_bytes() == before
