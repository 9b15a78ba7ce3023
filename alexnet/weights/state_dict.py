"""Plain state dicts of our ``alexnet`` / ``caffenet`` / ``alexnet_bn`` (features.conv1.weight ...): the
first two have the same keys in another layer order, so the arch must be named (alexnet_bn's batch-norm
statistics are told apart, and refused under another arch); crop and width come from the shapes."""
from __future__ import annotations

from torch import nn

from .common import (
    PAPER_LAYERS,
    Contents,
    FormatError,
    crop_from_fc6,
    first_few,
    infer_width,
    load_strict,
    new_model,
    unwrap_state,
    weights_info,
)


def is_state_dict(path, contents: Contents) -> bool:
    return "features.conv1.weight" in unwrap_state(path, contents())


def read_state_dict(path, contents: Contents, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    """load_weights for a plain alexnet/caffenet/alexnet_bn state dict (`arch` required)."""
    state = unwrap_state(path, contents())
    bn = any(k.endswith(".running_mean") for k in state)
    if bn and arch != "alexnet_bn":  # batch-norm statistics: only alexnet_bn has them
        other = f", not {arch}" if arch else ""
        raise FormatError(f"{path} holds batch-norm statistics (features.bn2.running_mean ...): a state_dict of "
                          f"our alexnet_bn{other}; pass --arch alexnet_bn")
    if arch is None:
        raise FormatError(f"{path} is a state_dict of our alexnet or caffenet (the same keys, a different "
                          "layer order): pass --arch alexnet or --arch caffenet")
    if arch == "owt":
        raise FormatError(f"{path} holds alexnet/caffenet weights (features.conv1 ...), not owt ones")
    need = [k for k in ("features.conv5.weight", "classifier.fc6.weight", "classifier.fc8.weight")
            if k not in state]
    if need:
        raise FormatError(f"{path}: incomplete {arch} state_dict, missing {first_few(need)}")
    num_classes = state["classifier.fc8.weight"].shape[0]
    crop = crop_from_fc6(path, arch, state["features.conv5.weight"].shape[0],
                         state["classifier.fc6.weight"].shape[1])
    width = width or infer_width(path, arch, state, num_classes, crop, PAPER_LAYERS)
    model = new_model(arch, num_classes, width, crop)
    load_strict(model, state, path)
    return model, weights_info(arch, width, crop, "image", num_classes, "state_dict")
