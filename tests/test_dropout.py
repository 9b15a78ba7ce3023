"""The two dropout styles: the same masks, scaled in training (inverted) or at test time (theano)."""
from __future__ import annotations

import pytest
import torch

from alexnet.models import build_model
from layers import Dropout


def test_theano_style_keeps_units_unscaled_and_scales_at_test():
    x = torch.rand(1000) + 0.5
    torch.manual_seed(3)
    inverted = Dropout(0.5, "inverted").train()(x)
    torch.manual_seed(3)
    theano = Dropout(0.5, "theano").train()(x)
    kept = inverted != 0
    assert torch.equal(kept, theano != 0) and 300 < int(kept.sum()) < 700  # the same mask
    assert torch.equal(theano[kept], x[kept]) and torch.equal(inverted[kept], 2 * x[kept])
    assert torch.equal(Dropout(0.5, "theano").eval()(x), x * 0.5)
    assert torch.equal(Dropout(0.5, "inverted").eval()(x), x)


def test_styles_compute_the_same_function_with_rescaled_weights():
    """theano-style net == inverted-style net whose fc7/fc8 weights carry the (1-p) factor."""
    torch.manual_seed(0)
    a = build_model("caffenet", 10, 0.125, 0.5, 67, "torch", dropout_style="theano")
    b = build_model("caffenet", 10, 0.125, 0.5, 67, "torch", dropout_style="inverted")
    state = a.state_dict()
    for key in ("classifier.fc7.weight", "classifier.fc8.weight"):
        state[key] = state[key] * 0.5
    b.load_state_dict(state)
    x = torch.randn(4, 3, 67, 67)
    torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=1e-5, atol=1e-6)
    torch.manual_seed(1)
    ya = a.train()(x)
    torch.manual_seed(1)
    yb = b.train()(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)


def test_bad_style_is_refused():
    with pytest.raises(ValueError, match="dropout style"):
        Dropout(0.5, "scaled")
