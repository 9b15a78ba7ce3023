"""Issue 26, class 1: a batch file is trusted by what it records (split, index, count), not by its name.

A link to another batch file, a hard link listed twice, or a training file copied into val/ read other
images under a listed name. Each is compared with what the intact folder gives: the reader, the
preflight (train.py, evaluate.py), evaluation's error rate computed by hand, and the upgrade converter.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from alexnet.evaluation import evaluate
from data.augment import Normalizer
from data.batchfile import BatchFileError
from data.layouts import DataError
from data.meta import check_files, read_meta
from data.reader import SplitData
from data.upgrade import convert_file, upgrade
from tests.conftest import load_script, tiny_overrides
from tests.test_evaluate import CROP, PixelLinear, hand_probs, trained  # noqa: F401 (a fixture)
from train import main as train_main


def _symlink(data: Path, name: str, target: str) -> None:
    (data / name).unlink()
    (data / name).symlink_to(target)


def _hard_link(data: Path, name: str, target: str) -> None:
    (data / name).unlink()
    os.link(data / target, data / name)


def _copy(data: Path, name: str, source: str) -> None:
    shutil.copyfile(data / source, data / name)


# (damage, the file at fault, what the message must also hold); each time both files hold 8 images, so
# the count meta.json lists does not tell them apart (prep's files hold 8, 6, 8, 8, 8, 7, 3 and 7, 8, 1)
DAMAGES = {
    "train file -> symlink to another": (lambda d: _symlink(d, "train/00002.h5", "00000.h5"), "train/00002.h5",
                                         "the same file as"),
    "train file hard-linked to another": (lambda d: _hard_link(d, "train/00003.h5", "train/00000.h5"),
                                          "train/00003.h5", "the same file as"),
    "train file copied into val": (lambda d: _copy(d, "val/00001.h5", "train/00003.h5"), "val/00001.h5",
                                   "records split 'train', index 3"),
}


def damaged(prep, tmp_path: Path, kind: str) -> Path:
    data = Path(shutil.copytree(prep[0], tmp_path / "data", symlinks=True))
    DAMAGES[kind][0](data)
    return data


@pytest.mark.parametrize("kind", DAMAGES)
def test_preflight_names_the_file_and_what_it_is(prep, tmp_path, kind):
    data = damaged(prep, tmp_path, kind)
    _, at_fault, says = DAMAGES[kind]
    with pytest.raises(DataError) as e:
        check_files(data, read_meta(data), ("train", "val"), mean=False)
    assert str(e.value).startswith(f"{data / at_fault}: ") and says in str(e.value)


@pytest.mark.parametrize("kind", DAMAGES)
def test_reader_refuses_a_file_recording_another_place(prep, tmp_path, kind):
    """Every read of the damaged file fails naming it; images of the other files read as in the intact folder."""
    data = damaged(prep, tmp_path, kind)
    _, at_fault, _ = DAMAGES[kind]
    split, name = at_fault.split("/")
    intact, broken = SplitData(prep[0], split), SplitData(data, split)
    fi = [p.name for p in broken.paths].index(name)
    bad = np.arange(broken.offsets[fi], broken.offsets[fi + 1])
    with pytest.raises(BatchFileError) as e:
        broken.read(bad)
    message = str(e.value)
    assert message.startswith(f"{data / at_fault}: records split ") and f"split {split!r}, index {fi}" in message
    good = np.setdiff1d(np.arange(len(intact)), bad)
    for got, want in zip(broken.read(good), intact.read(good)):
        np.testing.assert_array_equal(got, want)


def test_format_1_files_are_checked_too(prep, tmp_path):
    data = Path(shutil.copytree(prep[0], tmp_path / "data"))
    for split in ("train", "val"):
        for f in (data / split).glob("*.h5"):
            convert_file(f, version=1)
    _copy(data, "val/00001.h5", "train/00003.h5")
    with pytest.raises(BatchFileError, match="records split 'train', index 3"):
        SplitData(data, "val").read(np.arange(7, 10))


def test_evaluation_gives_the_intact_error_rate_or_refuses(prep, tmp_path):
    """The error rate computed by hand on the intact val images; the damaged copy never gives a number."""
    intact = SplitData(prep[0], "val")
    images, labels = intact.read(np.arange(len(intact)))
    model = PixelLinear(intact.num_classes, CROP)
    mean = intact.mean_image()
    probs = hand_probs(model, images, mean.astype(np.float64), CROP, 1)
    want = float(np.mean(probs.argmax(axis=1) != labels))
    got = evaluate(model, intact, CROP, Normalizer("image", mean), batch_size=5, progress=False)
    assert got["top1_err"] == pytest.approx(want)
    data = damaged(prep, tmp_path, "train file copied into val")
    with pytest.raises(BatchFileError, match="records split 'train'"):
        evaluate(model, SplitData(data, "val"), CROP, Normalizer("image", mean), batch_size=5, progress=False)


@pytest.mark.parametrize("kind", DAMAGES)
def test_evaluate_cli_exits_2_naming_the_file(prep, trained, tmp_path, kind, capsys):  # noqa: F811 (the fixture)
    """evaluate.py: the intact folder gives a number, the damaged copy one line and exit 2, no number."""
    evaluate_script = load_script("evaluate")
    data = damaged(prep, tmp_path, kind)
    split = DAMAGES[kind][1].split("/")[0]
    args = ["--weights", str(trained / "checkpoints" / "last.pt"), "--split", split, "--no-progress", "--device", "cpu"]
    assert evaluate_script.main(["--data", str(prep[0]), *args]) == 0
    assert "top-1 error" in capsys.readouterr().out
    assert evaluate_script.main(["--data", str(data), *args]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"{data / DAMAGES[kind][1]}:" in err and "Traceback" not in err
    assert "error" not in out


def test_train_exits_2_before_any_step(prep, tmp_path, capsys):
    data = damaged(prep, tmp_path, "train file -> symlink to another")
    code = train_main(["configs/demo.yaml", *tiny_overrides(data, tmp_path / "run", **{"model.arch": "owt",
                                                                                       "data.crop": 64})])
    err = capsys.readouterr().err
    assert code == 2 and f"{data / 'train/00002.h5'}: the same file as {data / 'train/00000.h5'}" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_upgrade_leaves_a_file_of_another_place_and_names_it(prep, tmp_path):
    data = Path(shutil.copytree(prep[0], tmp_path / "data"))
    for split in ("train", "val"):
        for f in (data / split).glob("*.h5"):
            convert_file(f, version=1)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    _copy(data, "val/00001.h5", "train/00003.h5")
    before = (data / "val/00001.h5").read_bytes()
    result = upgrade(data, quiet=True)
    assert [p["path"] for p in result["problems"]] == [str(data / "val/00001.h5")]
    assert "records split 'train', index 3" in result["problems"][0]["reason"]
    assert (data / "val/00001.h5").read_bytes() == before  # left as it was: not laundered into format 2


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["train file -> symlink to another", "train file copied into val"])
def test_a_resumed_preprocess_redoes_a_file_of_another_place(synth, prep, tmp_path, kind):
    """An unfinished output (no meta.json) holding a file of another place under a final name: the resumed
    run writes that file again instead of taking it for done, and ends as the intact output."""
    import h5py

    from data.preprocess import Options, preprocess
    data = damaged(prep, tmp_path, kind)
    (data / "meta.json").unlink()
    root, _ = synth
    preprocess(root / "train", data, root / "val", root / "LOC_val_solution.csv", Options(size=64, per_file=8),
               workers=2, quiet=True)
    for split in ("train", "val"):
        for intact in sorted((prep[0] / split).glob("*.h5")):
            redone = data / split / intact.name
            assert not redone.is_symlink()
            with h5py.File(intact) as a, h5py.File(redone) as b:
                assert np.array_equal(a["images"][...], b["images"][...]) and a.attrs["index"] == b.attrs["index"]
    assert read_meta(data)["splits"] == read_meta(prep[0])["splits"]
