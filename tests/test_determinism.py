"""train.deterministic: fixed-order pooling and LRN (the code a deterministic GPU run uses), on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import train
from alexnet.models import build_model
from layers import LRN, adaptive_avg_pool2d_fixed_order, lrn_reference, max_pool2d_fixed_order
from tests.conftest import tiny_overrides
from tests.test_parallel import DETERMINISTIC, rel_diff
from tests.test_train import assert_same_weights

# autograd nodes of the kernels whose CUDA backward adds with atomics (or has no deterministic kernel)
NONDETERMINISTIC_NODES = {"MaxPool2DWithIndicesBackward0", "AvgPool3DBackward0", "AdaptiveAvgPool2DBackward0"}


@pytest.fixture
def deterministic_mode():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def graph_nodes(t: torch.Tensor) -> set[str]:
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("shape", [(2, 3, 55, 55), (2, 4, 13, 13), (1, 2, 27, 27)])
@pytest.mark.parametrize("ties", [False, True])
def test_fixed_order_max_pool_equals_torch(shape, ties):
    torch.manual_seed(0)
    x = torch.randint(0, 3, shape).double() if ties else torch.randn(shape, dtype=torch.float64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = max_pool2d_fixed_order(a, 3, 2), F.max_pool2d(b, 3, 2)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def test_fixed_order_max_pool_keeps_channels_last():
    x = torch.randn(2, 8, 13, 13).contiguous(memory_format=torch.channels_last).requires_grad_()
    max_pool2d_fixed_order(x, 3, 2).sum().backward()
    assert x.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("side", [6, 12, 13, 7])
def test_fixed_order_adaptive_avg_pool_equals_torch(side):
    x = torch.randn(2, 3, side, side + 2, dtype=torch.float64)
    torch.testing.assert_close(adaptive_avg_pool2d_fixed_order(x, (6, 6)), F.adaptive_avg_pool2d(x, (6, 6)),
                               rtol=0, atol=1e-12)


def test_deterministic_lrn_is_the_paper_formula(deterministic_mode):
    x = (30 * torch.randn(2, 16, 5, 5, dtype=torch.float64)).requires_grad_()
    torch.testing.assert_close(LRN()(x), lrn_reference(x), rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(LRN(), (x,))


@pytest.mark.parametrize("arch, crop", [("alexnet", 67), ("caffenet", 67), ("owt", 80)])
def test_deterministic_mode_avoids_atomic_backward_kernels(arch, crop, deterministic_mode):
    """The training graph holds none of the kernels that are nondeterministic on CUDA."""
    torch.manual_seed(0)
    model = build_model(arch, 5, 0.125, 0.5, crop, "torch")
    loss = model(torch.randn(2, 3, crop, crop)).logsumexp(1).sum()
    assert not graph_nodes(loss) & NONDETERMINISTIC_NODES
    torch.use_deterministic_algorithms(False)
    loss = model(torch.randn(2, 3, crop, crop)).logsumexp(1).sum()
    assert graph_nodes(loss) & NONDETERMINISTIC_NODES  # the test sees them when they are there


def test_deterministic_training_matches_the_default_and_repeats_exactly(train_data, tmp_path):
    """On the CPU both modes are deterministic: equal to rounding, and a deterministic run repeats bitwise
    (train.py's main in this process: the three runs share its threads and settings; two threads, as
    the suite's one thread per process would make any order fixed)."""
    runs, threads = {}, torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, det in (("default", False), ("det1", True), ("det2", True)):
            runs[name] = tmp_path / name
            assert train.main(["configs/demo.yaml", *tiny_overrides(
                train_data, runs[name], **{**DETERMINISTIC, "train.deterministic": det, "model.dropout": 0.5})]) == 0
            assert torch.are_deterministic_algorithms_enabled() == det  # the mode was on for det1, det2 only
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    assert rel_diff(runs["det1"], runs["default"]) <= 1e-5
    assert_same_weights(runs["det1"] / "checkpoints" / "last.pt", runs["det2"] / "checkpoints" / "last.pt")


@pytest.mark.processes
def test_deterministic_config_key(train_data, tmp_path):
    run = tmp_path / "run"
    assert train.main(["configs/demo.yaml", *tiny_overrides(train_data, run, **{"train.epochs": 1}),
                       "train.deterministic=true"]) == 0
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
