"""alexnet/config.py: YAML + dotted overrides into a typed, validated config."""
from __future__ import annotations

from pathlib import Path

import pytest

from alexnet.config import (
    CHOICES,
    RANGES,
    Config,
    ConfigError,
    DuplicateKeyError,
    Range,
    differences,
    dump_yaml,
    from_dict,
    load_config,
    parse_override,
    read_yaml,
    summary,
    to_dict,
)


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
    ("train: {nesterov: 1}\n", "train.nesterov must be bool"),
    ("train: {lr_steps: 5}\n", "train.lr_steps must be a list"),
    ("train: {lr_steps: [a]}\n", "train.lr_steps[0] must be int"),
    ("train: 3\n", "train must be a mapping of keys, got 3"),
    ("- 1\n", "top level must be a mapping"),
])
def test_bad_files_name_the_key(tmp_path, text, expect):
    with pytest.raises(ConfigError, match=expect.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, "data: {root: x}\n" + text if not text.startswith("-") else text))


@pytest.mark.parametrize("override, expect", [
    ("train.batch_size=0", "train.batch_size must be at least 1, got 0"),
    ("train.lr=-1", "train.lr must be positive, got -1.0"),
    ("model.arch=vgg", "model.arch must be one of alexnet, caffenet, owt"),
    ("train.precision=fp16", "train.precision must be one of"),
    ("model.dropout=1.0", "model.dropout must be in"),
    ("train.lr_steps=[5,2]", "increasing"),
    ("data.root=", "data.root is not set"),
    ("lr=0.1", "must look like section.key=value"),
    ("train.nope=1", "unknown key train.nope"),
    # every number has a range, and is finite
    ("train.lr=.nan", "train.lr must be a finite number, got nan"),
    ("train.lr=.inf", "train.lr must be a finite number, got inf"),
    ("train.lr=0", "train.lr must be positive, got 0.0"),
    ("train.momentum=5", r"train.momentum must be in \[0, 1\), got 5.0"),
    ("train.momentum=1", r"train.momentum must be in \[0, 1\), got 1.0"),
    ("train.weight_decay=-1e-4", "train.weight_decay must not be negative, got -0.0001"),
    ("train.lr_gamma=0", r"train.lr_gamma must be in \(0, 1\], got 0.0"),
    ("train.lr_steps=[0, 3]", "train.lr_steps must be at least 1, got 0"),
    ("train.lr_steps=[3, 3]", "train.lr_steps must be increasing"),
    ("train.warmup_start_factor=2", r"train.warmup_start_factor must be in \[0, 1\], got 2.0"),
    ("train.seed=-1", "train.seed must be in"),
    ("data.channel_std=[0.2, 0, 0.2]", "data.channel_std must be positive, got 0.0"),
    ("data.channel_mean=[0.5, .nan, 0.5]", "data.channel_mean must be a finite number, got nan"),
    ("data.slots=1", "data.slots must be at least 2, got 1"),
    ("parallel.timeout=.inf", "parallel.timeout must be a finite number"),
    ("parallel.timeout=1e12", r"parallel.timeout must be in \(0, 2592000\]"),
    ("model.num_classes=0", "model.num_classes must be at least 1"),
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
IMAGENET_TRAIN = 1_281_167  # ILSVRC-2012's training images: what a config's data.root=imagenet256 holds


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    """Every shipped config loads and passes what the preflight checks without data, on the meta device:
    the full-size model it names builds at its crop, a model-parallel one splits it, and its global batch
    (the launcher's world: replicas x model_size) fits ImageNet's training set."""
    import torch

    from alexnet.distributed import DistInfo
    from alexnet.model_parallel import sharding_problem
    from alexnet.models import ARCHS, build_model
    from alexnet.replica import MeshLayout
    cfg = load_config(path, ["data.root=x"])
    assert cfg.model.arch in ARCHS
    with torch.device("meta"):
        full = build_model(cfg.model.arch, 1000, cfg.model.width, cfg.model.dropout, cfg.data.crop, "torch")
    if cfg.parallel.model_size > 1:
        assert sharding_problem(cfg.parallel.model, cfg.model.arch, cfg.parallel.model_size, full) is None
    world = cfg.parallel.replicas * cfg.parallel.model_size
    layout = MeshLayout(cfg, DistInfo(world=world, model_size=cfg.parallel.model_size))
    if (read_yaml(path.read_text()).get("data") or {}).get("root") == "imagenet256":
        assert layout.global_batch <= IMAGENET_TRAIN


def test_shipped_config_set():
    assert {"demo", "alexnet_1gpu", "alexnet_2gpu", "alexnet_2gpu_model", "alexnet_4gpu_hybrid", "alexnet_8gpu_fc",
            "alexnet_8gpu_goyal", "caffenet", "owt_squares", "theano_continue", "alexnet_lars_8k", "alexnet_bn_lars_8k",
            "alexnet_bn_lars_32k", "alexnet_sgd_8k"} <= {p.stem for p in CONFIGS}


# You, Gitman & Ginsburg 2017's recipes (issue 27): (arch, optimizer, global batch, micro-batch, global lr,
# warmup epochs); every one 100 epochs of poly power 2, momentum 0.9, weight decay 5e-4, eta 0.001.
LARGE_BATCH_RECIPES = {
    "alexnet_lars_8k": ("alexnet", "lars", 8192, 1024, 10.0, 2.0),
    "alexnet_bn_lars_8k": ("alexnet_bn", "lars", 8192, 1024, 14.0, 5.0),
    "alexnet_bn_lars_32k": ("alexnet_bn", "lars", 32768, 1024, 22.0, 5.0),
    "alexnet_sgd_8k": ("alexnet", "sgd", 8192, 1024, 0.03, 2.5),
}


@pytest.mark.parametrize("name", LARGE_BATCH_RECIPES)
def test_large_batch_recipes_are_the_papers(name):
    """The recipe configs state the paper's settings: global batch (8 replicas, gradients all-reduced),
    micro-batch (what one GPU holds at once), global lr not scaled with the batch, warmup, poly power 2."""
    from alexnet.distributed import DistInfo
    from alexnet.replica import MeshLayout
    arch, optimizer, batch, micro, lr, warmup = LARGE_BATCH_RECIPES[name]
    cfg = load_config(Path(__file__).parents[1] / "configs" / f"{name}.yaml")
    t = cfg.train
    layout = MeshLayout(cfg, DistInfo(world=cfg.parallel.replicas))
    assert (cfg.model.arch, t.optimizer, layout.global_batch, t.batch_size // t.slices) == (arch, optimizer, batch,
                                                                                              micro)
    assert (t.lr, t.warmup_epochs, t.lr_scaling, t.lr_policy, t.lr_power, t.epochs) == (lr, warmup, "none", "poly",
                                                                                          2.0, 100)
    assert (t.momentum, t.weight_decay, t.trust_coefficient, t.lars_mode, t.lars_exclude) == (
        0.9, 5e-4, 0.001, "scale", "none")
    assert (cfg.parallel.replicas, cfg.parallel.exchange) == (8, "gradients")


def test_cosine_lr_min_above_lr_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.lr_min=0.1 is above train.lr=0.01"):
        load_config(write(tmp_path, "data: {root: x}\ntrain: {lr_policy: cosine, lr_min: 0.1}\n"))
    load_config(write(tmp_path, "data: {root: x}\ntrain: {lr_policy: step, lr_min: 0.1}\n"))  # unused there


def _numeric_keys() -> dict[str, tuple[type, bool]]:
    """Every int or float key of the schema, read off the dataclasses: {key: (number type, is a list)}."""
    import typing
    keys = {}
    for section, section_type in typing.get_type_hints(Config).items():
        for name, hint in typing.get_type_hints(section_type).items():
            if type(None) in typing.get_args(hint):  # X | None -> X
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            is_list = typing.get_origin(hint) is list
            kind = typing.get_args(hint)[0] if is_list else hint
            if kind in (int, float):
                keys[f"{section}.{name}"] = (kind, is_list)
    return keys


def test_every_numeric_key_has_a_range():
    keys = _numeric_keys()
    assert len(keys) >= 38 and keys["train.momentum"] == (float, False) and keys["train.lr_steps"] == (int, True)
    assert sorted(keys) == sorted(RANGES)


@pytest.mark.parametrize("key", sorted(_numeric_keys()))
def test_every_numeric_key_refuses_values_out_of_range(tmp_path, key):
    """Below its range, and NaN/inf where it is a float: each refused, naming the key."""
    kind, is_list = _numeric_keys()[key]
    low = RANGES[key].low
    below = low if RANGES[key].low_open else low - (1 if kind is int else 0.5)
    for bad in [below, *([".nan", ".inf", "-.inf"] if kind is float else [])]:
        value = f"[{bad}, {bad}, {bad}]" if is_list else str(bad)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " must "):
            load_config(write(tmp_path, "data: {root: x}\n"), [f"{key}={value}"])


def _all_keys() -> dict[str, object]:
    """Every key of the schema, read off the dataclasses: {key: its type hint}."""
    import typing
    return {f"{section}.{name}": hint for section, section_type in typing.get_type_hints(Config).items()
            for name, hint in typing.get_type_hints(section_type).items()}


def test_every_config_key_has_a_declared_domain():
    """A flag (bool), a choice, a numeric range or a text key's domain (alexnet.config.TEXTS): a key added
    later without one fails here."""
    from alexnet.config import TEXTS
    keys = _all_keys()
    assert len(keys) >= 60 and keys["run.device"] is str and keys["data.flip"] is bool
    bare = [k for k, hint in keys.items() if hint is not bool and k not in CHOICES and k not in RANGES
            and k not in TEXTS]
    assert not bare, f"config keys without a declared domain: {bare}"
    assert set(TEXTS) <= set(keys)


def test_every_text_key_refuses_what_its_domain_refuses(tmp_path):
    """Each refused value of each text key (a list key: as one entry of it), through load_config: a
    ConfigError naming the key."""
    import yaml

    from alexnet.config import TEXTS
    tried = 0
    for key, domain in TEXTS.items():
        for bad in domain.refused:
            value = yaml.safe_dump([bad] if "list" in str(_all_keys()[key]) else bad, default_flow_style=True).strip()
            with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + " "):  # names the key first
                load_config(write(tmp_path, "data: {root: x}\n"), [f"{key}={value.removesuffix('...').strip()}"])
            tried += 1
    assert tried >= 12


def test_text_keys_by_hand(tmp_path):
    cfg = write(tmp_path, "data: {root: x}\n")
    assert load_config(cfg, ["run.device=cuda:1", "parallel.devices=[cuda:0, cuda:0]", "run.resume_from="]).run.device \
        == "cuda:1"
    with pytest.raises(ConfigError, match=r"^run\.device must be a device \(auto, cpu, cuda or cuda:N\), got gpu$"):
        load_config(cfg, ["run.device=gpu"])
    with pytest.raises(ConfigError, match=r"^parallel\.devices must be a device \(cpu, cuda or cuda:N\), got auto$"):
        load_config(cfg, ["parallel.devices=[cuda:0, auto]"])
    with pytest.raises(ConfigError, match=r"^run\.resume_from must be a checkpoint or weights \(a path or a "
                                          r"published set.s name\) to start from, or empty for none"):
        load_config(cfg, ["run.resume_from=' '"])


def test_exponent_floats_are_numbers(tmp_path):
    """YAML 1.1 reads 1e-3 (no dot, or no exponent sign) as a string; configs mean a number."""
    cfg = load_config(write(tmp_path, "data: {root: x}\ntrain: {lr: 1e-3, weight_decay: 5E-4, lr_min: 1e-5, "
                                      "lr_policy: cosine}\nrun: {checkpoint_timeout: 3e3}\n"), ["train.momentum=9e-1"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.lr_min) == (0.001, 0.0005, 1e-5)
    assert (cfg.run.checkpoint_timeout, cfg.train.momentum) == (3000.0, 0.9)
    assert parse_override("data.root=1e3x") == ("data.root", "1e3x")  # not a number: stays a string
    import yaml
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # yaml's own loader is left as it was


@pytest.mark.parametrize("text, expect", [
    ("data: {root: x}\ntrain:\n  lr: 0.1\n  epochs: 3\n  lr: 0.2\n", "key 'lr' is given twice in one mapping "
                                                                     r"\(lines 3 and 5\)"),
    ("data: {root: x}\ndata: {crop: 100}\n", r"key 'data' is given twice in one mapping \(lines 1 and 2\)"),
    ("data: {root: x, root: y}\n", r"key 'root' is given twice in one mapping \(both on line 1\)"),
])
def test_a_key_given_twice_is_refused(tmp_path, text, expect):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"{path}: {expect}"):
        load_config(path)
    with pytest.raises(ConfigError, match="given twice"):
        load_config(write(tmp_path, "data: {root: x}\n"), ["train.lr_steps={a: 1, a: 2}"])


def test_merge_keys_and_binary_files(tmp_path):
    """YAML merge keys still override on purpose; a config that is not text is one clear error."""
    from alexnet.config import read_yaml
    assert read_yaml("a: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}\n") == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"train: {lr: \xff\xfe\x00}\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("rng, text", [
    (Range(0, low_open=True), "be positive"), (Range(0), "not be negative"), (Range(2), "be at least 2"),
    (Range(1, low_open=True), "be greater than 1"), (Range(0.5), "be at least 0.5"),
    (Range(0, 1, high_open=True), "be in [0, 1)"), (Range(0, 1, low_open=True), "be in (0, 1]"),
    (Range(0.5, 2.5), "be in [0.5, 2.5]"), (Range(-3, 1e16, True, True), "be in (-3, 1e+16)"),
])
def test_range_descriptions(rng, text):
    assert rng.describe() == text


def test_range_bounds_open_and_closed():
    assert 1 in Range(1) and 1 not in Range(1, low_open=True) and 0.99 not in Range(1)
    assert 2 in Range(0, 2) and 2 not in Range(0, 2, high_open=True) and 2.01 not in Range(0, 2)
    assert 1.5 in Range(1, 2, low_open=True, high_open=True) and 10**9 in Range(0)


def test_relations_between_keys(tmp_path):
    path = write(tmp_path, "data: {root: x}\n")
    for override, expect in [
        ("data.channel_mean=[0.5, 0.5]",
         r"^data.channel_mean and data.channel_std must be 3 values each \(R, G, B\)$"),
        ("data.channel_std=[0.2, 0.2, 0.2, 0.2]", "must be 3 values each"),
        ("train.slices=3", "train.batch_size=256 is not divisible by train.slices=3"),
        ("train.lr_steps=[2, 5, 4]", r"train.lr_steps must be increasing, got \[2, 5, 4\]"),
    ]:
        with pytest.raises(ConfigError, match=expect):
            load_config(path, [override])
    with pytest.raises(ConfigError, match="^parallel.transport=ipc exchanges weights only; gradients use nccl, "
                                          "gloo or auto$"):
        load_config(path, ["parallel.exchange=gradients", "parallel.transport=ipc"])
    ok = [["train.slices=4"], ["parallel.transport=ipc"], ["parallel.exchange=gradients", "parallel.transport=gloo"],
          ["train.lr_policy=cosine", "train.lr_min=0.01"], ["train.lr_steps=[1, 2, 30]"]]
    for overrides in ok:  # the limits themselves are allowed (lr_min == lr, batch 256 in 4 slices)
        load_config(path, overrides)


def test_summary_and_differences(tmp_path):
    assert summary(Config()) == "  (paper defaults)"
    cfg = load_config(write(tmp_path, "train: {lr: 0.02}\n"), ["data.root=x"])
    assert summary(cfg) == "  data.root = x\n  train.lr = 0.02"
    base = Config()
    base.data.root = "x"
    assert differences(cfg, base) == {"train.lr": 0.02}


def test_overrides_without_a_file_and_an_empty_file(tmp_path):
    assert load_config(None, ["data.root=x"]).train.lr == 0.01
    assert load_config(write(tmp_path, ""), ["data.root=x"]) == load_config(None, ["data.root=x"])
    with pytest.raises(ConfigError, match="^data.root is not set: point it to a scripts/preprocess.py output folder$"):
        load_config(None)


def test_parse_override_spacing_and_empty_values():
    assert parse_override(" train.lr =0.5") == ("train.lr", 0.5)
    assert parse_override("data.root=") == ("data.root", "")
    assert parse_override("data.root=  ") == ("data.root", "")
    assert parse_override("data.root= a=b") == ("data.root", "a=b")  # split at the first '=' only
    with pytest.raises(ConfigError, match=r"override 'train.lr=\[' : value is not valid YAML|not valid YAML"):
        parse_override("train.lr=[")
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_override("train.lr")


def test_sources_named_in_errors_and_types_coerced(tmp_path):
    path = write(tmp_path, "data: {root: x}\ntrain: {lrr: 1}\n")
    with pytest.raises(ConfigError, match=f"^{path}: unknown key train.lrr"):
        load_config(path)
    with pytest.raises(ConfigError, match="^command line: unknown section 'trian'"):
        load_config(None, ["trian.lr=1"])
    with pytest.raises(ConfigError, match="^stored config: model must be a mapping"):
        from_dict({"model": 3})
    cfg = from_dict({"train": {"lr_steps": (1, 2)}, "data": {"channel_mean": [1, 0, 0]}, "model": {"num_classes": 5}})
    assert cfg.train.lr_steps == [1, 2] and cfg.model.num_classes == 5
    assert cfg.data.channel_mean == [1.0, 0.0, 0.0] and all(type(v) is float for v in cfg.data.channel_mean)
    with pytest.raises(ConfigError, match=r"model.num_classes must be int, got 'x' \(str\)"):
        from_dict({"model": {"num_classes": "x"}})
    with pytest.raises(ConfigError, match=r"data.channel_mean\[1\] must be float, got True"):
        from_dict({"data": {"channel_mean": [0.5, True, 0.5]}})
    with pytest.raises(ConfigError, match="run.dir must be str, got 5"):
        from_dict({"run": {"dir": 5}})


def test_dump_yaml_reads_back_in_section_order():
    cfg = from_dict({"train": {"lr": 0.02}, "data": {"root": "r"}})
    text = dump_yaml(cfg)
    assert text.startswith("data:\n  root: r\n") and read_yaml(text) == to_dict(cfg)
    assert "  lr_steps: [25, 45]\n" in text  # lists on one line
    assert from_dict(read_yaml(text)) == cfg


def test_unreadable_file_and_duplicates_after_an_unhashable_key(tmp_path, monkeypatch):
    import yaml
    with pytest.raises(DuplicateKeyError):  # keys after an unhashable one are still checked
        read_yaml("{? [1]: 1, a: 1, a: 2}")
    with pytest.raises(DuplicateKeyError):  # and after a merge key
        read_yaml("a: &b {x: 1}\nc: {<<: *b, y: 3, y: 4}\n")
    with pytest.raises(yaml.YAMLError, match="unhashable"):
        read_yaml("{? [1]: 1, a: 1}")
    path = write(tmp_path, "data: {root: x}\n")

    def refuse(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ConfigError, match=f"config file {path} cannot be read \\(Permission denied\\)"):
        load_config(path)


def test_dotted_keys_in_one_mapping(tmp_path):
    cfg = from_dict({"train.lr": 0.5, "train.momentum": 0.5, "data": {"root": "x"}})
    assert (cfg.train.lr, cfg.train.momentum, cfg.data.root) == (0.5, 0.5, "x")
    with pytest.raises(ConfigError, match="^command line: unknown key train.lr.x; valid keys of train: "):
        load_config(None, ["data.root=x", "train.lr.x=1"])


def test_the_largest_float_and_a_choice_refusal_by_hand(tmp_path):
    """1e30 itself is taken, twice it is refused with the whole message; a bad choice names its value."""
    cfg = write(tmp_path, "data: {root: x}\n")
    assert load_config(cfg, ["train.lr=1e30"]).train.lr == 1e30
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["train.lr=2e30"])
    assert str(e.value) == ("train.lr must be at most 1e+30, got 2e+30: no setting is that large, and it would "
                            "overflow float32 once scaled (lr x bias_lr_mult, ...)")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["data.mean=x"])
    assert str(e.value) == "data.mean must be one of image, channel, got 'x'"


def test_batch_relations_between_keys_by_hand(tmp_path):
    """The batch's relations at their edges: fc splits a replica's batch over its model group (M = 2 with an
    odd batch is refused), columns do not (each column takes the whole batch: 8 images in 8 slices), and
    LARS with the weights exchange over 2 replicas is refused."""
    cfg = write(tmp_path, "data: {root: x}\n")
    with pytest.raises(ConfigError, match=r"^train\.batch_size=9 is a replica's batch, which parallel\.model=fc "
                                          r"splits over its parallel\.model_size=2 processes: give a multiple of 2$"):
        load_config(cfg, ["parallel.model=fc", "parallel.model_size=2", "train.batch_size=9"])
    assert load_config(cfg, ["parallel.model=columns", "parallel.model_size=2", "train.batch_size=8",
                             "train.slices=8"]).train.slices == 8
    with pytest.raises(ConfigError, match=r"^train\.batch_size=8 \(4 per process of the fc model group\) is not "
                                          r"divisible by train\.slices=8$"):
        load_config(cfg, ["parallel.model=fc", "parallel.model_size=2", "train.batch_size=8", "train.slices=8"])
    with pytest.raises(ConfigError, match=r"^train\.optimizer=lars with parallel\.exchange=weights would adapt "):
        load_config(cfg, ["train.optimizer=lars", "parallel.replicas=2", "parallel.exchange=weights",
                          "train.lr_scaling=none"])
