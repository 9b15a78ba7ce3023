"""Every option of every user script, as its parser defines it: a value it takes has a declared domain
(data/domains.py, a list of choices, or text), and every value a numeric domain refuses is refused by the
script's own parser with exit 2 and one line naming the option, before anything runs.

The parsers are found by calling each script's main() with argparse's parse_args intercepted (the parser
is captured, nothing runs), subcommands included, so an option added later is tried without an edit here.
In-process for every option and value; one real process per run, a (script, option, value) drawn with a
seed that changes every run and is printed, for what only a process shows (no traceback, nothing written).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from pathlib import Path

import pytest

from data.domains import (
    DATASET_MARKS,
    AnyOf,
    Domain,
    Earlier,
    InputPath,
    OneLineParser,
    OutputPath,
    dataset_above,
    holding,
    json_holding,
    starting_with,
)
from tests import children
from tests.conftest import REPO
from tests.parsers import script_parser
from tests.test_script_help import user_scripts


def parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(the words that select it, parser) for `parser` and each subcommand's, depth first."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*prefix, name))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a user gives values to (not flags, not hidden, not positionals)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


@pytest.fixture(scope="module")
def every_option() -> list[tuple[str, tuple[str, ...], argparse.Action, argparse.ArgumentParser]]:
    return [(script, words, action, p) for script in user_scripts()
            for words, p in parsers(script_parser(script)) for action in options(p)]


def test_the_walk_finds_the_options_of_every_script_and_subcommand(every_option):
    """An independent look: options known to exist, in a script, a data module's CLI and a subcommand."""
    named = {(s, w, a.option_strings[-1]) for s, w, a, _ in every_option}
    assert {("scripts/evaluate.py", (), "--batch-size"), ("scripts/preprocess.py", (), "--workers"),
            ("scripts/make_synthetic.py", (), "--classes"), ("scripts/benchmark.py", ("read",), "--per-file"),
            ("scripts/gpu_check.py", (), "--budget")} <= named
    assert len({s for s, *_ in every_option}) >= 10


DECLARED = (Domain, OutputPath, InputPath, AnyOf)


def test_every_argument_that_takes_a_value_has_a_declared_domain(every_path_argument):
    """Options and positionals: a list of choices or a data/domains.py type; a bare int, float, str or no
    type at all (text taken as it comes: a missing file found only when opened, after other work) fails."""
    bare = [f"{s} {' '.join(w)} {(a.option_strings or [a.dest])[-1]}: type {getattr(a.type, '__name__', a.type)}"
            for s, w, a, _ in every_path_argument if a.choices is None and not isinstance(a.type, DECLARED)]
    assert not bare, "arguments without a declared domain (data/domains.py):\n" + "\n".join(bare)


# Where a tool writes, by the option's name; a new output option named so must declare an OutputPath.
OUTPUT_NAMES = ("out", "json", "csv", "dst", "keep", "cache")
# Output-like options that are not a place the tool's own results go, with the reason.
NOT_OUTPUT = {("scripts/benchmark.py", ("checkpoint",), "dir"):
              "a file system to time writes on (a temporary file, removed): any folder will do"}


@pytest.fixture(scope="module")
def every_path_argument() -> list[tuple[str, tuple[str, ...], argparse.Action, argparse.ArgumentParser]]:
    """Options and positionals alike: an output may be either (convert_weights.py's dst)."""
    return [(script, words, action, p) for script in user_scripts()
            for words, p in parsers(script_parser(script)) for action in p._actions
            if action.nargs != 0 and action.help != argparse.SUPPRESS
            and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]


def test_every_output_argument_declares_where_it_may_write(every_path_argument):
    named = [(s, w, a) for s, w, a, _ in every_path_argument if a.dest in OUTPUT_NAMES or a.dest in
             {k[2] for k in NOT_OUTPUT}]
    missing = [f"{s} {' '.join(w)} {a.dest}" for s, w, a in named
               if not isinstance(a.type, OutputPath) and (s, w, a.dest) not in NOT_OUTPUT]
    assert not missing, "output arguments without an OutputPath (data/domains.py):\n" + "\n".join(missing)
    assert len([1 for _, _, a in named if isinstance(a.type, OutputPath)]) >= 15


# Files no tool wrote, of the kinds the tools write and read: each is refused at every output file option.
_FOREIGN_FILES = {
    "config.yaml": (REPO / "configs" / "demo.yaml").read_bytes(),
    "meta.json": b'{"format_version": 2, "classes": 4, "dataset": "a1b2"}\n',
    "empty.json": b"",
    "list.json": b"[]",
    "object.json": b"{}",
    "notes.csv": b"name,label\r\nx,1\r\n",
    "page.html": b"<!DOCTYPE html><html><head><title>x: report</title></head></html>",
    "figure.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\x00Software\x00Matplotlib",
    "weights.pt": b"PK\x03\x04" + bytes(60),
}


def _bad_outputs(domain: OutputPath, tmp: Path) -> dict[str, str]:
    """Texts an output of `domain` must refuse, made under `tmp`, with the words the refusal must hold."""
    kind = domain.kind
    a_file, foreign = tmp / "a_file", tmp / "someone_elses"
    a_file.write_text("x")
    foreign.mkdir(exist_ok=True)
    (foreign / "mine.txt").write_text("not the tool's")
    pipe = tmp / "a_pipe"
    if not pipe.exists():
        os.mkfifo(pipe)
    # a pipe blocks its reader for ever; a device would be renamed over (as root, /dev/null itself)
    bad = {"": "empty", "/": "root folder", str(a_file / "x"): "is a file, so",
           str(pipe): f"{pipe} is not a regular file", "/dev/null": "/dev/null is not a regular file"}
    if kind == "file":
        bad[str(tmp)] = "is a folder"
        bad["."] = "is a folder"
        for name, content in _FOREIGN_FILES.items():  # someone else's file, where the tool would write
            (tmp / name).write_bytes(content)
            bad[str(tmp / name)] = f"{tmp / name} exists and is not "
    else:
        bad[str(foreign)] = "holds files this tool did not write ('mine.txt')"
        pictures = tmp / "pictures"  # the kinds of files tools write, but the user's (figures took any .png)
        pictures.mkdir(exist_ok=True)
        for name in ("holiday.png", "table.json"):
            (pictures / name).write_text("the user's")
        bad[str(pictures)] = "holds files this tool did not write ('holiday.png' and 1 more)"
        # a folder of the tool's own names (hidden ones are every tool's) holding a pipe, in a subfolder:
        # the tool opens its own files by name later, and a pipe blocks it for ever
        with_pipe = tmp / "with_a_pipe"
        if not with_pipe.exists():
            (with_pipe / ".state").mkdir(parents=True)
            os.mkfifo(with_pipe / ".state" / ".lock")
        bad[str(with_pipe)] = f"{with_pipe} holds .state/.lock, not a regular file or folder (a device, pipe or socket)"
        bad["."] = "(the working directory) holds files this tool did not write"
        # a file under one of the names the tool writes there, that it did not write (the user's filters.png)
        for name in domain.known:
            for foreign_name, content in _FOREIGN_FILES.items():
                folder = tmp / f"own-names-{name}-{foreign_name}"
                folder.mkdir(exist_ok=True)
                (folder / name).write_bytes(content)
                bad[str(folder)] = f"holds {name!r}, which has this tool's name but is not "
            as_pipe = tmp / f"own-names-{name}-a-pipe"  # judged by content, it must not be opened: it blocks
            as_pipe.mkdir(exist_ok=True)
            if not (as_pipe / name).exists():
                os.mkfifo(as_pipe / name)
            bad[str(as_pipe)] = f"holds {name!r}, which has this tool's name but is not "
            as_folder = tmp / f"own-names-{name}-a-folder"  # a folder of someone else's under the name
            (as_folder / name).mkdir(parents=True, exist_ok=True)
            (as_folder / name / "mine.txt").write_text("the user's")
            bad[str(as_folder)] = f"holds {name!r}, which has this tool's name but is not "
        if kind == "folder":
            bad[str(a_file)] = "is a file, not a folder"
    return bad


# Names an output folder's tool writes (own=) that it does not judge by what they hold (known=), with the reason.
UNJUDGED = {
    ("scripts/make_synthetic.py", "train"): "the tree is judged whole by its manifest.json (data/synthetic.py "
                                            "MANIFEST); generate() refuses another's before removing anything",
    ("scripts/make_synthetic.py", "val"): "as train",
    ("scripts/make_synthetic.py", "LOC_val_solution.csv"): "as train (it has the real file's header)",
    ("scripts/make_synthetic.py", "val.txt"): "as train",
    ("scripts/preprocess.py", "plan.json"): "read by preprocess itself before any work, naming what is wrong "
                                            "with it (data/preprocess.py _read_plan, _check_plan)",
}


def test_every_name_an_output_folder_takes_is_known_by_what_it_holds(every_path_argument):
    """A name a tool writes in its output folder, found there holding someone else's file or folder, was taken
    as the tool's by its name alone: replaced, removed (gpu_check's work/), or written beside (preprocess's
    sources_index.json). Each literal own name (a pattern such as *.npz is judged by its pattern) has a
    judge (known=), or a reason above."""
    names = {(script, name) for script, _, action, _ in every_path_argument
             if isinstance(action.type, OutputPath) and action.type.kind != "file"
             for name in action.type.own if not any(c in name for c in "*?[")
             and name not in action.type.known}
    assert names == set(UNJUDGED), f"without a judge: {sorted(names - set(UNJUDGED))}; " \
                                   f"listed but judged (or gone): {sorted(set(UNJUDGED) - names)}"


def refused_wrongly(cases, capsys) -> list[str]:
    """Each (script, words, action, parser, text, needed) given to its parser: what was not refused with exit
    2 and one line naming the argument and holding `needed`. Positionals through their type (their parser
    takes other positionals first)."""
    wrong = []
    for script, words, action, parser, text, needed in cases:
        if not action.option_strings:
            try:
                action.type(text)
                wrong.append(f"{script} {action.dest}={text!r}: accepted")
            except argparse.ArgumentTypeError as e:
                if needed not in str(e):
                    wrong.append(f"{script} {action.dest}={text!r}: {e}")
            continue
        flag = action.option_strings[-1]
        with pytest.raises(SystemExit) as e:
            parser.parse_args([f"{flag}={text}"])
        err = capsys.readouterr().err.strip().splitlines()
        if e.value.code != 2 or len(err) != 1 or flag not in err[0] or needed not in err[0]:
            wrong.append(f"{script} {' '.join(words)} {flag}={text!r}: exit {e.value.code}, {err[-1:]}")
    return wrong


def test_every_output_argument_refuses_where_it_must_not_write(every_path_argument, tmp_path, capsys,
                                                               monkeypatch):
    """"", "/", a file's child, a folder for a file and a file for a folder, and a folder of someone
    else's files (the working directory, here holding a_file and someone_elses, too): exit 2, one line
    naming the argument; positionals through their type (their parser takes other positionals first)."""
    monkeypatch.chdir(tmp_path)
    cases = [(script, words, action, parser, text, needed) for script, words, action, parser in every_path_argument
             if isinstance(action.type, OutputPath)
             for text, needed in _bad_outputs(action.type, tmp_path).items()]
    wrong = refused_wrongly(cases, capsys)
    assert not wrong, "\n".join(wrong)
    assert len(cases) >= 80


def _refuses(kind, text: str) -> bool:
    try:
        kind(text)
    except argparse.ArgumentTypeError:
        return True
    return False


def _bad_inputs(kind: InputPath | AnyOf | Domain, tmp: Path) -> dict[str, str]:
    """Texts an input type must refuse, made under `tmp`, with the words the refusal must hold. An AnyOf
    refuses what all its types refuse; a root user reads anything, so "cannot be read" is tried only for
    others (test_an_unreadable_input_is_refused holds the rule for root)."""
    if isinstance(kind, Domain):
        return {text: f"must be {kind.describe}" for text in kind.refused}
    if isinstance(kind, AnyOf):
        tried = {text for t in kind.types for text in _bad_inputs(t, tmp)}
        return {text: f"must be {kind.describe}" for text in sorted(tried) if _refuses(kind, text)}
    a_file, a_folder = tmp / "a_file", tmp / "a_folder"
    a_file.write_text("x")
    a_folder.mkdir(exist_ok=True)
    pipe = tmp / "a_pipe"
    if not pipe.exists():
        os.mkfifo(pipe)
    bad = {"": "empty", str(tmp / "missing"): "does not exist", str(a_file / "child"): "does not exist",
           str(pipe): "not a regular file", "/dev/zero": "not a regular file"}  # a pipe blocks its reader for ever
    if kind.kind == "file":
        bad[str(a_folder)] = "is a folder; give a file"
    if kind.kind == "folder":
        bad[str(a_file)] = "is a file, not a folder"
    if kind.names:
        bad["not_a_published_name"] = f"is not {kind.names_are} ({', '.join(kind.names)})"
    if os.geteuid() != 0:
        locked = tmp / f"locked_{kind.kind}"
        locked.mkdir() if kind.kind == "folder" else locked.write_text("x")
        locked.chmod(0)
        bad[str(locked)] = "cannot be read"
    return bad


def test_every_input_argument_refuses_what_it_cannot_read(every_path_argument, tmp_path, capsys):
    """"", a missing path, a path under a file, a folder for a file and a file for a folder, a word that names
    no published weight set, an unreadable path: exit 2 and one line naming the argument, at parse time."""
    cases = [(script, words, action, parser, text, needed) for script, words, action, parser in every_path_argument
             if isinstance(action.type, (InputPath, AnyOf))
             for text, needed in _bad_inputs(action.type, tmp_path).items()]
    wrong = refused_wrongly(cases, capsys)
    assert not wrong, "\n".join(wrong)
    assert len(cases) >= 100 and len({c[:3] for c in cases if isinstance(c[2].type, InputPath)}) >= 26


def test_an_input_takes_what_exists_and_the_names_it_knows(tmp_path, monkeypatch):
    (tmp_path / "f.npy").write_text("x")
    for kind in ("file", "either"):
        assert InputPath(kind)(str(tmp_path / "f.npy")) == str(tmp_path / "f.npy")
    for kind in ("folder", "either"):
        assert InputPath(kind)(str(tmp_path)) == str(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert InputPath("file")("~/f.npy") == "~/f.npy"  # the text, as the tool expands it
    assert InputPath("either", names=("torchvision",))("torchvision") == "torchvision"
    with pytest.raises(argparse.ArgumentTypeError) as e:
        InputPath("file", names=("a", "b"), names_are="a set")(str(tmp_path / "c"))
    assert str(e.value) == f"{tmp_path / 'c'} does not exist, and is not a set (a, b)"
    from data.domains import COUNT_TEXT
    classes = AnyOf("a count or a file", COUNT_TEXT, InputPath("file"))
    assert classes("3") == "3" and classes(str(tmp_path / "f.npy")) == str(tmp_path / "f.npy")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a count or a file, got '0'$"):
        classes("0")
    with pytest.raises(ValueError, match="kind must be"):
        InputPath("dir")


def test_an_unreadable_input_is_refused(tmp_path, monkeypatch):
    """The permission rule where the suite runs as root (who reads anything): os.access says no."""
    import data.domains
    (tmp_path / "f").write_text("x")
    asked = []
    monkeypatch.setattr(data.domains.os, "access", lambda path, mode: asked.append((Path(path), mode)) or False)
    for text, mode in ((str(tmp_path / "f"), os.R_OK), (str(tmp_path), os.R_OK | os.X_OK)):
        with pytest.raises(argparse.ArgumentTypeError, match=r"cannot be read \(permissions\)$"):
            InputPath("either")(text)
        assert asked[-1] == (Path(text), mode)


def test_an_output_takes_a_new_path_and_its_own_earlier_output(tmp_path):
    """What the tools must keep accepting: a new file or folder, an existing file (replaced as the tool's
    rules say), an empty folder, a folder holding only the tool's own names and hidden files."""
    mine = OutputPath("file", earlier=json_holding("mine", ("a",)))
    assert mine(str(tmp_path / "new" / "x.json")) == str(tmp_path / "new" / "x.json")
    (tmp_path / "old.json").write_text('{"a": 1, "b": 2}')
    assert mine(str(tmp_path / "old.json"))
    (tmp_path / "other.json").write_text('{"b": 2}')
    with pytest.raises(argparse.ArgumentTypeError, match=r"other.json exists and is not mine: name a new file, or move "
                       r"that one away first$"):
        mine(str(tmp_path / "other.json"))
    own = OutputPath("folder", own=("*.png", "cache"))
    for name in ("empty", "mine"):
        (tmp_path / name).mkdir()
    for entry in ("filters.png", "cache", ".lock", ".filters.123.tmp.png"):
        (tmp_path / "mine" / entry).write_text("")
    assert own(str(tmp_path / "empty")) and own(str(tmp_path / "mine")) and own(str(tmp_path / "brand_new"))
    assert OutputPath("either", own=("*.npy",))(str(tmp_path / "w.pt"))
    with pytest.raises(ValueError, match="kind must be"):
        OutputPath("dir")
    for kind, earlier in (("file", None), ("folder", mine.earlier), ("either", mine.earlier)):
        with pytest.raises(ValueError, match=r"^an output file says how it knows its own earlier output \(earlier=\), "
                           r"and only a file$"):
            OutputPath(kind, earlier=earlier)
    # known=: files of a folder known by name, each one of its own names; not for a file
    picture = holding("a marked picture", b"MARK")
    for kind, own, known in (("folder", ("*.json",), {"filters.png": picture}),
                             ("file", ("x.png",), {"x.png": picture})):
        with pytest.raises(ValueError, match=r"^known= names files of an output folder, each one of its own names"):
            OutputPath(kind, own=own, known=known, **({"earlier": mine.earlier} if kind == "file" else {}))
    marked = OutputPath("folder", own=("*.png",), known={"filters.png": picture})
    (tmp_path / "drawn").mkdir()
    (tmp_path / "drawn" / "filters.png").write_bytes(b"PNG ... MARK ...")
    (tmp_path / "drawn" / "holiday.png").write_bytes(b"the user's, under a name the tool never writes itself")
    assert marked(str(tmp_path / "drawn"))
    (tmp_path / "drawn" / "filters.png").write_bytes(b"PNG, the user's own")
    with pytest.raises(argparse.ArgumentTypeError, match=r"drawn holds 'filters.png', which has this tool's name but "
                       r"is not a marked picture; move it away first$"):
        marked(str(tmp_path / "drawn"))


def refusals(every_option, inputs: Path | None = None):
    """(script, words, action, parser, text) for each value an option must refuse; with `inputs` (a folder to
    make bad paths in), the paths its input options must refuse too."""
    for script, words, action, parser in every_option:
        if inputs is not None and isinstance(action.type, (InputPath, AnyOf)):
            for text in _bad_inputs(action.type, inputs):
                yield script, words, action, parser, text
        elif isinstance(action.type, Domain):
            for text in action.type.refused:
                yield script, words, action, parser, text
        elif action.choices is not None:
            yield script, words, action, parser, "not-a-choice"


def test_every_refused_value_of_every_option_exits_2_in_one_line_naming_it(every_option, capsys):
    tried, wrong = 0, []
    for script, words, action, parser, text in refusals(every_option):
        flag = action.option_strings[-1]
        with pytest.raises(SystemExit) as e:
            parser.parse_args([f"{flag}={text}"])
        err = capsys.readouterr().err.strip().splitlines()
        tried += 1
        if e.value.code != 2 or len(err) != 1 or flag not in err[0]:
            wrong.append(f"{script} {' '.join(words)} {flag}={text!r}: exit {e.value.code}, {err[-1:]}")
    assert not wrong, "\n".join(wrong)
    assert tried > 300  # every numeric option times its refused values


def test_a_domain_takes_its_own_values():
    from data.domains import COUNT, NON_NEGATIVE, NON_NEGATIVE_FLOAT, POSITIVE, at_least
    big = 2**63 - 1  # the largest count: int64's
    assert COUNT(str(big)) == at_least(1)(str(big)) == big and at_least(1).describe == "an integer >= 1"
    assert at_least(16).refused[:2] == ("15", str(2**63))  # just below and just above, by hand
    assert (COUNT("1"), NON_NEGATIVE("0"), at_least(16)("16"), POSITIVE("1e-9"), NON_NEGATIVE_FLOAT("0")) == \
        (1, 0, 16, 1e-9, 0.0)
    for domain in (COUNT, NON_NEGATIVE, POSITIVE, NON_NEGATIVE_FLOAT, at_least(16)):
        for text in domain.refused:
            with pytest.raises(argparse.ArgumentTypeError, match=f"must be {domain.describe}"):
                domain(text)


@pytest.mark.processes
def test_a_sampled_refusal_as_a_real_process_writes_nothing(every_option, tmp_path):
    """One (script, option, value) drawn anew every run (the seed is printed: rerun it with
    ALEXNET_DOMAIN_SEED): exit 2, one line, no traceback, nothing written in its working directory."""
    seed = int(os.environ.get("ALEXNET_DOMAIN_SEED", time.time_ns() % 2**32))
    print(f"ALEXNET_DOMAIN_SEED={seed}")
    inputs, work = tmp_path / "inputs", tmp_path / "cwd"
    inputs.mkdir()
    work.mkdir()
    script, words, action, _, text = random.Random(seed).choice(list(refusals(every_option, inputs)))
    flag = action.option_strings[-1]
    r = children.run([sys.executable, str(REPO / script), *words, f"{flag}={text}"], cpu_s=60, cwd=work)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and flag in lines[0], (seed, script, flag, text, r.stderr)
    assert list(work.iterdir()) == [], (seed, script, flag, text)


def test_a_refusal_of_someone_elses_folder_says_it_exactly(tmp_path, monkeypatch):
    """The message, by hand: the first foreign name and how many more; "(the working directory)" only for it."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    for name in ("b.txt", "a.txt", "own.png", ".hidden"):
        (folder / name).write_text("")
    out = OutputPath("folder", own=("*.png",))
    tail = "; give a new or empty folder, or one it wrote before"
    with pytest.raises(argparse.ArgumentTypeError) as e:
        out(str(folder))
    assert str(e.value) == f"{folder} holds files this tool did not write ('a.txt' and 1 more){tail}"
    (folder / "b.txt").unlink()
    monkeypatch.chdir(folder)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        out(".")
    assert str(e.value) == f". (the working directory) holds files this tool did not write ('a.txt'){tail}"


def test_devices_and_free_text_by_hand(tmp_path):
    """The device and text domains against values written out here, not their own refused lists."""
    from data.domains import DEVICE, device, text
    for name in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert DEVICE(name) == name and device()(name) == name
    for name in ("gpu", "cuda:x", "cuda:-1", "", "CPU", "cpu:0", " cuda", "cuda:", "mps"):
        for domain in (DEVICE, device()):  # the module's, made at import, and one made now
            with pytest.raises(argparse.ArgumentTypeError,
                               match=r"^must be a device \(auto, cpu, cuda or cuda:N\), got "):
                domain(name)
    strict = device(auto=False)
    assert strict("cuda:1") == "cuda:1" and strict("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a device \(cpu, cuda or cuda:N\), got auto$"):
        strict("auto")
    split = text("a split name")
    assert split("val") == "val" and split(" a b ") == " a b "
    for blank in ("", " ", "\t"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^must be a split name, got {re.escape(repr(blank))}$"):
            split(blank)


def test_input_path_messages_by_hand(tmp_path):
    missing = tmp_path / "nope"
    for kind in ("file", "folder", "either"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            InputPath(kind)(str(missing))
        assert str(e.value) == f"{missing} does not exist"
        with pytest.raises(argparse.ArgumentTypeError) as e:
            InputPath(kind)("")
        assert str(e.value) == "must name a path, got an empty one"
    with pytest.raises(argparse.ArgumentTypeError) as e:
        InputPath("either", names=("alexnet", "caffenet"))(str(missing))
    assert str(e.value) == f"{missing} does not exist, and is not one of the names (alexnet, caffenet)"


def test_an_earlier_output_is_known_by_what_it_holds(tmp_path, monkeypatch):
    """By hand: each way a tool knows its own file, on files that are and are not its own."""
    def at(name: str, content: bytes) -> Path:
        (tmp_path / name).write_bytes(content)
        return tmp_path / name
    obj, many = json_holding("o", ("a", "b")), json_holding("m", ("a",), many=True)
    assert obj(at("o1", b'{"a": 1, "b": [], "c": 3}')) and not obj(at("o2", b'{"a": 1}'))
    assert not obj(at("o3", b'[{"a": 1, "b": 2}]')) and not obj(at("o4", b'{"a": 1, "b": 2')) and not obj(at("o5", b""))
    assert many(at("m1", b'[{"a": 1}, {"a": 2, "z": 0}]')) and not many(at("m2", b"[]"))
    assert not many(at("m3", b'[{"a": 1}, {"b": 2}]')) and not many(at("m4", b'{"a": 1}'))
    assert not many(at("m5", b'[{"a": 1}, 3]'))
    head = starting_with("h", b"name,label\r\n")
    assert head(at("h1", b"name,label\r\nx,1\r\n")) and not head(at("h2", b"name,label,other\r\n"))
    assert not head(at("h3", b"name,lab"))
    mark = holding("k", b"MARK")
    assert mark(at("k1", b"\x00" * 9000 + b"MARK" + b"\x00")) and not mark(at("k2", b"MAR"))
    assert not obj(tmp_path / "missing") and not mark(tmp_path)  # unreadable: not the tool's
    assert (obj.what, many.what, head.what, mark.what) == ("o", "m", "h", "k")  # what the refusal calls it
    monkeypatch.setattr(Earlier, "LIMIT", 8)
    assert not mark(at("k3", b"MARK" + bytes(5))) and mark(at("k4", b"MARK" + bytes(4)))  # never read past LIMIT


def _two_paths(tmp_path: Path) -> OneLineParser:
    p = OneLineParser(prog="tool")
    p.add_argument("src", type=InputPath("file"))
    p.add_argument("-j", "--json", type=OutputPath("file", earlier=json_holding("j", ("a",))))
    p.add_argument("--csv", type=OutputPath("file", earlier=starting_with("c", b"a\r\n")))
    p.add_argument("--also", nargs="*", type=InputPath("file", names=("pub",)), default=[])
    p.add_argument("--weights", type=InputPath("file", names=("pub",)))  # a published name, not a file here
    p.add_argument("--absent", type=InputPath("file"), default=argparse.SUPPRESS)  # no attribute when not given
    return p


def test_one_file_named_twice_where_one_is_written_is_refused(tmp_path, capsys, monkeypatch):
    """Two outputs on one file (the second write would replace the first), or an output on an input: exit 2,
    one line naming both arguments; two inputs on one file are fine."""
    p, src, earlier = _two_paths(tmp_path), tmp_path / "in.json", tmp_path / "earlier.json"
    src.write_text('{"a": 1}')  # each is what --json takes: only the two names together are refused
    earlier.write_text('{"a": 2}')
    new, alias = tmp_path / "out", tmp_path / "sub" / ".." / "out"
    refused = {("-j/--json", "--csv"): [str(src), f"--json={new}", f"--csv={alias}"],
               ("src", "-j/--json"): [str(src), f"--json={tmp_path / 'sub' / '..' / 'in.json'}"],
               ("-j/--json", "--also"): [str(src), f"--json={earlier}", "--also", "pub", str(earlier)]}
    for (first, second), argv in refused.items():
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert f"{first} and {second} both name " in err[0], err
    assert err[0] == (f"tool: error: -j/--json and --also both name {earlier}: a command writes one file once, and "
                      "never over what it reads (see --help)")
    ns = argparse.Namespace()
    taken = p.parse_args([str(src), "--also", str(src), str(src), f"--json={new}", f"--csv={new}.csv"], namespace=ns)
    assert taken is ns and taken.also == [str(src)] * 2
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # a published name is not the file of that name here: no clash with --json pub
    assert p.parse_args([str(src), "--weights", "pub", "--also", "pub", "--json", "pub"]).json == "pub"


def test_evaluate_refuses_its_json_and_csv_on_one_file(tmp_path, capsys):
    """The check sits in the parser every tool uses: evaluate's own parser, its two outputs on one new file."""
    from tests.parsers import script_parser
    parser = script_parser("scripts/evaluate.py")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--data", str(tmp_path), "--weights", "torchvision", "--json", str(tmp_path / "r"),
                           "--csv", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--json and --csv both name" in err and "\n" not in err


# Which scripts take each tool's output folder for their own (their --out, or the folder they upgrade).
MAKERS = {"a synthetic tree": {"scripts/make_synthetic.py"},
          "a preprocessed output": {"scripts/preprocess.py", "scripts/upgrade_data.py"},
          "a run's folder": {"train.py"}}


@pytest.fixture(scope="module")
def tools_folders(synth, train_data, tmp_path_factory) -> dict[str, Path]:
    """Real output folders: make_synthetic's, preprocess's (locked while written: it keeps a .lock), and a
    run's folder as train.py starts it (its lock held, config.yaml written)."""
    from alexnet import rundir
    run = tmp_path_factory.mktemp("tools_folders") / "run"
    with rundir.hold(run):
        rundir.write_config(run, (REPO / "configs" / "demo.yaml").read_text())
    assert (train_data / ".lock").is_file()
    return {"a synthetic tree": synth[0], "a preprocessed output": train_data, "a run's folder": run}


def test_no_tool_takes_another_tools_output_folder_for_its_own(every_path_argument, tools_folders):
    """Every folder output of every script (as the parsers define them) and run.dir refuse each other tool's
    output folder: before, run.dir=<a preprocessed output> trained into it (its .lock read as a run's)."""
    from alexnet import rundir
    from alexnet.config import ConfigError
    outputs = [(s, a) for s, _, a, _ in every_path_argument if isinstance(a.type, OutputPath) and a.type.kind != "file"]
    assert len(outputs) >= 6
    wrong = [f"{script} {(a.option_strings or [a.dest])[-1]} takes {what} ({folder})"
             for script, a in outputs for what, folder in tools_folders.items()
             if script not in MAKERS[what] and not _refuses(a.type, str(folder))]
    for what, folder in tools_folders.items():
        try:
            rundir.check_run_dir(folder)
            if "train.py" not in MAKERS[what]:
                wrong.append(f"run.dir takes {what} ({folder})")
        except ConfigError as e:
            if "train.py" in MAKERS[what]:
                wrong.append(f"run.dir refuses {what}: {e}")
    assert not wrong, "\n".join(wrong)


def test_no_tool_writes_inside_a_preprocessed_output(every_path_argument, tools_folders):
    """Every output argument of every script given a new path inside a preprocessed output (evaluate --json
    DATA/eval.json, figures --out DATA/figs): refused, naming the output; before, the file or folder went among
    the data's, and a later preprocess or upgrade_data of DATA refused the folder for it."""
    from data.preprocess import OWN_NAMES
    data = tools_folders["a preprocessed output"]
    assert set(DATASET_MARKS) <= set(OWN_NAMES) and "train" in OWN_NAMES  # the marks are what preprocess writes
    wrong = []
    for script, _, action, _ in every_path_argument:
        if isinstance(action.type, OutputPath):
            for inside in (data / "new.json", data / "train" / "sub"):
                try:
                    action.type(str(inside))
                    wrong.append(f"{script} {(action.option_strings or [action.dest])[-1]} takes {inside}")
                except argparse.ArgumentTypeError as e:
                    if str(e) != (f"{inside} is inside the preprocessed output {data}: its files would lie among "
                                  "the data's; write it outside"):
                        wrong.append(f"{script}: {e}")
    assert not wrong, "\n".join(wrong)
    assert dataset_above(data) is None and dataset_above(data / "x") == data  # the output itself is not inside


def test_a_folder_is_known_by_another_outputs_rule(tmp_path, monkeypatch):
    """OutputPath.takes and domains.output_of (gpu_check's report folders, large-batch's --keep, a figures
    folder's cache/): a folder holding only the other output's names, each what it should be, or nothing."""
    from data.domains import json_holding, output_of
    inner = OutputPath("folder", own=("a.json", "logs"), known={"a.json": json_holding("an a", ("k",))})
    judge = output_of("the inner tool's output", lambda: inner)
    good = tmp_path / "good"
    (good / "logs").mkdir(parents=True)
    (good / "a.json").write_text('{"k": 1}')
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("the user's")  # in the working directory: only the folder asked counts
    assert inner.takes(good) and inner.takes(tmp_path / "empty") and judge(good) is True
    assert judge.what == "the inner tool's output"
    foreign, wrong, a_file = tmp_path / "foreign", tmp_path / "wrong", tmp_path / "a_file"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("the user's")
    wrong.mkdir()
    (wrong / "a.json").write_text('{"z": 1}')
    a_file.write_text("x")
    for path in (foreign, wrong, a_file, tmp_path / "missing"):
        assert not inner.takes(path) and not judge(path), path
