"""The developer tools (every tools/*.py that runs as a script) treat a reader that went away (`| head`) as
the user scripts do (alexnet.cli.protect_streams): no traceback, their own exit code. `faults.py --list |
head -1` ended in a BrokenPipeError traceback."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.processes


def _tools() -> list[str]:
    """The tools/*.py files with a top-level `if __name__ == "__main__":` block."""
    found = []
    for path in sorted((REPO / "tools").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.append(path.relative_to(REPO).as_posix())
    return found


# A command of each tool that writes to stdout and changes nothing (not --help: argparse drops its own
# write errors). A tool the walk finds without one here fails below.
LISTING = {"tools/faults.py": ["--list"], "tools/claims.py": [], "tools/mutants.py": ["--list"],
           "tools/mutmut_table.py": ["alexnet.*"]}  # an empty table of its stdin's nothing


def test_every_tool_has_a_listing_command():
    assert set(_tools()) == set(LISTING)


@pytest.mark.parametrize("tool", _tools())
def test_a_tool_whose_reader_went_away_ends_without_a_traceback(tool):
    """stdout a pipe whose reading end is already closed: the listing's first write fails with EPIPE; the
    tool ends as it would have (its own exit code) without a traceback."""
    argv = [sys.executable, tool, *LISTING[tool]]
    expected = subprocess.run(argv, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert expected.stdout  # it does write
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(argv, cwd=REPO, stdout=write, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == expected.returncode, r.stderr[-2000:]
