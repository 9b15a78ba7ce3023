"""alexnet/rundir.py: who locks run.dir, one run at a time, dead writers' temporaries removed,
config.yaml with its earlier versions kept."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from alexnet import rundir
from alexnet.launch import ENV_LOCK_FD
from data.fsutil import DirInUse
from tests.conftest import REPO


@pytest.mark.parametrize("env, want", [
    ({}, True),                                    # a lone process
    ({"WORLD_SIZE": "4", "RANK": "0"}, True),      # rank 0 under torchrun
    ({"WORLD_SIZE": "4", "RANK": "1"}, False),
    ({"WORLD_SIZE": "4"}, False),                  # no rank given: not rank 0
    ({ENV_LOCK_FD: "7"}, False),                   # a replica of train.py's launcher
    ({ENV_LOCK_FD: "7", "WORLD_SIZE": "2", "RANK": "0"}, False),
])
def test_lock_holder_here(monkeypatch, env, want):
    for key in (ENV_LOCK_FD, "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rundir.lock_holder_here() is want


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.processes
def test_hold_removes_dead_writers_temporaries_and_refuses_a_second_run(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    dead, sub = run / f".config.yaml.{dead_pid()}.tmp", run / "checkpoints" / f".last.pt.{dead_pid()}.tmp"
    live = run / "checkpoints" / ".epoch_001.pt.1.tmp"  # pid 1 is alive: its write may still finish
    for p in (dead, sub, live):
        p.write_bytes(b"x")
    with rundir.hold(run) as fd:
        assert isinstance(fd, int) and fd >= 0
        assert not dead.exists() and not sub.exists() and live.exists()
        out = capsys.readouterr().out
        assert f"removed {dead}" in out and f"removed {sub}" in out
        with pytest.raises(DirInUse):  # another holder (a second open file description) is refused
            rundir.hold(run).__enter__()
    with rundir.hold(run) as again:  # released when the first run ends
        assert again >= 0


def test_write_config_keeps_each_different_previous_config(tmp_path):
    run = tmp_path / "runs" / "run"
    assert rundir.write_config(run, "a: 1\n") is None           # creates run.dir and its parents
    assert (run / "config.yaml").read_text() == "a: 1\n"
    assert rundir.write_config(run, "a: 1\n") is None           # the same again: nothing kept
    kept = rundir.write_config(run, "a: 2\n")
    assert kept == run / "config.prev-1.yaml" and kept.read_text() == "a: 1\n"
    (run / "config.prev-9.yaml").write_text("old")                # numbering goes on after the highest
    (run / "config.prev-x.yaml").write_text("not a number")
    kept = rundir.write_config(run, "a: 3\n")
    assert kept == run / "config.prev-10.yaml" and kept.read_text() == "a: 2\n"
    assert (run / "config.yaml").read_text() == "a: 3\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.prev-1.yaml", "config.prev-10.yaml",
                                                     "config.prev-9.yaml", "config.prev-x.yaml", "config.yaml"]


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("where, words", [
    ("", "run.dir must be the folder this run writes into (e.g. run.dir=runs/NAME), got ''"),  # the config's
    ("/", "is the file system's root"),
    (".", "(the working directory) holds files that are not a training run's ('config.yaml' and 1 more)"),
    ("mine", "holds files that are not a training run's ('notes.txt')"),
    ("config.yaml", "run.dir=config.yaml is not a folder (a file, a device or a pipe)"),
    ("a_pipe", "run.dir=a_pipe is not a folder"),
    ("/dev/null", "run.dir=/dev/null is not a folder"),
])
def test_train_refuses_a_run_dir_that_is_not_a_runs_and_writes_nothing(tmp_path, monkeypatch, capsys, where, words):
    """run.dir= (empty) trained into the working directory, beside the user's files, and kept the user's own
    config.yaml as config.prev-1.yaml."""
    import train
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("the user's own\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep\n")
    if where == "a_pipe":
        os.mkfifo(tmp_path / "a_pipe")
    before = _tree(tmp_path)
    code = train.main([str(REPO / "configs" / "demo.yaml"), f"run.dir={where}", "data.root=/nonexistent"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert _tree(tmp_path) == before and (tmp_path / "config.yaml").read_text() == "the user's own\n"


@pytest.mark.parametrize("state", ["new", "empty", "a run's"])
def test_a_new_an_empty_or_a_runs_folder_is_a_run_dir(tmp_path, state):
    run = tmp_path / "run"
    if state != "new":
        run.mkdir()
    if state == "a run's":
        (run / "metrics.jsonl").write_text("")
        (run / "notes.txt").write_text("the user's, beside a run of theirs\n")
    rundir.check_run_dir(run)


def test_check_run_dir_words_by_hand(tmp_path, monkeypatch):
    """Each refusal's exact words, called directly (train.py's config refuses an empty run.dir first)."""
    from alexnet.config import ConfigError
    monkeypatch.chdir(tmp_path)

    def refusal(where) -> str:
        with pytest.raises(ConfigError) as e:
            rundir.check_run_dir(where)
        return str(e.value)
    assert refusal("") == "run.dir is empty: name the folder this run writes into (e.g. run.dir=runs/NAME)"
    assert refusal("  ") == "run.dir is empty: name the folder this run writes into (e.g. run.dir=runs/NAME)"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    assert refusal(mine) == (f"run.dir={mine} holds files that are not a training run's ('notes.txt'): a run writes "
                             "config.yaml, metrics.jsonl and checkpoints/ there; name a new or empty folder")
    (tmp_path / "todo.txt").write_text("the user's")
    assert refusal(".") == ("run.dir=. (the working directory) holds files that are not a training run's ('mine' "
                            "and 1 more): a run writes config.yaml, metrics.jsonl and checkpoints/ there; name a new "
                            "or empty folder")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {epochs: 1}\n")
    rundir.check_run_dir(run)  # a run's folder
    tail = ", not a regular file or folder (a device, pipe or socket): a tool's folder holds only files it wrote; " \
           "remove it"
    for count, name in enumerate(["metrics.jsonl", "checkpoints/last.pt", ".lock"], start=1):
        os.mkfifo(run / name)
        first = sorted(["metrics.jsonl", "checkpoints/last.pt", ".lock"][:count])[0]
        more = f" and {count - 1} more" if count > 1 else ""
        assert refusal(run) == f"run.dir={run} holds {first}{more}{tail}"


@pytest.mark.parametrize("names, taken", [
    ((".lock", "config.yaml"), True),                        # a run that died as it started
    ((".lock", "config.yaml", "config.prev-2.yaml"), True),  # ... a second time, with another config
    ((".lock",), True),                                      # ... before its config
    ((".lock", "meta.json", "mean.npy"), False),             # a preprocessed output: its lock is not a run's
    ((".lock", "config.yaml", "notes.txt"), False),
    (("config.yaml",), False),                               # the user's own config, no run started here
    ((".lock", "config.prev-x.yaml"), False),
])
def test_a_lock_marks_a_runs_folder_only_beside_its_configs(tmp_path, names, taken):
    from alexnet.config import ConfigError
    run = tmp_path / "run"
    run.mkdir()
    for name in names:
        (run / name).write_text("")
    if taken:
        rundir.check_run_dir(run)
    else:
        with pytest.raises(ConfigError, match="holds files that are not a training run's"):
            rundir.check_run_dir(run)


@pytest.mark.parametrize("inside", ["", "runs/demo", "train/run"])
def test_a_run_dir_in_the_data_is_refused_and_nothing_written(train_data, tmp_path, capsys, inside):
    """run.dir=DATA/runs/demo wrote the run among the preprocessed output's files (a later preprocess of DATA
    then refused the folder for them): exit 2, one line naming both keys, the data untouched."""
    import shutil

    import train
    data = tmp_path / "data"
    shutil.copytree(train_data, data)
    before = _tree(data)
    run = data / inside if inside else data
    code = train.main([str(REPO / "configs" / "demo.yaml"), f"data.root={data}", f"run.dir={run}", "data.crop=67",
                       "train.batch_size=8", "run.device=cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"run.dir={run} is {'inside ' if inside else ''}data.root={data}: the run's files would lie among" in err
    assert _tree(data) == before


@pytest.mark.parametrize("before", ["new", "new parents", "empty"])
def test_a_start_refused_after_the_lock_leaves_no_folder_it_made(tmp_path, capsys, before):
    """The lock makes run.dir (and its parents) before the data are read: a refusal then (here data.root does
    not exist) left an empty run.dir holding .lock. Folders that were there before are kept."""
    import train
    run = tmp_path / "runs" / "a" / "b" if before == "new parents" else tmp_path / "run"
    if before == "empty":
        run.mkdir()
    existing = _tree(tmp_path)
    code = train.main([str(REPO / "configs" / "demo.yaml"), f"data.root={tmp_path / 'nope'}", f"run.dir={run}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err, err
    assert tmp_path.is_dir() and _tree(tmp_path) == existing  # the folders above the ones it made are kept
    if before == "empty":
        assert not (run / ".lock").exists() and run.is_dir()


def test_a_folder_written_meanwhile_is_kept(tmp_path):
    """Only a run.dir that holds its lock alone is removed, and only the folders the lock made."""
    from alexnet.config import ConfigError
    run = tmp_path / "made" / "run"
    with pytest.raises(ConfigError), rundir.hold(run):
        (run / "config.yaml").write_text("written by the run\n")
        raise ConfigError("refused after the run wrote")
    assert (run / "config.yaml").is_file() and (run / ".lock").is_file()
    run2 = tmp_path / "made2" / "run"
    with pytest.raises(KeyboardInterrupt), rundir.hold(run2):
        (tmp_path / "made2" / "theirs.txt").write_text("another process's\n")
        raise KeyboardInterrupt
    assert not run2.exists() and (tmp_path / "made2" / "theirs.txt").is_file()
    died = tmp_path / "died"  # a run that died after its lock, before its config: its lock is its own
    died.mkdir()
    (died / ".lock").write_text("")
    with pytest.raises(KeyboardInterrupt), rundir.hold(died):
        raise KeyboardInterrupt
    assert (died / ".lock").is_file()
