"""The parser a script builds, captured as it is about to parse (its main() is called, nothing runs), for tests
that walk the scripts' own options (test_option_domains.py) or check documented commands against them
(test_doc_commands.py)."""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys

import pytest

from tests.conftest import REPO


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def _capture(self, args=None, namespace=None):
    raise _Captured(self)


def load(path: str):
    """`path` (a script or tool, from the repository root) as a module, registered while it loads (the
    dataclasses of a module look it up in sys.modules)."""
    name = "_parsed_" + re.sub(r"\W", "_", path)
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def script_parser(path: str) -> argparse.ArgumentParser:
    """The parser `path`'s main() builds, captured at its parse_args call."""
    module = load(path)
    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", _capture)
    try:
        module.main([])
    except _Captured as e:
        return e.parser
    finally:
        mp.undo()
    raise AssertionError(f"{path}: main() did not parse its arguments")


def parses_over_its_own_output(argv: list[str]) -> None:
    """A finished command's arguments parsed again (in this process) over what it wrote: each file or folder
    the tool wrote where an option said is its own earlier output (data.domains.OutputPath), which a new
    run replaces or resumes, not someone else's, which it refuses. `argv`: the script, then its arguments."""
    parse = getattr(load(argv[0]), "parse_args", None) or script_parser(argv[0]).parse_args
    try:
        parse(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"{' '.join(argv)}: refuses what it wrote itself (exit {e.code}; its message "
                             "above)") from None
