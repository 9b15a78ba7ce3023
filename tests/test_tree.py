"""The repository's tracked files: portable names, and nothing at the top level that no page names.

A file committed by mistake (a copy made under a name taken from a message, a scratch output) is caught
here, whatever its name: the rule is read from git's own list of tracked files, not from a list in the test.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PORTABLE = re.compile(r"[A-Za-z0-9_.-]+")
# What names a top-level file: the pages a user reads and the Makefile that uses it.
NAMERS = ("README.md", "Makefile", "docs/DESIGN.md", "docs/install.md", "docs/testing.md")


def tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


@pytest.mark.processes
def test_every_tracked_path_has_a_portable_name_and_every_top_level_file_is_named_by_a_page():
    files = tracked()
    bad = [p for p in files if not all(PORTABLE.fullmatch(part) for part in p.split("/"))]
    assert not bad, f"tracked paths with names outside [A-Za-z0-9_.-]: {bad}"
    pages = "\n".join((ROOT / n).read_text() for n in NAMERS)
    top = sorted({p for p in files if "/" not in p and not p.startswith(".")})
    unnamed = [p for p in top if p not in pages]
    assert not unnamed, f"top-level files no page names ({', '.join(NAMERS)}): {unnamed}"
