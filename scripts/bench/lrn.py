"""lrn: the LRN layer's forward + backward at the input shapes the model gives it, and a whole training
step, with torch's own `F.local_response_norm` (an avg_pool3d window sum differentiated by autograd) and
with layers.LRN (shifted slices, exp/log power, closed-form backward), side by side: ms and speedup.
"""
from __future__ import annotations

import contextlib

from data.domains import COUNT

from .common import add_model_args, add_timing_args, default_crop, device_name, subcommand, timed_steps
from .workload import constant_batch_step


def add_parser(sub):
    p = subcommand(sub, "lrn", "LRN forward+backward and a training step: torch's op against layers.LRN", run)
    add_model_args(p, crop=True)
    p.add_argument("--batch-size", type=COUNT, default=128)
    add_timing_args(p, steps=10, warmup=2)
    return p


@contextlib.contextmanager
def torchs_lrn():
    """Every layers.LRN computes with torch's F.local_response_norm while this is open."""
    import torch.nn.functional as F

    from layers import LRN
    own = LRN.forward
    LRN.forward = lambda m, x: F.local_response_norm(x, m.size, alpha=m.coeff * m.size, beta=m.beta, k=m.k)
    try:
        yield
    finally:
        LRN.forward = own


def lrn_inputs(arch: str, width: float, crop: int, batch: int, device) -> list[tuple]:
    """(LRN module, its input) for each LRN of the model, from one forward pass of a random batch; [] for a
    model without LRN (no pass then)."""
    import torch

    from alexnet.models import build_model
    from layers import LRN
    model = build_model(arch, 1000, width, 0.5, crop).to(device)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].detach().clone())))
             for m in model.modules() if isinstance(m, LRN)]
    if not hooks:
        return []
    with torch.no_grad():
        model(torch.randn(batch, 3, crop, crop, device=device))
    for h in hooks:
        h.remove()
    return seen


def run(args) -> dict:
    from alexnet.distributed import pick_device
    device = pick_device(args.device)
    crop = default_crop(args.arch, args.crop)
    inputs = lrn_inputs(args.arch, args.width, crop, args.batch_size, device)
    if not inputs:
        raise SystemExit(f"benchmark.py lrn: error: --arch {args.arch} has no LRN")
    rows = []

    def row(what: str, shape: str, make) -> None:
        times = {}
        for name, ctx in (("torch", torchs_lrn), ("layers", contextlib.nullcontext)):
            with ctx():
                step = make()
                times[name] = timed_steps(step, args.steps, device, args.repeat, args.warmup) / args.steps
        rows.append({"what": what, "shape": shape, "torch_ms": round(times["torch"] * 1e3, 3),
                     "layers_ms": round(times["layers"] * 1e3, 3),
                     "speedup": round(times["torch"] / times["layers"], 2)})

    for i, (module, x) in enumerate(inputs, 1):
        def forward_backward(module=module, x=x):
            leaf = x.requires_grad_(True)
            return lambda: module(leaf).sum().backward()
        row(f"lrn{i} forward+backward", "x".join(map(str, x.shape)), forward_backward)
    row("training step", f"{args.batch_size}x3x{crop}x{crop}",
        lambda: constant_batch_step(args.arch, args.width, crop, args.batch_size, "fp32", False, device))
    return {"benchmark": "lrn", "device": device_name(device), "arch": args.arch, "width": args.width,
            "crop": crop, "batch_size": args.batch_size, "rows": rows}
