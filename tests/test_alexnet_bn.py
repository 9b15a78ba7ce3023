"""AlexNet-BN (You, Gitman & Ginsburg 2017; NVCaffe models/alexnet_bn/train_val2.prototxt): the layers and
their count against the prototxt, the init, batch norm's train/eval modes against hand computations, its
running statistics per replica (DDP, weights exchange) and split by channel (columns), exact resume, and
the weight formats that cannot hold it."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train
from alexnet.checkpoint import load
from alexnet.metrics import read_metrics, without_wall_clock
from alexnet.models import build_model, count_params, feature_side, min_crop
from layers import Comm, MaxPool, TorchComm
from tests import ranks
from tests.conftest import load_script, signal_handlers_kept, tiny_overrides

BN = {"model.arch": "alexnet_bn"}
CROP, CLASSES, WIDTH = 67, 4, 0.125

# -- the layers, against the prototxt -------------------------------------------------------------------

# (name, type, channels in, channels out) of train_val2.prototxt's computing layers at width 1; groups of
# conv2/4/5: 2, as its `group: 2`.
PROTOTXT_FEATURES = [
    ("conv1", nn.Conv2d, 3, 96), ("relu1", nn.ReLU, 96, 96), ("pool1", MaxPool, 96, 96),
    ("bn2", nn.BatchNorm2d, 96, 96), ("conv2", nn.Conv2d, 96, 256), ("relu2", nn.ReLU, 256, 256),
    ("pool2", MaxPool, 256, 256),
    ("bn3", nn.BatchNorm2d, 256, 256), ("conv3", nn.Conv2d, 256, 384), ("relu3", nn.ReLU, 384, 384),
    ("bn4", nn.BatchNorm2d, 384, 384), ("conv4", nn.Conv2d, 384, 384), ("relu4", nn.ReLU, 384, 384),
    ("bn5", nn.BatchNorm2d, 384, 384), ("conv5", nn.Conv2d, 384, 256), ("relu5", nn.ReLU, 256, 256),
    ("pool5", MaxPool, 256, 256),
]
PROTOTXT_CLASSIFIER = [("fc6", nn.Linear, 256 * 6 * 6, 4096), ("relu6", nn.ReLU, 4096, 4096),
                       ("drop6", None, 4096, 4096), ("fc7", nn.Linear, 4096, 4096), ("relu7", nn.ReLU, 4096, 4096),
                       ("drop7", None, 4096, 4096), ("fc8", nn.Linear, 4096, 1000)]
# By hand: weights out x in/groups x k x k (+ out biases); batch norm without scale/shift has none.
PARAMS = {
    "conv1": 96 * 3 * 11 * 11 + 96,       # 34,944
    "conv2": 256 * 48 * 5 * 5 + 256,      # 307,456 (group 2: 96/2 inputs)
    "conv3": 384 * 256 * 3 * 3 + 384,     # 885,120
    "conv4": 384 * 192 * 3 * 3 + 384,     # 663,936 (group 2)
    "conv5": 256 * 192 * 3 * 3 + 256,     # 442,624 (group 2)
    "fc6": 4096 * 9216 + 4096,            # 37,752,832
    "fc7": 4096 * 4096 + 4096,            # 16,781,312
    "fc8": 1000 * 4096 + 1000,            # 4,097,000
}
TOTAL = 60_965_224  # the sum of PARAMS: AlexNet's count, batch norm adds no parameter


def _channels(module: nn.Module, before: int) -> tuple[int, int]:
    if isinstance(module, nn.Conv2d):
        return module.in_channels, module.out_channels
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, nn.BatchNorm2d):
        return module.num_features, module.num_features
    return before, before


def _sequence(seq: nn.Sequential, first: int) -> list[tuple]:
    out, c = [], first
    for name, module in seq.named_children():
        cin, cout = _channels(module, c)
        kind = type(module) if isinstance(module, (nn.Conv2d, nn.ReLU, MaxPool, nn.BatchNorm2d, nn.Linear)) else None
        out.append((name, kind, cin, cout))
        c = cout
    return out


def test_layers_and_parameter_count_follow_the_prototxt():
    with torch.device("meta"):  # torch's init: the paper's normal_ on a meta tensor imports torch._dynamo (1.7 s)
        model = build_model("alexnet_bn", 1000, 1.0, 0.5, 227, "torch")
    assert _sequence(model.features, 3) == PROTOTXT_FEATURES
    assert _sequence(model.classifier, 256 * 6 * 6) == PROTOTXT_CLASSIFIER  # dropout: None
    assert [model.features.get_submodule(f"conv{i}").groups for i in range(1, 6)] == [1, 2, 1, 2, 2]
    for module in model.features.children():
        if isinstance(module, nn.BatchNorm2d):  # the prototxt's eps 1e-4, scale_bias false, moving average 0.9
            assert (module.eps, module.momentum, module.affine, module.track_running_stats) == (1e-4, 0.1, False, True)
    per_layer = {name.split(".")[1]: sum(p.numel() for p in m.parameters())
                 for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert per_layer == PARAMS and sum(PARAMS.values()) == TOTAL == count_params(model)
    buffers = {k: v.numel() for k, v in model.state_dict().items() if ".bn" in k}
    assert sum(n for k, n in buffers.items() if "running" in k) == 2 * (96 + 256 + 384 + 384)
    assert sorted({k.split(".")[1] for k in buffers}) == ["bn2", "bn3", "bn4", "bn5"]


def test_geometry_width_and_lrn():
    assert min_crop("alexnet_bn") == 67 and feature_side("alexnet_bn", 227) == 6  # as alexnet: BN keeps sides
    with torch.device("meta"):
        quarter = build_model("alexnet_bn", 10, 0.25, 0.5, 227, "torch")
        caffe_lrn = build_model("alexnet_bn", 10, 0.25, 0.5, 227, "torch", lrn="caffe")
    convs = [m.out_channels for m in quarter.modules() if isinstance(m, nn.Conv2d)]
    assert convs == [24, 64, 96, 96, 64]  # as alexnet at width 0.25 (tests/test_models.py)
    assert [m.num_features for m in quarter.modules() if isinstance(m, nn.BatchNorm2d)] == [24, 64, 96, 96]
    torch.manual_seed(0)
    a = build_model("alexnet_bn", 3, 0.125, 0.0, CROP, "torch").eval()
    torch.manual_seed(0)
    b = build_model("alexnet_bn", 3, 0.125, 0.0, CROP, "torch", lrn="caffe").eval()
    x = torch.randn(2, 3, CROP, CROP)
    assert torch.equal(a(x), b(x))  # model.lrn has no effect: there is no LRN
    assert caffe_lrn.state_dict().keys() == quarter.state_dict().keys()


def test_paper_init_is_the_prototxt_fillers():
    torch.manual_seed(0)
    model = build_model("alexnet_bn", 1000, 0.5, 0.5, 227, "paper")
    # weight_filler gaussian std / bias_filler constant of each layer, from the prototxt
    expected = {"conv1": (0.01, 0.01), "conv2": (0.01, 0.01), "conv3": (0.01, 0.01), "conv4": (0.01, 0.01),
                "conv5": (0.01, 0.01), "fc6": (0.005, 0.1), "fc7": (0.005, 0.1), "fc8": (0.01, 0.01)}
    layers = {n.split(".")[1]: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert layers.keys() == expected.keys()
    for name, (std, bias) in expected.items():
        w = layers[name].weight
        assert torch.equal(layers[name].bias, torch.full_like(layers[name].bias, bias)), name
        assert abs(w.mean().item()) < 0.1 * std and math.isclose(w.std().item(), std, rel_tol=0.05), name
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):  # torch's start: mean 0, var 1
        assert not bn.running_mean.any() and torch.equal(bn.running_var, torch.ones_like(bn.running_var))


def test_batch_norm_train_and_eval_against_hand_computation():
    """Training: (x - batch mean) / sqrt(biased batch variance + 1e-4), then running = 0.9 running + 0.1 batch
    (unbiased variance); eval: (x - running_mean) / sqrt(running_var + 1e-4). In float64, by hand."""
    torch.manual_seed(0)
    bn = build_model("alexnet_bn", 3, 0.125, 0.0, CROP, "torch").features.bn3.double()
    c = bn.num_features
    mean0, var0 = torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) * 1e-3 + 1e-4
    bn.running_mean.copy_(mean0)
    bn.running_var.copy_(var0)
    x = 0.03 * torch.randn(5, c, 3, 3, dtype=torch.float64) + 0.2  # small variances: eps matters
    values = x.transpose(0, 1).reshape(c, -1)  # per channel: N x H x W values
    m, n = values.mean(1), values.shape[1]
    biased = ((values - m[:, None]) ** 2).sum(1) / n
    unbiased = biased * n / (n - 1)
    view = lambda v: v[None, :, None, None]  # noqa: E731
    bn.eval()
    torch.testing.assert_close(bn(x), (x - view(mean0)) / (view(var0) + 1e-4).sqrt(), rtol=1e-12, atol=1e-12)
    assert torch.equal(bn.running_mean, mean0)  # eval leaves the statistics alone
    bn.train()
    torch.testing.assert_close(bn(x), (x - view(m)) / (view(biased) + 1e-4).sqrt(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bn.running_mean, 0.9 * mean0 + 0.1 * m, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, 0.9 * var0 + 0.1 * unbiased, rtol=1e-12, atol=1e-12)


def test_eval_output_of_an_image_does_not_depend_on_its_batch():
    """Eval mode normalises with the running statistics (each image alone gives its row of the batch's
    output); training mode with the batch's."""
    torch.manual_seed(0)
    model = build_model("alexnet_bn", 3, 0.125, 0.0, CROP, "torch")
    x = torch.randn(4, 3, CROP, CROP)
    model(torch.randn(8, 3, CROP, CROP))  # some running statistics
    model.eval()
    torch.testing.assert_close(torch.cat([model(x[i:i + 1]) for i in range(4)]), model(x), rtol=1e-5, atol=1e-6)
    model.train()
    with torch.no_grad():
        assert not torch.allclose(model(x[:2])[0], model(x)[0], rtol=1e-3, atol=1e-5)


def test_columns_split_each_statistic_by_channel():
    """Column m's batch norm holds channels [m n/2, (m+1) n/2) of the single-device one (the channels its
    own conv rows produce); num_batches_tracked, a count, is whole in both; assembling gives it back."""
    from alexnet.model_parallel import ShardedNet
    torch.manual_seed(0)
    full = build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch")
    for i, bn in enumerate(m for m in full.modules() if isinstance(m, nn.BatchNorm2d)):
        bn.running_mean.copy_(torch.arange(bn.num_features) + 100.0 * i)
        bn.running_var.copy_(torch.arange(bn.num_features) + 0.5)
        bn.num_batches_tracked.fill_(7)
    parts = [ShardedNet(full, "columns", TorchComm(None, None, m, (0, 1))) for m in (0, 1)]
    for m, part in enumerate(parts):
        for name in ("bn2", "bn3", "bn4", "bn5"):
            whole, mine = full.features.get_submodule(name), part.features.get_submodule(name)
            n = whole.num_features // 2
            assert mine.num_features == n and int(mine.num_batches_tracked) == 7
            assert torch.equal(mine.running_mean, whole.running_mean[m * n:(m + 1) * n]), (m, name)
            assert torch.equal(mine.running_var, whole.running_var[m * n:(m + 1) * n]), (m, name)
    assembled = parts[0].assemble([p.state_dict() for p in parts])
    assert assembled.keys() == full.state_dict().keys()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in assembled.items())


# -- real processes (gloo): columns, DDP, weights exchange -------------------------------------------------


def _columns(comm: Comm, out: str) -> None:
    """columns M=2 against the single-device model, both on the same images: a training forward and
    backward, the running statistics it leaves, an eval forward, then three SGD steps; and the
    checkpoint's round trip (assemble, then local_shard)."""
    from alexnet.model_parallel import build_sharded
    torch.manual_seed(0)
    net = build_sharded("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch", "inverted", "columns", comm)
    torch.manual_seed(0)
    ref = build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (net, ref))
    record = {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 3, CROP, CROP, generator=g), torch.randint(0, CLASSES, (6,), generator=g)
        logits, ref_logits = net(x), ref(x)
        (F.cross_entropy(logits, y) / comm.size).backward()  # each column's share of the group's loss
        F.cross_entropy(ref_logits, y).backward()
        if step == 0:
            record["logits"] = (logits.detach(), ref_logits.detach())
            record["grads"] = (_gathered(net, comm, {k: p.grad for k, p in net.named_parameters()}),
                               {k: p.grad.clone() for k, p in ref.named_parameters()})
            record["stats"] = (_gathered(net, comm, dict(net.named_buffers())),
                               {k: b.clone() for k, b in ref.named_buffers()})
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    net.eval(), ref.eval()
    x = torch.randn(5, 3, CROP, CROP, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        record["eval logits"] = (net(x), ref(x))
    full = _gathered(net, comm, net.state_dict())
    record["trained"] = (full, ref.state_dict())
    torch.manual_seed(5)  # another start: loading must replace all of it
    fresh = build_sharded("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch", "inverted", "columns", comm)
    fresh.load_state_dict(fresh.local_shard(full))
    record["resumed"] = (fresh.state_dict(), net.state_dict())
    torch.save(record, f"{out}/columns-rank{comm.rank}.pt")


def _gathered(net, comm: Comm, mine: dict) -> dict:
    """The single-device dict assembled from every column's dict (as a checkpoint is)."""
    return net.assemble(comm.all_gather_object({k: v.detach().clone() for k, v in mine.items()}))


def _ddp(comm: Comm, out: str) -> None:
    """Gradients mode (our wrap_gradients): three steps, each replica on its own images; its running
    statistics, then what average_statistics makes of them."""
    from alexnet.exchange import average_statistics, wrap_gradients
    torch.manual_seed(0)
    model = build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch")
    ddp = wrap_gradients(model, torch.device("cpu"), 25, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = _replica_batch(comm.rank, step)
        F.cross_entropy(ddp(x), y).backward()
        getattr(ddp, "sync", lambda: None)()  # the simulator's mean after backward (DDP's is during it)
        opt.step()
        opt.zero_grad()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    average_statistics(model, comm)
    torch.save({"own": own, "averaged": model.state_dict()}, f"{out}/ddp-rank{comm.rank}.pt")


def _fc(comm: Comm, out: str) -> None:
    """fc M=2: the convs (and their batch norm) run on each process's own images; the statistics, then
    what average_statistics makes of them over the model group."""
    from alexnet.exchange import average_statistics
    from alexnet.model_parallel import build_sharded
    torch.manual_seed(0)
    net = build_sharded("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch", "inverted", "fc", comm)
    net(_replica_batch(comm.rank, 0)[0])
    own = {k: v.clone() for k, v in net.state_dict().items()}
    average_statistics(net, None)
    torch.save({"own": own, "averaged": net.state_dict()}, f"{out}/fc-rank{comm.rank}.pt")


def _replica_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(3, 3, CROP, CROP, generator=g), torch.randint(0, CLASSES, (3,), generator=g)


def _exchange(comm: Comm, transport: str, out: str) -> None:
    """The weights exchange after one step of each replica on its own images."""
    from alexnet.config import TrainConfig
    from alexnet.exchange import WeightExchange
    from alexnet.optim import build_optimizer
    from alexnet.replica import sgd_step
    rank = comm.rank
    torch.manual_seed(0)
    model = build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch")
    opt = build_optimizer(model, TrainConfig(lr=0.01))
    exchange = WeightExchange(model, opt, comm, transport)
    sgd_step(model, opt, *_replica_batch(rank, 0), lambda: torch.autocast("cpu", enabled=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exchange.after_step(1)
    exchange.close()
    torch.save({"before": before, "after": model.state_dict()}, f"{out}/exchange-{transport}-rank{rank}.pt")


def _member(comm: Comm, out: str) -> None:
    _columns(comm, out)
    _ddp(comm, out)
    _fc(comm, out)
    for transport in ("gloo", "ipc"):  # the weights exchange's all-reduce, and its shared-memory buffers
        _exchange(comm, transport, out)


@pytest.fixture(scope="module")
def members(tmp_path_factory) -> Path:
    """The folder of what the 2 members of `_member` saved, on the rank simulator (tests/ranks.py; the same
    statistics on 4 real processes with DDP over gloo: tests/test_parallel_math.py's
    test_a_layout_on_the_simulator_and_on_gloo)."""
    out = tmp_path_factory.mktemp("bn_members")
    ranks.members("sim", 2, _member, str(out))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def test_columns_compute_the_single_device_function(members):
    for rank in (0, 1):
        got = torch.load(members / f"columns-rank{rank}.pt", weights_only=True)
        for what in ("logits", "eval logits"):
            logits, ref = got[what]
            assert logits.shape == ref.shape and _rel(logits, ref) <= 1e-6, (rank, what)
        # the first step's gradients (1e-5: conv1's bias gradients nearly cancel under bn2, leaving float
        # noise) and statistics; the weights, statistics and counts after 3 steps
        for what, tolerance in (("grads", 1e-5), ("stats", 1e-6), ("trained", 1e-5)):
            mine, ref = got[what]
            assert mine.keys() == ref.keys(), what
            for key in ref:
                assert mine[key].shape == ref[key].shape and _rel(mine[key], ref[key]) <= tolerance, (rank, what, key)
        assert any(".running_var" in k for k in got["stats"][1])
        resumed, ours = got["resumed"]
        assert resumed.keys() == ours.keys() and all(torch.equal(resumed[k], ours[k]) for k in ours)
        own = {k: v.shape for k, v in ours.items() if k.endswith("bn2.running_mean")}
        assert own == {"features.bn2.running_mean": (6,)}  # its own half of conv1's 12 channels (width 1/8)


def _hand_ddp() -> tuple[list[dict], dict]:
    """What two data-parallel replicas do, by hand without DDP: each copy normalises its own images and
    keeps its own statistics; the mean of their gradients updates both."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch"))
    for step in range(3):
        for rank, model in enumerate(models):
            x, y = _replica_batch(rank, step)
            F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in models)):
                mean = sum(p.grad for p in ps) / 2
                for p in ps:
                    p -= 0.05 * mean
                    p.grad = None
    return [m.state_dict() for m in models], models[0].state_dict()


def test_data_parallel_statistics_are_per_replica_then_averaged(members):
    states, _ = _hand_ddp()
    for rank in (0, 1):
        got = torch.load(members / f"ddp-rank{rank}.pt", weights_only=True)
        for key, want in states[rank].items():  # weights: the same; statistics: the replica's own
            assert _rel(got["own"][key], want) <= 1e-5, (rank, key)
        for key in (k for k in states[rank] if k.endswith(("running_mean", "running_var"))):
            assert _rel(got["averaged"][key], (states[0][key] + states[1][key]) / 2) <= 1e-5, (rank, key)
        assert got["averaged"]["features.bn2.num_batches_tracked"] == 3  # a count, not averaged
    assert _rel(states[0]["features.bn3.running_mean"], states[1]["features.bn3.running_mean"]) > 1e-3


def test_fc_statistics_are_per_process_then_averaged_over_the_model_group(members):
    """fc: each process's batch norm sees its own images (not the single-device function, whose statistics
    would be the group's); average_statistics leaves the mean of the processes' statistics in every one."""
    single = []
    for rank in (0, 1):  # by hand: the single-device model on each process's images
        torch.manual_seed(0)
        model = build_model("alexnet_bn", CLASSES, WIDTH, 0.0, CROP, "torch")
        model(_replica_batch(rank, 0)[0])
        single.append(model.state_dict())
    stats = [k for k in single[0] if k.endswith(("running_mean", "running_var"))]
    for rank in (0, 1):
        got = torch.load(members / f"fc-rank{rank}.pt", weights_only=True)
        for key in stats:
            assert _rel(got["own"][key], single[rank][key]) <= 1e-5, (rank, key)
            assert _rel(got["averaged"][key], (single[0][key] + single[1][key]) / 2) <= 1e-5, (rank, key)
    assert _rel(single[0]["features.bn3.running_mean"], single[1]["features.bn3.running_mean"]) > 1e-3


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_weights_exchange_averages_the_running_statistics(members, transport):
    got = [torch.load(members / f"exchange-{transport}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    stats = [k for k in got[0]["before"] if k.endswith(("running_mean", "running_var"))]
    assert len(stats) == 8
    for key in stats:
        a, b = got[0]["before"][key], got[1]["before"][key]
        assert _rel(a, b) > 1e-3, key  # each replica's own images gave other statistics
        for g in got:
            assert _rel(g["after"][key], (a + b) / 2) <= 1e-6, (transport, key)
    for g in got:
        assert g["after"]["features.bn2.num_batches_tracked"] == 1


# -- train.py end to end -----------------------------------------------------------------------------------


def _train(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), signal_handlers_kept():
        assert train.main(["configs/demo.yaml", *args]) == 0
    return out.getvalue()


def _assert_same_state(a: Path, b: Path) -> None:
    sa, sb = load(a), load(b)
    assert sa["model"].keys() == sb["model"].keys() and any("running_var" in k for k in sa["model"])
    for key in sa["model"]:  # weights, running statistics and their counts
        assert torch.equal(sa["model"][key], sb["model"][key]), key
    va, vb = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert va.keys() == vb.keys() and va and all(torch.equal(va[k]["velocity"], vb[k]["velocity"]) for k in va)


def _evaluate(train_data: Path, weights: Path, out: Path) -> dict:
    assert load_script("evaluate").main(["--data", str(train_data), "--weights", str(weights), "--json", str(out),
                                         "--no-progress"]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def straight(train_data, tmp_path_factory) -> Path:
    """2 epochs of alexnet_bn in one process (shuffling, crops, flips, dropout on; validation batches of 5)."""
    run = tmp_path_factory.mktemp("bn_straight") / "run"
    _train(tiny_overrides(train_data, run, **BN, **{"data.val_batch_size": 5}))
    return run


@pytest.mark.whole_runs
@pytest.mark.processes
def test_resume_is_exact_and_evaluate_uses_the_running_statistics(train_data, tmp_path, straight):
    """2 epochs straight == 1 epoch + the same command to 2: weights, velocities, running statistics; then
    evaluate.py on the checkpoint gives the trainer's validation loss (both in eval mode: training mode's
    batch statistics would depend on the batch, 5 images in training's validation, 100 in evaluate.py's)."""
    split = tmp_path / "split"
    over = {**BN, "data.val_batch_size": 5}
    _train(tiny_overrides(train_data, split, **over, **{"train.epochs": 1}))
    assert "resumed from" in _train(tiny_overrides(train_data, split, **over))
    _assert_same_state(straight / "checkpoints" / "last.pt", split / "checkpoints" / "last.pt")
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert without_wall_clock(a) == without_wall_clock(b)
    state = load(straight / "checkpoints" / "last.pt")["model"]
    assert state["features.bn2.num_batches_tracked"] > 0 and state["features.bn2.running_var"].ne(1).all()
    val = [r for r in a if r["split"] == "val"][-1]
    record = _evaluate(train_data, straight / "checkpoints" / "last.pt", tmp_path / "eval.json")
    assert record["n"] == val["n"] and abs(record["loss"] - val["loss"]) <= 1e-5 * abs(val["loss"])


# -- weight formats that cannot hold batch norm -------------------------------------------------------------


def test_formats_without_batch_norm_refuse_in_one_line(tmp_path, capsys):
    from alexnet.weights.common import FormatError
    from alexnet.weights.load import load_weights
    torch.manual_seed(0)
    model = build_model("alexnet_bn", CLASSES, WIDTH, 0.5, CROP, "torch")
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    convert = load_script("convert_weights").main
    assert convert([str(plain), str(tmp_path / "theano")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "alexnet_bn" in err and "Theano" in err, err
    assert not (tmp_path / "theano").exists()
    for arch in (None, "alexnet"):
        with pytest.raises(FormatError, match="batch-norm statistics.*--arch alexnet_bn"):
            load_weights(plain, arch)
    loaded, info = load_weights(plain, "alexnet_bn")
    assert info["arch"] == "alexnet_bn" and not loaded.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(FormatError, match="torchvision AlexNet weights \\(arch owt\\), not 'alexnet_bn'"):
        load_weights(_torchvision_file(tmp_path), "alexnet_bn")


def _torchvision_file(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "tv.pth"
    torch.save(build_model("owt", 10, 0.125, 0.5, 224, "torch").state_dict(), path)
    return path


@pytest.mark.whole_runs
def test_a_checkpoint_refuses_theano_export_in_one_line(straight, tmp_path, capsys):
    capsys.readouterr()
    assert load_script("convert_weights").main([str(straight / "checkpoints" / "last.pt"), str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'alexnet_bn'" in err and "batch norm" in err, err
    assert not (tmp_path / "t").exists()


def test_a_batch_norm_caffemodel_is_refused_naming_the_layer(tmp_path, capsys):
    """NVCaffe's AlexNet-BN as a .caffemodel (the prototxt's layer sequence, BatchNorm with its 3 blobs)."""
    from tests.caffe_nets import layer, params_of, small_blobs
    blobs, net, bottom = small_blobs(), b"", "data"
    for name, kind, _, _ in PROTOTXT_FEATURES + PROTOTXT_CLASSIFIER:
        kind = {nn.Conv2d: "Convolution", nn.ReLU: "ReLU", MaxPool: "Pooling", nn.BatchNorm2d: "BatchNorm",
                nn.Linear: "InnerProduct", None: "Dropout"}[kind]
        if kind == "BatchNorm":  # mean, variance, NVCaffe's variance correction
            net += layer("V2", name, kind, bottom, name, (np.zeros(4, np.float32),) * 2 + (np.ones(1, np.float32),))
        else:
            net += layer("V2", name, kind, bottom, name, tuple(blobs.get(name, ())), params_of(name, kind, blobs))
        bottom = name
    path = tmp_path / "alexnet_bn.caffemodel"
    path.write_bytes(net)
    assert load_script("convert_weights").main([str(path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layer 3 'bn2' is a BatchNorm" in err and "alexnet_bn" in err, err


@pytest.mark.whole_runs
def test_figures_draw_conv1_and_eval_mode_neighbours(straight, train_data, tmp_path):
    """filters (conv1) and neighbours (the last nn.Linear's input, in eval mode: each image's features alone,
    as a brute-force ranking of fc7 computed image by image)."""
    from alexnet.weights.load import load_weights
    from data.reader import SplitData
    from tests.test_figures import fc7_by_hand
    weights, out = straight / "checkpoints" / "last.pt", tmp_path / "fig"
    assert load_script("figures").main(["--weights", str(weights), "--data", str(train_data), "--out", str(out),
                                        "--only", "filters", "neighbours", "--queries", "2", "--neighbours", "3",
                                        "--no-progress", "--device", "cpu"]) == 0
    assert "alexnet_bn" in json.loads((out / "filters.json").read_text())["title"]
    record = json.loads((out / "neighbours.json").read_text())
    model, info = load_weights(weights)
    train_split, val = SplitData(train_data, "train"), SplitData(train_data, "val")
    feats = np.concatenate([fc7_by_hand(model, train_split, [i], info["crop"]) for i in range(len(train_split))])
    for q in record["queries"]:
        qf = fc7_by_hand(model, val, [q["index"]], info["crop"])[0]
        order = np.argsort(np.sqrt(((feats - qf) ** 2).sum(axis=1)), kind="stable")[:3]
        assert [n["index"] for n in q["neighbours"]] == order.tolist()
