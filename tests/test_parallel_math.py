"""The distributed math on the rank simulator (alexnet/simulate.py): every layout of R replicas x M model
shards trains as one process with the global batch, over generated layouts, architectures, optimizers,
exchanges and micro-batches (Hypothesis); the weights exchange every k steps against replicas trained
apart and averaged by hand; sharded layers' trust ratios; uneven evaluation rows; batch-norm statistics
per replica and their averages.

Each rank runs alexnet/replica.py's Replica on its share of one global batch, read as the reader does
(MeshLayout.reader_rank of reader_world); the expectation is one process (a Replica without peers) on the
whole batch, or replicas computed apart in this process and averaged with torch by hand. Everything runs
in float64, so that the order in which collectives add leaves ~1e-14 and the tolerance can be 1e-6:
a gradient or a trust ratio off by far less than a factor shows.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from alexnet.config import Config, ConfigError, apply, validate
from alexnet.distributed import DistInfo
from alexnet.model_parallel import build_sharded
from alexnet.models import build_model
from alexnet.replica import Replica
from alexnet.simulate import run_ranks
from layers import TorchComm
from tests.conftest import examples, tier_cases
from tests.ranks import REAL_GROUP, mesh

CLASSES = 4
TOLERANCE = 1e-6  # relative, in float64 (see the module docstring)
FLOOR = 1e-3      # tensors smaller than this are compared absolutely (to 1e-9): conv1's bias ahead of batch
                  # norm has a gradient that nearly cancels, whose velocity is mostly rounding


@pytest.fixture(autouse=True)
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
CROP = {"alexnet": 67, "caffenet": 67, "alexnet_bn": 67, "owt": 63}
NO_AUTOCAST = contextlib.nullcontext


@dataclass(frozen=True)
class Layout:
    replicas: int = 1
    model_size: int = 1
    mode: str = "fc"
    exchange: str = "gradients"
    slices: int = 1
    batch: int = 4            # the images one reading process takes per step (this test's own notion)
    arch: str = "alexnet"
    optimizer: str = "sgd"
    momentum: float = 0.9
    every: int = 1

    def overrides(self) -> dict:
        over = {"model.arch": self.arch, "model.width": 0.125, "model.dropout": 0.0, "model.init": "torch",
                "data.crop": CROP[self.arch], "data.root": "unused", "train.batch_size": self.train_batch,
                "train.slices": self.slices, "train.optimizer": self.optimizer, "train.weight_decay": 5e-4,
                "parallel.replicas": self.replicas, "parallel.model_size": self.model_size,
                "parallel.model": self.mode, "parallel.exchange": self.exchange, "parallel.exchange_every": self.every}
        if self.optimizer == "lamb":
            over["train.lr"] = 0.01
        else:  # large enough that a gradient off by a factor, or a wrong trust ratio, shows in 3 steps
            over.update({"train.lr": 0.5 if self.optimizer == "lars" else 0.05, "train.momentum": self.momentum})
        if self.optimizer == "lars":
            over["train.trust_coefficient"] = 0.02
        return over

    def config(self, **changes) -> Config:
        cfg = Config()
        apply(cfg, {**self.overrides(), **changes}, "test")
        validate(cfg)
        return cfg

    @property
    def world(self) -> int:
        return self.replicas * self.model_size

    @property
    def train_batch(self) -> int:
        """train.batch_size: a replica's batch, which an fc model group's processes share out."""
        return self.batch * self.model_size if self.mode == "fc" else self.batch

    @property
    def readers(self) -> int:
        """Processes reading distinct images (the global batch is batch x readers)."""
        return self.replicas if self.mode == "columns" and self.model_size > 1 else self.world


def global_batches(layout: Layout, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n, crop = layout.batch * layout.readers, CROP[layout.arch]
    return [(torch.randn(n, 3, crop, crop, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
            for _ in range(steps)]


def _state(replica: Replica) -> dict:
    """The single-device model and optimizer state (complete on rank 0), as a checkpoint holds them."""
    model, opt = replica.full_state()
    out = {("model", k): v.detach().clone() for k, v in model.items()}
    for i, s in opt["state"].items():
        out.update({("opt", i, key): v.detach().clone() for key, v in s.items() if torch.is_tensor(v) and v.ndim})
    return out


def on_ranks(layout: Layout, batches, nccl: bool = False, **changes) -> dict:
    """Train `layout` on the simulator, one step per global batch; rank 0's assembled state."""
    cfg = layout.config(**changes)

    def member(info: DistInfo):
        replica = Replica(cfg, info, CLASSES)
        b, r = layout.batch, replica.layout.reader_rank
        for step, (x, y) in enumerate(batches, 1):
            replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], step, NO_AUTOCAST)
        if replica.exchange is not None and len(batches) % replica.exchange.every:
            replica.average_now()  # as a checkpoint between two exchanges does
        replica.average_statistics()
        return _state(replica)  # every rank takes part (a gather inside model group 0); rank 0's is whole
    return run_ranks(layout.world, member, layout.model_size, cfg, nccl=nccl)[0]


@contextlib.contextmanager
def _data_group_all_reduces(info: DistInfo, events: list):
    """On real processes: every all-reduce of the data group (DDP's buckets) noted in `events` as (which
    buffer, how many bytes)."""
    import torch.distributed as dist
    if not isinstance(info.data_peers, TorchComm):
        yield
        return
    real = dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kwargs):
        if group is info.data_peers.group:
            events.append(["reduce", tensor.data_ptr(), tensor.numel() * tensor.element_size()])
        return real(tensor, *args, group=group, **kwargs)
    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def _mesh_member(info: DistInfo, cfg: Config, layout: Layout, steps: int) -> dict:
    """on_ranks' rank, as a module-level function that spawned processes can import; also where each
    step's gradients live and every data-group all-reduce of the step, in order with the last gradient of
    the backward pass (the input's). The batches are made here (no tensor crosses to a spawned process)."""
    torch.set_default_dtype(torch.float64)  # a spawned process starts with float32
    batches = global_batches(layout, steps)
    replica = Replica(cfg, info, CLASSES)
    b, r = layout.batch, replica.layout.reader_rank
    events, steps = [], []
    with _data_group_all_reduces(info, events):
        for step, (x, y) in enumerate(batches, 1):
            x = x[r * b:(r + 1) * b].clone().requires_grad_()
            x.register_hook(lambda grad: events.append(["input grad"]))
            events.clear()
            replica.step(x, y[r * b:(r + 1) * b], step, NO_AUTOCAST)
            steps.append({"events": list(events), "grads": {
                k: [p.grad.data_ptr(), p.grad.numel() * p.grad.element_size()]
                for k, p in replica.model.named_parameters()}})
    replica.average_statistics()
    local = {k: v.detach().clone() for k, v in replica.model.state_dict().items()}
    return {"state": _state(replica), "local": local, "steps": steps}


def one_process(layout: Layout, batches, slices: int | None = None) -> dict:
    """The same steps in one process with the whole global batch (`slices`: its micro-batches)."""
    one = Layout(batch=layout.batch * layout.readers, arch=layout.arch, optimizer=layout.optimizer,
                 momentum=layout.momentum, slices=slices or layout.slices)
    replica = Replica(one.config(), DistInfo(), CLASSES)
    for step, (x, y) in enumerate(batches, 1):
        replica.step(x, y, step, NO_AUTOCAST)
    return _state(replica)


STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64, with ||b|| at least FLOOR."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(FLOOR))


def rel_diff(a: dict, b: dict, statistics: bool = True) -> float:
    """max over the tensors of ||a - b|| / ||b||; integer tensors must be equal. Not `statistics`: batch
    norm's running statistics are left out (a reference in R micro-batches updates them R times in a row,
    R replicas once each and then average: another moving average, tested by itself below)."""
    assert a.keys() == b.keys() and any(k[0] == "opt" for k in b)
    worst = 0.0
    for key, want in b.items():
        assert a[key].shape == want.shape, key
        if not statistics and key[0] == "model" and key[1].rsplit(".", 1)[-1] in STATISTICS:
            continue
        if not want.is_floating_point():
            assert torch.equal(a[key], want), key
            continue
        worst = max(worst, rel(a[key], want))
    return worst


def _valid(layout: Layout) -> bool:
    try:
        layout.config()
    except ConfigError:
        return False
    return True


@st.composite
def layouts(draw) -> Layout:
    mode = draw(st.sampled_from(["data", "fc", "columns"]))
    arch = draw(st.sampled_from(["alexnet", "caffenet", "alexnet_bn"] + ([] if mode == "columns" else ["owt"])))
    model_size = {"data": 1, "columns": 2}.get(mode) or draw(st.sampled_from([2, 4]))
    replicas = draw(st.integers(1 if model_size > 1 else 2, 3))
    optimizer = draw(st.sampled_from(["sgd", "lars", "lamb"]))
    exchange = "gradients" if optimizer != "sgd" and replicas > 1 else draw(st.sampled_from(["weights", "gradients"]))
    slices = draw(st.sampled_from([1, 2]))
    batch = draw(st.integers(max(1, slices), 4))
    return Layout(replicas=replicas, model_size=model_size, mode="fc" if mode == "data" else mode,
                  exchange=exchange, slices=slices, batch=batch, arch=arch, optimizer=optimizer,
                  momentum=draw(st.sampled_from([0.0, 0.9])))


def reference_slices(layout: Layout) -> int:
    """Micro-batches of the one-process run that sees what the layout's batch norm sees: every replica
    (and every fc process) normalises its own images (and its own slices) with their own statistics;
    columns normalise their group's images as one device would."""
    if layout.arch != "alexnet_bn":
        return layout.slices
    return layout.readers * layout.slices


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), nccl=st.booleans())
def test_every_layout_trains_as_one_process(layout, nccl):
    """R x M processes (data parallel, fc, columns, the hybrids), each exchange, micro-batches, SGD, LARS
    and LAMB: three steps equal one process's with the global batch, weights and optimizer state, within
    TOLERANCE (the collectives add in another order). fc with batch norm is not the single-device function
    (model_parallel's docstring): its convs' statistics are each process's own images'."""
    assume(_valid(layout) and not (layout.arch == "alexnet_bn" and layout.mode == "fc" and layout.model_size > 1))
    batches = global_batches(layout, 3)
    slices = reference_slices(layout)
    got, want = on_ranks(layout, batches, nccl=nccl), one_process(layout, batches, slices)
    assert rel_diff(got, want, statistics=slices == layout.slices) <= TOLERANCE


# One example of each family, always run (Hypothesis draws others each run).
NAMED = {
    "2 replicas, gradients": Layout(replicas=2),
    "2 replicas, weights": Layout(replicas=2, exchange="weights"),
    "3 replicas, weights, plain SGD, 2 slices": Layout(replicas=3, exchange="weights", momentum=0.0, slices=2),
    "columns": Layout(model_size=2, mode="columns"),
    "fc M=4, owt": Layout(model_size=4, arch="owt"),
    "columns R=2, gradients, 2 slices": Layout(replicas=2, model_size=2, mode="columns", slices=2),
    "fc R=2 x M=2, weights": Layout(replicas=2, model_size=2, exchange="weights"),
    "fc R=3 x M=2, gradients, 2 slices": Layout(replicas=3, model_size=2, slices=2, batch=2),
    "LARS, 2 replicas": Layout(replicas=2, optimizer="lars"),
    "LARS, columns": Layout(model_size=2, mode="columns", optimizer="lars"),
    "LARS, fc M=2": Layout(model_size=2, optimizer="lars"),
    "LAMB, fc R=2 x M=2": Layout(replicas=2, model_size=2, optimizer="lamb"),
    "LAMB, columns": Layout(model_size=2, mode="columns", optimizer="lamb"),
    "batch norm, 2 replicas": Layout(replicas=2, arch="alexnet_bn"),
    "batch norm, columns R=2": Layout(replicas=2, model_size=2, mode="columns", arch="alexnet_bn"),
    "batch norm, 2 replicas, weights": Layout(replicas=2, exchange="weights", arch="alexnet_bn"),
}


@pytest.mark.parametrize("name", tier_cases(NAMED))
def test_named_layouts_train_as_one_process(name):
    layout = NAMED[name]
    batches = global_batches(layout, 3)
    slices = reference_slices(layout)
    assert rel_diff(on_ranks(layout, batches), one_process(layout, batches, slices),
                    statistics=slices == layout.slices) <= TOLERANCE


HYBRID = Layout(replicas=2, model_size=2, slices=2, batch=2, arch="alexnet_bn")  # fc R=2 x M=2, gradients


@pytest.mark.parametrize("backend", ["sim", pytest.param("gloo", marks=REAL_GROUP)])
def test_a_layout_on_the_simulator_and_on_gloo(backend):
    """The same case, fc R=2 x M=2 of alexnet_bn in gradients mode with 2 micro-batches, on the simulator and
    on 4 real processes (alexnet.distributed.setup, gathers over gloo, DDP over each part's data group):
    both give one process's result, so what the simulator checks is what runs. On gloo, DDP's buckets
    too: each gradient is in exactly one data-group all-reduce per step, the first of which starts before
    the backward pass ends (DDP's first step is one bucket; the second has those of bucket_mb)."""
    cfg = HYBRID.config(**{"parallel.bucket_mb": 0.05})
    batches = global_batches(HYBRID, 3)
    got = mesh(backend, cfg, functools.partial(_mesh_member, cfg=cfg, layout=HYBRID, steps=3))
    slices = reference_slices(HYBRID)
    want = one_process(HYBRID, batches, slices)
    assert rel_diff(got[0]["state"], want, statistics=False) <= TOLERANCE  # rank 0 assembles the checkpoint
    for a, b in ((0, 2), (1, 3)):  # the same part in both model groups, trained on other images, kept equal
        for key, value in got[a]["local"].items():
            if not key.endswith(STATISTICS):
                assert torch.equal(value, got[b]["local"][key]), key
    if backend == "sim":
        return
    for rank, g in enumerate(got):
        kinds = [e[0] for e in g["steps"][1]["events"]]
        last_input_grad = len(kinds) - 1 - kinds[::-1].index("input grad")
        assert "reduce" in kinds and kinds.index("reduce") < last_input_grad, (rank, kinds)  # during backward
        assert kinds.count("reduce") > 2, (rank, kinds)
        for step, s in enumerate(g["steps"], 1):
            reduced = [e[1:] for e in s["events"] if e[0] == "reduce"]
            for key, (ptr, size) in s["grads"].items():
                covering = [b for b in reduced if b[0] <= ptr and ptr + size <= b[0] + b[1]]
                assert len(covering) == 1, (rank, step, key, len(covering))
            assert sum(b[1] for b in reduced) == sum(size for _, size in s["grads"].values()), (rank, step)


# -- a checkpoint of any layout resumes in any other ----------------------------------------------------------

def _resumed(first: Layout, then: Layout, batches, split: int) -> dict:
    """`split` steps in layout `first`, its assembled state (as a checkpoint holds it) loaded into every rank of
    layout `then` (Replica.load_full_state), the remaining steps there; rank 0's assembled state."""
    cfg = first.config()

    def before(info: DistInfo):
        replica = Replica(cfg, info, CLASSES)
        b, r = first.batch, replica.layout.reader_rank
        for step, (x, y) in enumerate(batches[:split], 1):
            replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], step, NO_AUTOCAST)
        replica.average_statistics()
        return replica.full_state()
    model_state, opt_state = run_ranks(first.world, before, first.model_size, cfg)[0]
    cfg2 = then.config()

    def after(info: DistInfo):
        torch.manual_seed(123)  # another start: loading must replace all of it
        replica = Replica(cfg2, info, CLASSES)
        replica.load_full_state(*copy.deepcopy((model_state, opt_state)))  # each its own, as from the file
        b, r = then.batch, replica.layout.reader_rank
        for step, (x, y) in enumerate(batches[split:], split + 1):
            replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], step, NO_AUTOCAST)
        replica.average_statistics()
        return _state(replica)
    return run_ranks(then.world, after, then.model_size, cfg2)[0]


RESUMES = {  # (first, then), each with a global batch of 8
    "columns -> fc R=2 x M=2": (Layout(model_size=2, mode="columns", batch=8),
                                Layout(replicas=2, model_size=2, batch=2)),
    "fc M=4 -> 2 replicas": (Layout(model_size=4, batch=2), Layout(replicas=2, batch=4)),
    "one -> columns R=2, weights": (Layout(batch=8), Layout(replicas=2, model_size=2, mode="columns", batch=4,
                                                            exchange="weights")),
    "fc M=2, LARS -> one": (Layout(model_size=2, batch=4, optimizer="lars"), Layout(batch=8, optimizer="lars")),
    "one, LAMB -> fc M=2": (Layout(batch=8, optimizer="lamb"), Layout(model_size=2, batch=4, optimizer="lamb")),
    "columns, LAMB -> fc M=4": (Layout(model_size=2, mode="columns", batch=8, optimizer="lamb"),
                                Layout(model_size=4, batch=2, optimizer="lamb")),
    "columns, batch norm -> one": (Layout(model_size=2, mode="columns", batch=8, arch="alexnet_bn"),
                                   Layout(batch=8, arch="alexnet_bn")),
}


@pytest.mark.parametrize("name", tier_cases(RESUMES))
def test_a_checkpoint_of_any_layout_resumes_in_any_other(name):
    """Two steps in one layout, its checkpoint's state loaded into another (every per-parameter state tensor
    sliced or assembled: velocities, Adam's moments, batch norm's statistics), two more steps there: one
    process's four steps."""
    first, then = RESUMES[name]
    batches = global_batches(first, 4)
    assert rel_diff(_resumed(first, then, batches, 2), one_process(first, batches)) <= TOLERANCE


# -- the weights exchange every k steps: replicas apart, averaged by hand ------------------------------------

def _apart(layout: Layout, batches) -> dict:
    """R one-process replicas, each on its own share, their weights, velocities and statistics averaged
    (torch, by hand) after every `every` steps, and at the end (as a checkpoint does)."""
    one = Layout(batch=layout.batch, arch=layout.arch, momentum=layout.momentum)
    replicas = [Replica(one.config(), DistInfo(), CLASSES) for _ in range(layout.replicas)]
    b = layout.batch

    def average():
        tensors = [[*(p.data for p in r.model.parameters()), *r.optimizer.velocities(),
                    *(t for t in r.model.buffers() if t.is_floating_point())] for r in replicas]
        for group in zip(*tensors):
            mean = torch.stack(group).mean(0)
            for t in group:
                t.copy_(mean)
    for step, (x, y) in enumerate(batches, 1):
        for r, replica in enumerate(replicas):
            replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], step, NO_AUTOCAST)
        if step % layout.every == 0 or step == len(batches):
            average()
    return _state(replicas[0])


@pytest.mark.parametrize("replicas, every, steps, arch", [(2, 3, 7, "alexnet"), (3, 2, 5, "alexnet_bn"),
                                                         (2, 1, 3, "caffenet")])
def test_weights_exchange_every_k_steps_averages_replicas_trained_apart(replicas, every, steps, arch):
    layout = Layout(replicas=replicas, exchange="weights", every=every, arch=arch)
    batches = global_batches(layout, steps)
    assert rel_diff(on_ranks(layout, batches), _apart(layout, batches)) <= TOLERANCE


def test_replicas_between_exchanges_differ_and_hold_each_their_own():
    """Before the first exchange (every 3 steps), each replica holds what it trained alone: the exchange
    did not average early (on one step of 2 replicas, rank 1's weights are its own one-process run's)."""
    layout = Layout(replicas=2, exchange="weights", every=3)
    batches = global_batches(layout, 1)
    cfg = layout.config()

    def member(info):
        replica = Replica(cfg, info, CLASSES)
        r, b = info.rank, layout.batch
        replica.step(batches[0][0][r * b:(r + 1) * b], batches[0][1][r * b:(r + 1) * b], 1, NO_AUTOCAST)
        return {k: v.clone() for k, v in replica.model.state_dict().items()}
    got = run_ranks(2, member, 1, cfg)
    alone = Replica(Layout(batch=layout.batch).config(), DistInfo(), CLASSES)
    alone.step(batches[0][0][4:8], batches[0][1][4:8], 1, NO_AUTOCAST)
    for key, want in alone.model.state_dict().items():
        assert torch.equal(got[1][key], want), key
    assert not torch.equal(got[0]["features.conv1.weight"], got[1]["features.conv1.weight"])


# -- sharded layers: the single-device function, with uneven evaluation rows --------------------------------

PART_CASES = [("columns", "alexnet", 2), ("columns", "caffenet", 2), ("columns", "alexnet_bn", 2), ("fc", "alexnet", 2),
              ("fc", "caffenet", 4), ("fc", "owt", 4)]


@settings(max_examples=examples(20), deadline=None)
@given(case=st.sampled_from(PART_CASES), rows=st.lists(st.integers(0, 3), min_size=4, max_size=4),
       batch=st.integers(1, 3))
def test_parts_compute_the_single_device_function(case, rows, batch):
    """Each member's logits and gradients (its loss 1/M of its rows' mean, replicated layers summed over
    the group) against the single-device model on all images; then evaluation with members holding
    different numbers of rows, some none (fc), against the single-device model on their concatenation."""
    mode, arch, world = case
    rows = rows[:world] if mode == "fc" else [sum(rows)] * world
    assume(sum(rows) > 0)
    crop = CROP[arch]
    images = batch * (world if mode == "fc" else 1)
    g = torch.Generator().manual_seed(sum(rows) + 10 * batch)
    x_all = torch.randn(max(images, sum(rows)), 3, crop, crop, generator=g)
    y_all = torch.randint(0, 4, (images,), generator=g)

    def member(comm):
        rank = comm.rank
        torch.manual_seed(0)
        net = build_sharded(arch, 4, 0.125, 0.0, crop, "torch", "inverted", mode, comm)
        x, y = (x_all[rank * batch:(rank + 1) * batch], y_all[rank * batch:(rank + 1) * batch]) if mode == "fc" \
            else (x_all[:images], y_all)
        logits = net(x)
        (F.cross_entropy(logits, y) / world).backward()
        net.sync_model_group()
        net.eval()
        with torch.no_grad():
            start = sum(rows[:rank]) if mode == "fc" else 0
            eval_logits = net(x_all[start:start + rows[rank]])
        return {k: p.grad for k, p in net.named_parameters()}, logits.detach(), eval_logits, net

    from layers.sim import SimWorld
    sim = SimWorld(world)
    got = sim.run(lambda rank: member(sim.comm(rank)))
    torch.manual_seed(0)
    ref = build_model(arch, 4, 0.125, 0.0, crop, "torch")
    ref_logits = ref(x_all[:images])
    F.cross_entropy(ref_logits, y_all).backward()
    grads = got[0][3].assemble([g[0] for g in got])
    logits = torch.cat([g[1] for g in got]) if mode == "fc" else got[0][1]
    assert logits.shape == ref_logits.shape and rel(logits, ref_logits.detach()) <= TOLERANCE
    for k, p in ref.named_parameters():
        assert grads[k].shape == p.grad.shape and rel(grads[k], p.grad) <= TOLERANCE, k
    ref.eval()
    with torch.no_grad():
        want = ref(x_all[:sum(rows)] if mode == "fc" else x_all[:rows[0]])
    uneven = torch.cat([g[2] for g in got]) if mode == "fc" else got[0][2]
    assert uneven.shape == want.shape and rel(uneven, want) <= TOLERANCE


# -- batch norm's statistics: per replica in training, averaged before validation and checkpoints ------------

def test_batch_norm_statistics_are_each_replicas_own_until_averaged():
    """Gradients mode, 2 replicas of alexnet_bn: after a step each holds the running statistics of its own
    images (a one-process run on its share: computed apart here), and average_statistics leaves both with
    their mean, by hand."""
    layout = Layout(replicas=2, arch="alexnet_bn")
    x, y = global_batches(layout, 1)[0]
    cfg = layout.config()

    def member(info):
        replica = Replica(cfg, info, CLASSES)
        r, b = info.rank, layout.batch
        replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], 1, NO_AUTOCAST)
        own = {k: v.clone() for k, v in replica.model.named_buffers() if v.is_floating_point()}
        replica.average_statistics()
        return own, {k: v.clone() for k, v in replica.model.named_buffers() if v.is_floating_point()}
    got = run_ranks(2, member, 1, cfg)
    for r in range(2):
        alone = Replica(Layout(batch=layout.batch, arch="alexnet_bn").config(), DistInfo(), CLASSES)
        alone.step(x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4], 1, NO_AUTOCAST)
        for k, v in alone.model.named_buffers():
            if v.is_floating_point():
                torch.testing.assert_close(got[r][0][k], v, rtol=1e-5, atol=1e-6)
    for k in got[0][0]:
        mean = (got[0][0][k] + got[1][0][k]) / 2
        assert not torch.equal(got[0][0][k], got[1][0][k]), k
        for r in range(2):
            torch.testing.assert_close(got[r][1][k], mean, rtol=1e-6, atol=1e-7)


def test_fc_batch_norm_statistics_are_averaged_over_the_model_group():
    """fc M=2 with alexnet_bn: the convs (and their statistics) are data parallel inside the model group;
    average_statistics gives both members the mean of the two, replicated statistics only."""
    layout = Layout(model_size=2, arch="alexnet_bn")
    x, y = global_batches(layout, 1)[0]
    cfg = layout.config()

    def member(info):
        replica = Replica(cfg, info, CLASSES)
        r, b = info.rank, layout.batch
        replica.step(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], 1, NO_AUTOCAST)
        own = {k: v.clone() for k, v in replica.model.named_buffers() if v.is_floating_point()}
        replica.average_statistics()
        return own, {k: v.clone() for k, v in replica.model.named_buffers() if v.is_floating_point()}
    got = run_ranks(2, member, 2, cfg)
    assert got[0][0]
    for k in got[0][0]:
        mean = (got[0][0][k] + got[1][0][k]) / 2
        for r in range(2):
            torch.testing.assert_close(got[r][1][k], mean, rtol=1e-6, atol=1e-7)


# -- what the layouts refuse -----------------------------------------------------------------------------

def test_lars_with_the_weights_exchange_over_replicas_is_refused_where_the_world_decides():
    """Under torchrun parallel.replicas is ignored: Replica itself refuses an adaptive optimizer with the
    weights exchange once the world has more than one replica (each would adapt to its own gradient)."""
    cfg = Layout(optimizer="lars", exchange="weights").config()

    def member(info):
        with pytest.raises(ConfigError, match="adapt each of the 2 replicas to its own gradient"):
            Replica(cfg, info, CLASSES)
        return True
    assert run_ranks(2, member, 1, cfg) == [True, True]


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_the_weights_exchange_keeps_a_float64_models_precision(transport):
    """1 + 2^-40 and 1 - 2^-40 average to exactly 1 in float64 (and to 1 in float32 only by rounding both):
    the exchange's buffers are the model's dtype, through the all-reduce and the shared-memory buffers (not
    torch's default dtype, float32 here)."""
    from alexnet.exchange import WeightExchange
    from alexnet.optim import build_optimizer
    from layers.sim import SimWorld
    torch.set_default_dtype(torch.float32)
    world = SimWorld(2)
    delta = 2.0 ** -40

    def member(rank):
        model = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.fill_(1.0 + (delta if rank == 0 else 3 * delta))
        opt = build_optimizer(model, Layout().config().train)
        exchange = WeightExchange(model, opt, world.comm(rank), transport)
        exchange.average()
        exchange.close()
        return float(model.weight.detach())
    assert world.run(member) == [1.0 + 2 * delta] * 2



# -- the weights exchange's own parts ------------------------------------------------------------------------

@pytest.fixture
def shm(tmp_path, monkeypatch):
    """The exchange's shared-memory folder, one of this test's own (other suites' runs share /dev/shm)."""
    from alexnet import exchange
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(exchange, "shm_folder", lambda: folder)
    return folder


@pytest.mark.parametrize("transport, impl", [("ipc", "IpcAverage"), ("gloo", "AllReduceAverage")])
def test_the_weights_exchange_by_transport_its_bytes_and_no_files_left(transport, impl, shm):
    """3 replicas of a model of 6 values and 6 velocities (48 bytes in float32): ipc reads its 2 peers' buffers
    (96 bytes moved per exchange), the all-reduce moves 2 (n - 1) / n of it (64); exchanged at every step by
    default; the shared-memory buffers are unlinked once mapped (nothing in /dev/shm after)."""
    from alexnet.exchange import WeightExchange
    from alexnet.optim import build_optimizer
    from layers.sim import SimWorld
    torch.set_default_dtype(torch.float32)
    world = SimWorld(3)

    def member(rank):
        model = torch.nn.Linear(2, 2)
        opt = build_optimizer(model, Layout().config().train)
        exchange = WeightExchange(model, opt, world.comm(rank), transport)
        made = type(exchange.impl).__name__, exchange.bytes_per_exchange(), exchange.sent[0]
        done = exchange.after_step(1)
        exchange.close()
        return (*made, done, exchange.sent[0])
    for name, size, sent0, done, sent in world.run(member):
        assert (name, size, sent0, done) == (impl, 48, 0, True)
        assert sent == (96 if transport == "ipc" else 64) and type(sent) is int  # whole bytes
    assert list(shm.iterdir()) == []


def _segment(folder, name: str, age_s: float):
    import os
    import time
    path = folder / name
    path.write_bytes(bytes(8))
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def test_a_killed_replicas_shared_memory_is_removed_at_the_next_start(shm, capsys):
    """A replica killed while its buffers were shared (between making and unlinking them) left them in
    /dev/shm, RAM until the machine restarts. The next ipc start removes a segment nobody holds that is older
    than a minute, and says so once; one held by its maker (a live run beside this one), one made a moment
    ago (its maker about to lock it) and a file named otherwise are kept."""
    import fcntl
    import os

    from alexnet.exchange import IpcAverage
    from layers.sim import SimWorld
    # named so that each kept one sorts before the stale ones: the walk goes on past it
    other = _segment(shm, "alexnet-0-notes", 120)
    (shm / "alexnet-0000000000000000-0-0").symlink_to(shm / "gone")  # cannot be opened: skipped
    held = _segment(shm, "alexnet-0000000000000001-0-1", 120)
    young = _segment(shm, "alexnet-0000000000000002-0-0", 5)
    stale = _segment(shm, "alexnet-ffffffffffffffff-1-0", 120)
    _segment(shm, "alexnet-ffffffffffffffff-None-0", 120)  # a name only a mutant makes: removed all the same
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        world = SimWorld(2)
        world.run(lambda rank: IpcAverage(10, torch.device("cpu"), world.comm(rank)).close())
    finally:
        os.close(fd)
    assert sorted(p.name for p in shm.iterdir()) == sorted([held.name, young.name, other.name,
                                                            "alexnet-0000000000000000-0-0"])
    assert capsys.readouterr().out == f"removed {stale} and 1 more: shared memory of replicas that were killed\n"
    held.unlink()  # its maker let go of it above: stale now
    one = _segment(shm, "alexnet-eeeeeeeeeeeeeeee-0-0", 120)
    again = SimWorld(2)
    again.run(lambda rank: IpcAverage(10, torch.device("cpu"), again.comm(rank)).close())
    assert capsys.readouterr().out == f"removed {one}: shared memory of replicas that were killed\n"


def test_the_exchange_names_its_buffers_so_a_later_start_finds_them(shm, monkeypatch):
    """Each replica makes two buffers, named with one token for the run, its rank and the buffer, by
    make_segment (locked, readable by this user only): names the sweep of a later start recognises."""
    import os
    import stat

    from alexnet import exchange
    from layers.sim import SimWorld
    made, real = [], exchange.make_segment

    def recorded(path, nbytes):
        fd = real(path, nbytes)
        made.append((path.name, stat.S_IMODE(os.fstat(fd).st_mode), os.fstat(fd).st_size))
        return fd
    monkeypatch.setattr(exchange, "make_segment", recorded)
    world = SimWorld(2)
    world.run(lambda rank: exchange.IpcAverage(10, torch.device("cpu"), world.comm(rank)).close())
    token = made[0][0].split("-")[1]
    assert sorted(made) == [(f"alexnet-{token}-{r}-{b}", 0o600, 40) for r in range(2) for b in range(2)]
    assert all(exchange.SEGMENT.match(name) for name, _, _ in made) and len(token) == 16


def test_make_segment_never_takes_an_existing_file_and_leaves_nothing_when_it_fails(tmp_path):
    from alexnet.exchange import make_segment
    path = tmp_path / "alexnet-0123456789abcdef-0-0"
    path.write_bytes(b"another run's")
    with pytest.raises(FileExistsError):
        make_segment(path, 8)
    assert path.read_bytes() == b"another run's"
    with pytest.raises(OSError) as e:
        make_segment(tmp_path / "alexnet-0123456789abcdef-0-1", -1)  # ftruncate refuses: the file goes
    assert type(e.value) is OSError and list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("has_dev_shm", [True, False])
def test_the_segments_live_in_dev_shm_where_the_machine_has_it_else_in_tmp(monkeypatch, has_dev_shm):
    """/dev/shm is memory; /tmp may be a disk, which would write the exchange's pages back to it."""
    from pathlib import Path

    from alexnet import exchange
    real = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda self: has_dev_shm if str(self) == "/dev/shm" else real(self))
    assert str(exchange.shm_folder()) == ("/dev/shm" if has_dev_shm else "/tmp")


def test_a_replica_failing_as_it_shares_unlinks_its_buffers(shm, monkeypatch):
    """A failure after the buffers were made (here, mapping a peer's) unlinks this replica's own at once."""
    from alexnet.exchange import IpcAverage
    from layers.sim import SimWorld

    def refuse(*args, **kwargs):
        raise OSError("cannot map")
    monkeypatch.setattr(torch, "from_file", refuse)
    world = SimWorld(2)
    with pytest.raises(OSError, match="cannot map"):
        world.run(lambda rank: IpcAverage(10, torch.device("cpu"), world.comm(rank)))
    assert list(shm.iterdir()) == []


@pytest.mark.processes
def test_a_segment_is_held_while_its_maker_lives_and_stale_once_it_is_killed(tmp_path):
    """The lock is what tells a live segment from a dead one, across processes: a maker (the exchange's own
    make_segment) sleeping holds it, SIGKILL releases it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from alexnet.exchange import remove_stale_segments
    from tests.conftest import REPO
    path = tmp_path / "alexnet-0123456789abcdef-0-0"
    maker = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                              "from alexnet.exchange import make_segment; make_segment(Path(sys.argv[1]), 64); "
                              "print('made', flush=True); time.sleep(600)", str(path)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout.readline() == "made\n"
        os.utime(path, (time.time() - 120,) * 2)
        assert remove_stale_segments(tmp_path) == [] and path.stat().st_size == 64  # held: kept
        maker.send_signal(signal.SIGKILL)
        maker.wait()
        assert remove_stale_segments(tmp_path) == [path] and not path.exists()
    finally:
        maker.kill()
        maker.wait()


@pytest.mark.parametrize("exchange", ["weights", "gradients"])
def test_a_replicas_bytes_sent_by_hand(exchange):
    """2 replicas, one step. Both modes start with the first sending its weights to the second (B bytes,
    B = the parameters' bytes; a broadcast counts at its source). Weights: then one exchange moves 2 (2 - 1)
    / 2 of the weights-and-velocities buffer from each: buffer + B from the first, buffer from the second.
    Gradients: each sends 2 (2 - 1) / 2 B for the gradients' mean: 2B from the first, B from the second."""
    layout = Layout(replicas=2, exchange=exchange)
    cfg = layout.config(**{"parallel.transport": "gloo"})

    def member(info):
        replica = Replica(cfg, info, CLASSES)
        x, y = global_batches(layout, 1)[0]
        replica.step(x[:4], y[:4], 1, NO_AUTOCAST)
        buffer = replica.exchange.bytes_per_exchange() if replica.exchange else 0
        return replica.sent_bytes(), sum(p.numel() * p.element_size() for p in replica.model.parameters()), buffer
    (sent0, size, buffer), (sent1, _, _) = run_ranks(2, member, 1, cfg)
    want = (buffer + size, buffer) if exchange == "weights" else (2 * size, size)
    assert (sent0, sent1) == want and min(want) > 0


def test_a_resume_takes_momentum_and_decay_from_the_config():
    """The checkpoint's optimizer state holds its run's momentum and decay; the config of the resumed run
    decides them (as the schedule decides the lr)."""
    first = Layout(batch=4)
    replica = Replica(first.config(), DistInfo(), CLASSES)
    x, y = global_batches(first, 1)[0]
    replica.step(x, y, 1, NO_AUTOCAST)
    model_state, opt_state = replica.full_state()
    resumed = Replica(first.config(**{"train.momentum": 0.5, "train.weight_decay": 1e-3}), DistInfo(), CLASSES)
    resumed.load_full_state(*copy.deepcopy((model_state, opt_state)))
    assert [g["momentum"] for g in resumed.optimizer.param_groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [1e-3, 0.0]  # biases: no decay
    assert [len(g["params"]) for g in resumed.optimizer.param_groups] == [8, 8]


def test_averaged_gradients_pass_keywords_on_and_broadcast_from_the_first():
    from alexnet.exchange import AveragedGradients
    from layers.sim import SimWorld

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x, scale=1.0):
            return self.w * x * scale
    world = SimWorld(2)

    def member(rank):
        module = Scaled()
        with torch.no_grad():
            module.w.fill_(rank + 5.0)
        wrapped = AveragedGradients(module, world.comm(rank))
        return float(wrapped(torch.ones(1), scale=3.0).detach())
    assert world.run(member) == [15.0, 15.0]  # member 0's weight 5, times 3


def test_wrap_gradients_gives_ddp_for_a_torch_group_and_the_mean_for_the_simulator(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from alexnet.exchange import AveragedGradients, wrap_gradients
    from layers.sim import SimWorld
    torch.set_default_dtype(torch.float32)
    world = SimWorld(1)
    assert isinstance(wrap_gradients(torch.nn.Linear(2, 2), torch.device("cpu"), 25, world.comm(0)),
                      AveragedGradients)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for comm in (None, TorchComm(dist.group.WORLD, None, 0, (0,))):
            assert isinstance(wrap_gradients(torch.nn.Linear(2, 2), torch.device("cpu"), 25, comm),
                              DistributedDataParallel)
    finally:
        dist.destroy_process_group()
