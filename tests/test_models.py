"""AlexNet variants: shapes, parameter counts, layer names/order, init, limits, errors."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from torch import nn

from alexnet.models import ARCHS, build_model, count_params, init_paper_, min_crop
from layers import LRN, Dropout

# torchvision.models.alexnet().state_dict(), written out so the test needs no torchvision.
TORCHVISION_SHAPES = {
    "features.0.weight": (64, 3, 11, 11),
    "features.0.bias": (64,),
    "features.3.weight": (192, 64, 5, 5),
    "features.3.bias": (192,),
    "features.6.weight": (384, 192, 3, 3),
    "features.6.bias": (384,),
    "features.8.weight": (256, 384, 3, 3),
    "features.8.bias": (256,),
    "features.10.weight": (256, 256, 3, 3),
    "features.10.bias": (256,),
    "classifier.1.weight": (4096, 9216),
    "classifier.1.bias": (4096,),
    "classifier.4.weight": (4096, 4096),
    "classifier.4.bias": (4096,),
    "classifier.6.weight": (1000, 4096),
    "classifier.6.bias": (1000,),
}
ALEXNET_FEATURES = [
    "conv1", "relu1", "norm1", "pool1",
    "conv2", "relu2", "norm2", "pool2",
    "conv3", "relu3", "conv4", "relu4", "conv5", "relu5", "pool5",
]  # fmt: skip
CAFFENET_FEATURES = [
    "conv1", "relu1", "pool1", "norm1",
    "conv2", "relu2", "pool2", "norm2",
    "conv3", "relu3", "conv4", "relu4", "conv5", "relu5", "pool5",
]  # fmt: skip
CLASSIFIER = ["fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8"]
CONV_BIAS = (0.0, 0.1, 0.0, 0.1, 0.0)
FC_STD = (0.005, 0.005, 0.01)
FC_BIAS = (0.1, 0.1, 0.0)


def _meta_model(arch: str, **kwargs: object) -> nn.Module:
    # Meta tensors carry shapes only: full-size models and forwards cost nothing.
    with torch.device("meta"):
        return build_model(arch, **kwargs)


def _layers(model: nn.Module, kind: type[nn.Module]) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("crop", [227, 224])
@pytest.mark.parametrize("num_classes", [1000, 10])
def test_output_shape_full_size(arch: str, crop: int, num_classes: int) -> None:
    model = _meta_model(arch, num_classes=num_classes, crop=crop)
    out = model(torch.empty(2, 3, crop, crop, device="meta"))
    assert out.shape == (2, num_classes)


@pytest.mark.parametrize("arch,crop,fc6_in", [
    ("alexnet", 227, 256 * 6 * 6), ("alexnet", 224, 256 * 5 * 5),
    ("caffenet", 227, 256 * 6 * 6), ("caffenet", 224, 256 * 5 * 5),
    ("owt", 227, 256 * 6 * 6), ("owt", 224, 256 * 6 * 6),
])  # fmt: skip
def test_fc6_input_follows_crop(arch: str, crop: int, fc6_in: int) -> None:
    fc6 = _layers(_meta_model(arch, crop=crop), nn.Linear)[0]
    assert fc6.in_features == fc6_in


@pytest.mark.parametrize("arch", ARCHS)
def test_demo_setting_real_forward_backward(arch: str) -> None:
    torch.manual_seed(0)
    model = build_model(arch, num_classes=10, width=0.25, crop=112)
    out = model(torch.randn(2, 3, 112, 112))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()  # in-place ReLUs must not break autograd
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("arch,expected", [("alexnet", 60_965_224), ("caffenet", 60_965_224), ("owt", 61_100_840)])
def test_parameter_counts(arch: str, expected: int) -> None:
    assert count_params(_meta_model(arch, num_classes=1000, width=1.0, crop=227)) == expected


def test_owt_state_dict_matches_torchvision() -> None:
    state = _meta_model("owt").state_dict()
    assert list(state) == list(TORCHVISION_SHAPES)
    assert {k: tuple(v.shape) for k, v in state.items()} == TORCHVISION_SHAPES


def test_alexnet_and_caffenet_layer_names_and_order() -> None:
    alex, caffe = _meta_model("alexnet"), _meta_model("caffenet")
    assert list(alex.features._modules) == ALEXNET_FEATURES
    assert list(caffe.features._modules) == CAFFENET_FEATURES
    assert list(alex.classifier._modules) == list(caffe.classifier._modules) == CLASSIFIER
    assert isinstance(alex.features.norm1, LRN) and isinstance(caffe.features.norm2, LRN)
    assert alex.state_dict().keys() == caffe.state_dict().keys()
    assert "features.conv1.weight" in alex.state_dict() and "classifier.fc6.weight" in alex.state_dict()
    assert [c.groups for c in _layers(alex, nn.Conv2d)] == [1, 2, 1, 2, 2]
    assert alex.crop == caffe.crop == 227


def test_alexnet_and_caffenet_compute_different_functions() -> None:
    torch.manual_seed(0)
    alex = build_model("alexnet", width=0.25, crop=112).eval()
    caffe = build_model("caffenet", width=0.25, crop=112).eval()
    caffe.load_state_dict(alex.state_dict())
    x = 50 * torch.randn(2, 3, 112, 112)  # large inputs so LRN is far from the identity
    assert not torch.allclose(alex(x), caffe(x))


@pytest.mark.parametrize("arch", ["alexnet", "owt"])
def test_paper_init_statistics(arch: str) -> None:
    torch.manual_seed(0)
    model = build_model(arch, width=0.5)
    convs, fcs = _layers(model, nn.Conv2d), _layers(model, nn.Linear)
    expected = [(c, 0.01, b) for c, b in zip(convs, CONV_BIAS)] + list(zip(fcs, FC_STD, FC_BIAS))
    assert len(expected) == 8
    for layer, std, bias in expected:
        assert abs(layer.weight.mean().item()) < 0.1 * std
        assert math.isclose(layer.weight.std().item(), std, rel_tol=0.05)
        assert torch.equal(layer.bias, torch.full_like(layer.bias, bias))


def test_paper_init_is_reproducible_from_global_seed() -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model("caffenet", num_classes=10, width=0.25, crop=112).state_dict()

    first, again, other = weights(1), weights(1), weights(2)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["features.conv1.weight"], other["features.conv1.weight"])


def test_torch_init_leaves_defaults() -> None:
    torch.manual_seed(0)
    model = build_model("alexnet", width=0.25, crop=112, num_classes=10, init="torch")
    conv2 = model.features.conv2
    assert not torch.equal(conv2.bias, torch.full_like(conv2.bias, 0.1))
    init_paper_(model)
    assert torch.equal(conv2.bias, torch.full_like(conv2.bias, 0.1))


@pytest.mark.parametrize("arch,expected", [("alexnet", 67), ("caffenet", 67), ("owt", 63)])
def test_min_crop(arch: str, expected: int) -> None:
    smallest = min_crop(arch)
    assert smallest == expected  # hand-derived: pool5 needs 3, conv2/pool2 need 7, conv1 needs 15
    torch.manual_seed(0)
    model = build_model(arch, num_classes=10, width=0.1, crop=smallest)
    assert model(torch.randn(1, 3, smallest, smallest)).shape == (1, 10)
    with pytest.raises(ValueError, match=r"data\.crop.*" + str(smallest - 1)):
        build_model(arch, crop=smallest - 1)


def test_width_rounding_keeps_grouped_convs_valid() -> None:
    model = _meta_model("alexnet", width=0.25)
    assert [c.out_channels for c in _layers(model, nn.Conv2d)] == [24, 64, 96, 96, 64]
    assert [f.out_features for f in _layers(model, nn.Linear)] == [1024, 1024, 1000]
    # 96 * 0.3 = 28.8 -> 29 -> 30 (even for the groups of 2); 384 * 0.3 = 115.2 -> 116.
    odd = _meta_model("alexnet", width=0.3)
    assert [c.out_channels for c in _layers(odd, nn.Conv2d)] == [30, 78, 116, 116, 78]
    tiny = _meta_model("alexnet", width=1e-3, num_classes=7)
    assert [c.out_channels for c in _layers(tiny, nn.Conv2d)] == [2, 2, 2, 2, 2]
    assert [f.out_features for f in _layers(tiny, nn.Linear)] == [4, 4, 7]
    owt = _meta_model("owt", width=0.3)
    assert [c.out_channels for c in _layers(owt, nn.Conv2d)] == [19, 58, 115, 77, 77]
    assert _layers(owt, nn.Linear)[0].in_features == 77 * 36


def test_odd_width_real_forward() -> None:
    torch.manual_seed(0)
    for arch in ARCHS:
        model = build_model(arch, num_classes=5, width=0.3, crop=80)
        assert model(torch.randn(1, 3, 80, 80)).shape == (1, 5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_dropout_rate_and_structure(arch: str, rate: float) -> None:
    model = _meta_model(arch, dropout=rate)
    drops = _layers(model, Dropout)
    assert len(drops) == 2 and all(d.p == rate for d in drops)
    assert model.state_dict().keys() == _meta_model(arch).state_dict().keys()


def test_channels_last_and_bf16_autocast() -> None:
    torch.manual_seed(0)
    model = build_model("alexnet", num_classes=10, width=0.25, crop=112).eval()
    x = torch.randn(2, 3, 112, 112)
    expected = model(x)
    model_cl = model.to(memory_format=torch.channels_last)
    got = model_cl(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()


@pytest.mark.parametrize("kwargs,key", [
    ({"arch": "vgg"}, "model.arch"),
    ({"init": "xavier"}, "model.init"),
    ({"width": 0}, "model.width"),
    ({"width": -0.5}, "model.width"),
    ({"width": float("nan")}, "model.width"),
    ({"width": float("inf")}, "model.width"),
    ({"dropout": 1.0}, "model.dropout"),
    ({"dropout": -0.1}, "model.dropout"),
    ({"num_classes": 0}, "model.num_classes"),
    ({"num_classes": 2.5}, "model.num_classes"),
    ({"crop": 10}, "data.crop"),
])  # fmt: skip
def test_bad_arguments_name_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        build_model(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)  # the offending value too


def test_unknown_arch_lists_valid_archs() -> None:
    with pytest.raises(ValueError) as info:
        build_model("resnet")
    assert all(arch in str(info.value) for arch in ARCHS) and "resnet" in str(info.value)
    with pytest.raises(ValueError, match="owt"):
        min_crop("resnet")


def _torchvision() -> ModuleType:
    try:
        import torchvision
    except Exception as exc:  # a wheel built for another torch/CUDA raises RuntimeError, not ImportError
        pytest.skip(f"torchvision not importable: {exc!r}")
    return torchvision


def _compare_with_torchvision(device: str) -> None:
    torchvision = _torchvision()
    torch.manual_seed(0)
    reference = torchvision.models.alexnet().to(device).eval()  # random init, no download
    model = build_model("owt", crop=224).to(device).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(4, 3, 224, 224, device=device)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        got, expected = model(x), reference(x)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_owt_equals_torchvision_cpu() -> None:
    _compare_with_torchvision("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_owt_equals_torchvision_cuda() -> None:
    _compare_with_torchvision("cuda")
