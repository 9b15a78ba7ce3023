"""tools/faults.py: the verdict of each outcome, and a small subset of the table run end to end with a
planted failing case (the table itself is run by hand; its result is in docs/reliability.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script
from tools.faultcheck.core import Case, Skip, judge
from tools.faultcheck.preprocess_cases import CASES as PREPROCESS_CASES

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

W = Path("/work/c01")


def case(expect: int = 2, names: tuple[str, ...] = ("{w}/meta.json",), line: str = "") -> Case:
    return Case("x", "traceback", "a fault", expect, names, setup=lambda work: [], line=line)


@pytest.mark.parametrize("code, out, err, problem, expect, verdict, reason", [
    (2, "", "tool: error: /work/c01/meta.json: not UTF-8\n", None, 2, "OK", ""),
    (1, "", "tool: error: /work/c01/meta.json: not UTF-8\n", None, 2, "WEAK", "exit 1, expected 2"),
    (2, "", "tool: error: meta.json: not UTF-8\n", None, 2, "WEAK", "the message does not name 'W/meta.json'"),
    (0, "done\n", "", None, 2, "DEFECT", "exit 0, expected 2"),
    (2, "", "warning: x\n", None, 0, "DEFECT", "exit 2, expected 0"),
    (1, "", "Traceback (most recent call last):\n  File ...\nKeyError: 'classes' /work/c01/meta.json\n", None, 1,
     "DEFECT", "a traceback"),
    (2, "", "tool: error: /work/c01/meta.json: x\n", "a temporary file left behind", 2, "DEFECT",
     "a temporary file left behind"),
    (-9, "", "", None, 1, "DEFECT", "killed by signal 9"),
    (None, "", "", None, 2, "DEFECT", "no exit within 120 s"),
])
def test_verdicts(code, out, err, problem, expect, verdict, reason):
    got, why, _ = judge(case(expect), code, out, err, problem, W)
    assert got == verdict and reason in why, (got, why)
    assert (why == "") == (verdict == "OK")


def test_the_message_is_the_first_line_of_stderr_else_stdout_or_the_line_asked_for():
    first = "first /work/c01/meta.json"
    assert judge(case(), 2, "out\n", f"\n  {first}\nsecond\n", None, W)[2] == first
    assert judge(case(), 2, f"{first}\n", "", None, W)[2] == first
    picked = case(expect=0, names=("lr 0.001",), line=r"lr \d")
    out = "config\nglobal batch 8, lr 0.001\n"
    assert judge(picked, 0, out, "note\n", None, W) == ("OK", "", "global batch 8, lr 0.001")
    assert judge(picked, 0, "config\n", "note\n", None, W)[0] == "WEAK"  # no such line: nothing named


def test_a_subset_of_the_table_with_planted_failures(tmp_path, monkeypatch, capsys):
    faults = load_script("faults", "tools")
    real = next(c for c in PREPROCESS_CASES if c.name == "preprocess-out-is-a-file")
    planted = [
        Case("planted-wrong-exit", "traceback", "as above, but expecting exit 1 and another name", 1,
             ("nowhere.txt",), real.setup),
        Case("planted-traceback", "traceback", "a command that dies with a traceback", 2, ("boom",),
             lambda work: ["-c", "raise ValueError('boom')"]),
    ]
    monkeypatch.setattr(faults, "CASES", [real, *planted])
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    code = faults.main(["--work", str(tmp_path / "w"), "--md", str(md), "--json", str(js)])
    assert code == 1
    record = json.loads(js.read_text())
    rows = {c["case"]: c for c in record["cases"]}
    assert rows[real.name]["verdict"] == "OK" and rows[real.name]["exit"] == 2
    assert rows[real.name]["message"].startswith("preprocess.py: error: argument --out: W/c01/file.txt is a file")
    assert (rows["planted-wrong-exit"]["verdict"], rows["planted-wrong-exit"]["reason"]) == (
        "WEAK", "exit 2, expected 1; the message does not name 'nowhere.txt'")
    assert rows["planted-traceback"]["verdict"] == "DEFECT"
    assert rows["planted-traceback"]["reason"].startswith("a traceback; exit 1, expected 2")
    assert record["counts"] == {"OK": 1, "WEAK": 1, "DEFECT": 1, "SKIP": 0}
    table = md.read_text().splitlines()
    assert len([r for r in table if r.startswith("| `")]) == 3
    assert "| **WEAK**: exit 2, expected 1;" in next(r for r in table if "planted-wrong-exit" in r)
    assert "3 cases: 1 OK, 1 WEAK, 1 DEFECT, 0 SKIP" in capsys.readouterr().out
    def cannot(work):
        raise Skip("cannot mount a tmpfs (not root?)")
    monkeypatch.setattr(faults, "CASES", [real, Case("planted-skip", "traceback", "x", 2, (), cannot)])
    assert faults.main(["--work", str(tmp_path / "w2"), "--json", str(js)]) == 0  # a SKIP fails nothing
    assert [c["verdict"] for c in json.loads(js.read_text())["cases"]] == ["OK", "SKIP"]


def test_the_tools_get_the_default_stop_signals_when_started_in_the_background(tmp_path, monkeypatch):
    """A shell starts `faults.py &` with SIGINT ignored, nohup with SIGHUP ignored, and exec keeps an ignored
    signal ignored: its Ctrl-C and SIGHUP cases would judge that (exit 0 or a hang) instead of the tools."""
    import signal
    faults = load_script("faults", "tools")
    probe = Case("stop-signals-default", "traceback", "the child's SIGINT and SIGHUP dispositions", 0, (),
                 lambda work: ["-c", "import signal, sys; sys.exit(0 if signal.getsignal(signal.SIGINT) is "
                               "signal.default_int_handler and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL "
                               "else 3)"])
    monkeypatch.setattr(faults, "CASES", [probe])
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGHUP)}
    try:
        assert faults.main(["--work", str(tmp_path / "w"), "--json", str(tmp_path / "t.json")]) == 0
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert json.loads((tmp_path / "t.json").read_text())["cases"][0]["verdict"] == "OK"


def test_every_case_is_named_once_with_a_known_kind():
    from tools.faultcheck.core import KINDS
    faults = load_script("faults", "tools")
    names = [c.name for c in faults.CASES]
    assert len(names) == len(set(names)) and len(names) > 120
    assert [c.name for c in faults.CASES if c.kind not in KINDS] == []
