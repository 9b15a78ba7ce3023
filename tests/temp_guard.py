"""The temporary directory is left as it was found: every test, and every module, class or session fixture,
gets a TMPDIR of its own inside pytest's folder for the run (every process it starts inherits it; Python's
`tempfile` in this process reads it), and whatever is left there when the test or fixture ends fails it,
naming each entry. A child that forgot its files, a killed tool's temporary folder, a tool of torch's
that leaves its log folder behind: each would otherwise pile up in /tmp run after run.

A plugin (`-p tests.temp_guard`; tests/conftest.py registers it), so that it can run on its own over a probe
(tests/test_suite.py). It imports nothing heavy.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "TMPDIR"
# What a tool outside the project leaves in the temporary directory by design: the name's start, why, and the
# files its folder may hold (anything else in it is a leftover of ours). torchrun (torch.distributed.run)
# without --log-dir makes its log folder with tempfile.mkdtemp (torch/distributed/elastic/multiprocessing/
# api.py) and never removes it: run id, attempt and local rank folders, and a rank's error.json if it failed.
TOOLS_LEAVE = {"torchelastic_": ("torchrun's log folder (torch never removes it)", {"error.json"})}
# torch's compiler keeps a cache for the user (tempfile's directory/torchinductor_<user>, made as torch.distributed
# and torch.compile start) and, the first time a process asks for it, writes its path into this variable, which
# every process started later inherits: it is set once for the run, in pytest's folder for it.
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def leftovers(folder: Path) -> list[str]:
    """What `folder` holds that nothing should have left, in words; a tool's known folder (TOOLS_LEAVE) is
    removed instead when it holds only what that tool leaves."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        known = next((files for start, (_, files) in TOOLS_LEAVE.items() if entry.name.startswith(start)), None)
        if known is not None and entry.is_dir(follow_symlinks=False) and _holds_only(Path(entry.path), known):
            shutil.rmtree(entry.path)
            continue
        kind = "a folder" if entry.is_dir(follow_symlinks=False) else "a file"
        found.append(f"{entry.name} ({kind})")
    return found


def _holds_only(folder: Path, names: set[str]) -> bool:
    return all(name in names for _, _, files in os.walk(folder) for name in files)


class TempGuard:
    """Hands out the temporary directories and puts the previous one back when each ends."""

    def __init__(self, root: Path):
        self.root = root
        self.numbers = itertools.count()

    @contextlib.contextmanager
    def scoped(self, label: str) -> Iterator[Path]:
        """TMPDIR (and tempfile's cached choice) set to a new empty folder for the block, then put back."""
        folder = self.root / f"{next(self.numbers):05d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)[:60]}"
        folder.mkdir(parents=True)
        saved = os.environ.get(ENV), tempfile.tempdir
        os.environ[ENV], tempfile.tempdir = str(folder), str(folder)
        try:
            yield folder
        finally:
            if saved[0] is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved[0]
            tempfile.tempdir = saved[1]

    @staticmethod
    def check(folder: Path, who: str) -> None:
        """Fail naming what `who` left in `folder`; remove the folder if it is empty."""
        left = leftovers(folder)
        if left:
            pytest.fail(f"{who} left in its temporary directory ({folder}): {', '.join(left)}", pytrace=False)
        folder.rmdir()


_GUARD = pytest.StashKey["TempGuard | None"]()
_OPEN = pytest.StashKey[contextlib.ExitStack]()
_FOLDER = pytest.StashKey[Path]()


def _guard(config: pytest.Config) -> TempGuard | None:
    """The run's guard, made at the first test or fixture, in the real temporary directory's pytest folder
    (pytest makes that folder then, before any TMPDIR of ours is set)."""
    if _GUARD not in config.stash:
        factory = getattr(config, "_tmp_path_factory", None)
        config.stash[_GUARD] = None if factory is None else TempGuard(factory.getbasetemp() / "tmpdir")
        if factory is not None:
            # Inductor's cache: one for the run, not in whichever test's folder first asked for it
            os.environ.setdefault(INDUCTOR_CACHE, str(factory.getbasetemp() / "torchinductor"))
    return config.stash[_GUARD]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    guard = _guard(item.config)
    if guard is not None:
        stack = contextlib.ExitStack()
        item.stash[_OPEN] = stack
        item.stash[_FOLDER] = stack.enter_context(guard.scoped(item.name))
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    """Checked after the test's fixtures are torn down (and any fixture that ends with it, which checks its own)."""
    stack = item.stash.get(_OPEN, None)
    try:
        return (yield)
    finally:
        if stack is not None:
            stack.close()
            TempGuard.check(item.stash[_FOLDER], item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module, class or session fixture's own folder while it sets up (what it starts keeps it), checked when
    the fixture is torn down, after its own teardown."""
    guard = _guard(request.config)
    if guard is None or fixturedef.scope == "function":
        yield
        return
    who = f"fixture {fixturedef.argname!r} ({fixturedef.scope} scope)"
    with guard.scoped(f"{fixturedef.scope}-{fixturedef.argname}") as folder:
        fixturedef.addfinalizer(lambda: TempGuard.check(folder, who))  # runs after the fixture's own teardown
        yield
