"""Every user script's --help (each .py file directly in scripts/, and train.py) ends with one example command.

The last non-empty line of the help is `example: python <the script> ...`, and every --flag it uses is one
the help lists. The scripts are found by listing the folder, so a new script without an example fails
here; all of them run in one subprocess (each imports torch: one import instead of twelve).
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests import children
from tests.conftest import REPO

# Runs each script given as `--help` in this one process (runpy, as `python SCRIPT --help` would), and
# writes {script: {"code": exit code, "help": stdout, "collecting": gc.isenabled() after it, "follows": whether
# it took the parent's pid its starter gave it (procs.follow_parent)}} to the file named first.
DRIVER = r"""
import contextlib, gc, io, json, os, runpy, sys
out, scripts, results = sys.argv[1], sys.argv[2:], {}
for script in scripts:
    buf, code, path = io.StringIO(), 0, list(sys.path)
    sys.argv = [script, "--help"]
    os.environ["ALEXNET_PARENT_PID"] = str(os.getppid())  # as procs.watched_env says it: this test's process
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
    sys.path[:] = path
    results[script] = {"code": code, "help": buf.getvalue(), "collecting": gc.isenabled(),
                       "follows": "ALEXNET_PARENT_PID" not in os.environ}
with open(out, "w") as f:
    json.dump(results, f)
"""

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def user_scripts() -> list[str]:
    """The user scripts, as `python <this>` names them from the repository root."""
    return [p.relative_to(REPO).as_posix() for p in sorted((REPO / "scripts").glob("*.py"))] + ["train.py"]


def help_problems(script: str, text: str) -> list[str]:
    """What is wrong with `script`'s --help output `text` (empty: it ends with a working example)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return [f"{script}: --help printed nothing"]
    command = lines[-1].removeprefix("example:").strip()
    words = command.split()
    if words[:1] != ["python"] or words[1:2] != [script]:
        return [f"{script}: the last line of --help is not an example `python {script} ...`: {lines[-1]!r}"]
    rest = "\n".join(lines[:-1])
    return [f"{script}: the example's {flag} is not an option of the script"
            for flag in FLAG.findall(command) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", rest)]


OPTION = re.compile(r"^  (-{1,2}\w[\w-]*)")  # an option's first line in argparse's listing


def help_gaps(script: str, text: str) -> list[str]:
    """Options listed without a word of help, and a description whose first line stops mid-sentence."""
    lines = text.splitlines()
    gaps = []
    for i, line in enumerate(lines):
        m = OPTION.match(line)
        if not m or re.search(r"\S\s{2,}\S", line.strip()):  # help on the same line, after the signature
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^\s{6,}\S", following):  # nor on the next, indented below it
            gaps.append(f"{script}: {m.group(1)} has no help")
    after_usage = text.split("\n\n", 1)[1] if "\n\n" in text else ""
    first = after_usage.strip().splitlines()[0] if after_usage.strip() else ""
    if not first.rstrip().endswith((".", ")", ":")):
        gaps.append(f"{script}: the description's first line stops mid-sentence: {first!r}")
    return gaps


@pytest.mark.processes
def test_every_user_script_help_ends_with_an_example(tmp_path):
    scripts = user_scripts()
    assert {"scripts/preprocess.py", "scripts/evaluate.py", "scripts/gpu_check.py", "train.py"} <= set(scripts)
    out = tmp_path / "help.json"
    r = children.run([sys.executable, "-c", DRIVER, str(out), *scripts], cpu_s=120, cwd=REPO,
                     env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    bad = [f"{s}: --help exited {results[s]['code']}" for s in scripts if results[s]["code"] != 0]
    bad += [problem for s in scripts for problem in help_problems(s, results[s]["help"])]
    bad += [gap for s in scripts for gap in help_gaps(s, results[s]["help"])]
    # quiet_start turned the collector off for the imports; protect_streams turns it back on (a script that
    # skipped it would train for days without collecting cycles)
    bad += [f"{s}: the garbage collector is still off after --help" for s in scripts if not results[s]["collecting"]]
    # and asks to end with the process that started it (a benchmark's train.py runs, gpu_check's steps and their
    # commands, our launcher's replicas): one that did not would outlive a starter killed by SIGKILL
    bad += [f"{s}: did not follow its parent (procs.follow_parent)" for s in scripts if not results[s]["follows"]]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_missing_example_and_a_flag_the_script_lacks():
    text = "usage: x.py [-h] --data DATA\n\noptions:\n  --data DATA  the data\n\nExit codes: 0 done.\n"
    assert help_problems("scripts/x.py", text) == [
        "scripts/x.py: the last line of --help is not an example `python scripts/x.py ...`: 'Exit codes: 0 done.'"]
    assert help_problems("scripts/x.py", text + "\nexample: python scripts/y.py --data d\n") == [
        "scripts/x.py: the last line of --help is not an example `python scripts/x.py ...`: "
        "'example: python scripts/y.py --data d'"]
    assert help_problems("scripts/x.py", text + "\nexample: python scripts/x.py --data d --crops 10\n") == [
        "scripts/x.py: the example's --crops is not an option of the script"]
    assert help_problems("scripts/x.py", text + "\nexample: python scripts/x.py --data d\n") == []
    assert help_problems("scripts/x.py", "") == ["scripts/x.py: --help printed nothing"]


def test_the_check_sees_an_option_without_help_and_a_cut_description():
    text = ("usage: x.py [-h] --data DATA\n\nEvaluate weights and\n\noptions:\n"
            "  -h, --help   show this help message and exit\n  --data DATA\n  --out OUT    the folder\n"
            "  --very-long-option-name VERY_LONG_OPTION_NAME\n                        its help below\n")
    assert help_gaps("x.py", text) == ["x.py: --data has no help",
                                       "x.py: the description's first line stops mid-sentence: 'Evaluate weights and'"]
    assert help_gaps("x.py", text.replace("  --data DATA\n", "  --data DATA  the data\n").replace(" and", ".")) == []
