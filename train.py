#!/usr/bin/env python3
"""Train AlexNet: a YAML config in, a run directory out.

    python train.py configs/demo.yaml                        # CPU demo on generated data
    python train.py configs/alexnet_1gpu.yaml data.root=/data/imagenet256
    python train.py configs/alexnet_1gpu.yaml train.lr=0.02 run.dir=runs/lr02   # dotted overrides
    python train.py configs/alexnet_2gpu.yaml                # 2 replicas on this host (train.py starts them)
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \
        train.py configs/alexnet_8gpu_goyal.yaml             # 2 hosts x 8 GPUs: one replica per process

The run directory (run.dir) receives config.yaml (the resolved config; a different earlier one is kept as
config.prev-N.yaml), metrics.jsonl, tb/ (TensorBoard, if installed), checkpoints/ (last.pt, best.pt,
epoch_NNN.pt) and .lock (held while a run uses the directory: a second run into it is refused).
Re-running the same command resumes from checkpoints/last.pt, mid-epoch included. Ctrl-C (or SIGTERM, or
SIGHUP: the terminal closed, ssh dropped; unless ignored, as under nohup) writes a checkpoint and stops. A
standard output that goes away (`| head`, a closed terminal) stops the output, not the training: one line
on stderr says so, and the run goes on to its end.
Exit codes: 0 done, 1 failed (e.g. the loss became NaN, disk full), 2 bad config, data or path (e.g. run.dir
read-only or in use by another run), 128+N stopped by signal N (130: Ctrl-C before training started).
"""
from __future__ import annotations

from alexnet import startup

startup.quiet_start(__name__, "train.py")  # first: a Ctrl-C while torch imports is one line, not a traceback

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from alexnet.checkpoint import CheckpointError  # noqa: E402
from alexnet.cli import protect_streams  # noqa: E402
from alexnet.config import Config, ConfigError, load_config, summary  # noqa: E402
from alexnet.distributed import DistInfo, StartError, print0, setup, teardown  # noqa: E402
from alexnet.launch import launch_local, report_gave_up  # noqa: E402
from alexnet.preflight import check_apart, check_run, describe_start  # noqa: E402
from alexnet.replica import MeshLayout  # noqa: E402
from alexnet.rundir import ENV_LOCK_FD, check_run_dir, hold, lock_holder_here  # noqa: E402
from alexnet.trainer import NonFiniteLoss, StopFlag, Trainer  # noqa: E402
from data.batchfile import BatchFileError  # noqa: E402
from data.domains import InputPath, OneLineParser, text  # noqa: E402
from data.fsutil import os_error_exit_code, os_error_message  # noqa: E402
from data.layouts import DataError  # noqa: E402
from data.procs import die_with_parent  # noqa: E402
from data.reader import epoch_steps  # noqa: E402
from data.slot_loader import LoaderError  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Overrides: section.key=value, e.g. train.epochs=10 data.root=DIR\n\n"
                                       "example: python train.py configs/alexnet_1gpu.yaml data.root=imagenet256")
    p.add_argument("config", type=InputPath("file"),
                   help="YAML config (see configs/); states only what differs from the defaults")
    p.add_argument("overrides", nargs="*", default=[], type=text("section.key=value"),
                   help="optional dotted overrides, e.g. train.lr=0.02")
    p.add_argument("--dry-run", action="store_true", help="check the config, the data and run.dir as a start "
                   "would, print what would run (processes, global batch, steps), then exit without writing")
    return p.parse_args(argv)


def dry_run(cfg: Config, world: int) -> int:
    """What a start checks (config, data, run.dir), and what it would run; nothing is written or locked."""
    check_run_dir(cfg.run.dir)
    meta = check_run(cfg, world, dry=True)
    layout = MeshLayout(cfg, DistInfo(world=world, model_size=cfg.parallel.model_size))
    t = cfg.train
    steps = epoch_steps(meta["splits"]["train"]["count"], layout.global_batch)  # the train reader's
    start = describe_start(cfg, meta, layout.global_batch, steps, lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"train.py: dry run: the config, the data ({cfg.data.root}) and run.dir ({cfg.run.dir}) are fine; "
          f"would start {world} process(es): {_layout_words(cfg)}; {cfg.model.arch} width {cfg.model.width:g}, "
          f"global batch {layout.global_batch} ({t.batch_size} {layout.batch_unit}), {steps} steps an epoch, "
          f"{t.epochs} epochs, optimizer {t.optimizer}{start}")
    return 0


def _layout_words(cfg: Config) -> str:
    """`R replica(s)`, with ` x M (mode model parallel)` for model groups: the start line's words."""
    p = cfg.parallel
    words = f"{p.replicas} replica(s)"
    return words + (f" x {p.model_size} ({p.model} model parallel)" if p.model_size > 1 else "")


def _says_for_the_run() -> bool:
    """Rank 0 (or a process of its own) speaks for the run: every rank got the same signal."""
    return os.environ.get("RANK", "0") == "0"


def install_signal_handlers(stop: StopFlag) -> None:
    """First Ctrl-C/SIGTERM/SIGHUP: checkpoint at the next step and stop; a second one: stop at once.
    SIGHUP ignored (nohup) stays ignored: such a run is meant to outlive its terminal."""
    startup.done()  # quiet_start's handlers give way

    def handler(signum, frame):
        if stop.requested:
            raise KeyboardInterrupt
        stop.request(signum)
        if _says_for_the_run():
            print(f"\n{signal.Signals(signum).name}: stopping after this step (checkpoint first)", file=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held():
    """Stop signals kept off the main thread while the group forms: one landing in the rendezvous' connect
    would fail it with EINTR, which c10d logs with a C++ stack before retrying (poll and connect are not
    restarted). The kernel hands such a signal to another thread (torch has some) or keeps it pending until
    the block ends; either way Python runs the handler in the main thread (a stop request at the first step).
    A mask, not data.procs.stops_between_calls: the point is the system call, not where the handler runs."""
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run_replica(cfg: Config, config_path: str) -> int:
    """Train as this process's replica (the only one, or one of WORLD_SIZE); returns the exit code."""
    stop, info = StopFlag(), None
    if "WORLD_SIZE" in os.environ:
        # Started by a launcher (ours or torchrun's agent): if it dies, even by SIGKILL, this replica gets
        # SIGTERM, which checkpoints with the other replicas and stops, instead of training on unwatched and
        # holding run.dir's lock. Before the handlers below exist, SIGTERM just ends it.
        die_with_parent(signal.SIGTERM)  # torchrun's agent (ours told its pid: protect_streams)
    # Before setup: a stop signal during the rendezvous is a request the ranks agree on at the first step
    # (checkpoint, exit 128 + N), not one rank leaving while the others wait for it in the group's start.
    install_signal_handlers(stop)
    try:
        with signals_held():
            info = setup(cfg)
        if cfg.parallel.replicas not in (1, info.replicas):
            print0(info, f"parallel.replicas={cfg.parallel.replicas} is ignored: the launcher started {info.world} "
                         f"processes, {info.replicas} replica(s) of {info.model_size}")
        print0(info, f"config {config_path} (differences from the paper defaults):\n{summary(cfg)}")
        result = Trainer(cfg, info, stop).fit()
        startup.ignore_stops()  # the outcome is decided: a late Ctrl-C must not break the teardown
    except (ConfigError, DataError, BatchFileError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except StartError as e:  # could not join the other processes: a peer died or never came
        report_gave_up(int(os.environ.get("RANK", 0)))
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    except (NonFiniteLoss, LoaderError, CheckpointError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return os_error_exit_code(e.__cause__) if isinstance(e.__cause__, OSError) else 1
    except RuntimeError as e:  # a collective failed: a peer died or hung past parallel.timeout
        if info is None or not info.distributed:
            raise
        report_gave_up(info.rank)
        print(f"train.py: replica rank {info.rank}: {e}", file=sys.stderr)
        return 1
    teardown(info, cfg.parallel.timeout)
    if stop.requested:
        return 128 + stop.signum
    if result:
        print0(info, f"done: val top-1 error {result['top1_err']:.4f}, top-5 error {result['top5_err']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check, lock run.dir, then train here or launch the replicas; returns the exit code."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        local = cfg.parallel.replicas * cfg.parallel.model_size if "WORLD_SIZE" not in os.environ else 1
        check_apart(cfg)  # before run.dir's lock makes the folder; a dry run says it too
        if args.dry_run:
            return dry_run(cfg, int(os.environ.get("WORLD_SIZE", local)))
        with hold(cfg.run.dir) if lock_holder_here() else contextlib.nullcontext() as lock_fd:
            if ENV_LOCK_FD not in os.environ:  # not a replica of our launcher, which checked already
                check_run(cfg, int(os.environ.get("WORLD_SIZE", local)))
            if local > 1:
                return launch(cfg, args, local, lock_fd)
            return run_replica(cfg, args.config)
    except (ConfigError, DataError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the operating system refused: read-only or full run.dir, ...
        print(f"train.py: error: {os_error_message(e)}", file=sys.stderr)
        return os_error_exit_code(e)
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C: no checkpoint
        if _says_for_the_run():
            print("train.py: interrupted; stopped without writing a checkpoint", file=sys.stderr)
        return 128 + signal.SIGINT


def launch(cfg: Config, args: argparse.Namespace, processes: int, lock_fd: int) -> int:
    """Start the processes of this host; they inherit run.dir's lock."""
    print(f"train.py: starting {processes} processes on this host: {_layout_words(cfg)}", flush=True)
    return launch_local(__file__, [args.config, *args.overrides], processes, cfg.parallel.timeout, lock_fd)


def exit_process(code: int) -> None:
    """Exit; a replica of a distributed run skips the interpreter's teardown.

    After a clean finish (process group destroyed, checkpoints fsynced, files closed), letting the
    interpreter tear down the C++ side of torch.distributed occasionally aborted a replica at exit
    ("terminate called without an active exception"), turning a finished run into a reported failure.
    """
    if "WORLD_SIZE" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    # keep_start_handlers: until training installs its handlers (or the launcher its forwarding), a stop
    # signal still ends the start-up in one line; nothing is written before then.
    protect_streams("train.py", "standard output is gone (closed, or its reader went away): the output stops "
                                "there, the training goes on", keep_start_handlers=True)
    exit_process(main())
