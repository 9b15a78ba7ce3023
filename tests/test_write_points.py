"""Every write point of every tool that writes, killed at: the tools' files take their final names only in
data.fsutil.commit (checked over the source), whose test hook numbers each moment at run time (before and
after each rename); the tool is killed with SIGKILL at a moment drawn per run (seeded, the seed printed;
ALEXNET_WRITE_POINTS=all: every moment), no process of it survives, and the same command again gives the
uninterrupted run's output with no temporary left (tests/write_points.py says how). Two runs of one
command on one output: the first held at a drawn moment while the second runs whole, then let go; each
finishes or is refused in one line, and they leave one run's output (one tool per suite run, drawn).

A new write (a new commit call) is a new moment without an edit here; a new user script must be listed
below as walked or as writing nothing to resume (test_every_script_is_walked_or_declared)."""
from __future__ import annotations

import ast
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import figure_runs
from tests.conftest import REPO, tiny_overrides
from tests.parsers import parses_over_its_own_output
from tests.write_points import (
    differences,
    run_inside,
    run_tool,
    snapshot,
    temporaries,
    written_in_place,
    written_outside,
)

# Its tests start processes (the tools): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

SEED = int(os.environ.get("ALEXNET_WRITE_SEED") or random.SystemRandom().randrange(10**6))
EVERY = os.environ.get("ALEXNET_WRITE_POINTS") == "all"
LOADER = {"data.loading": "process", "run.device": "cpu"}  # the demo's: a loader process per trainer
# The library: where a file may take its final name only through data.fsutil.commit.
SOURCES = ("alexnet", "data", "scripts", "train.py")


@dataclass
class Case:
    """A tool's command for an output folder `out` (made fresh by `fresh` before each run)."""

    argv: Callable[[Path], list[str]]
    fresh: Callable[[Path], None] = lambda out: out.mkdir(parents=True)
    ignore: tuple[str, ...] = ()        # files whose presence after a kill is by design (named where used)
    inputs: dict = field(default_factory=dict)


def _copy_of(source: Path) -> Callable[[Path], None]:
    return lambda out: shutil.copytree(source, out)


def _cases(factory) -> dict[str, Case]:
    data = figure_runs.named_data(factory)
    run = figure_runs.demo_run(factory)
    src = data.parent / "src"
    ckpt = run / "checkpoints" / "last.pt"
    return {
        # A run killed before its first checkpoint keeps that attempt's records as metrics.prev-N.jsonl (so
        # that no step is recorded twice): by design, the one file the rerun adds.
        "train": Case(lambda out: ["train.py", "configs/demo.yaml", *tiny_overrides(data, out, **LOADER)],
                      fresh=lambda out: None, ignore=("metrics.prev-*.jsonl",)),
        # train.py's own launcher, its 2 replicas (sessions of their own) and their loader processes
        "train:replicas": Case(lambda out: ["train.py", "configs/demo.yaml",
                                            *tiny_overrides(data, out, **LOADER, **{"parallel.replicas": 2})],
                               fresh=lambda out: None, ignore=("metrics.prev-*.jsonl",)),
        "preprocess": Case(lambda out: ["scripts/preprocess.py", "--train-dir", str(src / "train"), "--val-dir",
                                        str(src / "val"), "--val-labels", str(src / "val.txt"), "--out", str(out),
                                        "--size", "72", "--per-file", "16", "--workers", "2", "--quiet"],
                           fresh=lambda out: None),
        "evaluate": Case(lambda out: ["scripts/evaluate.py", "--data", str(data), "--weights", str(ckpt),
                                      "--json", str(out / "eval.json"), "--csv", str(out / "eval.csv"),
                                      "--no-progress", "--crops", "10"]),
        "report": Case(lambda out: ["scripts/report.py", str(out), "--no-progress", "--train-images", "20"],
                       fresh=_copy_of(run)),
        "figures": Case(lambda out: ["scripts/figures.py", "--weights", str(ckpt), "--data", str(data), "--out",
                                     str(out), "--n-images", "4", "--train-images", "20", "--queries", "2",
                                     "--neighbours", "3"], fresh=lambda out: None),
        "plot": Case(lambda out: ["scripts/plot.py", str(run), "--out", str(out / "curve.png")]),
        "convert_weights": Case(lambda out: ["scripts/convert_weights.py", str(theano_folder(factory)),
                                             str(out / "converted.pt")]),
        "convert_weights:to-theano": Case(lambda out: ["scripts/convert_weights.py", str(theano_pt(factory)),
                                                       str(out / "theano")]),
        "upgrade_data": Case(lambda out: ["scripts/upgrade_data.py", str(out), "--quiet"],
                             fresh=_copy_of(format_1(factory, data))),
    }


TOOLS = ["train", "train:replicas", "preprocess", "evaluate", "report", "figures", "plot", "convert_weights",
         "convert_weights:to-theano", "upgrade_data"]  # script[:what], a script may write in several ways
# Files a tool writes under their own names by design (not renamed into place by commit), with the reason.
# Any other file opened for writing under its final name fails the walk (tests/write_audit records them).
IN_PLACE = {
    ".lock": "a folder's lock (data.fsutil.exclusive_dir): an empty file held with flock, never read as output",
    "metrics.jsonl": "the run's append-only log (alexnet.metrics.MetricsLog): whole lines appended and flushed; "
                     "a line cut short is dropped when the file is opened, and truncate_after rewrites it "
                     "through commit",
}
# Scripts that write nothing a later run resumes from or reads (what they print, or a generated test
# input that is written again whole), with the reason.
NOT_WALKED = {
    "predict": "prints its predictions; writes no file",
    "make_synthetic": "writes generated test images; run again it writes them all again",
    "benchmark": "its --json is one atomic write (commit) of measurements, not resumable work",
    "gpu_check": "writes its report through commit; its steps are the other tools",
}


def theano_folder(factory) -> Path:
    from tests.test_theano_weights import EPOCH, write_folder
    folder = factory.getbasetemp() / "write_points_theano"
    if not folder.exists():
        write_folder(folder / "weights", EPOCH, seed=4)
    return folder / "weights"


def theano_pt(factory) -> Path:
    """The Theano folder converted to our .pt (caffenet, the paper's LRN): what converts back to a folder."""
    path = factory.getbasetemp() / "write_points_theano.pt"
    if not path.exists():  # an input of the walk, not a walked run: in this process
        from tests.conftest import load_script
        assert load_script("convert_weights").main([str(theano_folder(factory)), str(path)]) == 0
    return path


def format_1(factory, data: Path) -> Path:
    from tests.test_fastread import format_1_copy
    folder = factory.getbasetemp() / "write_points_format_1"
    if not folder.exists():
        format_1_copy(data, folder)
    return folder


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    print(f"write points: seed {SEED} (ALEXNET_WRITE_SEED={SEED} draws the same moments; "
          "ALEXNET_WRITE_POINTS=all tries every one)")
    return _cases(tmp_path_factory)


def test_every_script_is_walked_or_declared(cases):
    scripts = {p.stem for p in (REPO / "scripts").glob("*.py")} | {"train"}
    walked = {t.split(":")[0] for t in TOOLS}
    assert set(cases) == set(TOOLS) and not walked & set(NOT_WALKED)
    assert walked | set(NOT_WALKED) == scripts, (
        f"walked: {sorted(walked)}; declared: {sorted(NOT_WALKED)}; scripts: {sorted(scripts)}")


def _renames(path: Path, root: Path = REPO) -> list[str]:
    """Calls that give a file a new name (os.replace/rename, shutil.move, Path.rename, Path.replace with one
    argument, str.replace has two) outside data/fsutil.py's commit."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "commit" and path.name == "fsutil.py":
            for inner in ast.walk(node):
                inner.allowed = True  # type: ignore[attr-defined]
    # the names a module binds to os, shutil and their renaming functions (import os as _os, from os import
    # replace): a rename under another name is still a rename
    modules, functions = {"os": "os", "shutil": "shutil"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname or a.name: a.name for a in node.names if a.name in ("os", "shutil")})
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            functions.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or getattr(node, "allowed", False):
            continue
        f = node.func
        name = ast.unparse(f)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
            name = f"{modules[f.value.id]}.{f.attr}"
        elif isinstance(f, ast.Name):
            name = functions.get(f.id, name)
        if (name in ("os.replace", "os.rename", "os.renames", "shutil.move")
                or (isinstance(f, ast.Attribute) and f.attr == "rename")
                or (isinstance(f, ast.Attribute) and f.attr == "replace" and len(node.args) + len(node.keywords) == 1)):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_rename_goes_through_commit():
    files = [p for s in SOURCES for p in ([REPO / s] if s.endswith(".py") else (REPO / s).rglob("*.py"))]
    found = [hit for p in files for hit in _renames(p)]
    assert not found, "a file takes its final name outside data.fsutil.commit:\n" + "\n".join(found)


def test_the_rename_check_finds_a_planted_rename(tmp_path):
    planted = tmp_path / "fsutil.py"
    planted.write_text("import os, shutil\nfrom pathlib import Path\n\ndef f(a, b):\n    os.replace(a, b)\n"
                       "    Path(a).replace(b)\n    'x'.replace('a', 'b')\n    shutil.move(a, b)\n"
                       "    Path(a).rename(b)\n\ndef commit(a, b):\n    os.replace(a, b)\n\n"
                       "import os as _os\nfrom os import replace as swap, renames\nfrom shutil import move\n\n"
                       "def g(a, b):\n    _os.replace(a, b)\n    swap(a, b)\n    renames(a, b)\n    move(a, b)\n")
    assert [h.split(": ", 1)[1] for h in _renames(planted, tmp_path)] == [
        "os.replace(a, b)", "Path(a).replace(b)", "shutil.move(a, b)", "Path(a).rename(b)",
        "_os.replace(a, b)", "swap(a, b)", "renames(a, b)", "move(a, b)"]


# by tool and output path: an output may hold its own path (report's cache file is named by a key made of the
# weights' path, inside the output), so a snapshot is only the expectation for the path it was made in
_UNINTERRUPTED: dict[tuple[str, str], tuple[int, dict]] = {}


def uninterrupted(tool: str, case: Case, work: Path) -> tuple[int, dict]:
    """The tool's write moments and output, run once without a stop (in `work`/out; kept for the
    module's other tests of the tool): it writes only through commit, and only into its output."""
    out = work / "out"
    if (tool, str(out)) in _UNINTERRUPTED:
        return _UNINTERRUPTED[tool, str(out)]
    case.fresh(out)
    done = run_tool(case.argv(out), work)
    assert done.rc == 0, done.output[-3000:]
    moments = len(done.trace)
    assert moments >= 2 and moments % 2 == 0, done.trace  # a rename is two moments: before and after
    assert done.opened, "the write audit recorded nothing: tests/write_audit/sitecustomize.py did not load"
    in_place = written_in_place(done.opened, out, IN_PLACE)
    assert not in_place, f"{tool} wrote these under their final names, not through commit: {in_place}"
    outside = written_outside(done.opened, out, (str(work / "trace-"),))
    assert not outside, f"{tool} wrote outside its output {out}: {outside}"
    print(f"{tool}: {moments} moments ({moments // 2} renames)")
    parses_over_its_own_output(case.argv(out))
    _UNINTERRUPTED[tool, str(out)] = moments, snapshot(out, case.ignore)
    shutil.rmtree(out)
    return _UNINTERRUPTED[tool, str(out)]


def _each_moment(tool: str, case: Case, work: Path, salt: str = ""):
    """(moment, the tool's moments, the uninterrupted output) for each moment this run tries (one drawn with
    the seed, or all), the output folder `work`/out made fresh before each."""
    out = work / "out"
    moments, want = uninterrupted(tool, case, work)
    rng = random.Random(f"{SEED}-{salt}{tool}")
    for k in (range(1, moments + 1) if EVERY else [rng.randint(1, moments)]):
        shutil.rmtree(out, ignore_errors=True)
        case.fresh(out)
        yield k, moments, want


@pytest.mark.parametrize("tool", TOOLS)
def test_killed_at_a_write_point_the_tool_reruns_to_the_same_output(tool, cases, tmp_path):
    """The uninterrupted run and each killed one write to the same path (outputs may hold their own path,
    a cache key made of it, a plot legend with the folder's name)."""
    case, out = cases[tool], tmp_path / "out"
    for k, moments, want in _each_moment(tool, case, tmp_path):
        killed = run_tool(case.argv(out), tmp_path, pause_at=k)
        assert killed.rc == -9, killed.output[-2000:]
        where = f"{tool} killed at moment {k} of {moments} ({killed.trace[k - 1][2]} {killed.trace[k - 1][3]})"
        again = run_tool(case.argv(out), tmp_path)
        assert again.rc == 0, f"{where}; the rerun exited {again.rc}: {again.output[-3000:]}"
        assert not temporaries(out), f"{where}; left: {temporaries(out)}"
        diff = differences(snapshot(out, case.ignore), want)
        assert not diff, f"{where}; the rerun's output differs from the uninterrupted run's: {diff}"


def _refused_in_one_line(run) -> bool:
    lines = [ln for ln in run.output.splitlines() if ln.strip()]
    return run.rc not in (0, None) and len(lines) == 1 and "Traceback" not in run.output


def test_a_second_run_inside_a_write_point_of_the_first_leaves_one_runs_output(cases, tmp_path):
    """Two runs of one command on one output (sent twice, two jobs of a batch scheduler): the first is held
    at a write moment (drawn per run) while the second runs whole, then goes on. Each finishes, or is
    refused in one line; what they leave is what one run leaves, and no temporary. One tool per suite run,
    drawn with the seed (drawn here, not as a parameter: each xdist worker must collect the same tests);
    ALEXNET_WRITE_POINTS=all: each tool at each of its moments."""
    for tool in TOOLS if EVERY else [random.Random(f"{SEED}-inside").choice(TOOLS)]:
        print(f"a second run inside {tool}'s write moments")
        _second_run_inside(tool, cases[tool], tmp_path / tool.replace(":", "-"))


def _second_run_inside(tool: str, case: Case, work: Path) -> None:
    work.mkdir()
    out = work / "out"
    for k, moments, want in _each_moment(tool, case, work, "inside-"):
        first, second = run_inside(case.argv(out), work, k)
        where = f"{tool}, the second run inside moment {k} of {moments} of the first ({first.trace[k - 1][2]} " \
                f"{first.trace[k - 1][3]})"
        for name, r in (("first", first), ("second", second)):
            assert r.rc == 0 or _refused_in_one_line(r), f"{where}: the {name} exited {r.rc}: {r.output[-3000:]}"
        assert 0 in (first.rc, second.rc), f"{where}: neither finished: {first.output[-1500:]}{second.output[-1500:]}"
        assert not temporaries(out), f"{where}; left: {temporaries(out)}"
        diff = differences(snapshot(out, case.ignore), want)
        assert not diff, f"{where}: the two left another output than one run: {diff}"


def test_a_pipe_in_place_of_a_file_of_the_output_is_refused_not_waited_on(cases, tmp_path):
    """Each file a tool's output holds after its run, replaced by a named pipe (which blocks whoever opens it
    until a partner comes), and the same command again: it finishes or is refused in one line, and no thread
    of it blocks opening the pipe (found in /proc at once: tests/children.waiting_on_a_pipe). One tool and
    one of its files per suite run, drawn with the seed; ALEXNET_WRITE_POINTS=all: every file of every tool."""
    failures = []
    for tool in TOOLS if EVERY else [random.Random(f"{SEED}-pipe").choice(TOOLS)]:
        failures += _pipe_in_output(tool, cases[tool], tmp_path / tool.replace(":", "-"))
    assert not failures, "\n".join(failures)


def _pipe_in_output(tool: str, case: Case, work: Path) -> list[str]:
    """What went wrong with each file of `tool`'s output tried as a pipe."""
    import subprocess
    import sys

    from tests import children
    work.mkdir()
    out, kept = work / "out", work / "kept"
    case.fresh(out)
    done = run_tool(case.argv(out), work)
    assert done.rc == 0, done.output[-3000:]
    shutil.copytree(out, kept, symlinks=True)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file() and not p.is_symlink())
    assert files, f"{tool} left no file in {out}"
    rng = random.Random(f"{SEED}-pipe-{tool}")
    failures = []
    for rel in files if EVERY else [rng.choice(files)]:
        shutil.rmtree(out)
        shutil.copytree(kept, out, symlinks=True)
        (out / rel).unlink()
        os.mkfifo(out / rel)
        with open(work / "log.txt", "w+") as log:
            proc = subprocess.Popen([sys.executable, *case.argv(out)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    start_new_session=True)
            blocked = children.wait_unless_blocked_on_a_pipe(proc, cpu_s=300)
            log.seek(0)
            output = log.read()
        where = f"{tool}: {rel} of its output a named pipe"
        print(f"{where}: exit {proc.returncode}")
        lines = [ln for ln in output.splitlines() if ln.strip()]
        if blocked:
            failures.append(f"{where}: waited on it for ever: {blocked}; {output[-1000:]}")
        elif not (proc.returncode == 0 or (proc.returncode == 2 and len(lines) == 1 and "Traceback" not in output)):
            failures.append(f"{where}: exit {proc.returncode}: {output[-1000:]}")
    return failures
