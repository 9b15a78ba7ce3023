"""Where a run resumes, and what its dry run says: the same checkpoint, the same epoch and step, or the same
refusal, whatever is damaged in run.dir and whatever the config changed. Generated: every subset of the
run's checkpoint files damaged, under each config change (none; a global batch that does or does not divide
the checkpoint's images; a key a resume refuses), each compared between `train.py --dry-run` and the run.
The dry run once named run.dir's newest file without loading it, and said "would resume" where the run then
fell back to an older file or refused."""
from __future__ import annotations

import itertools
import os
import re
import shutil
from pathlib import Path

import pytest

import train
from tests.conftest import in_fast_tier, tiny_overrides

# 48 images, batch 8: 6 steps an epoch; stopped at global step 8, last.pt is 2 steps into epoch 2
STOPPED = {"train.max_steps": 8, "data.loading": "inline", "train.log_every": 1}
CHANGES = {"same config": {}, "batch 16 (divides 16 images)": {"train.batch_size": 16},
           "batch 12 (does not divide 16 images)": {"train.batch_size": 12},
           "another width (refused)": {"model.width": 0.25}}
DRY = re.compile(r"would resume from (\S+) at epoch (\d+), step (\d+) \(")
REAL = re.compile(r"resumed from (\S+): epoch (\d+), step (\d+) ")


def _copy_run(src: Path, dst: Path) -> None:
    """A copy of a run folder with its hard links (last.pt and best.pt are often links to an epoch file)."""
    copied: dict[tuple[int, int], Path] = {}
    dst.mkdir()
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key in copied:
            os.link(copied[key], target)
        else:
            shutil.copy2(path, target)
            copied[key] = target


def _damage(path: Path) -> None:
    """Replaced by its first 100 bytes (a torn copy), its links elsewhere untouched."""
    head = path.read_bytes()[:100]
    path.unlink()
    path.write_bytes(head)


def _outcome(code: int, out: str, err: str, pattern: re.Pattern) -> tuple:
    if code != 0:
        return ("refused", code, err.strip().splitlines()[-1])
    found = pattern.search(out)
    assert found, out
    return ("resumes", Path(found.group(1)).name, int(found.group(2)), int(found.group(3)))


@pytest.fixture(scope="module")
def template(train_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("template") / "run"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **STOPPED)]) == 0
    return run


def _subsets(names: list[str]):
    return itertools.chain.from_iterable(itertools.combinations(names, k) for k in range(len(names) + 1))


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_dry_run_names_what_the_run_resumes_from_or_its_refusal(train_data, template, tmp_path, capsys, change):
    names = sorted(p.name for p in (template / "checkpoints").iterdir() if p.name.endswith(".pt"))
    assert "last.pt" in names and len(names) >= 3  # last.pt mid-epoch, epoch_001.pt and best.pt at least
    seen = set()
    subsets = list(_subsets(names))
    if in_fast_tier():  # the edit loop's tier: nothing damaged, the newest alone, everything (the suite: all)
        subsets = [(), ("last.pt",), tuple(names)]
    for i, damaged in enumerate(subsets):
        run = tmp_path / f"run{i}"
        _copy_run(template, run)
        for name in damaged:
            _damage(run / "checkpoints" / name)
        args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **STOPPED, **CHANGES[change])]
        capsys.readouterr()
        dry = _outcome(train.main([*args, "--dry-run"]), *capsys.readouterr(), DRY)
        real = _outcome(train.main(args), *capsys.readouterr(), REAL)
        assert dry == real, (damaged, dry, real)
        seen.add(dry[0])
    if change == "same config":
        assert seen == {"resumes", "refused"}  # some file loads, and where none does both refuse
