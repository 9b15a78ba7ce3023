"""Model parallelism, one process per device: Krizhevsky 2012's two columns and 2014's sharded fc layers.

A model group of M processes holds one model between them. Every sharded layer is cut by output units
(rows of its weight): process m holds rows [m n/M, (m+1) n/M) of the single-device layer, under the
same state-dict key. The local module is built by slicing the single-device model, so a sharded run
starts from the very weights the single-device run with the same seed starts from, and checkpoints
are assembled back into the ordinary single-device state dict.

``columns`` (M = 2; alexnet, caffenet, alexnet_bn): every conv and fc layer is split; conv2, conv4 and
conv5 are the single-device model's grouped convolutions, so each column reads only its own channels;
conv3 and the fc layers read both columns (the cross-connections: a gather along channels or features).
Both columns see the whole image. LRN's 5-channel window crosses the column boundary in the
single-device model, so each column first receives its neighbour's 2 edge channels: the columns
compute exactly the single-device function (not the per-column LRN of the 2012 GPUs). alexnet_bn's
batch norm is per channel and always reads one column's own channels (conv1/2/3/4's outputs), so it is
split by channel too: each column holds its channels' running statistics (sharded buffers), and since
both columns see the same images its batch statistics are exactly the single-device ones.

``fc`` (any M dividing the fc widths and the class count; every arch): the conv layers are
replicated and run data parallel inside the model group, each process on its own images; their
features are gathered along the batch, and fc6..fc8 are sharded, each process computing its output
units for the images of all M processes. Gradients flow back to each process's own images. alexnet_bn's
batch norm (in the convs) thus normalises each process's own images with their own statistics: fc is
not the single-device function there, and the running statistics are averaged over the model group
before validation and checkpoints (``exchange.average_statistics``).

Gradients: a process's loss is its rows' share of the model group's mean loss (1/M of its own mean),
so that the sums the collectives' backward passes form are the model group's gradients; replicated
parameters are summed over the model group (``sync_model_group``). Across the R data-parallel groups
the processes holding the same shard average, exactly as data-parallel replicas do.

Dropout: each element is masked once, by the process that owns it (a shard's own output units; the
owt input dropout on each process's own images, before the gather), from that process's own RNG. The
masks follow the same distribution as in the unsharded run, but are other draws.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from layers import LRN, Comm, all_reduce_sum, gather, gather_counts, lrn_with_halo

from .models import build_model

MODES = ("columns", "fc")
COLUMN_ARCHS = ("alexnet", "caffenet", "alexnet_bn")
# A batch norm's per-channel buffers; its num_batches_tracked is one count, the same in every column.
_CHANNEL_BUFFERS = ("running_mean", "running_var")
_COUNTS = ("num_batches_tracked",)


def sharding_problem(mode: str, arch: str, model_size: int, full: nn.Module) -> str | None:
    """Why `full` cannot be split `model_size` ways in `mode` (None if it can)."""
    if mode == "columns" and (model_size != 2 or arch not in COLUMN_ARCHS):
        return (f"parallel.model=columns is Krizhevsky 2012's two-column split of alexnet/caffenet: it needs "
                f"parallel.model_size=2 and model.arch alexnet or caffenet (or alexnet_bn, the same columns "
                f"with batch norm) (got {model_size}, {arch})")
    layers = [m for m in full.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if mode == "fc":
        layers = [m for m in layers if isinstance(m, nn.Linear)]
    for layer in layers:
        n = layer.weight.shape[0]
        if n % model_size:
            what = "classes" if layer is layers[-1] else "units"
            return (f"parallel.model_size={model_size} does not divide a layer of {n} {what} "
                    f"({type(layer).__name__} {tuple(layer.weight.shape)}); choose a model_size that divides it")
    return None


def _rows(layer: nn.Module, m: int, parts: int) -> nn.Module:
    """A copy of a Conv2d/Linear holding output units [m n/parts, (m+1) n/parts) only."""
    n = layer.weight.shape[0] // parts
    local = copy.deepcopy(layer)
    with torch.no_grad():
        local.weight = nn.Parameter(layer.weight[m * n:(m + 1) * n].clone())
        if layer.bias is not None:
            local.bias = nn.Parameter(layer.bias[m * n:(m + 1) * n].clone())
    if isinstance(local, nn.Linear):
        local.out_features = n
    else:
        local.out_channels = n
        if local.groups > 1:  # a grouped conv's column reads its own channels only: one group here
            local.in_channels //= local.groups
            local.groups = 1
    return local


def _channels_of(bn: nn.BatchNorm2d, m: int, parts: int) -> nn.BatchNorm2d:
    """A copy of a batch norm holding channels [m n/parts, (m+1) n/parts) only (statistics and affine)."""
    n = bn.num_features // parts
    local = copy.deepcopy(bn)
    local.num_features = n
    with torch.no_grad():
        for key in ("weight", "bias"):
            if getattr(bn, key, None) is not None:
                setattr(local, key, nn.Parameter(getattr(bn, key)[m * n:(m + 1) * n].clone()))
        for key in _CHANNEL_BUFFERS:
            if getattr(bn, key, None) is not None:
                setattr(local, key, getattr(bn, key)[m * n:(m + 1) * n].clone())  # a registered buffer stays one
    return local


def _sliced(part: nn.Module) -> list[str]:
    """The names of a split layer's tensors that hold one slice per member: all but a batch count."""
    return [k for k, _ in (*part.named_parameters(), *part.named_buffers()) if k not in _COUNTS]


class ShardedNet(nn.Module):
    """One process's part of a model-parallel network (see the module docstring)."""

    def __init__(self, full: nn.Module, mode: str, comm: Comm):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"model parallelism must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.comm = mode, comm
        m, parts = comm.rank, comm.size
        self.sharded_keys: set[str] = set()
        split = (nn.Conv2d, nn.Linear, nn.BatchNorm2d) if mode == "columns" else (nn.Linear,)
        local = copy.deepcopy(full)
        for name, module in list(local.named_modules()):
            if isinstance(module, split):
                parent, _, leaf = name.rpartition(".")
                part = _channels_of(module, m, parts) if isinstance(module, nn.BatchNorm2d) else _rows(module, m, parts)
                setattr(local.get_submodule(parent), leaf, part)
                self.sharded_keys.update(f"{name}.{key}" for key in _sliced(part))
        self.features = local.features
        self.avgpool = getattr(local, "avgpool", None)
        self.classifier = local.classifier

    # -- forward ---------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this process's loss rows: its own images (fc), or the model group's (columns)."""
        if self.mode == "columns":
            h = torch.flatten(gather(self._column_features(x), self.comm, 1), 1)  # fc6 reads both columns
            return self._classifier(h, counts=None, gather_rows=False)
        h = self.features(x)
        if self.avgpool is not None:
            h = self.avgpool(h)
        # Training batches are equal; validation's last ones may not be (nor non-empty).
        counts = None if self.training else gather_counts(x.shape[0], self.comm, x.device)
        return self._classifier(torch.flatten(h, 1), counts, gather_rows=True)

    def _column_features(self, x: torch.Tensor) -> torch.Tensor:
        split = False  # whether the current activations are this column's channels only
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                if split and layer.in_channels != x.shape[1]:  # conv3: reads both columns
                    x = gather(x, self.comm, 1)
                x, split = layer(x), True
            elif isinstance(layer, LRN):
                x = self._lrn(layer, x)
            else:
                x = layer(x)
        return x

    def _lrn(self, lrn: LRN, x: torch.Tensor) -> torch.Tensor:
        """LRN across both columns' channels: the neighbours' edge channels first (a small gather)."""
        h, m, parts = lrn.size // 2, self.comm.rank, self.comm.size
        edges = gather(torch.cat([x[:, :h], x[:, -h:]], 1), self.comm, 1)  # per member: first h, last h
        zeros = x.new_zeros((x.shape[0], h, *x.shape[2:]))
        left = edges[:, 2 * h * (m - 1) + h:2 * h * m] if m > 0 else zeros
        right = edges[:, 2 * h * (m + 1):2 * h * (m + 1) + h] if m < parts - 1 else zeros
        return lrn_with_halo(x, left, right, lrn)

    def _classifier(self, h: torch.Tensor, counts: tuple[int, ...] | None, gather_rows: bool) -> torch.Tensor:
        """The sharded fc layers: fc6 reads every member's rows (fc) or the full features (columns);
        each later one reads the previous one's units gathered from every member."""
        first = True
        for layer in self.classifier:
            if isinstance(layer, nn.Linear):
                if not first:
                    h = gather(h, self.comm, 1)
                elif gather_rows:
                    h = gather(h, self.comm, 0, counts)
                first = False
            h = layer(h)
        logits = gather(h, self.comm, 1)
        if self.mode == "columns":
            return logits
        n = logits.shape[0] // self.comm.size if counts is None else counts[self.comm.rank]
        start = n * self.comm.rank if counts is None else sum(counts[:self.comm.rank])
        return logits[start:start + n]

    # -- parameters ---------------------------------------------------------------------------------------

    def replicated_parameters(self) -> list[nn.Parameter]:
        return [p for k, p in self.named_parameters() if k not in self.sharded_keys]

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [p for k, p in self.named_parameters() if k in self.sharded_keys]

    def replicated_buffers(self) -> list[torch.Tensor]:
        """fc: the convs' batch-norm running statistics, which each process updates from its own images."""
        return [b for k, b in self.named_buffers() if k not in self.sharded_keys and b.is_floating_point()]

    def local_shard(self, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This process's part of a single-device state dict (or velocity dict) keyed like ours."""
        m, parts = self.comm.rank, self.comm.size
        out = {}
        for key, value in full_state.items():
            if key in self.sharded_keys:
                n = value.shape[0] // parts
                value = value[m * n:(m + 1) * n]
            out[key] = value
        return out

    def assemble(self, pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The single-device dict from every member's local dict, in member order."""
        return {key: torch.cat([p[key] for p in pieces]) if key in self.sharded_keys else value
                for key, value in pieces[0].items()}

    def sync_model_group(self) -> None:
        """Sum the replicated parameters' gradients over the model group (each saw its own images)."""
        params = [p for p in self.replicated_parameters() if p.grad is not None]
        if params and self.comm.size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            all_reduce_sum(flat, self.comm)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()


def build_sharded(arch: str, num_classes: int, width: float, dropout: float, crop: int, init: str,
                  dropout_style: str, mode: str, comm: Comm, lrn: str = "paper") -> ShardedNet:
    """This process's part of the single-device model `build_model(...)` would give (same RNG use)."""
    full = build_model(arch, num_classes, width, dropout, crop, init, dropout_style, lrn)
    problem = sharding_problem(mode, arch, comm.size, full)
    if problem:
        raise ValueError(problem)
    return ShardedNet(full, mode, comm)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
