"""The base of this repository's optimizers: torch's Optimizer, without its first-call import of dynamo.

torch wraps Optimizer.add_param_group, zero_grad, state_dict and load_state_dict in
``torch._disable_dynamo``, which imports torch._dynamo the first time one of them runs: about a second of
CPU in every process that builds an optimizer (measured: 1.08 s on the 2-core VM, torch 2.13), paid by
every replica at start-up. Nothing here calls them under torch.compile (train.compile compiles the
model's forward only), so the unwrapped functions are used; a torch without the wrapper has nothing to
unwrap.
"""
from __future__ import annotations

import torch


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)


class Optimizer(torch.optim.Optimizer):
    add_param_group = _unwrapped(torch.optim.Optimizer.add_param_group)
    zero_grad = _unwrapped(torch.optim.Optimizer.zero_grad)
    state_dict = _unwrapped(torch.optim.Optimizer.state_dict)
    load_state_dict = _unwrapped(torch.optim.Optimizer.load_state_dict)
