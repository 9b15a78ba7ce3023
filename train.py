#!/usr/bin/env python3
"""Train AlexNet: a YAML config in, a run directory out.

    python train.py configs/demo.yaml                        # CPU demo on generated data
    python train.py configs/alexnet_1gpu.yaml data.root=/data/imagenet256
    python train.py configs/alexnet_1gpu.yaml train.lr=0.02 run.dir=runs/lr02   # dotted overrides

The run directory (run.dir) receives config.yaml (the resolved config), metrics.jsonl, tb/ (TensorBoard,
if installed) and checkpoints/ (last.pt, best.pt, epoch_NNN.pt). Re-running the same command resumes
from checkpoints/last.pt, mid-epoch included. Ctrl-C (or SIGTERM) writes a checkpoint and stops.
Exit codes: 0 done, 1 failed (e.g. the loss became NaN), 2 bad config or data, 128+N stopped by signal N.
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from alexnet.config import Config, ConfigError, dump_yaml, load_config, summary
from alexnet.distributed import DistInfo, print0, setup
from alexnet.trainer import NonFiniteLoss, StopFlag, Trainer
from data.batchfile import atomic_write_bytes
from data.layouts import DataError
from data.slot_loader import LoaderError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Overrides: section.key=value, e.g. train.epochs=10 data.root=DIR")
    p.add_argument("config", help="YAML config (see configs/); states only what differs from the defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.02")
    return p.parse_args(argv)


def write_run_config(cfg: Config, dist: DistInfo) -> None:
    if dist.is_main:
        run = Path(cfg.run.dir)
        run.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run / "config.yaml", dump_yaml(cfg).encode())


def install_signal_handlers(stop: StopFlag) -> None:
    """First Ctrl-C/SIGTERM: checkpoint at the next step and stop; a second one: stop at once."""
    def handler(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.request(signum)
        print(f"\n{signal.Signals(signum).name}: stopping after this step (checkpoint first)", file=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    try:
        cfg = load_config(args.config, args.overrides)
        dist = setup(cfg.run.device)
        print0(dist, f"config {args.config} (differences from the paper defaults):\n{summary(cfg)}")
        write_run_config(cfg, dist)
        install_signal_handlers(stop)
        trainer = Trainer(cfg, dist, stop)
        result = trainer.fit()
    except (ConfigError, DataError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLoss, LoaderError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    if stop.requested:
        return 128 + stop.signum
    if result:
        print0(dist, f"done: val top-1 error {result['top1_err']:.4f}, top-5 error {result['top5_err']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
