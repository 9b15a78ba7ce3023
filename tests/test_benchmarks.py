"""scripts/benchmark.py: every subcommand at a tiny size writes the JSON keys (and prints the table)
that gpu_check and docs/benchmarks/*.json rely on.

`loading` and `exchange` run in the CPU twin of `make gpu-bench` with these flags
(tests/test_gpu_check.py checks their keys with `check_keys`), so not twice; `large-batch` in its own test
(its keys and its figures from one run). Not run at all, for time:
`exchange --table1` (four train.py runs), `loading`'s CPU full-size row, and `parallel`'s measured layouts
beyond one process (tests/test_model_parallel.py measures three of them).
"""
import itertools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_script, sigint_inside_the_pool
from tests.parsers import parses_over_its_own_output
from tests.test_determinism import graph_nodes

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

TINY = ["--width", "0.125", "--crop", "67", "--batch-size", "8", "--steps", "2", "--warmup", "1", "--repeat", "1"]
CASES = {  # subcommand: (flags, top-level keys, keys of each row)
    "preprocess": (["--images", "20", "--workers", "2"],
                   ["benchmark", "images", "cpu_count", "draft_speedup", "rows"],
                   [["what", "workers", "img_per_s", "img_per_s_per_worker"]] * 6),
    "read": (["--files", "3", "--per-file", "16", "--size", "32", "--batch-sizes", "16", "--threads", "2",
              "--repeat", "1"],
             ["benchmark", "cpu", "images", "image_size", "files", "shuffle_window", "threads", "repeat", "data",
              "rows"],
             [["what", "batch", "img_per_s", "GB_per_s", "vs_memory_bound"]] * 8),
    "train": ([*TINY, "--precisions", "fp32", "bf16"],
              ["benchmark", "device", "arch", "width", "crop", "batch_size", "compile", "rows"],
              [["precision", "channels_last", "img_per_s", "s_per_20_iter", "vs_fp32"]] * 4),
    "loading": ([*TINY, "--files-per-epoch", "2", "--no-cpu-full-size"],
                ["benchmark", "device", "arch", "width", "crop", "batch_size", "precision", "channels_last", "data",
                 "rows"],
                [["what", "img_per_s", "s_per_20_iter", "vs_upper_bound"]] * 5),
    "exchange": (["--width", "0.125", "--batch-size", "8", "--warmup", "1", "--repeat", "1"],
                 ["benchmark", "replicas", "arch", "width", "device", "rows"],
                 # on the CPU: ipc and gloo exchanges, gloo gradient all-reduce, 2 DDP steps, then the step
                 [["what", "mbytes", "ms", "vs_step"]] * 5 + [["what", "mbytes", "ms"]]),
    "checkpoint": (["--width", "0.125", "--repeat", "1"],
                   ["benchmark", "device", "arch", "width", "mbytes", "dir", "rows"],
                   [["what", "step_loop_ms", "write_ms"], ["what", "step_loop_ms", "write_ms", "vs_synchronous"]]),
    # --quick: AlexNet-BN, 2 epochs of 48 images, B 2 and 4 x B, one seed: 5 train.py runs (one a sweep point)
    "large-batch": (["--quick"],
                    ["benchmark", "cpu", "proxy", "main_lrs", "rows", "gap", "sweep", "runs", "wall_s"],
                    [["arch", "optimizer", "batch", "lr", "warmup_epochs", "steps", "top1_err", "top1_min",
                      "top1_max", "top5_err", "per_seed", "diverged", "seconds"]] * 4),
    # alexnet's two LRNs, then a training step
    "lrn": ([*TINY[:4], "--batch-size", "4", "--steps", "1", "--warmup", "1", "--repeat", "1"],
            ["benchmark", "device", "arch", "width", "crop", "batch_size", "rows"],
            [["what", "shape", "torch_ms", "layers_ms", "speedup"]] * 3),
}


IN_GPU_BENCH_TWIN = ("loading", "exchange")


def check_keys(what: str, result: dict, stdout: str) -> None:
    """A benchmark's --json result and printed table against CASES[what]."""
    _, keys, row_keys = CASES[what]
    assert list(result) == keys and result["benchmark"] == what
    assert [list(row) for row in result["rows"]] == row_keys
    header = stdout.splitlines()[0].split()
    assert header == list(dict.fromkeys(k for ks in row_keys for k in ks))  # the table of the rows


@pytest.mark.parametrize("what", [w for w in CASES if w not in IN_GPU_BENCH_TWIN and w != "large-batch"])
def test_subcommand_writes_its_keys(tmp_path, what):
    flags = CASES[what][0]
    out = tmp_path / f"{what}.json"
    r = run_script("scripts/benchmark.py", what, *flags, "--json", str(out), cpu_s=300)
    assert r.returncode == 0, r.stderr
    check_keys(what, json.loads(out.read_text()), r.stdout)


def test_parallel_writes_its_keys(monkeypatch):
    """benchmark.py parallel's result with one measured layout and one skipped (more processes than devices)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import parallel
    monkeypatch.setattr(parallel, "LAYOUTS", (("1 device", 1, 1, "fc"), ("16 data parallel", 16, 1, "fc")))
    args = parallel.add_parser(_subparsers()).parse_args(
        ["--batch-size", "16", "--width", "0.125", "--steps", "1", "--warmup", "1", "--device", "cpu"])
    result = args.run(args)
    assert list(result) == ["benchmark", "device", "width", "global_batch", "precision", "rows", "cost_model"]
    measured, skipped = result["rows"]
    assert list(measured) == ["layout", "processes", "batch_per_process", "ms_per_step", "img_per_s",
                              "MB_sent_per_step", "MB_params_per_process", "speedup", "yadan_speedup"]
    assert list(skipped) == ["layout", "status"] and skipped["status"].startswith("skipped: needs 16 devices")
    assert list(result["cost_model"]) == ["assumed_step_ms", "rows"] and len(result["cost_model"]["rows"]) == 9
    links = [f"{link} {what}" for link in ("PCIe 3.0 x16", "PCIe 4.0 x16", "NVLink (H100)")
             for what in ("ms", "vs step")]
    assert all(list(row) == ["layout", "MB_per_step", *links] for row in result["cost_model"]["rows"])
    assert args.tables == (("cost_model", "cost model (full-size AlexNet, global batch 256; a model, not a "
                                          "measurement)"),)


def _subparsers():
    import argparse
    return argparse.ArgumentParser().add_subparsers()


def test_large_batch_runs_train_py_and_reports_every_point(tmp_path):
    """large-batch --quick: every optimizer at 4 x B through train.py (the grid's steps are the trainer's),
    the gap table and every sweep point, the grid's marked."""
    out, keep = tmp_path / "lb.json", tmp_path / "keep"
    argv = ["scripts/benchmark.py", "large-batch", "--quick", "--json", str(out), "--keep", str(keep)]
    r = run_script(*argv, cpu_s=300)
    assert r.returncode == 0, r.stderr
    parses_over_its_own_output(argv)  # the same command again takes its --json and --keep as its own
    result = json.loads(out.read_text())
    check_keys("large-batch", result, r.stdout)
    rows = {(x["optimizer"], x["batch"]): x for x in result["rows"]}
    assert set(rows) == {("sgd", 2), ("sgd", 8), ("lars", 8), ("lamb", 8)}
    assert rows[("sgd", 2)]["steps"] == 48 and rows[("sgd", 8)]["steps"] == 12  # 24 and 6 steps x 2 epochs
    assert rows[("sgd", 8)]["lr"] == 0.04 and rows[("lars", 8)]["lr"] == result["main_lrs"]["alexnet_bn"]["lars"]
    assert all(0 <= x["top1_err"] <= 1 and x["per_seed"] == [x["top1_err"]] for x in result["rows"])
    assert [g["optimizer"] for g in result["gap"]] == ["sgd", "lars", "lamb"]
    assert [(p["optimizer"], p["lr"], p["in_grid"]) for p in result["sweep"]] == [
        ("sgd", 0.04, True), ("lars", 5.0, False), ("lars", 10.0, True), ("lamb", 0.02, True)]
    assert result["runs"] == 5 and "the sweep at 16 x B" in r.stdout


def test_large_batch_ctrl_c_stops_the_grid_and_starts_no_queued_run(monkeypatch, tmp_path):
    """Ctrl-C (sent from inside the pool's wait, where it once could leave a lock held) stops train_all after
    that wait returns; the runs still queued are cancelled, not trained one after the other by the shutdown."""
    import argparse
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import large_batch
    started = []

    def fake_run(run, data, root, args):
        started.append(run["batch"])
        time.sleep(0.3)
        return {"top1_err": 0.5, "status": "done", "seconds": 0.3}
    monkeypatch.setattr(large_batch, "train_one", fake_run)
    from data import procs
    returned = sigint_inside_the_pool(monkeypatch, procs, "wait")  # the grid's pool: data.procs.in_threads
    runs = [{"batch": b, "arch": "alexnet", "optimizer": "sgd", "lr": 0.01, "seed": 0} for b in range(8)]
    with pytest.raises(KeyboardInterrupt):
        large_batch.train_all(runs, tmp_path / "data", tmp_path / "runs", argparse.Namespace(jobs=1))
    assert returned, "the KeyboardInterrupt was raised inside the pool's own wait"
    assert started == [0], started  # no run starts after the stop
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_large_batch_gap_and_share_closed():
    """The gap is against the best SGD at 16 x B; closed = (best SGD - optimizer) / gap."""
    import argparse
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import large_batch
    args = argparse.Namespace(archs=["alexnet"], batch=16, scale=16)
    row = lambda opt, batch, lr, err: {"arch": "alexnet", "optimizer": opt, "batch": batch, "lr": lr,  # noqa: E731
                                       "top1_err": err}
    rows = [row("sgd", 16, 0.01, 0.40), row("sgd", 256, 0.16, 0.90), row("sgd", 256, 0.08, 0.60),
            row("lars", 256, 10.0, 0.50), row("lamb", 256, 0.02, 0.65)]
    gap = large_batch.gap_rows(rows, args)
    assert [(g["optimizer"], g["lr"], g["sgd_gap"], g["closed"]) for g in gap] == [
        ("sgd", 0.08, 0.2, 0.0), ("lars", 10.0, 0.2, 0.5), ("lamb", 0.02, 0.2, -0.25)]


def test_an_existing_json_is_not_replaced_without_force(tmp_path, capsys):
    """A kept measurement (docs/benchmarks/*.json) survives a benchmark pointed at it: refused before the
    run, in one line; every subcommand takes the same rule. A file that is no benchmark's output is refused
    even with --force (it is not a measurement to replace)."""
    from tests.conftest import load_script
    kept, foreign = tmp_path / "kept.json", tmp_path / "notes.json"
    kept.write_bytes((REPO / "docs" / "benchmarks" / "read_cpu.json").read_bytes())
    foreign.write_text('{"kept": true}')
    import argparse

    from tests.parsers import script_parser
    main = load_script("benchmark").main
    subcommands = [a for a in script_parser("scripts/benchmark.py")._actions
                   if isinstance(a, argparse._SubParsersAction)][0].choices
    assert {"read", "large-batch", "train"} <= set(subcommands)
    for what in subcommands:  # every subcommand, as the parser defines them
        with pytest.raises(SystemExit) as e:
            main([what, "--json", str(kept)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "--force" in err and str(kept) in err, err
        with pytest.raises(SystemExit) as e:
            main([what, "--json", str(foreign), "--force"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and f"{foreign} exists and is not a benchmark" in err
    assert kept.read_bytes() == (REPO / "docs" / "benchmarks" / "read_cpu.json").read_bytes()
    assert foreign.read_text() == '{"kept": true}'


def test_lrn_benchmark_times_torchs_op_against_the_layer_and_refuses_a_model_without_lrn():
    """benchmark.py lrn: inside torchs_lrn every layers.LRN is torch's F.local_response_norm (its autograd
    graph holds avg_pool3d), outside it the layer's own function; owt, which has no LRN, is refused."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import lrn

    from layers import LRN
    x = (30.0 * torch.randn(2, 7, 3, 3, dtype=torch.float64)).requires_grad_(True)
    layer = LRN()
    with lrn.torchs_lrn():
        theirs = layer(x)
    ours = layer(x)
    assert any("AvgPool3D" in n for n in graph_nodes(theirs))
    assert not any("AvgPool3D" in n for n in graph_nodes(ours)) and any("_WindowLRN" in n for n in graph_nodes(ours))
    torch.testing.assert_close(theirs, F.local_response_norm(x, 5, alpha=5e-4, beta=0.75, k=2.0), rtol=0, atol=0)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    args = lrn.add_parser(_subparsers()).parse_args(["--arch", "owt", "--device", "cpu", "--width", "0.125",
                                                     "--batch-size", "2", "--steps", "1", "--warmup", "0"])
    with pytest.raises(SystemExit, match="owt has no LRN"):
        args.run(args)



# How a benchmark's module makes temporary data: alexnet.cli.temporary_directory (the only way the project
# makes a temporary folder: tests/test_held_stops.py), or bench.common.run_workers (its result's folder).
# Keyed on "tempfile" before, the walk lost five of its six cases silently when the modules moved to the helper.
MAKERS = {"temporary_directory": REPO / "alexnet" / "cli.py", "run_workers": REPO / "scripts" / "bench" / "common.py"}


def _makes_temporary_data(what: str) -> bool:
    """Whether a subcommand's module (scripts/bench/<what>.py) puts its data in a temporary directory."""
    text = (REPO / "scripts" / "bench" / f"{what.replace('-', '_')}.py").read_text()
    return any(re.search(rf"\b{name}\(", text) for name in MAKERS)


# Every subcommand that makes temporary data, stopped by a signal (in turn SIGTERM, SIGHUP, SIGINT), as a
# scheduler's time limit or a closed terminal would.
STOPPED = list(zip([w for w in CASES if _makes_temporary_data(w)],
                   itertools.cycle([signal.SIGTERM, signal.SIGHUP, signal.SIGINT])))


def _session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (a zombie has ended), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            state, _, _, session = stat[stat.rindex(")") + 2:].split()[:4]
            if int(session) == sid and state != "Z":
                found.append(int(entry.name))
    return found


def test_the_makers_of_temporary_data_the_stop_cases_look_for_exist():
    """A maker renamed would leave the walk above with nothing to find, and its cases gone without a word."""
    for name, where in MAKERS.items():
        assert f"def {name}(" in where.read_text(), (name, where)
    assert len(STOPPED) > 1


@pytest.mark.parametrize("what, sig", STOPPED, ids=[f"{w}-{s.name}" for w, s in STOPPED])
def test_a_stopped_benchmark_leaves_nothing_in_the_temporary_directory(tmp_path, what, sig):
    """Stopped once its temporary data is there: exit 128 + N, one line, no process of it left (its workers
    included), and its temporary directory empty."""
    import subprocess

    from tests import children
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "scripts/benchmark.py", what, *CASES[what][0]], cwd=REPO, text=True,
                            env={**os.environ, "TMPDIR": str(temp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its workers in its session
    children.wait_until(lambda: any(temp.iterdir()), proc, cpu_s=120, what=f"benchmark.py {what}: no temporary data")
    proc.send_signal(sig)
    _, err = children.communicate(proc, cpu_s=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    by = "" if sig == signal.SIGINT else f" by {sig.name}"  # Ctrl-C is said as every tool says it
    # A stop whose exception a library dropped (Cython's start of numpy.random registers classes with abc and
    # drops any error) comes back when the work has run to its end, and says so (cli.stopping_on_signals).
    assert err.strip().splitlines()[-1] in (f"benchmark.py: interrupted{by}",
                                            f"benchmark.py: interrupted{by} after its work was done"), err[-2000:]
    left = _session_ended(proc.pid)
    assert left == [] and list(temp.iterdir()) == [], [(p, children._cmdline(p)) for p in left]


def test_a_failing_benchmark_worker_ends_the_others_at_once(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # as benchmark.py has it: the workers import bench.common
    from bench.common import run_workers

    from tests.bench_workers import fails_or_waits  # a light module: each spawned worker imports it
    finished = tmp_path / "finished"
    with pytest.raises(RuntimeError, match="benchmark worker 1 of 2 exited with code 3"):
        run_workers(fails_or_waits, 2, str(finished))
    assert not finished.exists()  # killed, not waited for


def test_a_stop_inside_a_benchmark_workers_start_waits_until_all_have_started(monkeypatch, capfd):
    """A stop landing after a worker's process was made but before its bootstrap was written cut that worker
    off: it printed "EOFError: Ran out of input" after the benchmark's line, and lived on (it had no handle
    yet to be killed by); a signal mask did not hold it once torch's threads were there. A process-directed
    SIGTERM right after each worker's process is made: the run ends in Stopped once all have started, and
    every worker is ended, with nothing on stderr."""
    import multiprocessing.util

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench.common import run_workers

    from alexnet import cli
    from tests.bench_workers import waits
    real, started = multiprocessing.util.spawnv_passfds, []

    def spawned_then_stopped(path, args, passfds):
        pid = real(path, args, passfds)
        if any(b"spawn_main" in os.fsencode(arg) for arg in args):  # a worker (not multiprocessing's resource tracker)
            started.append(pid)
            os.kill(os.getpid(), signal.SIGTERM)
        return pid
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawned_then_stopped)
    with pytest.raises(cli.Stopped), cli.stopping_on_signals():
        run_workers(waits, 2)
    assert len(started) == 2
    for pid in started:  # each reaped by run_workers (a live or unreaped child would be found)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert capfd.readouterr().err == ""


def _session_ended(sid: int) -> list[int]:
    """The processes of session `sid` still alive GONE_S from now (tests/children.none_left's "outlived"):
    multiprocessing's resource tracker, which nobody waits for, holds the benchmark's stdout and stderr
    (seen in /proc/<pid>/fd) and closes them as it exits, a moment before it is a zombie: a look right after
    the benchmark's output ended saw it alive once (exchange-SIGTERM, two spinning processes beside)."""
    from tests import children
    deadline = time.monotonic() + children.GONE_S
    while (left := _session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _spawned_workers(sid: int) -> list[int]:
    """The multiprocessing workers (spawn_main) among the live processes of session `sid`."""
    found = []
    for pid in _session_members(sid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # it ended meanwhile
            continue
    return found


def test_a_benchmark_killed_by_sigkill_takes_its_workers_with_it(tmp_path):
    """A benchmark killed where nothing can clean up (SIGKILL: the out-of-memory killer, a scheduler's hard
    limit) left its exchange workers running their timed steps, or waiting in the rendezvous, for nobody
    (seen by hand, 2026-11-29): a spawned worker asked for its parent's death signal only after its imports,
    and a parent dead by then went unseen. run_workers in a process of its own, killed as its workers start."""
    import subprocess

    from tests import children
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/scripts']; from bench.common import run_workers; "
            "from tests.bench_workers import waits; run_workers(waits, 2)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(REPO)], cwd=REPO, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # SIGKILL: its temporary folder stays
    try:
        workers = children.wait_until(lambda: _spawned_workers(proc.pid) if len(_spawned_workers(proc.pid)) == 2
                                      else [], proc, cpu_s=60, what="the workers never started")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert workers and _session_ended(proc.pid) == []  # the workers, and the tracker after them
    finally:
        for pid in _session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
