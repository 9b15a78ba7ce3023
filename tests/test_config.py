"""alexnet/config.py: YAML + dotted overrides into a typed, validated config."""
from __future__ import annotations

from pathlib import Path

import pytest

from alexnet.config import Config, ConfigError, differences, dump_yaml, from_dict, load_config, parse_override, to_dict


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_paper(tmp_path):
    cfg = load_config(write(tmp_path, "data: {root: x}\n"))
    t = cfg.train
    assert (t.batch_size, t.lr, t.momentum, t.weight_decay, t.epochs) == (256, 0.01, 0.9, 5e-4, 65)
    assert (t.bias_lr_mult, t.bias_decay_mult, t.lr_steps, t.lr_gamma) == (2.0, 0.0, [25, 45], 0.1)
    assert (cfg.data.crop, cfg.model.arch, cfg.model.dropout) == (227, "alexnet", 0.5)


def test_file_then_overrides(tmp_path):
    path = write(tmp_path, "data: {root: /d, crop: 224}\ntrain: {lr: 0.02, lr_steps: [1, 2]}\n")
    cfg = load_config(path, ["train.lr=0.05", "train.lr_steps=[3, 4]", "data.flip=false",
                             "model.num_classes=null", "run.dir=runs/x"])
    assert cfg.train.lr == 0.05 and cfg.train.lr_steps == [3, 4] and cfg.data.flip is False
    assert cfg.data.crop == 224 and cfg.model.num_classes is None and cfg.run.dir == "runs/x"
    assert isinstance(load_config(path, ["train.lr=1"]).train.lr, float)  # int accepted for a float key


@pytest.mark.parametrize("text, expect", [
    ("train: {lrr: 0.1}\n", "unknown key train.lrr; valid keys of train: epochs, batch_size"),
    ("trian: {lr: 0.1}\n", "unknown section 'trian'; valid sections: data, model, train, run"),
    ("train: {lr: fast}\n", "train.lr must be float"),
    ("train: {epochs: 1.5}\n", "train.epochs must be int"),
    ("data: {flip: 1}\n", "data.flip must be bool"),
    ("train: {lr_steps: 5}\n", "train.lr_steps must be a list"),
    ("train: {lr_steps: [a]}\n", "train.lr_steps[0] must be int"),
    ("train: 3\n", "train must be a mapping"),
    ("- 1\n", "top level must be a mapping"),
])
def test_bad_files_name_the_key(tmp_path, text, expect):
    with pytest.raises(ConfigError, match=expect.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, "data: {root: x}\n" + text if not text.startswith("-") else text))


@pytest.mark.parametrize("override, expect", [
    ("train.batch_size=0", "train.batch_size must be positive"),
    ("train.lr=-1", "train.lr must not be negative"),
    ("model.arch=vgg", "model.arch must be one of alexnet, caffenet, owt"),
    ("train.precision=fp16", "train.precision must be one of"),
    ("model.dropout=1.0", "model.dropout must be in"),
    ("train.lr_steps=[5,2]", "increasing"),
    ("data.root=", "data.root is not set"),
    ("lr=0.1", "must look like section.key=value"),
    ("train.nope=1", "unknown key train.nope"),
])
def test_bad_overrides(tmp_path, override, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(write(tmp_path, "data: {root: x}\n"), [override])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: {lr: [\n"))


def test_roundtrip_and_differences(tmp_path):
    cfg = load_config(write(tmp_path, "data: {root: r}\ntrain: {lr: 0.3}\n"))
    again = from_dict(to_dict(cfg))
    assert again == cfg
    assert differences(cfg) == {"data.root": "r", "train.lr": 0.3}
    assert "lr: 0.3" in dump_yaml(cfg)
    assert parse_override("train.lr_steps=[1, 2]") == ("train.lr_steps", [1, 2])
    assert Config().train.lr_steps is not Config().train.lr_steps  # no shared mutable defaults


CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    """Every shipped config loads, and a model-parallel one splits the full-size model it names."""
    import torch

    from alexnet.model_parallel import sharding_problem
    from alexnet.models import build_model
    cfg = load_config(path, ["data.root=x"])
    assert cfg.model.arch in ("alexnet", "caffenet", "owt")
    if cfg.parallel.model_size > 1:
        with torch.device("meta"):
            full = build_model(cfg.model.arch, 1000, cfg.model.width, 0.5, cfg.data.crop, "torch")
        assert sharding_problem(cfg.parallel.model, cfg.model.arch, cfg.parallel.model_size, full) is None


def test_shipped_config_set():
    assert {"demo", "alexnet_1gpu", "alexnet_2gpu", "alexnet_2gpu_model", "alexnet_4gpu_hybrid", "alexnet_8gpu_fc",
            "alexnet_8gpu_goyal", "caffenet", "owt", "theano_continue"} <= {p.stem for p in CONFIGS}
