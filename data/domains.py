"""The domains of the user scripts' arguments, declared once: numbers, devices, free text, the paths a tool
reads and the paths it writes. Each is an argparse ``type`` that converts the text, refuses a value outside
the domain in one line naming the option (argparse adds its name), and says which values it must refuse,
from which tests/test_option_domains.py tries every argument of every script as the parsers define them.
A bare ``type=int`` or ``type=float`` accepts -1, 0, nan and inf alike, a bare input path accepts a
missing file until the tool opens it (after other work, naming no option), and a bare output path accepts
"", "/" and a folder of someone else's files: the test fails for an argument without a domain."""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .fsutil import SPECIAL, is_special, special_entries_words


class Domain:
    """An argparse type: `convert` the text, then require `ok(value)`; `refused`: texts it must refuse."""

    def __init__(self, describe: str, convert: Callable[[str], float | int], ok: Callable[[float | int], bool],
                 refused: tuple[str, ...]):
        self.describe, self.convert, self.ok, self.refused = describe, convert, ok, refused
        self.__name__ = describe  # argparse's "invalid <name> value" for text that does not convert

    def __call__(self, text: str) -> float | int:
        try:
            value = self.convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {self.describe}, got {text!r}") from None
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe}, got {text}")
        return value

    def __repr__(self) -> str:
        return f"Domain({self.describe})"


MAX_INT = 2**63 - 1  # beyond, no count means anything (torch, numpy and h5py overflow)
_NOT_INT = ("1.5", "x", "", "nan", "1e999")
_NOT_FLOAT = ("x", "", "nan", "inf", "-inf", "1e999")


def at_least(low: int) -> Domain:
    """An integer from `low` up (to MAX_INT)."""
    return Domain(f"an integer >= {low}", int, lambda n: low <= n <= MAX_INT,
                  (str(low - 1), str(MAX_INT + 1), *_NOT_INT))


COUNT = at_least(1)          # how many: images, steps, files, workers, replicas ...
NON_NEGATIVE = at_least(0)   # may be none: seeds, epochs (0 where the default means "the last"), warmups


def _digits(text: str) -> str:
    if not text.isdigit():
        raise ValueError(text)
    return text


# a count kept as the text the tool reads itself (preprocess's --classes: N, or a file)
COUNT_TEXT = Domain(COUNT.describe, _digits, lambda t: COUNT.ok(int(t)), COUNT.refused)
POSITIVE = Domain("a finite number > 0", float, lambda x: math.isfinite(x) and x > 0, ("0", "-1", *_NOT_FLOAT))
NON_NEGATIVE_FLOAT = Domain("a finite number >= 0", float, lambda x: math.isfinite(x) and x >= 0,
                            ("-0.5", *_NOT_FLOAT))


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError(text)
    return text


def text(describe: str) -> Domain:
    """Free text the tool reads itself (a name, a list): only an empty or blank value is refused here."""
    return Domain(describe, _nonempty, lambda s: True, ("", " "))


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device(auto: bool = True) -> Domain:
    """A torch device name as the tools take it: cpu, cuda, cuda:N (and `auto`: cuda if present, else cpu).
    Whether that GPU exists is asked later, where CUDA is started."""
    words = "auto, cpu, cuda or cuda:N" if auto else "cpu, cuda or cuda:N"
    return Domain(f"a device ({words})", str, lambda s: (auto and s == "auto") or bool(_DEVICE.fullmatch(s)),
                  ("gpu", "cuda:x", "cuda:-1", "", *(() if auto else ("auto",))))


DEVICE = device()


def _named_path(text: str) -> Path:
    """The path a non-empty argument names (`~` expanded), else the refusal every path argument gives."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a path, got an empty one")
    return Path(text).expanduser()


def _refuse_special(path: Path, text: str) -> None:
    """A pipe blocks its reader until a writer comes; a device (/dev/null, /dev/stdout) would be renamed over
    by an atomic write."""
    if is_special(path):
        raise argparse.ArgumentTypeError(f"{text} is {SPECIAL}; give a file name")


class InputPath:
    """An argparse type for what a tool reads: an existing, readable `file`, `folder`, or `either`. `names`:
    words taken as they are (the published weight sets, fetched by name), described by `names_are`.
    Refused: an empty path, one that does not exist, a folder given for a file and the reverse, one this
    user cannot read. Returns the text."""

    def __init__(self, kind: str, names: tuple[str, ...] = (), names_are: str = "one of the names"):
        if kind not in ("file", "folder", "either"):
            raise ValueError(f"InputPath kind must be file, folder or either, got {kind!r}")
        self.kind, self.names, self.names_are = kind, tuple(names), names_are
        self.__name__ = f"input {kind}"

    def __call__(self, text: str) -> str:
        path = _named_path(text)
        if text in self.names:
            return text
        if not path.exists():
            also = f", and is not {self.names_are} ({', '.join(self.names)})" if self.names else ""
            raise argparse.ArgumentTypeError(f"{text} does not exist{also}")
        _refuse_special(path, text)
        if self.kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give a file")
        if self.kind == "folder" and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise argparse.ArgumentTypeError(f"{text} cannot be read (permissions)")
        return text

    def __repr__(self) -> str:
        return f"InputPath({self.kind}, {self.names})"


class AnyOf:
    """An argparse type taking what any of `types` takes (tried in order): e.g. a count or a file."""

    def __init__(self, describe: str, *types: Callable[[str], object]):
        self.describe, self.types = describe, types
        self.__name__ = describe

    def __call__(self, text: str) -> object:
        for kind in self.types:
            try:
                return kind(text)
            except argparse.ArgumentTypeError:
                continue
        raise argparse.ArgumentTypeError(f"must be {self.describe}, got {text!r}")

    def __repr__(self) -> str:
        return f"AnyOf({self.describe})"


class Earlier:
    """How a tool knows a file at one of its output paths as its own earlier output, which a new run
    replaces; anything else found there is refused. `what` names that output in the refusal; `test`
    reads the file (an unreadable one, or one over LIMIT bytes, is not the tool's)."""

    LIMIT = 1 << 29  # no result these tools write is larger: a bigger file is not read whole to find out

    def __init__(self, what: str, test: Callable[[Path], bool]):
        self.what, self.test = what, test

    def __call__(self, path: Path) -> bool:
        try:
            st = path.stat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                return False  # a pipe would block the test that reads it, for ever; no tool writes a device
            return st.st_size <= self.LIMIT and bool(self.test(path))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            return False

    def __repr__(self) -> str:
        return f"Earlier({self.what})"


def json_holding(what: str, keys: tuple[str, ...], many: bool = False) -> Earlier:
    """JSON: an object holding `keys` (`many`: a non-empty list of such objects)."""
    def test(path: Path) -> bool:
        obj = json.loads(path.read_bytes())
        items = obj if many and isinstance(obj, list) else [obj] if not many else []
        return bool(items) and all(isinstance(i, dict) and set(keys) <= i.keys() for i in items)
    return Earlier(what, test)


def starting_with(what: str, prefix: bytes) -> Earlier:
    """A file whose first bytes are `prefix` (a CSV's header row, a page's head)."""
    def test(path: Path) -> bool:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    return Earlier(what, test)


def holding(what: str, mark: bytes) -> Earlier:
    """A file holding `mark` (an image's metadata: where the format puts it varies)."""
    return Earlier(what, lambda path: mark in path.read_bytes())


# What marks a preprocessed output (data/preprocess.py writes plan.json first, meta.json last, beside train/):
# nothing but preprocess and upgrade_data writes inside one, or a later resume or upgrade of it is refused.
DATASET_MARKS = ("plan.json", "meta.json")


def dataset_above(path: str | os.PathLike) -> Path | None:
    """The preprocessed output that `path` lies inside (below its folder, not the folder itself), if any."""
    for folder in Path(path).resolve().parents:
        if (folder / "train").is_dir() and any((folder / mark).is_file() for mark in DATASET_MARKS):
            return folder
    return None


class OutputPath:
    """An argparse type for where a tool writes: a `file`, a `folder` whose entries may only be the tool's
    own (`own`: glob patterns of the names it writes there; hidden names, its temporaries and locks, are
    its own too), or `either` (a file, or such a folder). Refused: an empty path, the root folder, a folder
    given for a file, a file given for a folder, a folder (the working directory too) that holds anything
    else, and an existing `file` that `earlier` does not know as the tool's own: no tool writes among,
    renames or overwrites files it did not make. (`either`: the tool judges an existing file itself, with
    its --force.) A folder's `known` names entries it writes there by name (files, or folders judged whole)
    and how it knows each as its own: one of those names holding anything else (the user's own filters.png
    in a figures folder, a raw dataset's train/ in preprocess's --out) is refused too. Returns the text."""

    def __init__(self, kind: str, own: tuple[str, ...] = (), earlier: Earlier | None = None,
                 known: dict[str, Earlier] | None = None):
        if kind not in ("file", "folder", "either"):
            raise ValueError(f"OutputPath kind must be file, folder or either, got {kind!r}")
        if (kind == "file") != (earlier is not None):
            raise ValueError("an output file says how it knows its own earlier output (earlier=), and only a file")
        known = dict(known or {})
        if known and kind == "file" or any(not any(fnmatch.fnmatch(n, g) for g in own) for n in known):
            raise ValueError("known= names files of an output folder, each one of its own names (own=)")
        self.kind, self.own, self.earlier, self.known = kind, own, earlier, known
        self.__name__ = f"output {kind}"

    def __call__(self, text: str) -> str:
        path = _named_path(text)
        if path.resolve() == Path(path.anchor or "/").resolve() and path.is_absolute():
            raise argparse.ArgumentTypeError(f"must not be the root folder {text}")
        _refuse_special(path, text)
        if self.kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name (in it, for example)")
        if self.kind == "folder" and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
        blocker = next((q for q in path.absolute().parents if q.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise argparse.ArgumentTypeError(f"{blocker} is a file, so {text} cannot be made")
        if (root := dataset_above(path)) is not None:
            raise argparse.ArgumentTypeError(f"{text} is inside the preprocessed output {root}: its files would lie "
                                             "among the data's; write it outside")
        if self.earlier is not None and path.is_file() and not self.earlier(path):
            raise argparse.ArgumentTypeError(f"{text} exists and is not {self.earlier.what}: name a new file, or move "
                                             "that one away first")
        if self.kind != "file" and path.is_dir():
            foreign = self.foreign(path)
            if foreign:
                where = " (the working directory)" if path.resolve() == Path.cwd().resolve() else ""
                more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
                raise argparse.ArgumentTypeError(f"{text}{where} holds files this tool did not write ({foreign[0]!r}"
                                                 f"{more}); give a new or empty folder, or one it wrote before")
            unknown = self.unknown(path)
            if unknown:
                name, what = unknown[0]
                raise argparse.ArgumentTypeError(f"{text} holds {name!r}, which has this tool's name but is not "
                                                 f"{what}; move it away first")
            special = special_entries_words(path, text)  # its own names, but one it would open is a pipe
            if special:
                raise argparse.ArgumentTypeError(special)
        return text

    def foreign(self, folder: Path) -> list[str]:
        """The entries of `folder` that are not the tool's own."""
        try:
            names = sorted(e.name for e in os.scandir(folder))
        except OSError:
            return []
        return [n for n in names if not n.startswith(".") and not any(fnmatch.fnmatch(n, g) for g in self.own)]

    def unknown(self, folder: Path) -> list[tuple[str, str]]:
        """(name, what it should be) of the entries of `folder` named as one of `known` that are not it (its
        test sees a file or a folder: a folder where a file is known fails to be read, and is not it)."""
        return [(name, earlier.what) for name, earlier in self.known.items()
                if (folder / name).exists() and not earlier(folder / name)]

    def takes(self, folder: Path) -> bool:
        """Whether `folder` is one this domain writes into as its own: it holds only its names, each known one
        what it should be (the rule of a new run's check, for a folder another output holds)."""
        return folder.is_dir() and not self.foreign(folder) and not self.unknown(folder)

    def __repr__(self) -> str:
        return f"OutputPath({self.kind}, {self.own})"


def output_of(what: str, domain: Callable[[], OutputPath]) -> Earlier:
    """A folder that is the output of another tool (or another run), known by that output's own rule: `domain()`
    gives its OutputPath (late, so that a module need not import a heavy one, or itself, to declare it)."""
    return Earlier(what, lambda path: domain().takes(path))


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors (a bad value, a missing argument) are one line, `prog: error:
    ...`, exit 2, as the tools' other errors; --help still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        self._one_writer_per_file(parsed)
        return parsed, extras

    def _one_writer_per_file(self, parsed: argparse.Namespace) -> None:
        """Two of a command's paths naming one file, one of them written: the second write would replace
        the first, or the output its own input."""
        seen: dict[Path, tuple[str, bool]] = {}
        for action in self._actions:
            if not isinstance(action.type, (OutputPath, InputPath)):
                continue
            values = getattr(parsed, action.dest, None)
            writes = isinstance(action.type, OutputPath)
            for value in values if isinstance(values, list) else [values]:
                if not isinstance(value, str) or value in getattr(action.type, "names", ()):
                    continue
                name = "/".join(action.option_strings) or action.metavar or action.dest
                where = Path(value).expanduser().resolve()
                if where in seen and (writes or seen[where][1]):
                    self.error(f"{seen[where][0]} and {name} both name {value}: a command writes one file once, "
                               "and never over what it reads")
                seen.setdefault(where, (name, writes))
