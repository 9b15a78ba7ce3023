"""Elastic restarts under torchrun: workers SIGKILLed at planted points (tests/kill_points.py), restarted by
torchrun, and resumed from the last checkpoint, end equal to an uninterrupted run.

Every attempt of a job shares torchrun's rendezvous store, so a restart must not read what a killed
attempt left there (alexnet/distributed.py attempt_store): before it did, a restart failed or hung in
about two of three tries.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from alexnet.checkpoint import compare_checkpoints
from alexnet.launch import free_port
from alexnet.metrics import read_metrics, without_wall_clock
from tests import children
from tests.conftest import REPO, run_script, tiny_overrides

pytestmark = pytest.mark.slow

# Randomness off and no dropout: a resumed run equals an uninterrupted one bit for bit, whatever the
# process (torchrun's workers or train.py's own replicas). 4 epochs of 3 steps, a checkpoint every 2 steps.
RUN = {"data.shuffle": False, "data.random_crop": False, "data.flip": False, "model.dropout": 0.0,
       "data.loading": "inline", "train.epochs": 4, "train.log_every": 1, "train.batch_size": 8,
       "data.val_batch_size": 4, "parallel.exchange": "gradients", "parallel.transport": "gloo",
       "run.save_every_steps": 2}


@pytest.fixture(scope="module")
def uninterrupted(train_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted")
    r = run_script("train.py", "configs/demo.yaml", *tiny_overrides(train_data, run, **RUN, **{"parallel.replicas": 2}),
                   cpu_s=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def torchrun(nodes: int, per_node: int, restarts: int) -> list[list[str]]:
    """The agents' command lines (one per node) of a c10d rendezvous on this machine."""
    port = free_port()
    return [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
             f"--nproc-per-node={per_node}", f"--max-restarts={restarts}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", "--monitor-interval=0.2",
             "tests/kill_points.py", "configs/demo.yaml"] for node in range(nodes)]


def run_agents(commands: list[list[str]], kills: str, overrides: list[str]) -> list[subprocess.CompletedProcess]:
    """Run the agents to their end (each in a session of its own, all killed if the job outlives 300 s)."""
    env = {**os.environ, "ALEXNET_TEST_KILLS": kills, "PYTHONUNBUFFERED": "1"}
    agents = [subprocess.Popen([*c, *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True) for c in commands]
    done = []
    try:
        for agent in agents:
            out, err = children.communicate(agent, cpu_s=300)
            done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:
        for agent in agents:  # a hung job: its agents and their workers go with the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    return done


def assert_equal_runs(run, ref) -> None:
    c = compare_checkpoints(run / "checkpoints" / "last.pt", ref / "checkpoints" / "last.pt")
    assert c["weights"] <= 1e-6 and c["velocities"] <= 1e-6, c
    assert without_wall_clock(read_metrics(run / "metrics.jsonl")) == without_wall_clock(
        read_metrics(ref / "metrics.jsonl"))  # each record once: what a killed attempt wrote was cut back


def test_four_kills_in_a_row_resume_exactly(train_data, tmp_path, uninterrupted):
    """One job, five attempts: a worker dies in its first step (no checkpoint yet), in validation, in a
    checkpoint write (rank 0, which writes them), and in a training step; the fifth attempt finishes."""
    run = tmp_path / "run"
    kills = "0:1:first,1:0:val,2:0:save,3:1:step=9"
    [r] = run_agents(torchrun(1, 2, restarts=4), kills, tiny_overrides(train_data, run, **RUN))
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("failed (exitcode:") == 4, r.stderr[-4000:]  # the agent's line per failed attempt
    assert r.stdout.count("resumed from") == 3, r.stdout[-4000:]  # all but the attempt after the first step
    assert_equal_runs(run, uninterrupted)
    assert not list((run / "checkpoints").glob(".*.tmp"))  # the killed write's temporary file was removed


def test_the_store_hosts_rank_0_killed_on_one_of_two_nodes(train_data, tmp_path, uninterrupted):
    """Two agents (two nodes of one process each): rank 0, on the node that hosts the rendezvous store,
    dies mid-epoch; only its agent counts a restart, so the two agents' TORCHELASTIC_RESTART_COUNT
    then differ, and the job still resumes as one."""
    run = tmp_path / "run"
    results = run_agents(torchrun(2, 1, restarts=2), "0:0:step=5", tiny_overrides(train_data, run, **RUN))
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    assert "exitcode: -9" in results[0].stderr, results[0].stderr[-3000:]
    assert_equal_runs(run, uninterrupted)
