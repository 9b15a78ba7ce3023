"""Data parallelism end to end on CPU, what only real processes show: faults, torchrun on one and two nodes
against the launcher's computation, the launcher's rate. The layouts' math and the trainer's use of it run
on the rank simulator (tests/test_parallel_runs.py); train.py's launcher with 2 replicas in both exchanges
against 1 replica, in the gpu-check CPU twin (tests/test_gpu_check.py)."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from alexnet.checkpoint import compare_checkpoints, load
from alexnet.metrics import read_metrics, without_wall_clock
from data.procs import child_pids
from tests import children
from tests.conftest import REPO, run_script, signal_handlers_kept, tiny_overrides
from tests.documented import documented, runnable, with_overrides
from train import main as train_main

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

# Randomness off and no dropout: then N replicas of batch b must follow 1 replica of batch N*b.
DETERMINISTIC = {"data.shuffle": False, "data.random_crop": False, "data.flip": False, "model.dropout": 0.0,
                 "data.loading": "inline", "train.epochs": 2, "train.log_every": 1}


def train(train_data, run, cpu_s: float = 300, **extra) -> subprocess.CompletedProcess:
    """train.py with DETERMINISTIC and `extra`; a run of one process runs here (its torch start-up, ~2 s of
    CPU, is already paid), the others as a process tree (returning its output either way)."""
    args = ["configs/demo.yaml", *tiny_overrides(train_data, run, **{**DETERMINISTIC, **extra})]
    if extra.get("parallel.replicas", 1) == 1 and extra.get("parallel.model_size", 1) == 1:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), signal_handlers_kept():
            assert train_main(args) == 0
        return subprocess.CompletedProcess(args, 0, out.getvalue(), "")
    r = run_script("train.py", *args, cpu_s=cpu_s)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rel_diff(a, b) -> float:
    """max over the tensors of the two runs' last checkpoints of ||a - b|| / ||b||."""
    c = compare_checkpoints(a / "checkpoints" / "last.pt", b / "checkpoints" / "last.pt")
    return max(c["weights"], c["velocities"])


TWO = {"train.batch_size": 8, "parallel.replicas": 2}


@pytest.fixture(scope="module")
def launcher_math(train_data, tmp_path_factory) -> Path:
    """What train.py's launcher computes for 2 replicas of 8, gradients exchange: on the rank simulator
    (the launcher itself, 2 replicas against 1 with twice the batch in both exchanges, is the gpu-check CPU
    twin's replicas-ipc and replicas-gloo-gradients steps: tests/test_gpu_check.py)."""
    from tests.test_parallel_runs import sim_train
    run = tmp_path_factory.mktemp("launcher_math")
    sim_train(train_data, run, **TWO_GRADIENTS)
    return run


def test_mid_epoch_checkpoint_with_another_global_batch_is_refused(train_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(train_data, run, **{"train.batch_size": 8, "train.max_steps": 1})
    # the refusal comes before any training: train.py's main in this process
    assert train_main(["configs/demo.yaml", *tiny_overrides(train_data, run, **{
        **DETERMINISTIC, "train.batch_size": 16})]) == 2
    assert "not a multiple of the global batch 16" in capsys.readouterr().err


def _launch(train_data, run, **extra) -> subprocess.Popen:
    """README's 2-replica command, long (100 epochs) and with a loader process per replica."""
    command = documented("python", "train.py", "configs/demo.yaml", "parallel.replicas=2")
    over = tiny_overrides(train_data, run, **{"train.epochs": 100, "data.loading": "process", **extra})
    return subprocess.Popen(runnable(with_overrides(command, over)), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _replicas_training(proc, run) -> list[int]:
    def training() -> list[int]:
        reps = child_pids(proc.pid)
        return reps if len(reps) == 2 and (run / "metrics.jsonl").exists() and all(map(child_pids, reps)) else []
    return children.wait_until(training, proc, cpu_s=90, what="replicas did not start")


def _tree(pids: list[int]) -> list[int]:
    out = list(pids)
    for p in pids:
        out += _tree(child_pids(p))
    return out


def _all_gone(pids, timeout=20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0]
    except OSError:
        return "Z"


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def assert_fault_ends_the_run(train_data, run, fault: str, **extra) -> None:
    """Kill (SIGKILL) or hang (SIGSTOP) rank 1 of a 2-process run: it ends within the bound
    (parallel.timeout=6 s), exit 1, rank 1 named, no process left, the last checkpoint loadable."""
    proc = _launch(train_data, run, **{"parallel.timeout": 6, **extra})
    reps = _replicas_training(proc, run)
    everything = _tree(reps)
    victim = next(p for p in reps if _rank_of(p) == 1)
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    _, err = children.communicate(proc, cpu_s=120)
    took = time.monotonic() - start
    assert proc.returncode == 1, err[-2000:]
    assert took < (10 if fault == "kill" else 6 + 40), took
    if fault == "kill":
        assert "replica rank 1" in err and "signal 9" in err, err[-2000:]
    else:
        assert "replica rank 1 stopped making progress" in err, err[-2000:]
    assert _all_gone(everything), [p for p in everything if os.path.exists(f"/proc/{p}")]
    last = run / "checkpoints" / "last.pt"
    if last.exists():
        load(last)  # the last good checkpoint stays loadable


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_dead_or_hung_replica_stops_the_run(train_data, tmp_path, fault):
    assert_fault_ends_the_run(train_data, tmp_path / "run", fault)


def test_a_killed_launcher_takes_its_replicas_with_it_after_a_checkpoint(train_data, tmp_path):
    """kill -9 of train.py's launcher (timeout -s KILL, a batch scheduler, the out-of-memory killer): its
    replicas get SIGTERM from the kernel, checkpoint together and exit 143; no process is left, the run's lock
    is free, and the same command resumes from the checkpoint."""
    run = tmp_path / "run"
    proc = _launch(train_data, run, **{"train.epochs": 100_000})  # ends only if stopped
    reps = _replicas_training(proc, run)
    everything = _tree(reps)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    watch = children.Watch(reps, "the replicas of a killed launcher", cpu_s=60)
    while [p for p in everything if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]:
        watch.check()  # they checkpoint first: waited for while they make progress
        time.sleep(children.POLL_S)
    state = load(run / "checkpoints" / "last.pt")  # written by the stop the SIGTERM asked for
    assert state["epoch"] < 1000, state["epoch"]
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{
        "train.epochs": state["epoch"] + 1, "data.loading": "inline"}), cpu_s=120)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]


def test_a_launcher_killed_while_its_replicas_start_takes_them_with_it(train_data, tmp_path):
    """kill -9 of the launcher in the seconds its replicas spend importing, before they ask the kernel for a
    signal at its death: a replica then found its parent already gone and trained on, an orphan holding the
    run's lock. Each is told the launcher's pid, so it stops as it finds it gone."""
    run = tmp_path / "run"
    proc = _launch(train_data, run, **{"train.epochs": 100_000})
    def both_started() -> list[int]:
        reps = child_pids(proc.pid)
        return reps if len(reps) == 2 else []
    reps = children.wait_until(both_started, proc, cpu_s=30, what="replicas did not start")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    tree = _tree(reps)
    try:
        assert _all_gone(tree, timeout=children.GONE_S), [(p, children._cmdline(p)) for p in _tree(reps)]
    finally:
        for pid in tree + _tree(reps):  # what outlived it does not outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not (run / "metrics.jsonl").exists()  # they stopped before training


@pytest.fixture(scope="module")
def torchrun_single_node(train_data, tmp_path_factory) -> Path:
    """The documented multi-node command, on one machine: torchrun --nnodes=1 --nproc-per-node=2 (gloo)."""
    tr = tmp_path_factory.mktemp("torchrun")
    command = documented("torchrun", "--nnodes=1", "--nproc-per-node=2")
    over = tiny_overrides(train_data, tr, **DETERMINISTIC, **TORCHRUN)
    r = children.run(runnable(with_overrides(command, over), _port()), cwd=REPO, cpu_s=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return tr


def test_torchrun_single_node_two_processes(torchrun_single_node, launcher_math):
    own, tr = launcher_math, torchrun_single_node
    assert rel_diff(tr, own) == 0  # the same run, the same threads per process (launch.replica_threads)
    a, b = read_metrics(tr / "metrics.jsonl"), read_metrics(own / "metrics.jsonl")
    assert without_wall_clock(a) == without_wall_clock(b)


def test_torchrun_two_nodes_on_one_machine(train_data, tmp_path, launcher_math):
    """Two torchrun agents, each standing for one node (--nnodes=2, --nproc-per-node=1), meet through a
    c10d rendezvous on 127.0.0.1 and train as one job over gloo: the same run as the local launcher's."""
    own, tr = launcher_math, tmp_path / "two_nodes"
    command = documented("torchrun", "--nnodes=2", "--nproc-per-node=1")  # README's, "run in two terminals"
    argv = runnable(with_overrides(command, tiny_overrides(train_data, tr, **DETERMINISTIC, **TORCHRUN)), _port())
    agents = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in (0, 1)]
    outs = [children.communicate(a, cpu_s=300) for a in agents]
    for agent, (_, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
    assert "2 replica(s)" in outs[0][0] + outs[1][0]
    assert rel_diff(tr, own) <= 1e-5
    a, b = read_metrics(tr / "metrics.jsonl"), read_metrics(own / "metrics.jsonl")
    assert len(a) == len(b) and all(abs(x["loss"] - y["loss"]) < 1e-4 for x, y in zip(a, b))


# the local launcher's 2 replicas (gloo gradients), and what each torchrun process is given
TWO_GRADIENTS = {**TWO, "parallel.exchange": "gradients", "parallel.transport": "gloo", "train.momentum": 0.9}
TORCHRUN = {"train.batch_size": 8, "parallel.exchange": "gradients"}


def _port() -> int:
    from alexnet.launch import free_port
    return free_port()


def test_replicas_ignored_under_torchrun(train_data, tmp_path):
    """The same config on many hosts: under torchrun each process is one replica, whatever replicas says."""
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, tmp_path, **{
        "parallel.replicas": 3, "train.epochs": 1}), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "parallel.replicas=3 is ignored: the launcher started 1 processes" in r.stdout


def test_images_per_second_count_every_replicas_images(torchrun_single_node):
    """img_per_s is the global rate: each record's images (both replicas' 8) over its window. The window
    runs from the previous record to this one, so rate x the records' time difference is the global batch
    (a little more: the time between the two also holds the logging itself)."""
    import statistics
    run = torchrun_single_node
    train_records = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    seen = [b["img_per_s"] * (b["time"] - a["time"]) / 16 for a, b in zip(train_records, train_records[1:])
            if a["epoch"] == b["epoch"]]
    assert len(seen) >= 3 and 0.8 < statistics.median(seen) < 2.0, seen
