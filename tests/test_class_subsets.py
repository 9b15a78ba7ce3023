"""--classes N|FILE and --train-per-class K beyond what tests/test_devkit.py checks: the seed decides the
N classes (and only the seed), N may be every class, K alone is recorded, and meta.json counts the
validation images left out. Expectations by hand: the label file's lines counted, the sorted file names
of each class folder, and two runs compared."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.layouts import DataError
from data.preprocess import Options, preprocess
from data.sources import choose_classes
from tests.test_preprocess import concat

WNIDS = [f"n{k:08d}" for k in range(100)]
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def test_classes_n_is_a_function_of_the_seed():
    """The same seed picks the same classes (a re-run, another machine); another seed picks others."""
    a, info = choose_classes(WNIDS, "10", 1)
    assert choose_classes(WNIDS, "10", 1)[0] == a and choose_classes(list(WNIDS), 10, 1)[0] == a
    assert len(set(a)) == 10 and a == sorted(a) and set(a) <= set(WNIDS)
    assert choose_classes(WNIDS, "10", 2)[0] != a
    assert info == {"classes": 10, "of": 100, "chosen_by": "seed 1"}


def test_classes_n_may_be_every_class_but_not_more_or_none():
    assert choose_classes(WNIDS, "100", 5)[0] == WNIDS
    for bad in ("101", "0"):
        with pytest.raises(DataError, match="the train source has 100 classes"):
            choose_classes(WNIDS, bad, 5)


def _run(synth, out: Path, **opts) -> dict:
    root, _ = synth
    preprocess(root / "train", out, root / "val", root / "val.txt", Options(size=16, per_file=64, **opts),
               workers=1, quiet=True)
    return json.loads((out / "meta.json").read_text())


@pytest.mark.processes
def test_the_preprocessing_seed_reaches_the_class_choice(synth, tmp_path):
    """--seed 3 and --seed 4 pick the classes choose_classes picks for them (they differ), and the labels
    number the chosen classes in sorted order."""
    _, manifest = synth
    picks = {seed: choose_classes(manifest["classes"], "2", seed)[0] for seed in (3, 4)}
    assert picks[3] != picks[4]
    for seed, chosen in picks.items():
        meta = _run(synth, tmp_path / str(seed), class_subset="2", seed=seed)
        assert meta["classes"] == chosen and meta["subset"]["chosen_by"] == f"seed {seed}"
        _, labels, names = concat(tmp_path / str(seed), "train")
        assert [chosen[y] for y in labels] == [n.split("/")[0] for n in names]


@pytest.mark.processes
def test_val_images_outside_the_subset_are_counted(synth, tmp_path):
    """meta.json's subset.val_images_outside: val.txt's images of the classes left out, counted by hand."""
    root, manifest = synth
    chosen = [manifest["classes"][0], manifest["classes"][2]]
    listed = tmp_path / "chosen.txt"
    listed.write_text("".join(f"{w}\n" for w in chosen))
    meta = _run(synth, tmp_path / "out", class_subset=str(listed))
    lines = [line.split() for line in (root / "val.txt").read_text().splitlines()]
    outside = sum(1 for name, label in lines if manifest["classes"][int(label)] not in chosen
                  and name.lower().endswith(IMAGE_SUFFIXES))
    assert outside > 0
    assert meta["subset"] == {"classes": 2, "of": 4, "chosen_by": f"list {listed}", "train_per_class": None,
                              "val_images_outside": outside}


@pytest.mark.processes
def test_train_per_class_alone_keeps_the_first_k_of_every_class(synth, tmp_path):
    """--train-per-class 3 without --classes: every class, each its first 3 image files by name (those that
    decode), recorded in meta.json; validation untouched."""
    root, manifest = synth
    meta = _run(synth, tmp_path / "out", train_per_class=3)
    assert meta["classes"] == manifest["classes"] and meta["subset"] == {"train_per_class": 3}
    _, _, names = concat(tmp_path / "out", "train")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    skipped = {s["path"].removeprefix("train/") for s in report["skipped"]}
    want = set()
    for wnid in manifest["classes"]:
        files = sorted(p.name for p in (root / "train" / wnid).iterdir() if p.name.lower().endswith(IMAGE_SUFFIXES))
        want |= {f"{wnid}/{f}" for f in files[:3]}
    assert set(names) == want - skipped and len(names) + len(skipped & want) == 3 * len(manifest["classes"])
    assert meta["splits"]["val"]["count"] == json.loads((tmp_path / "out" / "report.json").read_text())[
        "counts"]["val"]["written"] > 0
