"""Shared fixtures: one small synthetic ImageNet tree and its preprocessed output per test session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_script(*args: str, timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a repository script with this interpreter; output captured as text."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=full_env, **kw)


@pytest.fixture(scope="session")
def synth(tmp_path_factory) -> tuple[Path, dict]:
    """A synthetic ImageNet-format tree (flat val with both label files) with every quirk."""
    from data.synthetic import generate
    root = tmp_path_factory.mktemp("synth")
    manifest = generate(root, num_classes=4, train_per_class=12, val_per_class=4, seed=0,
                        min_side=48, max_side=160)
    return root, manifest


@pytest.fixture(scope="session")
def prep(synth, tmp_path_factory) -> tuple[Path, dict]:
    """`synth` preprocessed at 64x64, 8 images per file, Kaggle val labels."""
    from data.preprocess import Options, preprocess
    root, _ = synth
    out = tmp_path_factory.mktemp("prep")
    summary = preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv",
                         Options(size=64, per_file=8), workers=2, quiet=True)
    return out, summary


@pytest.fixture(scope="session")
def train_data(synth, tmp_path_factory) -> Path:
    """`synth` preprocessed at 72x72 (alexnet's smallest crop is 67), 16 images per file."""
    from data.preprocess import Options, preprocess
    root, _ = synth
    out = tmp_path_factory.mktemp("train_data")
    preprocess(root / "train", out, root / "val", root / "val.txt", Options(size=72, per_file=16),
               workers=2, quiet=True)
    return out


def load_script(name: str):
    """A scripts/<name>.py as a module, to call its main() in-process (fast error-path tests)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_overrides(data_root: Path, run_dir: Path, **extra) -> list[str]:
    """Dotted overrides for a seconds-long alexnet run on `train_data`."""
    base = {"data.root": str(data_root), "data.crop": 67, "model.width": 0.125, "model.init": "torch",
            "train.batch_size": 8, "train.epochs": 2, "train.log_every": 2, "train.lr_steps": [1],
            "run.dir": str(run_dir), "run.progress": False, "run.tensorboard": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip where CUDA is absent (CI); on a GPU machine run them with -m gpu."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
