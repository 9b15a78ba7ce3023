"""Data parallelism end to end on CPU: 2 replicas (gloo and ipc) against 1, slices, resume, faults, torchrun."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from alexnet.checkpoint import compare_checkpoints, load
from alexnet.metrics import read_metrics
from data.procs import child_pids
from tests.conftest import REPO, run_script, tiny_overrides

# Randomness off and no dropout: then N replicas of batch b must follow 1 replica of batch N*b.
DETERMINISTIC = {"data.shuffle": False, "data.random_crop": False, "data.flip": False, "model.dropout": 0.0,
                 "data.loading": "inline", "train.epochs": 2, "train.log_every": 1}


def train(train_data, run, **extra) -> subprocess.CompletedProcess:
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{**DETERMINISTIC, **extra}),
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rel_diff(a, b) -> float:
    """max over the tensors of the two runs' last checkpoints of ||a - b|| / ||b||."""
    c = compare_checkpoints(a / "checkpoints" / "last.pt", b / "checkpoints" / "last.pt")
    return max(c["weights"], c["velocities"])


@pytest.fixture(scope="module")
def one_replica(train_data, tmp_path_factory):
    """The reference: 1 replica, batch 16, 2 epochs of 3 steps."""
    run = tmp_path_factory.mktemp("one")
    train(train_data, run, **{"train.batch_size": 16})
    return run


@pytest.mark.parametrize("exchange, transport, momentum", [
    ("gradients", "gloo", 0.9),
    ("weights", "ipc", 0.9),
    ("weights", "gloo", 0.9),
    ("weights", "ipc", 0.0),
])
def test_two_replicas_equal_one_with_twice_the_batch(train_data, tmp_path, one_replica, exchange, transport,
                                                      momentum):
    ref = one_replica
    if momentum == 0.0:
        ref = tmp_path / "one_plain"
        train(train_data, ref, **{"train.batch_size": 16, "train.momentum": 0.0})
    run = tmp_path / "two"
    r = train(train_data, run, **{"train.batch_size": 8, "parallel.replicas": 2, "parallel.exchange": exchange,
                                  "parallel.transport": transport, "train.momentum": momentum})
    assert f"exchange {exchange} via {transport}" in r.stdout
    assert rel_diff(run, ref) <= 1e-5
    a, b = read_metrics(run / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [x["split"] for x in a] == [x["split"] for x in b]
    for x, y in zip(a, b):  # metrics reduced over replicas: the same counts as one replica
        assert x["iter"] == y["iter"] and abs(x["loss"] - y["loss"]) < 1e-4 and x.get("n") == y.get("n")


def test_weights_mode_plain_sgd_equals_gradients_mode(train_data, tmp_path):
    grads, weights = tmp_path / "g", tmp_path / "w"
    common = {"train.batch_size": 8, "parallel.replicas": 2, "train.momentum": 0.0}
    train(train_data, grads, **common, **{"parallel.exchange": "gradients"})
    train(train_data, weights, **common, **{"parallel.exchange": "weights", "parallel.transport": "ipc"})
    assert rel_diff(weights, grads) <= 1e-5


@pytest.mark.parametrize("replicas", [1, 2])
def test_slices_equal_one_pass(train_data, tmp_path, one_replica, replicas):
    run = tmp_path / "sliced"
    train(train_data, run, **{"train.batch_size": 16 // replicas, "train.slices": 2, "parallel.replicas": replicas,
                              "parallel.exchange": "gradients"})
    assert rel_diff(run, one_replica) <= 1e-5


def test_checkpoint_resumes_into_one_replica_and_back(train_data, tmp_path):
    """2 replicas for an epoch, 1 replica (same global batch) for the next, 2 again: as 3 epochs of 2."""
    straight, hopped = tmp_path / "straight", tmp_path / "hopped"
    two = {"train.batch_size": 8, "parallel.replicas": 2, "parallel.exchange": "gradients"}
    train(train_data, straight, **two, **{"train.epochs": 3})
    train(train_data, hopped, **two, **{"train.epochs": 1})
    r = train(train_data, hopped, **{"train.batch_size": 16, "train.epochs": 2})
    assert "resumed from" in r.stdout
    r = train(train_data, hopped, **two, **{"train.epochs": 3})
    assert "resumed from" in r.stdout
    assert rel_diff(hopped, straight) <= 1e-5
    assert load(hopped / "checkpoints" / "last.pt")["epoch"] == 3


def test_mid_epoch_checkpoint_with_another_global_batch_is_refused(train_data, tmp_path):
    run = tmp_path / "run"
    train(train_data, run, **{"train.batch_size": 8, "train.max_steps": 1})
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **{
        **DETERMINISTIC, "train.batch_size": 16}), timeout=300)
    assert r.returncode == 2 and "not a multiple of the global batch 16" in r.stderr


def _launch(train_data, run, **extra) -> subprocess.Popen:
    over = tiny_overrides(train_data, run, **{"train.epochs": 100, "parallel.replicas": 2, "data.loading": "process",
                                               **extra})
    return subprocess.Popen([sys.executable, "train.py", "configs/demo.yaml", *over], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _replicas_training(proc, run, timeout=90) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        reps = child_pids(proc.pid)
        if len(reps) == 2 and (run / "metrics.jsonl").exists() and all(child_pids(p) for p in reps):
            return reps
        time.sleep(0.1)
    raise AssertionError("replicas did not start")


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
    (parallel.timeout=10 s), exit 1, rank 1 named, no process left, the last checkpoint loadable."""
    proc = _launch(train_data, run, **{"parallel.timeout": 10, **extra})
    reps = _replicas_training(proc, run)
    everything = _tree(reps)
    victim = next(p for p in reps if _rank_of(p) == 1)
    os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1, err[-2000:]
    assert took < (10 if fault == "kill" else 10 + 40), took
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


def test_torchrun_single_node_two_processes(train_data, tmp_path):
    """The documented multi-node command, on one machine: torchrun --nnodes=1 --nproc-per-node=2 (gloo)."""
    own, tr = tmp_path / "own", tmp_path / "torchrun"
    common = {**DETERMINISTIC, "train.batch_size": 8, "parallel.exchange": "gradients"}
    train(train_data, own, **common, **{"parallel.replicas": 2})
    over = tiny_overrides(train_data, tr, **common)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                        "--master-port", str(_port()), "train.py", "configs/demo.yaml", *over], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert rel_diff(tr, own) <= 1e-5  # the same run; thread counts may differ, so not always bitwise
    a, b = read_metrics(tr / "metrics.jsonl"), read_metrics(own / "metrics.jsonl")
    assert len(a) == len(b) and all(abs(x["loss"] - y["loss"]) < 1e-4 for x, y in zip(a, b))


def test_torchrun_two_nodes_on_one_machine(train_data, tmp_path):
    """Two torchrun agents, each standing for one node (--nnodes=2, --nproc-per-node=1), meet through a
    c10d rendezvous on 127.0.0.1 and train as one job over gloo: the same run as the local launcher."""
    own, tr = tmp_path / "own", tmp_path / "two_nodes"
    common = {**DETERMINISTIC, "train.batch_size": 8, "parallel.exchange": "gradients"}
    train(train_data, own, **common, **{"parallel.replicas": 2})
    port, over = _port(), tiny_overrides(train_data, tr, **common)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                "--rdzv-id=alexnet-test", "train.py", "configs/demo.yaml", *over],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in (0, 1)]
    outs = [a.communicate(timeout=300) for a in agents]
    for agent, (_, err) in zip(agents, outs):
        assert agent.returncode == 0, err[-3000:]
    assert "2 replica(s)" in outs[0][0] + outs[1][0]
    assert rel_diff(tr, own) <= 1e-5
    a, b = read_metrics(tr / "metrics.jsonl"), read_metrics(own / "metrics.jsonl")
    assert len(a) == len(b) and all(abs(x["loss"] - y["loss"]) < 1e-4 for x, y in zip(a, b))


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
