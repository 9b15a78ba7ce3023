"""torchvision's AlexNet state dicts: the keys of our ``owt`` model (features.0.weight ... classifier.6)."""
from __future__ import annotations

from torch import nn

from .common import Contents, FormatError, first_few, infer_width, load_strict, new_model, unwrap_state, weights_info

TORCHVISION_CROP = 224
# (state-dict key, unscaled channel count) per layer, most channels first, as common.PAPER_LAYERS.
_OWT_LAYERS = (("classifier.1.weight", 4096), ("features.6.weight", 384), ("features.8.weight", 256),
               ("features.10.weight", 256), ("features.3.weight", 192), ("features.0.weight", 64))


def is_torchvision(path, contents: Contents) -> bool:
    """torchvision's key names (a key missing is named by read_torchvision, not called another format)."""
    state = unwrap_state(path, contents())
    return "features.0.weight" in state or "classifier.6.weight" in state


def read_torchvision(path, contents: Contents, arch: str | None, width: float | None) -> tuple[nn.Module, dict]:
    """load_weights for a torchvision state dict: arch owt, torchvision's crop and normalisation."""
    state = unwrap_state(path, contents())
    if arch not in (None, "owt"):
        raise FormatError(f"{path} holds torchvision AlexNet weights (arch owt), not {arch!r}; omit --arch")
    need = [k for k in ("features.0.weight", "classifier.6.weight") if k not in state]
    if need:
        raise FormatError(f"{path}: incomplete torchvision AlexNet state_dict, missing {first_few(need)}")
    num_classes = state["classifier.6.weight"].shape[0]
    crop = TORCHVISION_CROP  # the adaptive pool makes the weights crop-independent: use torchvision's
    width = width or infer_width(path, "owt", state, num_classes, crop, _OWT_LAYERS)
    model = new_model("owt", num_classes, width, crop)
    load_strict(model, state, path)
    return model, weights_info("owt", width, crop, "channel", num_classes, "torchvision")
