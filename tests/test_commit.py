"""data.fsutil.commit, the one place a tool's file takes its final name: the rename, the sweep of dead
writers' temporaries beside it (once per folder and process), and its test hook's numbering."""
from __future__ import annotations

import os

import pytest

from data import fsutil


def dead_pid() -> int:
    return 4_194_304 + 7  # above Linux's largest pid (PID_MAX_LIMIT, 2**22): never a live process


def test_commit_renames_and_sweeps_dead_writers_temporaries_once_per_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(fsutil, "_SWEPT", set())
    dead, live = dead_pid(), os.getpid()
    stale = [tmp_path / f".a.pt.{dead}.tmp", tmp_path / f".curve.{dead}.tmp.png"]
    kept = [tmp_path / f".b.pt.{live}.tmp", tmp_path / "notes.txt", tmp_path / f"x.{dead}.tmp"]  # live, not ours
    for p in stale + kept:
        p.write_text("x")
    tmp = fsutil.temp_path(tmp_path / "out.json")
    assert tmp.name == f".out.json.{live}.tmp"
    tmp.write_text("new")
    fsutil.commit(tmp, tmp_path / "out.json")
    assert (tmp_path / "out.json").read_text() == "new" and not tmp.exists()
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    later = tmp_path / f".c.pt.{dead}.tmp"  # left after this process swept the folder: its next run sweeps it
    later.write_text("x")
    second = fsutil.temp_path(tmp_path / "curve.png", keep_suffix=True)
    assert second.name == f".curve.{live}.tmp.png"
    second.write_text("png")
    fsutil.commit(second, tmp_path / "curve.png")
    assert later.exists() and (tmp_path / "curve.png").read_text() == "png"


def test_the_hook_numbers_every_moment_and_holds_the_chosen_one(tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(fsutil.WRITE_TRACE, str(trace))
    monkeypatch.setenv(fsutil.PAUSE_AT, "3")
    (tmp_path / "trace.txt.go").touch()  # released at once: the hold ends when this file exists
    for name in ("a", "b"):
        tmp = fsutil.temp_path(tmp_path / name)
        tmp.write_text(name)
        fsutil.commit(tmp, tmp_path / name)
    rows = [line.split(" ", 3) for line in trace.read_text().splitlines()]
    assert [(n, m, os.path.basename(p)) for n, _, m, p in rows] == [
        ("1", "before", "a"), ("2", "after", "a"), ("3", "before", "b"), ("4", "after", "b")]
    assert {pid for _, pid, _, _ in rows} == {str(os.getpid())}


def test_the_hook_holds_the_thread_at_the_chosen_moment_until_let_go(tmp_path, monkeypatch):
    """PAUSE_AT=2 (after the first rename): the writing thread stops there, the first file renamed and the
    second not begun, until WRITE_TRACE.go exists."""
    import threading
    import time
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(fsutil.WRITE_TRACE, str(trace))
    monkeypatch.setenv(fsutil.PAUSE_AT, "2")

    def write_two():
        for name in ("a", "b"):
            tmp = fsutil.temp_path(tmp_path / name)
            tmp.write_text(name)
            fsutil.commit(tmp, tmp_path / name)
    t = threading.Thread(target=write_two, daemon=True)
    t.start()
    while len(trace.read_text().splitlines() if trace.exists() else []) < 2:
        time.sleep(0.01)
    t.join(0.3)  # held: still there well after its second moment
    assert t.is_alive() and (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert len(trace.read_text().splitlines()) == 2
    (tmp_path / "trace.txt.go").touch()
    t.join(10)
    assert not t.is_alive() and (tmp_path / "b").read_text() == "b" and len(trace.read_text().splitlines()) == 4


def test_written_in_place_names_what_skipped_commit(tmp_path):
    """The walk's audit, by hand: under `out`, a temporary and a declared name pass, the folder itself
    (tempfile's nameless probe) passes, a file outside `out` is not the tool's output; a final name is found."""
    from tests.write_points import written_in_place
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    opened = [str(out / ".eval.json.123.tmp"), str(out / ".curve.123.tmp.png"), str(out / "metrics.jsonl"),
              str(out), str(tmp_path / "elsewhere.json"), str(out / "sub" / "eval.json"), str(out / "a.png"),
              str(out / "a.png")]
    assert written_in_place(opened, out, {"metrics.jsonl": "why"}) == ["sub/eval.json", "a.png"]
    assert written_in_place(opened, out, {"*.json*": "why", "*.png": "why"}) == []


def test_written_outside_names_what_a_tool_wrote_beside_its_output(tmp_path):
    from tests.write_points import written_outside
    out = tmp_path / "out"
    out.mkdir()
    opened = [str(out / "a.json"), "/dev/null", "/dev/shm/alexnet-1-0", str(tmp_path / "trace-1.txt"), str(tmp_path),
              str(tmp_path / "out.json"), str(tmp_path / "outside.png")]
    assert written_outside(opened, out, (str(tmp_path / "trace-"),)) == [str(tmp_path / "out.json"),
                                                                         str(tmp_path / "outside.png")]


def test_check_writable_makes_nothing_probes_the_nearest_folder_and_names_the_file(tmp_path, monkeypatch):
    """Before any work: a folder for a file, a file in the way and a folder that takes no new entry are refused
    naming the file asked for (errno, words, name); a folder still to be made is made by the write, not here."""
    import errno
    import tempfile

    from data.fsutil import check_writable
    check_writable(tmp_path / "new" / "deeper" / "x.json")
    assert list(tmp_path.iterdir()) == []  # nothing made, no probe left
    with pytest.raises(IsADirectoryError) as e:
        check_writable(tmp_path)
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.EISDIR, "Is a directory", str(tmp_path))
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError) as e:
        check_writable(tmp_path / "f" / "sub" / "x.json")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (
        errno.ENOTDIR, f"Not a directory: {tmp_path / 'f'} is a file", str(tmp_path / "f" / "sub" / "x.json"))
    asked = []

    def refused(**kwargs):
        asked.append(kwargs)
        raise PermissionError(errno.EACCES, "Permission denied", str(kwargs["dir"]) + "/probe")
    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(OSError) as e:
        check_writable(tmp_path / "new" / "x.json")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.EACCES, "Permission denied",
                                                                   str(tmp_path / "new" / "x.json"))
    assert asked == [{"dir": tmp_path, "prefix": ".x.json.probe"}]  # the nearest folder that exists
