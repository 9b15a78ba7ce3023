"""The weight formats package: its imports point one way, and a new file format is one FileFormat line."""
from __future__ import annotations

import ast
import sys

import pytest
import torch

from alexnet.checkpoint import CheckpointError
from alexnet.weights import load
from alexnet.weights.common import FormatError
from tests import children
from tests.conftest import REPO

PACKAGE = REPO / "alexnet" / "weights"
TOP = ("convert", "load", "start")  # the modules that may import the formats (start: convert and load)


def _package_imports(module: str) -> set[str]:
    """The modules of alexnet/weights that `module` imports (relative imports of the package)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module} if node.module else {a.name for a in node.names}
    return out


def test_formats_do_not_import_the_modules_above_them():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert {"common", "load", "convert", "theano", "torchvision"} <= set(modules)
    for module in modules:
        if module not in TOP:
            assert not _package_imports(module) & set(TOP), module
    assert not _package_imports("convert") & {"load", "start"}
    assert not _package_imports("load") & {"convert", "start"}


@pytest.mark.processes
def test_evaluation_and_weights_do_not_import_the_trainer():
    code = ("import sys, alexnet.evaluation, alexnet.weights.load, alexnet.weights.convert; "
            "print(sorted(m for m in sys.modules if m in ('alexnet.trainer', 'train')))")
    r = children.run([sys.executable, "-c", code], cwd=REPO, cpu_s=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_new_format_is_one_line_and_is_told_before_torch_load(tmp_path, monkeypatch):
    """A format torch.load cannot read, put first, is read by its own reader; the file is never torch-loaded."""
    model = torch.nn.Linear(2, 3)

    def read(path, contents, arch, width):
        return model.train(), {"source": "fake", "arch": arch}

    fake = load.FileFormat("fake", lambda path, contents: str(path).endswith(".fake"), read)
    monkeypatch.setattr(load, "FILE_FORMATS", (fake, *load.FILE_FORMATS))
    path = tmp_path / "w.fake"
    path.write_bytes(b"\x08\x01 not a torch file")
    got, info = load.load_weights(path, "caffenet")
    assert got is model and not got.training and info == {"source": "fake", "arch": "caffenet"}
    other = tmp_path / "w.pt"
    other.write_bytes(b"\x08\x01 not a torch file")
    with pytest.raises(CheckpointError, match="cannot be loaded as weights"):
        load.load_weights(other)  # the other formats still torch.load it
    torch.save({"foo.weight": torch.zeros(2)}, other)
    with pytest.raises(FormatError, match="unrecognised weights: keys foo.weight"):
        load.load_weights(other)


def test_a_model_to_load_into_has_no_tensor_its_state_does_not_set(monkeypatch):
    """new_model gives memory holding NaN, not initial values: every tensor must be one that load_strict sets,
    and one a reader missed is NaN. A buffer outside the state (persistent=False) would keep that, so it is
    refused; on the meta device (a check of shapes) the model stays there."""
    from alexnet.weights import common
    model = common.new_model("alexnet", 10, 0.125, 67)
    assert {p.device.type for p in model.state_dict().values()} == {"cpu"}
    assert all(p.isnan().all() for p in model.state_dict().values())  # what a reader misses is NaN, refused
    assert all(b.isnan().all() or not b.is_floating_point() for b in
               common.new_model("alexnet_bn", 10, 0.125, 67).state_dict().values())
    with torch.device("meta"):
        assert {p.device.type for p in common.new_model("alexnet", 10, 0.125, 67).state_dict().values()} == {"meta"}
    built = common.build_model

    def with_a_loose_buffer(*args, **kwargs):
        model = built(*args, **kwargs)
        model.register_buffer("scale", torch.ones(1), persistent=False)
        return model
    monkeypatch.setattr(common, "build_model", with_a_loose_buffer)
    with pytest.raises(TypeError, match=r"buffers \['scale'\] are not in its state"):
        common.new_model("alexnet", 10, 0.125, 67)


def test_a_caffe_file_fills_every_tensor_or_is_refused():
    """The Caffe reader copies blobs into new_model's memory, which holds NaN: a blob for each tensor of the
    model, no fewer."""
    import numpy as np

    from alexnet.weights import caffe, common
    model = common.new_model("caffenet", 10, 0.125, 67)
    state = {k: np.zeros(tuple(v.shape), np.float32) for k, v in model.state_dict().items()}
    caffe._copy_into(model, state)
    assert all(not v.any() for v in model.state_dict().values())
    del state["classifier.fc8.bias"]
    with pytest.raises(FormatError, match=r"are not the model's tensors"):
        caffe._copy_into(model, state)
