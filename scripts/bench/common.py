"""What the benchmarks share: timing with warm-up, worker processes, arguments, tables and JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from data.domains import COUNT, DEVICE, NON_NEGATIVE, POSITIVE

REPO = Path(__file__).resolve().parents[2]
ARCHS = ("alexnet", "caffenet", "owt")


# -- arguments ------------------------------------------------------------------------------------------

def subcommand(sub, name: str, summary: str, run: Callable[[argparse.Namespace], dict],
               tables: Sequence[tuple[str, str]] = ()) -> argparse.ArgumentParser:
    """The parser of one benchmark; `run(args)` returns its result, whose `rows` are its table and whose
    keys named in `tables` (key, title) are tables printed after it."""
    p = sub.add_parser(name, help=summary)
    p.set_defaults(run=run, tables=tuple(tables))
    return p


def add_model_args(p: argparse.ArgumentParser, crop: bool = False) -> None:
    """--arch and --width (and --crop) of the model a benchmark builds."""
    p.add_argument("--arch", default="alexnet", choices=ARCHS)
    p.add_argument("--width", type=POSITIVE, default=1.0)
    if crop:
        p.add_argument("--crop", type=NON_NEGATIVE, default=0, help="default: 227 (224 for owt)")


def add_timing_args(p: argparse.ArgumentParser, steps: int = 20, warmup: int = 5, repeat: int = 3) -> None:
    """--device, and --steps timed --repeat times after --warmup steps."""
    p.add_argument("--device", type=DEVICE, default="auto")
    p.add_argument("--steps", type=COUNT, default=steps, help="timed steps per repeat")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=warmup)
    p.add_argument("--repeat", type=COUNT, default=repeat)


def default_crop(arch: str, crop: int = 0) -> int:
    """`crop`, or the arch's own: 224 for owt (torchvision's), 227 for the paper's models."""
    return crop or (224 if arch == "owt" else 227)


# -- timing ---------------------------------------------------------------------------------------------

def timed_steps(step: Callable[[], object], steps: int, device, repeat: int, warmup: int = 0,
                barrier: Callable[[], object] | None = None) -> float:
    """Median seconds for `steps` calls of step(), device work included, after `warmup` calls.

    `barrier` (several processes) starts every timed run together, after the device is idle.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        _synchronize(device)
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    """The GPU's name, or the CPU's cores and torch version."""
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({len(os.sched_getaffinity(0))} cores, torch {torch.__version__})"


def cpu_name() -> str:
    """The CPU's model name and the cores this process may use."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "cpu") if Path("/proc/cpuinfo").exists() else "cpu"
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


# -- worker processes -----------------------------------------------------------------------------------

def _worker_main(worker: Callable, *args) -> None:
    """A worker's entry: it ends with the benchmark, even one killed by SIGKILL (it would go on with its timed
    steps, or wait in the rendezvous, for nobody)."""
    from data.procs import die_with_parent
    die_with_parent()
    worker(*args)


def run_workers(worker: Callable, world: int, *args) -> object:
    """Run worker(rank, world, port, *args, out) in `world` spawned processes; return the JSON that one
    of them wrote to the file `out`. Stopped (a signal, Ctrl-C) or on a worker's failure, the others are
    killed before the temporary folder goes; they are daemons, so one caught half-started by a stop is
    ended by multiprocessing at exit instead of waited for (it would wait in the rendezvous forever)."""
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    from alexnet.cli import temporary_directory
    from alexnet.launch import free_port
    from data.procs import stops_between_calls
    with temporary_directory() as tmp:
        out, port, spawn = Path(tmp) / "result.json", free_port(), mp.get_context("spawn")
        procs = [spawn.Process(target=_worker_main, args=(worker, rank, world, port, *args, str(out)),
                               daemon=True)
                 for rank in range(world)]
        try:
            with stops_between_calls():  # a stop landing in a start cut the bootstrap a worker reads (EOFError)
                for proc in procs:
                    proc.start()
            running = list(procs)
            while running:  # the first to fail ends the run: the others would wait for it in a collective
                ended = wait([proc.sentinel for proc in running])
                for proc in [p for p in running if p.sentinel in ended]:
                    proc.join()
                    running.remove(proc)
                    if proc.exitcode != 0:
                        raise RuntimeError(f"benchmark worker {procs.index(proc)} of {world} exited with code "
                                           f"{proc.exitcode} (its traceback is above)")
        except BaseException:
            for proc in procs:
                if proc.pid is not None and proc.is_alive():
                    proc.kill()
            for proc in procs:
                if proc.pid is not None:
                    proc.join()
            raise
        return json.loads(out.read_text())


def join_as(rank: int, world: int, port: int) -> None:
    """Set the environment torch.distributed starts from (what torchrun would set), for a worker."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


# -- the report -----------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    """Right-aligned columns: every key of the rows, in order of appearance; missing cells empty."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line([r.get(c, "") for c in cols])
                                                                      for r in rows])


def report(result: dict, tables: Sequence[tuple[str, str]], json_path: str | None) -> None:
    """Print the result's rows, then its other tables and its figures; write it all to `json_path`."""
    print(table(result["rows"]))
    for key, title in tables:
        if key in result:
            rows = result[key]["rows"] if isinstance(result[key], dict) else result[key]
            print(f"\n{title}:")
            print(table(rows))
    print({k: v for k, v in result.items() if k != "rows" and k not in dict(tables)})
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
