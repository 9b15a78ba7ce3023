"""Every shell command of the documents (README.md, docs/*.md, pretrained/README.md: their ```bash blocks), as
written, checked against the code: a user script's arguments by the script's own parser, train.py's config
and overrides by the config loader (as train.py --dry-run does first), torchrun's own options by torchrun's
parser, a make target by the Makefile, a pytest marker or path by pytest.ini and the tree. A command of a
kind this file cannot check fails, so a new kind of documented command gets a check here first.

The commands are found by reading the documents, so a command added or changed later is checked without an
edit here. What this cannot show (the data and GPUs the commands name) train.py --dry-run shows where they
exist (test below); the CPU demo itself runs in tests/test_train.py (test_demo_config_learns). The CPU
training commands also run: each `python train.py configs/demo.yaml ...` here, with the suite's data and
tiny sizes after it; the torchrun ones in tests/test_parallel.py, taken from the page (tests/documented.py).
"""
from __future__ import annotations

import argparse
import math
import re
import shlex
from pathlib import Path

import pytest

from alexnet.config import load_config
from alexnet.metrics import read_metrics
from data.domains import InputPath
from tests.conftest import REPO
from tests.documented import documented_commands
from tests.parsers import script_parser


def _absent_taken(self: InputPath, text: str) -> str:
    """The documents name the user's own files (imagenet256, a run's checkpoint): an input path absent here is
    taken as written; one that exists here (a config, a script) is checked as the tool checks it."""
    if text.strip() and text not in self.names and not Path(text).expanduser().exists():
        return text
    return _CHECK_INPUT(self, text)


_CHECK_INPUT = InputPath.__call__


def _parse(path: str, args: list[str]) -> argparse.Namespace:
    parser = script_parser(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InputPath, "__call__", _absent_taken)
        try:
            return parser.parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"{path} refuses {shlex.join(args)} (exit {e.code})") from None


def check_train(args: list[str]) -> None:
    ns = _parse("train.py", args)
    load_config(REPO / ns.config, ns.overrides)  # ConfigError names the key


def check_command(argv: list[str]) -> None:
    """Raises AssertionError (or the config loader's ConfigError) where `argv` drifted from the code."""
    head, rest = argv[0], argv[1:]
    if head in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
        args = rest[2:]
        markers = (REPO / "pytest.ini").read_text()
        for i, word in enumerate(args):
            if word == "-m":
                assert re.search(rf"^\s+{re.escape(args[i + 1])}:", markers, re.M), f"no marker {args[i + 1]}"
            elif not word.startswith("-") and (i == 0 or args[i - 1] not in ("-m", "-p", "-k", "-n")):
                assert (REPO / word.split("::")[0]).exists(), f"no test path {word}"
        return
    if head in ("python", "python3"):
        script, args = rest[0], rest[1:]
        assert (REPO / script).is_file(), f"no script {script}"
        if script == "train.py":
            check_train(args)
        else:
            _parse(script, args)
        return
    if head == "torchrun":
        from torch.distributed.run import get_args_parser
        ns = get_args_parser().parse_args(rest)
        assert ns.training_script == "train.py", ns.training_script
        if ns.rdzv_backend == "c10d":  # the node's rank comes from the rendezvous: a --node-rank is ignored
            assert not any(w.startswith(("--node-rank", "--node_rank")) for w in rest), \
                "--node-rank is ignored with c10d"
        check_train(ns.training_script_args)
        return
    if head == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        for word in rest:
            if "=" not in word:
                assert word in targets, f"no make target {word}"
        return
    if head == "bash":
        assert (REPO / rest[0]).is_file(), f"no script {rest[0]}"
        return
    raise AssertionError(f"a documented command this test cannot check: {shlex.join(argv)} (add its kind)")


def test_the_documents_give_commands_of_every_kind():
    """An independent look at what the walk must find."""
    found = {shlex.join(argv) for _, argv in documented_commands()}
    assert "make demo" in found and "make test" in found
    assert any(c.startswith("torchrun --nnodes=2") and "train.py" in c for c in found)
    assert any(c.startswith("python scripts/evaluate.py") and "--weights torchvision" in c for c in found)
    assert len(found) > 40


@pytest.mark.parametrize("where, argv", documented_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_documented_command_agrees_with_the_code(where, argv):
    check_command(argv)


@pytest.mark.parametrize("drifted, says", [
    ("python scripts/evaluate.py --data d --weights w --crops 3", "refuses"),
    ("python scripts/evaluate.py --data d --weights w --top-k 5", "refuses"),
    ("python train.py configs/alexnet_1gpu.yaml train.lrate=0.1", "train.lrate"),
    ("python train.py configs/alexnet_3gpu.yaml", "alexnet_3gpu"),
    ("torchrun --nnodes=2 --node-rank=1 --rdzv-backend=c10d --rdzv-endpoint=H:1 train.py configs/demo.yaml",
     "ignored"),
    ("make gpu-checks", "no make target"),
    ("python scripts/preprocess.py --train-dir t --out o --size 0", "refuses"),
    ("docker run alexnet", "cannot check"),
])
def test_a_drifted_command_fails(drifted, says):
    with pytest.raises(Exception, match=says):
        check_command(shlex.split(drifted))


def test_dry_run_checks_config_data_and_run_dir_and_writes_nothing(train_data, tmp_path, capsys):
    from train import main
    run = tmp_path / "run"
    base = ["--dry-run", "configs/demo.yaml", f"data.root={train_data}", f"run.dir={run}", "data.crop=67"]
    assert main([*base, "train.batch_size=8", "parallel.replicas=2", "parallel.model_size=2",
                 "parallel.model=fc"]) == 0
    out = capsys.readouterr().out
    assert "would start 4 process(es): 2 replica(s) x 2 (fc model parallel)" in out
    # train.batch_size is a replica's batch: 2 replicas x 8, each fc process reading 4; 48 training images // 16
    assert "global batch 16 (8 per replica, 4 per process of its model group), 3 steps an epoch" in out
    assert not run.exists()
    assert main([*base, "train.batch_size=64"]) == 2  # the data hold fewer images than one batch
    assert "fewer than one global batch" in capsys.readouterr().err and not run.exists()
    assert main([*base[:2], f"data.root={tmp_path / 'none'}", *base[3:]]) == 2
    assert not run.exists()
    theirs = tmp_path / "theirs"  # run.dir a folder of the user's files: refused as a start refuses it
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user's")
    assert main([*base[:3], f"run.dir={theirs}", *base[4:], "train.batch_size=8"]) == 2
    assert "run.dir" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]


def _cpu_training_commands() -> list[tuple[str, list[str]]]:
    """The documented train.py commands on the demo's config (they run on a CPU in seconds), one per run
    (two pages showing one run in two folders show one command)."""
    from tests.documented import same_run
    seen, found = set(), []
    for where, argv in documented_commands():
        key = same_run(argv)
        if argv[:3] == ["python", "train.py", "configs/demo.yaml"] and key not in seen:
            seen.add(key)
            found.append((where, argv))
    return found


@pytest.mark.processes
@pytest.mark.parametrize("where, argv", _cpu_training_commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_documented_cpu_training_command_runs_as_written(where, argv, train_data, tmp_path):
    """Each as the page writes it, with the suite's data, a folder and tiny sizes after it (later overrides
    win): a run of one process in this process (train.py's main), a launched one as a process tree."""
    import io
    from contextlib import redirect_stdout

    from tests.conftest import run_script, signal_handlers_kept, tiny_overrides
    from tests.documented import with_overrides
    from train import main as train_main
    run = tmp_path / "run"
    args = with_overrides(argv, tiny_overrides(train_data, run, **{"train.epochs": 1}))[2:]
    cfg = load_config(REPO / args[0], [a for a in args[1:] if not a.startswith("--")])
    if cfg.parallel.replicas * cfg.parallel.model_size > 1 and "--dry-run" not in args:
        r = run_script("train.py", *args, cpu_s=120)
        code, out = r.returncode, r.stdout + r.stderr
    else:
        buf = io.StringIO()
        with redirect_stdout(buf), signal_handlers_kept():
            code = train_main(args)
        out = buf.getvalue()
    assert code == 0, f"{where}: {out[-2000:]}"
    if "--dry-run" in args:
        assert "would start" in out and not run.exists(), out
    else:
        records = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
        assert records and all(math.isfinite(r["loss"]) for r in records), (where, records)


def test_every_documented_torchrun_command_on_the_demo_config_is_run_by_a_test():
    """The CPU torchrun commands (2 processes, 2 "nodes") run in tests/test_parallel.py, taken from the page by
    tests/documented.py's documented(...): every one the documents show must be the one a test takes."""
    import ast
    taken = []
    for path in (REPO / "tests").glob("test_*.py"):
        if "documented(" not in (text := path.read_text()):  # parsing every test module took 1.2 s
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "documented":
                taken.append([a.value for a in node.args if isinstance(a, ast.Constant)])
    shown = [(w, a) for w, a in documented_commands() if a[0] == "torchrun" and "configs/demo.yaml" in a]
    assert len(shown) >= 2
    missing = [w for w, a in shown if not any(a[:len(t)] == t for t in taken)]
    assert not missing, f"documented torchrun commands no test runs: {missing}"
