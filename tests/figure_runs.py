"""Runs shared by tests/test_figures.py and tests/test_report.py, each built once per test session.

- ``named_data``: 4 synthetic classes with class names (meta.json's class_names), 72x72;
- ``demo_run``: configs/demo.yaml at width 0.125, crop 67, 2 epochs on it (single device);
- ``columns_run``: the same model trained as two columns (parallel.model=columns, 2 processes);
- ``theano``: a Theano weights folder (caffenet width 0.125, 6 classes) and 256x256 data, and a run
  continued from its converted checkpoint for one epoch.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.conftest import load_script, run_script, tiny_overrides

# words per synthetic wnid: the figures name classes by the first of them
WORDS = {"n01440764": "red circle, round thing", "n01441764": "yellow square", "n01442764": "green triangle",
         "n01443764": "cyan cross, plus sign"}
SPEED = {"data.loading": "inline", "run.device": "cpu"}


def shared(factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` once per session (both test modules ask for the same runs), then the folder."""
    folder = factory.getbasetemp() / name
    if not (folder / ".built").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        build(folder)
        (folder / ".built").touch()
    return folder


def named_data(factory) -> Path:
    def build(folder: Path) -> None:
        from data.preprocess import Options, preprocess
        from data.synthetic import generate
        generate(folder / "src", num_classes=4, train_per_class=10, val_per_class=4, seed=7, quirks=False,
                 min_side=64, max_side=120)
        names = folder / "words.txt"
        names.write_text("".join(f"{w} {t}\n" for w, t in WORDS.items()))
        preprocess(folder / "src" / "train", folder / "data", folder / "src" / "val", folder / "src" / "val.txt",
                   Options(size=72, per_file=16), workers=2, quiet=True, class_names=names)
    return shared(factory, "named_data", build) / "data"


def demo_run(factory) -> Path:
    data = named_data(factory)

    def build(folder: Path) -> None:
        import train
        over = tiny_overrides(data, folder / "run", **SPEED)
        assert train.main(["configs/demo.yaml", *over]) == 0
    return shared(factory, "demo_run", build) / "run"


def columns_run(factory) -> Path:
    data = named_data(factory)

    def build(folder: Path) -> None:
        over = tiny_overrides(data, folder / "run", **SPEED, **{"parallel.model": "columns", "parallel.model_size": 2,
                                                                "train.epochs": 1})
        r = run_script("train.py", "configs/demo.yaml", *over, cpu_s=300)
        assert r.returncode == 0, r.stderr[-3000:]
    return shared(factory, "columns_run", build) / "run"


def theano(factory) -> tuple[Path, Path, Path, dict]:
    """(the Theano folder, its 256x256 data, a run continued from it, the folder's epoch-3 arrays)."""
    from tests.test_theano_weights import CLASSES, EPOCH, continue_overrides, write_folder

    def build(folder: Path) -> None:
        import train
        from data.preprocess import Options, preprocess
        from data.synthetic import generate
        generate(folder / "src", num_classes=CLASSES, train_per_class=2, val_per_class=2, seed=3, quirks=False,
                 min_side=64, max_side=200)
        preprocess(folder / "src" / "train", folder / "data", folder / "src" / "val", folder / "src" / "val.txt",
                   Options(size=256, per_file=8, resize="warp"), workers=2, quiet=True)
        write_folder(folder / "weights", EPOCH, seed=30)
        ckpt = folder / "converted.pt"
        assert load_script("convert_weights").main([str(folder / "weights"), str(ckpt), "--momentum"]) == 0
        over = continue_overrides(folder / "data", folder / "run", ckpt, **{"train.max_steps": 0,
                                                                             "train.epochs": EPOCH + 1})
        assert train.main(["configs/theano_continue.yaml", *over]) == 0
    root = shared(factory, "theano", build)
    arrays = {stem: np.load(root / "weights" / f"{stem}_{EPOCH}.npy") for stem in ("W_0",)}
    return root / "weights", root / "data", root / "run", arrays
