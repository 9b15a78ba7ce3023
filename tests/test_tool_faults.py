"""Faults of scripts/convert_weights.py and scripts/predict.py (tools/faults.py's convert-* and predict-*
cases): one line naming what is at fault, exit 2 for bad input, 130 for Ctrl-C, and no output written."""
from __future__ import annotations

import json

import pytest
import torch

from alexnet.models import build_model
from tests.caffe_nets import small_blobs, write_model
from tests.conftest import load_script
from tests.test_faults import mounts, one_line  # noqa: F401  (mounts: a fixture)

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

NOT_USABLE = "holds NaN or inf (the first tensor that does): these weights are not usable"


@pytest.fixture(scope="module")
def image(synth) -> str:
    root, manifest = synth
    wnid = manifest["classes"][0]
    return str(root / "train" / wnid / f"{wnid}_00001.JPEG")


@pytest.fixture(scope="module")
def owt(tmp_path_factory) -> str:
    """torchvision-layout weights (per-channel normalisation: predict.py needs no --data)."""
    path = tmp_path_factory.mktemp("owt") / "tv.pt"
    torch.save(build_model("owt", num_classes=5, width=0.125, crop=224, init="torch").state_dict(), path)
    return str(path)


def caffenet_with_nan(tmp_path) -> str:
    state = build_model("caffenet", num_classes=4, width=0.125, crop=227, init="torch").state_dict()
    state["classifier.fc7.weight"][2, 3] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    return str(tmp_path / "nan.pt")


def caffemodel_with_inf(tmp_path) -> str:
    blobs = small_blobs(classes=4)
    blobs["fc7"][0][1, 2] = float("inf")
    return str(write_model(tmp_path, "caffenet", "V1", blobs, name="inf.caffemodel"))


@pytest.mark.parametrize("source,extra,tensor", [
    (caffenet_with_nan, ["--arch", "caffenet"], "classifier.fc7.weight"),  # .pt -> a Theano folder
    (caffemodel_with_inf, [], "model.classifier.fc7.weight"),  # .caffemodel -> a .pt checkpoint
])
def test_convert_refuses_non_finite_weights_writing_nothing(tmp_path, capsys, source, extra, tensor):
    src, dst = source(tmp_path), tmp_path / "out"
    assert load_script("convert_weights").main([src, str(dst), *extra]) == 2
    assert one_line(capsys.readouterr().err) == f"convert_weights.py: error: {src}: {tensor} {NOT_USABLE}"
    assert not dst.exists()


def test_convert_read_only_destination_is_one_plain_line(tmp_path, capsys, mounts):  # noqa: F811
    src = tmp_path / "c.pt"
    torch.save(build_model("caffenet", num_classes=4, width=0.125, crop=227, init="torch").state_dict(), src)
    dst = mounts(tmp_path / "ro", "size=1m,ro") / "theano"
    assert load_script("convert_weights").main([str(src), str(dst), "--arch", "caffenet", "--epoch", "3"]) == 2
    assert one_line(capsys.readouterr().err) == f"convert_weights.py: error: {dst}: read-only file system"


def test_predict_refuses_non_finite_weights(tmp_path, capsys, image):
    state = build_model("owt", num_classes=5, width=0.125, crop=224, init="torch").state_dict()
    state["features.3.bias"][0] = float("-inf")
    torch.save(state, tmp_path / "inf.pt")
    assert load_script("predict").main([str(tmp_path / "inf.pt"), image]) == 2
    out, err = capsys.readouterr()
    assert one_line(err) == f"predict.py: error: {tmp_path / 'inf.pt'}: features.3.bias {NOT_USABLE}" and out == ""


def test_predict_json_under_a_file_is_one_line_before_any_work(tmp_path, capsys, owt, image, monkeypatch):
    (tmp_path / "file.txt").write_text("x")
    predict = load_script("predict")
    monkeypatch.setattr(predict, "predict", lambda args: pytest.fail("predicted before checking --json"))
    with pytest.raises(SystemExit) as e:  # refused by the option's domain, as it is parsed
        predict.main([owt, image, "--json", str(tmp_path / "file.txt" / "p.json")])
    assert e.value.code == 2
    err = one_line(capsys.readouterr().err)
    assert "error: argument --json: " in err, err  # prog: sys.argv[0], pytest here
    assert f"{tmp_path / 'file.txt'} is a file, so {tmp_path / 'file.txt' / 'p.json'} cannot be made" in err, err
    assert (tmp_path / "file.txt").read_text() == "x"


def test_predict_top_must_be_positive_in_one_line(capsys, owt, image):
    with pytest.raises(SystemExit) as e:
        load_script("predict").main([owt, image, "--top", "0"])
    assert e.value.code == 2
    err = one_line(capsys.readouterr().err)  # prog: sys.argv[0], pytest's in-process
    assert err.endswith(": error: argument --top: must be an integer >= 1, got 0 (see --help)"), err


def test_predict_ctrl_c_exits_130_in_one_line(tmp_path, capsys, owt, image, monkeypatch):
    predict = load_script("predict")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(predict, "predict_log_probs", interrupted)
    try:
        code = predict.main([owt, image, "--json", str(tmp_path / "p.json")])
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("Ctrl-C escaped main()")
    assert code == 130
    assert one_line(capsys.readouterr().err) == "predict.py: interrupted" and not (tmp_path / "p.json").exists()


def test_a_run_refused_after_its_options_makes_no_folder_for_its_outputs(tmp_path, capsys, train_data, image, owt):
    """--json and --csv in folders that do not exist yet, and weights refused when loaded (after the options
    were read): the folders were made before the work and left empty. Exit 2, one line, nothing made."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not weights")
    runs = {"evaluate": ["--data", str(train_data), "--weights", str(bad), "--json", str(tmp_path / "a" / "b" /
                                                                                        "e.json"),
                         "--csv", str(tmp_path / "c" / "e.csv"), "--no-progress"],
            "predict": [str(bad), image, "--json", str(tmp_path / "d" / "p.json")]}
    for script, argv in runs.items():
        assert load_script(script).main(argv) == 2, script
        assert "cannot be loaded as weights" in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]
    assert load_script("predict").main([owt, image, "--json", str(tmp_path / "d" / "p.json")]) == 0  # the write
    assert [r["image"] for r in json.loads((tmp_path / "d" / "p.json").read_text())] == [image]   # makes it

