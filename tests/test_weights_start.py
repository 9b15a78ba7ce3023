"""run.resume_from=NAME or any weights file (alexnet/weights/start.py): a run starts from published weights
fetched from the local server, from a torchvision file or a .caffemodel, with the run's own optimizer at
rest; the settings the weights fix are named when the config disagrees; a dry run checks it all and
fetches nothing. Checked against the files themselves: with lr 1e-30 a run ends with exactly their weights."""
from __future__ import annotations

import pytest
import torch

import train
from alexnet.checkpoint import load
from alexnet.config import Config, ConfigError, to_dict
from alexnet.models import build_model
from alexnet.weights import hub
from alexnet.weights.checkpoint_file import WEIGHTS_KIND
from alexnet.weights.common import FormatError
from alexnet.weights.convert import training_checkpoint
from alexnet.weights.load import load_weights
from alexnet.weights.start import starting_checkpoint
from tests.caffe_nets import SMALL, random_blobs, write_model
from tests.conftest import REPO, pipe_nobody_writes, tiny_overrides

OWT = {"model.arch": "owt", "data.mean": "channel"}
STILL = {"train.lr": 1e-30, "train.epochs": 1, "data.loading": "inline"}  # steps below nearly every ulp


def _owt_file(path, classes: int = 4, seed: int = 3) -> dict:
    torch.manual_seed(seed)
    state = build_model("owt", num_classes=classes, width=0.125, crop=224, init="torch").state_dict()
    torch.save(state, path)
    return state


def _same(state: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert torch.allclose(state[key], value, rtol=0, atol=atol), key


# What steps of lr 1e-30 can move: a weight below about 1e-23 still has an ulp below them (a 2-replica run
# moved one fc6 weight by 4.5e-34); a weight from elsewhere differs by 1e-2 and more.
MOVED = 1e-20


def test_a_published_name_starts_a_run_from_its_weights_fetched_once(server, published, train_data, tmp_path,
                                                                     capsys):
    expected = _owt_file(tmp_path / "tv.pth")
    url, files = server
    files.files["torchvision-file.bin"] = body = (tmp_path / "tv.pth").read_bytes()
    entry = published("torchvision", body, f"{url}/good")
    run = tmp_path / "run"
    args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **OWT, **STILL), "run.resume_from=torchvision"]
    assert train.main(args) == 0
    out, err = capsys.readouterr()
    assert "torchvision-file.bin" not in err  # run.progress=false: no download bar either
    assert f"starting from the weights of {hub.cache_dir() / entry.file} (published as torchvision)" in out
    _same(load(run / "checkpoints" / "last.pt")["model"], expected, MOVED)
    again = tmp_path / "again"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, again, **OWT, **STILL),
                       "run.resume_from=torchvision"]) == 0
    assert len(files.log) == 1  # the second run read the cache


def test_a_fresh_run_does_not_end_with_those_weights(train_data, tmp_path):
    """The control of the test above: lr 1e-30 alone keeps the run's own initial weights, not the file's."""
    expected = _owt_file(tmp_path / "tv.pth")
    run = tmp_path / "run"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **OWT, **STILL)]) == 0
    got = load(run / "checkpoints" / "last.pt")["model"]
    assert not torch.equal(got["features.0.weight"], expected["features.0.weight"])


def test_the_settings_the_weights_fix_and_their_classes_are_named_when_the_config_differs(train_data, tmp_path,
                                                                                          capsys):
    _owt_file(tmp_path / "tv.pth")
    _owt_file(tmp_path / "tv10.pth", classes=10)
    run = tmp_path / "run"
    cases = [({}, tmp_path / "tv.pth", "holds weights for model.arch=owt, data.mean=channel; this config has "
                                       "model.arch=alexnet, data.mean=image: set model.arch=owt data.mean=channel"),
             (OWT, tmp_path / "tv10.pth", f"holds weights for 10 classes, {train_data} has 4"),
             (OWT, tmp_path / "gone.pt", "run.resume_from: ")]
    for extra, path, words in cases:
        code = train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **extra, **STILL),
                           f"run.resume_from={path}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and words in err, err
        assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_caffemodel_starts_with_the_runs_own_optimizer(train_data, tmp_path, capsys):
    """A .caffemodel by path, under LARS (a converted checkpoint holds SGD's state, which LARS refuses):
    the run ends at its weights, as load_weights reads them."""
    blobs = random_blobs(SMALL["channels"], SMALL["hidden"], 4, 67, seed=5)
    path = write_model(tmp_path, "caffenet", "V2", blobs)
    expected = load_weights(path)[0].state_dict()
    run = tmp_path / "run"
    settings = {"model.arch": "caffenet", "train.optimizer": "lars", **STILL}
    code = train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **settings), f"run.resume_from={path}"])
    err = capsys.readouterr().err
    assert code == 2 and "set model.lrn=caffe" in err, err
    code = train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **settings, **{"model.lrn": "caffe"}),
                       f"run.resume_from={path}"])
    assert code == 0, capsys.readouterr().err
    _same(load(run / "checkpoints" / "last.pt")["model"], expected, MOVED)


def test_a_dry_run_checks_the_start_and_fetches_nothing(server, published, train_data, tmp_path, capsys):
    _owt_file(tmp_path / "tv.pth")
    url, files = server
    files.files["torchvision-file.bin"] = body = (tmp_path / "tv.pth").read_bytes()
    entry = published("torchvision", body, f"{url}/good")
    run = tmp_path / "run"
    args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **OWT), "run.resume_from=torchvision", "--dry-run"]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert f"run.resume_from=torchvision: would fetch {url}/good/torchvision-file.bin into " \
           f"{hub.cache_dir() / entry.file}" in out
    assert files.log == [] and not hub.cache_dir().exists() and not run.exists()
    hub.fetch("torchvision", progress=False)
    assert train.main(args) == 0
    assert f"would start from the weights of {hub.cache_dir() / entry.file} at epoch 1, step 0" in \
        capsys.readouterr().out
    wrong = ["configs/demo.yaml", *tiny_overrides(train_data, run), "run.resume_from=torchvision", "--dry-run"]
    assert train.main(wrong) == 2
    assert "set model.arch=owt data.mean=channel" in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.parametrize("dry", [True, False])
def test_a_pipe_or_a_device_to_start_from_is_refused_not_read(train_data, tmp_path, capsys, dry):
    """A named pipe blocks its reader until a writer comes: run.resume_from naming one hung train.py (and its
    dry run) for ever. Refused in one line before it is opened, as a device is."""
    pipe = tmp_path / "weights.pt"
    with pipe_nobody_writes(pipe) as opened:
        for source in (pipe, "/dev/zero"):
            args = ["configs/demo.yaml", *tiny_overrides(train_data, tmp_path / "run"), f"run.resume_from={source}"]
            assert train.main(args + ["--dry-run"] * dry) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err == [f"train.py: error: run.resume_from: {source}: not a regular file or folder (a device, "
                           "pipe or socket)"], err
    assert not opened, "the pipe was opened for reading"


# -- weights.start in-process: what a start holds, and every refusal's words ---------------------------------


def _cfg(**keys) -> Config:
    cfg = Config()
    for key, value in keys.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_training_checkpoint_is_taken_as_it_is(tmp_path):
    """Its run continues: its own epoch, velocities and RNG, nothing marked as a weights start."""
    model = build_model("alexnet", 4, 0.125, 0.5, 67, "torch")
    velocities = {k: torch.full_like(p, 0.5).numpy() for k, p in model.named_parameters()}
    state = training_checkpoint(model, _cfg(data__crop=67, model__width=0.125), 4, {"format": "ours"}, epoch=3,
                                velocities=velocities)
    torch.save(state, tmp_path / "run.pt")
    got, path = starting_checkpoint(str(tmp_path / "run.pt"), _cfg(), progress=False)
    assert path == tmp_path / "run.pt" and got["epoch"] == 3 and got["source"] == {"format": "ours"}
    assert got["optimizer"]["state"][0]["velocity"].eq(0.5).all()


def test_a_folder_is_refused_naming_the_conversion(tmp_path):
    with pytest.raises(FormatError) as e:
        starting_checkpoint(str(tmp_path), _cfg(), progress=False)
    assert str(e.value) == (f"{tmp_path} is a folder; a Theano folder becomes a checkpoint with "
                            f"scripts/convert_weights.py {tmp_path} FILE.pt --momentum (then run.resume_from=FILE.pt)")


def test_a_start_records_its_weights_and_leaves_the_callers_config_alone(tmp_path):
    expected = _owt_file(tmp_path / "tv.pth")
    # owt takes any crop (its adaptive pool): the run's 67, not torchvision's 224
    cfg = _cfg(model__arch="owt", data__mean="channel", data__crop=67, model__width=0.125)
    state, path = starting_checkpoint(str(tmp_path / "tv.pth"), cfg, progress=False)
    assert state["source"] == {"format": "torchvision", "file": str(tmp_path / "tv.pth"), "weights_only": True}
    assert (state["epoch"], state["step"], state["num_classes"]) == (0, 0, 4)
    assert state["config"]["model"]["num_classes"] == 4 and state["config"]["data"]["crop"] == 67
    assert cfg.model.num_classes is None  # the run's own config is not the start's
    _same(state["model"], expected)


def test_a_published_start_names_its_set_and_shows_a_bar_only_when_asked(server, published, tmp_path, capsys):
    _owt_file(tmp_path / "tv.pth")
    url, files = server
    files.files["torchvision-file.bin"] = body = (tmp_path / "tv.pth").read_bytes()
    entry = published("torchvision", body, f"{url}/good")
    cfg = _cfg(model__arch="owt", data__mean="channel", model__width=0.125)
    state, path = starting_checkpoint("torchvision", cfg, progress=True)
    assert "torchvision-file.bin" in capsys.readouterr().err  # the bar names the file
    assert path == hub.cache_dir() / entry.file
    assert state["source"] == {"format": "torchvision", "file": str(path), "weights_only": True, "name": "torchvision"}
    path.unlink()
    starting_checkpoint("torchvision", cfg, progress=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError) as e:
        starting_checkpoint("torchvision", _cfg(data__mean="channel", model__width=0.125), progress=False)
    assert str(e.value) == (f"run.resume_from=torchvision ({path}) holds weights for model.arch=owt; this config "
                            "has model.arch=alexnet: set model.arch=owt")


def test_the_settings_the_weights_fix_are_read_off_the_weights(tmp_path):
    """A Caffe net's crop (from fc6) and LRN, a weights file's dropout style: each named when the config
    differs, by path."""
    caffe = write_model(tmp_path, "caffenet", "V2", random_blobs(SMALL["channels"], SMALL["hidden"], 4, 227, seed=1))
    with pytest.raises(ConfigError) as e:
        starting_checkpoint(str(caffe), _cfg(model__arch="caffenet", model__width=0.125, data__crop=67), False)
    assert str(e.value) == (f"run.resume_from={caffe} holds weights for model.lrn=caffe, data.crop=227; this "
                            "config has model.lrn=paper, data.crop=67: set model.lrn=caffe data.crop=227")
    theano_style = _cfg(data__crop=67, model__width=0.125, model__dropout_style="theano")
    model = build_model("alexnet", 4, 0.125, 0.5, 67, "torch", dropout_style="theano")
    torch.save({"kind": WEIGHTS_KIND, "version": 1, "config": to_dict(theano_style), "model": model.state_dict(),
                "num_classes": 4}, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"holds weights for model\.dropout_style=theano; this config has "
                                          r"model\.dropout_style=inverted: set model\.dropout_style=theano$"):
        starting_checkpoint(str(tmp_path / "w.pt"), _cfg(data__crop=67, model__width=0.125), False)
    assert starting_checkpoint(str(tmp_path / "w.pt"), theano_style, False)[0]["epoch"] == 0


def test_a_dry_run_says_where_the_run_starts(train_data, tmp_path, capsys):
    """Fresh: nothing; a run.dir with checkpoints: its newest, whatever run.resume_from says."""
    run = tmp_path / "run"
    args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **STILL), f"run.resume_from={tmp_path / 'x.pt'}"]
    assert train.main([*args[:-1], "--dry-run"]) == 0
    assert "would resume" not in capsys.readouterr().out
    assert train.main(args[:-1]) == 0
    capsys.readouterr()
    assert train.main([*args, "--dry-run"]) == 0  # x.pt does not exist: it is not read
    assert (f"; would resume from {run / 'checkpoints' / 'last.pt'} at epoch 2, step 0 (run.dir's newest "
            "checkpoint that loads; run.resume_from is not read)") in capsys.readouterr().out


def test_a_file_named_like_a_published_set_wins_over_the_name(server, published, train_data, tmp_path,
                                                              monkeypatch):
    """As for every --weights: the launcher fetches nothing (the server has nothing: a fetch would fail)."""
    expected = _owt_file(tmp_path / "torchvision")
    url, files = server
    published("torchvision", b"other", f"{url}/good")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    args = [str(REPO / "configs/demo.yaml"), *tiny_overrides(train_data, run, **OWT, **STILL),
            "run.resume_from=torchvision"]
    assert train.main(args) == 0
    assert files.log == []
    _same(load(run / "checkpoints" / "last.pt")["model"], expected, MOVED)


def test_a_start_reads_its_file_once(tmp_path, monkeypatch):
    """Every replica reads the start at start-up: a 233 MB file is not loaded twice to tell its format."""
    import alexnet.checkpoint
    import alexnet.weights.load
    import alexnet.weights.start
    _owt_file(tmp_path / "tv.pth")
    real, paths = alexnet.checkpoint.load, []

    def counted(path, *args, **kw):
        paths.append(path)
        return real(path, *args, **kw)
    for module in (alexnet.weights.start, alexnet.weights.load):
        monkeypatch.setattr(module, "load", counted)
    starting_checkpoint(str(tmp_path / "tv.pth"), _cfg(model__arch="owt", data__mean="channel",
                                                       model__width=0.125), progress=False)
    assert paths == [tmp_path / "tv.pth"]


# -- run.new_classifier: fine-tuning on other classes -----------------------------------------------------


OWT_HEAD = ("classifier.6.weight", "classifier.6.bias")  # owt's last layer, by torchvision's names


def test_weights_of_other_classes_fine_tune_with_a_new_last_layer(train_data, tmp_path, capsys):
    """Weights for 10 classes on data of 4: refused naming run.new_classifier; with it, the run ends with the
    file's weights everywhere but the last layer, which is a new one of 4 rows (torch's init for owt: every
    value within 1/sqrt(fan_in), none the file's), the same for the same train.seed."""
    source = _owt_file(tmp_path / "tv10.pth", classes=10)
    runs = {name: tmp_path / name for name in ("refused", "a", "b", "seed")}
    base = ["configs/demo.yaml", f"run.resume_from={tmp_path / 'tv10.pth'}"]
    assert train.main([*base, *tiny_overrides(train_data, runs["refused"], **OWT, **STILL)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"holds weights for 10 classes, {train_data} has 4; use the data they were trained on, or "
                        "set run.new_classifier=true to fine-tune them with a new last layer for its classes (a "
                        "new run.dir)"), err
    heads = {}
    for name, seed in (("a", 0), ("b", 0), ("seed", 1)):
        over = tiny_overrides(train_data, runs[name], **OWT, **STILL, **{"train.seed": seed})
        assert train.main([*base, *over, "run.new_classifier=true"]) == 0
        out = capsys.readouterr().out
        assert (f"starting from the weights of {tmp_path / 'tv10.pth'} with a new last layer for 4 classes (the "
                "weights': 10): epoch 1") in out, out
        got = load(runs[name] / "checkpoints" / "last.pt")
        assert got["num_classes"] == 4
        body = {k: v for k, v in source.items() if k not in OWT_HEAD}
        _same({k: v for k, v in got["model"].items() if k not in OWT_HEAD}, body, MOVED)
        weight, bias = (got["model"][k] for k in OWT_HEAD)
        bound = 1 / (source["classifier.6.weight"].shape[1] ** 0.5)
        assert weight.shape == (4, source["classifier.6.weight"].shape[1]) and bias.shape == (4,)
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound and bias.abs().max() <= bound
        assert not any(torch.equal(weight[0], row) for row in source["classifier.6.weight"])
        heads[name] = weight
    assert torch.equal(heads["a"], heads["b"]) and not torch.equal(heads["a"], heads["seed"])


def test_a_new_classifier_is_drawn_from_the_seed_alone_and_leaves_the_global_stream_alone(tmp_path):
    """Every process of a run computes its start on its own: the new layer must not depend on what the
    process drew before, nor move what it draws after. model.init=paper: N(0, fc8's std) and fc8's bias
    (AlexNet-BN's prototxt: 0.01, 0.01; models.BN_INIT, written here by hand)."""
    model = build_model("alexnet_bn", 10, 0.125, 0.5, 67, "torch")
    own = to_dict(_cfg(model__arch="alexnet_bn", model__width=0.125, data__crop=67))
    torch.save({"kind": WEIGHTS_KIND, "version": 1, "model": model.state_dict(), "num_classes": 10, "config": own},
               tmp_path / "w.pt")
    cfg = _cfg(model__arch="alexnet_bn", model__width=0.125, data__crop=67, model__init="paper",
               run__new_classifier=True)
    heads = []
    for drawn_before in (1, 2):
        torch.manual_seed(drawn_before)
        before = torch.get_rng_state()
        state, _ = starting_checkpoint(str(tmp_path / "w.pt"), cfg, False, classes=7)
        assert torch.equal(torch.get_rng_state(), before)
        heads.append(state["model"]["classifier.fc8.weight"])
        bias = state["model"]["classifier.fc8.bias"]
        assert bias.shape == (7,) and bias.eq(0.01).all()
    assert torch.equal(heads[0], heads[1]) and heads[0].shape == (7, 512)
    assert abs(heads[0].std().item() - 0.01) < 0.001 and abs(heads[0].mean().item()) < 0.001
    assert state["source"]["new_classifier"] == {"classes_before": 10} and state["num_classes"] == 7


def test_new_classifier_without_the_data_class_count_is_a_callers_error(tmp_path):
    _owt_file(tmp_path / "tv.pth")
    cfg = _cfg(model__arch="owt", data__mean="channel", model__width=0.125, run__new_classifier=True)
    with pytest.raises(ValueError) as e:
        starting_checkpoint(str(tmp_path / "tv.pth"), cfg, progress=False)
    assert str(e.value) == "run.new_classifier needs the data's class count"


def test_a_training_checkpoint_under_new_classifier_is_a_start_at_rest(tmp_path):
    """Another run's checkpoint (epoch 3, momentum 0.5) fine-tuned on other classes: its weights at epoch 0,
    the optimizer at rest, its own classes forgotten."""
    model = build_model("alexnet", 6, 0.125, 0.5, 67, "torch")
    velocities = {k: torch.full_like(p, 0.5).numpy() for k, p in model.named_parameters()}
    torch.save(training_checkpoint(model, _cfg(data__crop=67, model__width=0.125), 6, {"format": "ours"}, epoch=3,
                                   velocities=velocities), tmp_path / "run.pt")
    cfg = _cfg(data__crop=67, model__width=0.125, run__new_classifier=True)
    state, _ = starting_checkpoint(str(tmp_path / "run.pt"), cfg, False, classes=4)
    assert state["epoch"] == 0 and state["num_classes"] == 4 and state["classes"] is None
    assert all(v["velocity"].eq(0).all() for v in state["optimizer"]["state"].values())
    assert torch.equal(state["model"]["features.conv1.weight"], model.state_dict()["features.conv1.weight"])
    assert state["model"]["classifier.fc8.weight"].shape[0] == 4


def test_new_classifier_needs_weights_and_a_dry_run_says_it(train_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run), "run.new_classifier=true"]) == 2
    assert capsys.readouterr().err.strip() == (
        "train.py: error: run.new_classifier=true replaces the last layer of run.resume_from's weights, and "
        "run.resume_from is not set: name the weights to fine-tune (e.g. run.resume_from=torchvision)")
    _owt_file(tmp_path / "tv10.pth", classes=10)
    args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **OWT), f"run.resume_from={tmp_path / 'tv10.pth'}",
            "run.new_classifier=true", "--dry-run"]
    assert train.main(args) == 0
    assert (f"would start from the weights of {tmp_path / 'tv10.pth'} with a new last layer for 4 classes (the "
            "weights': 10) at epoch 1, step 0") in capsys.readouterr().out
    assert not run.exists()
