"""The training configuration: typed, validated, nested sections; YAML files plus dotted overrides.

The defaults ARE the paper's settings (Krizhevsky 2012 as trained by Ding et al. 2014: batch 256,
lr 0.01, momentum 0.9, weight decay 5e-4, biases at twice the lr without decay, 65 epochs, lr / 10
after epochs 25 and 45), so a config file states only what differs.

    cfg = load_config("configs/demo.yaml", ["train.lr=0.02", "train.lr_steps=[5,8]"])

Unknown keys and wrong types fail with :class:`ConfigError`, naming the key and the valid keys.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data.domains import DEVICE, Domain, device, text
from data.text import shown


class ConfigError(ValueError):
    """A config file or override that cannot be used; names the key."""


@dataclass
class DataConfig:
    root: str = ""                 # a scripts/preprocess.py output folder
    crop: int = 227                # side of the (random or center) crop fed to the model
    random_crop: bool = True       # false: center crop in training too
    flip: bool = True              # random horizontal flip per image
    shuffle: bool = True           # false: batch files and images in written order
    shuffle_window: int = 16       # files mixed together per shuffle window (0: one global permutation)
    mean: str = "image"            # image: subtract the mean image (paper); channel: (x/255 - mean) / std
    channel_mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    channel_std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    loading: str = "process"       # process: a loader process per trainer fills shared device slots while
                                   # the trainer computes; thread: the same in a thread; inline: no overlap
    slots: int = 3                 # process/thread: batches prepared ahead (>= 2)
    loader_timeout: float = 300.0  # seconds without a batch before the loader is declared hung
    val_batch_size: int = 0        # 0: train.batch_size


@dataclass
class ModelConfig:
    arch: str = "alexnet"          # alexnet | caffenet | owt
    width: float = 1.0             # channel multiplier (small demos and tests)
    dropout: float = 0.5
    dropout_style: str = "inverted"  # inverted: scaled in training (PyTorch); theano: scaled by (1-p) at
                                     # test time (the paper; continues a converted Theano run exactly)
    num_classes: int | None = None  # default: the dataset's
    init: str = "paper"            # paper: N(0, 0.01) etc. as the Theano reproduction; torch: PyTorch's
    lrn: str = "paper"             # paper: k=2, alpha not divided by n (the paper, pylearn2, the Theano
                                   # weights); caffe: k=1, alpha/n (the BVLC weights; layers/lrn.py)


@dataclass
class TrainConfig:
    epochs: int = 65
    batch_size: int = 256          # per replica
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    bias_lr_mult: float = 2.0      # biases learn at twice the rate ...
    bias_decay_mult: float = 0.0   # ... and are not decayed
    optimizer: str = "sgd"         # sgd: the paper's momentum SGD; lars | lamb: layer-wise trust ratios for large
                                   # batches (You et al. 2017, 2019; alexnet/large_batch.py)
    trust_coefficient: float = 0.001  # lars: eta, the local lr is eta x ||w|| / (||g|| + wd ||w||)
    lars_mode: str = "scale"       # lars: scale (the paper: lr x local lr) | clip (LARC: min(lr, local lr))
    lars_exclude: str = "none"     # lars, lamb: bias_and_norm: tensors with ndim <= 1 get no decay, no trust ratio
    lr_policy: str = "step"        # step | auto | cosine | constant | poly
    lr_steps: list[int] = field(default_factory=lambda: [25, 45])  # step: lr *= lr_gamma after these epochs
    lr_gamma: float = 0.1
    lr_auto_threshold: float = 0.01  # auto: lr *= lr_gamma when val top-1 error improved less than this ...
    lr_auto_patience: int = 2      # ... over this many epochs
    lr_min: float = 0.0            # cosine: the final lr
    lr_power: float = 2.0          # poly: lr x (1 - step / total steps) ^ lr_power (You et al.: 2)
    warmup_epochs: float = 0.0     # linear warmup, per step
    warmup_start_factor: float | None = None  # warmup starts at this x lr (default: 1/k under linear
                                              # scaling by k, i.e. the unscaled lr, as Goyal et al.; else 0)
    seed: int = 0
    precision: str = "fp32"        # fp32 | tf32 | bf16 (autocast)
    channels_last: bool = False
    compile: bool = False          # torch.compile the model
    deterministic: bool = False    # bitwise-repeatable GPU runs: deterministic algorithms only, no cuDNN
                                   # autotuning, fixed-order pooling/LRN backward (somewhat slower)
    slices: int = 1                # each replica's batch runs as this many sequential micro-batches
                                   # (gradients accumulated, one update: Synkhronos' input slicing)
    lr_scaling: str = "none"       # linear: lr x (total batch / lr_ref_batch) (Goyal et al. 2017)
    lr_ref_batch: int = 256        # the total batch at which train.lr is right
    log_every: int = 20            # steps between train records and progress-bar updates
    val_every: int = 1             # epochs between validations
    max_steps: int = 0             # stop after this many steps in total (0: no limit; smoke tests)


@dataclass
class RunConfig:
    dir: str = "runs/default"
    keep_last: int = 3             # per-epoch checkpoints kept besides last.pt and best.pt
    save_every_steps: int = 0      # also checkpoint every N steps mid-epoch (0: only at epoch ends)
    checkpoint_timeout: float = 1800.0  # seconds replicas wait for rank 0 to finish writing a checkpoint
                                   # (written in the background; waited for only before the next one)
    resume_from: str = ""          # a checkpoint to start from when run.dir has none yet (e.g. a Theano
                                   # epoch converted by scripts/convert_weights.py --momentum), or any
                                   # weights by path or published name (torchvision...): epoch 1, at rest
    new_classifier: bool = False   # fine-tune run.resume_from's weights on other classes: its last layer
                                   # replaced by a new one for the data's classes (model.init, train.seed)
    device: str = "auto"           # auto (cuda if present) | cpu | cuda | cuda:N
    progress: bool = True          # tqdm progress bar
    tensorboard: bool = True       # event files, when tensorboard is installed


@dataclass
class ParallelConfig:
    replicas: int = 1              # data-parallel replicas; train.py starts replicas x model_size processes
                                   # (under torchrun: WORLD_SIZE / model_size)
    model_size: int = 1            # processes (devices) holding one model between them: model parallelism
    model: str = "fc"              # fc: conv layers data parallel, fc layers sharded (Krizhevsky 2014, any
                                   # arch); columns: the two columns of Krizhevsky 2012 (model_size 2)
    devices: list[str] = field(default_factory=list)  # e.g. [cuda:0, cuda:1]; replica r uses
                                   # devices[local rank % len]; empty: one GPU per local rank, or cpu
    exchange: str = "weights"      # weights: average parameters and momentum every exchange_every steps
                                   # (the paper); gradients: all-reduce gradients in the backward pass
    exchange_every: int = 1        # weights: steps between exchanges
    transport: str = "auto"        # ipc (one host: peers' buffers read directly) | nccl | gloo | auto
    bucket_mb: float = 25.0        # gradients: all-reduce bucket size
    timeout: float = 300.0         # seconds before a hung replica stops the others (a dead one stops
                                   # them at once); covers the skew of a first step (cuDNN autotuning,
                                   # compile), not checkpoint writes (run.checkpoint_timeout)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


CHOICES: dict[str, tuple] = {
    "data.mean": ("image", "channel"),
    "data.loading": ("process", "thread", "inline"),
    "model.arch": ("alexnet", "caffenet", "owt", "alexnet_bn"),
    "model.init": ("paper", "torch"),
    "model.dropout_style": ("inverted", "theano"),
    "model.lrn": ("paper", "caffe"),
    "train.lr_policy": ("step", "auto", "cosine", "constant", "poly"),
    "train.optimizer": ("sgd", "lars", "lamb"),
    "train.lars_mode": ("scale", "clip"),
    "train.lars_exclude": ("none", "bias_and_norm"),
    "train.precision": ("fp32", "tf32", "bf16"),
    "train.lr_scaling": ("none", "linear"),
    "parallel.exchange": ("weights", "gradients"),
    "parallel.transport": ("auto", "ipc", "nccl", "gloo"),
    "parallel.model": ("fc", "columns"),
}
# The text keys' domains (data/domains.py's types), checked with the config: their form. Whether a path
# exists is asked where it is used (data.root and run.resume_from when a run starts or dries, run.dir by
# its lock), since a config may be checked on a machine that does not hold them.
TEXTS: dict[str, Domain] = {
    "data.root": text("a scripts/preprocess.py output folder"),
    "run.dir": text("the folder this run writes into (e.g. run.dir=runs/NAME)"),
    "run.resume_from": Domain("a checkpoint or weights (a path or a published set's name) to start from, "
                              "or empty for none", str,
                              lambda s: s == "" or bool(s.strip()), (" ",)),
    "run.device": DEVICE,
    "parallel.devices": device(auto=False),  # each entry
}
MAX_SECONDS = 30 * 86400  # timeouts: torch.distributed and timedelta overflow long before "never"


@dataclass(frozen=True)
class Range:
    """An interval a numeric key must lie in (validate() refuses NaN and inf before asking)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def describe(self) -> str:
        """What a value must do, as in "must be positive"."""
        if self.high == math.inf:
            if self.low == 0:
                return "be positive" if self.low_open else "not be negative"
            return f"be {'greater than' if self.low_open else 'at least'} {_number(self.low)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"be in {left}{_number(self.low)}, {_number(self.high)}{right}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


POSITIVE, NON_NEGATIVE, COUNT = Range(0, low_open=True), Range(0), Range(1)
MAX_FLOAT = 1e30  # any float key: far beyond any setting, well inside float32 (3.4e38) when multiplied
MAX_WIDTH = 64    # model.width: 64 x AlexNet is ~250 billion parameters; beyond, sizes overflow int64
FRACTION, SECONDS = Range(0, 1, high_open=True), Range(0, MAX_SECONDS, low_open=True)
# Every numeric key (list keys: each element). tests/test_config.py checks that none is missing.
RANGES: dict[str, Range] = {
    "data.crop": COUNT, "data.shuffle_window": NON_NEGATIVE, "data.channel_mean": Range(0, 1),
    "data.channel_std": POSITIVE, "data.slots": Range(2), "data.loader_timeout": SECONDS,
    "data.val_batch_size": NON_NEGATIVE,
    "model.width": Range(0, MAX_WIDTH, low_open=True), "model.dropout": FRACTION, "model.num_classes": COUNT,
    "train.epochs": COUNT, "train.batch_size": COUNT, "train.lr": POSITIVE, "train.momentum": FRACTION,
    "train.weight_decay": NON_NEGATIVE, "train.bias_lr_mult": NON_NEGATIVE, "train.bias_decay_mult": NON_NEGATIVE,
    "train.lr_steps": COUNT, "train.lr_gamma": Range(0, 1, low_open=True), "train.lr_auto_threshold": FRACTION,
    "train.lr_auto_patience": COUNT, "train.lr_min": NON_NEGATIVE, "train.warmup_epochs": NON_NEGATIVE,
    "train.warmup_start_factor": Range(0, 1), "train.seed": Range(0, 2**63, high_open=True),
    "train.slices": COUNT, "train.lr_ref_batch": COUNT, "train.log_every": COUNT, "train.val_every": COUNT,
    "train.max_steps": NON_NEGATIVE, "train.trust_coefficient": POSITIVE, "train.lr_power": POSITIVE,
    "run.keep_last": NON_NEGATIVE, "run.save_every_steps": NON_NEGATIVE, "run.checkpoint_timeout": SECONDS,
    "parallel.replicas": COUNT, "parallel.model_size": COUNT, "parallel.exchange_every": COUNT,
    "parallel.bucket_mb": POSITIVE, "parallel.timeout": SECONDS,
}


# What a config may hold once its aliases are expanded: each scalar counts 1 + its length, each list or
# mapping 1. configs/ count at most 181; a 313-byte alias bomb counts 10^9 (GBs of memory to build).
MAX_EXPANDED = 100_000
MAX_CONFIG_BYTES = 2**20  # a config file is a few kilobytes
MAX_INT_BITS = 64  # beyond, no config number means anything (torch, numpy and timedelta overflow)


class ConfigYAMLError(yaml.YAMLError):
    """A YAML text a config must not be (a key given twice, an alias bomb, a number out of range); `line`
    is where, when the message does not say it."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


class DuplicateKeyError(ConfigYAMLError):
    """A YAML mapping that states one key twice."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def expanded_size(root: yaml.Node, limit: int = MAX_EXPANDED) -> int:
    """What the YAML node graph `root` holds with every alias expanded (a scalar counts 1 + its length, a
    list or mapping 1), counted without expanding anything; limit + 1 once past `limit`, or if an alias
    refers to a node that holds it (a cycle: endless)."""
    sizes: dict[int, int] = {}
    path: set[int] = set()  # the nodes being counted: an alias to one of them is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        key = id(node)
        if counted:  # every child has its size by now
            path.discard(key)
            sizes[key] = min(limit + 1, 1 + sum(sizes[id(c)] for c in _children(node)))
        elif key in path:
            return limit + 1
        elif key not in sizes:
            if isinstance(node, yaml.ScalarNode):
                sizes[key] = 1 + len(node.value)
                continue
            path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader plus fixes for configs: ``1e-3`` is a float (YAML 1.1 wants ``1.0e-3``, and reads
    ``1e-3`` as a string); a key given twice in one mapping is an error, not "the last wins"; aliases may
    not expand past MAX_EXPANDED (anchors and merge keys ``<<: *base`` work below it); a number that no
    int64 or float holds (``1e400`` would read as inf, a 400-digit integer overflows later) is refused."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None and expanded_size(node) > MAX_EXPANDED:
            raise ConfigYAMLError(f"holds more than {MAX_EXPANDED} characters of values once its aliases (*name) "
                                  "are expanded, or an alias that contains itself (a config holds a few hundred): "
                                  "refused")
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            value = super().construct_yaml_int(node)
        except ValueError:  # more decimal digits than Python converts
            value = None
        if value is None or abs(value).bit_length() > MAX_INT_BITS:
            raise ConfigYAMLError(f"the number {shown(node.value, 60)} is too large (a config number fits "
                                  f"{MAX_INT_BITS} bits)", node.start_mark.line + 1)
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        text = node.value.lower().lstrip("+-")
        if math.isinf(value) and text != ".inf":
            raise ConfigYAMLError(f"the number {shown(node.value, 60)} is beyond the range of a float (about 1.8e308; "
                                  "write .inf for infinity)", node.start_mark.line + 1)
        if value == 0 and any(c in "123456789" for c in text.split("e")[0]):
            raise ConfigYAMLError(f"the number {shown(node.value, 60)} is too small for a float: it would read as 0",
                                  node.start_mark.line + 1)
        return value

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" overrides on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not None:
                    where = f"lines {first} and {line}" if first != line else f"both on line {line}"
                    raise DuplicateKeyError(f"key {shown(key)} is given twice in one mapping ({where}); keep one")
                lines[key] = line
        return super().construct_mapping(node, deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", ConfigLoader.construct_yaml_float)


def read_yaml(text: str | bytes) -> Any:
    """YAML with ConfigLoader (safe: plain data only); ConfigYAMLError, a yaml.YAMLError, for what a config
    must not be."""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (ConfigLoader is a SafeLoader)
    except RecursionError:  # PyYAML composes nested lists by recursion
        raise ConfigYAMLError("nested too deeply (a config nests a few levels)") from None


def _sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` as the annotated type, or ConfigError naming the key."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(key, value, next(a for a in args if a is not type(None)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {shown(value)}")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[hint]
    if not ok(value):
        raise ConfigError(f"{key} must be {hint.__name__}, got {shown(value)} ({type(value).__name__})")
    return float(value) if hint is float else value


@functools.cache
def _hints(section: type) -> dict[str, Any]:
    """A section's keys and their types (its annotations are strings, and resolving them is the most of
    a config's loading: once per class, not per key set)."""
    return typing.get_type_hints(section)


def apply(cfg: Config, updates: dict[str, Any], source: str) -> None:
    """Set nested `updates` ({section: {key: value}} or {"section.key": value}) onto `cfg` in place."""
    for top, value in updates.items():
        if isinstance(top, str) and "." in top:
            section, key = top.split(".", 1)
            apply(cfg, {section: {key: value}}, source)
            continue
        sections = _sections(cfg)
        if top not in sections:
            raise ConfigError(f"{source}: unknown section {shown(top)}; valid sections: {', '.join(sections)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {top} must be a mapping of keys, got {shown(value)}")
        section = sections[top]
        hints = _hints(type(section))
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{source}: unknown key {top}.{_key(key)}; valid keys of {top}: {', '.join(hints)}")
            setattr(section, key, _coerce(f"{top}.{key}", v, hints[key]))


def _key(key: Any) -> str:
    """A key as typed where it is short plain text, else quoted (and bounded)."""
    plain = isinstance(key, str) and 0 < len(key) <= 60 and key.isprintable() and key.strip() == key
    return key if plain else shown(key)


def get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def _numbers(value: Any) -> list:
    return [v for v in (value if isinstance(value, list) else [value]) if v is not None]


def validate(cfg: Config) -> None:
    """Value checks that types cannot express: choices, every number's range, and relations."""
    for key, allowed in CHOICES.items():
        if get(cfg, key) not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}, got {shown(get(cfg, key))}")
    for key, allowed in RANGES.items():
        for v in _numbers(get(cfg, key)):
            if not math.isfinite(v):
                raise ConfigError(f"{key} must be a finite number, got {shown(v)}")
            if v not in allowed:
                raise ConfigError(f"{key} must {allowed.describe()}, got {shown(v)}")
            if isinstance(v, float) and abs(v) > MAX_FLOAT:
                raise ConfigError(f"{key} must be at most {MAX_FLOAT:g}, got {shown(v)}: no setting is that large, "
                                  "and it would overflow float32 once scaled (lr x bias_lr_mult, ...)")
    _validate_relations(cfg)
    if not cfg.data.root:
        raise ConfigError("data.root is not set: point it to a scripts/preprocess.py output folder")
    for key, domain in TEXTS.items():
        value = get(cfg, key)
        for v in value if isinstance(value, list) else [value]:
            try:
                domain(v)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"{key} {e}") from None


def _validate_relations(cfg: Config) -> None:
    """Checks between keys."""
    t = cfg.train
    if any(a >= b for a, b in zip(t.lr_steps, t.lr_steps[1:])):
        raise ConfigError(f"train.lr_steps must be increasing, got {shown(t.lr_steps)}")
    if t.lr_policy == "cosine" and t.lr_min > t.lr:
        raise ConfigError(f"train.lr_min={t.lr_min:g} is above train.lr={t.lr:g}: cosine would raise the lr")
    if len(cfg.data.channel_mean) != 3 or len(cfg.data.channel_std) != 3:
        raise ConfigError("data.channel_mean and data.channel_std must be 3 values each (R, G, B)")
    m = cfg.parallel.model_size
    if cfg.parallel.model == "fc" and m > 1 and t.batch_size % m:
        raise ConfigError(f"train.batch_size={t.batch_size} is a replica's batch, which parallel.model=fc splits "
                          f"over its parallel.model_size={m} processes: give a multiple of {m}")
    per_process = t.batch_size // m if cfg.parallel.model == "fc" and m > 1 else t.batch_size
    if per_process % t.slices:
        what = f" ({per_process} per process of the fc model group)" if per_process != t.batch_size else ""
        raise ConfigError(f"train.batch_size={t.batch_size}{what} is not divisible by train.slices={t.slices}")
    if cfg.run.new_classifier and not cfg.run.resume_from:
        raise ConfigError("run.new_classifier=true replaces the last layer of run.resume_from's weights, and "
                          "run.resume_from is not set: name the weights to fine-tune (e.g. "
                          "run.resume_from=torchvision)")
    if cfg.parallel.exchange == "gradients" and cfg.parallel.transport == "ipc":
        raise ConfigError("parallel.transport=ipc exchanges weights only; gradients use nccl, gloo or auto")
    _validate_large_batch(t, cfg.parallel.exchange, cfg.parallel.replicas)


def _validate_large_batch(t: TrainConfig, exchange: str, replicas: int) -> None:
    """LARS and LAMB: combinations that would silently run another algorithm."""
    if t.optimizer == "sgd":
        return
    if exchange == "weights" and replicas > 1:
        raise ConfigError(f"train.optimizer={t.optimizer} with parallel.exchange=weights would adapt each of the "
                          f"{replicas} replicas to its own gradient, not to the global batch's; set "
                          "parallel.exchange=gradients")
    if t.lr_scaling == "linear":
        raise ConfigError(f"train.lr_scaling=linear does not apply to train.optimizer={t.optimizer}: its global lr "
                          "is not linear in the batch (You et al.: AlexNet 2 at 512, 10 at 4K-8K); set train.lr "
                          "and train.lr_scaling=none")
    if t.nesterov:
        raise ConfigError(f"train.nesterov applies to train.optimizer=sgd only, not {t.optimizer}")


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=0.02' -> ('train.lr', 0.02); the value is read as YAML (lists, null, true)."""
    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override {shown(text, 80)} must look like section.key=value (e.g. train.lr=0.02)")
    try:
        return key.strip(), read_yaml(raw) if raw.strip() else ""
    except ConfigYAMLError as e:
        raise ConfigError(f"override {shown(text, 80)}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {shown(text, 80)}: value is not valid YAML ({e})") from None


def _read_config_file(path: Path) -> Any:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {len(text)} bytes, not a config (a config is a few kilobytes; at most "
                          f"{MAX_CONFIG_BYTES})")
    try:
        return read_yaml(text) or {}
    except ConfigYAMLError as e:
        raise ConfigError(f"{path}: line {e.line}: {e}" if e.line else f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides; validated."""
    cfg = Config()
    if path is not None:
        data = _read_config_file(Path(path))
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        apply(cfg, data, str(path))
    for override in overrides:
        key, value = parse_override(override)
        apply(cfg, {key: value}, "command line")
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """A Config from to_dict() output (e.g. stored in a checkpoint), checked like a file."""
    cfg = Config()
    apply(cfg, data, "stored config")
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def differences(cfg: Config, base: Config | None = None) -> dict[str, Any]:
    """Dotted keys whose value differs from `base` (default: the defaults): the short summary."""
    a, b = to_dict(cfg), to_dict(base or Config())
    return {f"{s}.{k}": v for s in a for k, v in a[s].items() if b[s][k] != v}


def summary(cfg: Config) -> str:
    """One line per setting that differs from the paper defaults."""
    return "\n".join(f"  {k} = {v}" for k, v in differences(cfg).items()) or "  (paper defaults)"
