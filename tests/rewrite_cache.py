"""pytest's assertion rewriting of the test modules, done once per run instead of once per xdist worker.

pytest rewrites each test module's asserts before importing it and keeps the result in __pycache__, but
only where Python may write bytecode: under PYTHONDONTWRITEBYTECODE=1 (this VM, some CI images) every
worker parsed, rewrote and compiled all 89 of ours again (`pytest --collect-only -p no:xdist`, the project's
own bytecode compiled: 12.4 s of CPU without that cache, 5.7-5.9 s with it; docs/testing.md). The controller
writes the cache in a thread while the workers start (they import torch first), so both read it. pytest
reads its cache whatever that setting says, checks it against the source's size and modification time,
and replaces it atomically; a module not written yet when a worker reaches it is rewritten there, as
before. Writing goes through pytest's own functions (private ones: `requirements-test.txt` pins pytest);
if they are gone, nothing is written and the workers rewrite, as before.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest


def modules(config: pytest.Config) -> list[Path]:
    """The test modules and conftest.py files the run's paths (its arguments, else `testpaths`) hold."""
    import fnmatch
    patterns = config.getini("python_files")
    found = set()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if path.is_dir():
            found |= {p for p in path.rglob("*.py")
                      if p.name == "conftest.py" or any(fnmatch.fnmatch(p.name, pat) for pat in patterns)}
        elif path.is_file():
            found |= {path, *(c for c in (d / "conftest.py" for d in path.parents) if c.is_file())}
    return sorted(found)


def written(config: pytest.Config, paths: list[Path]) -> list[Path]:
    """Write the rewritten code of each of `paths` into pytest's cache where it is missing or out of date;
    return those written."""
    try:
        from _pytest.assertion import rewrite
        state = config.stash[rewrite.assertstate_key]
    except (ImportError, AttributeError, KeyError):  # another pytest, or --assert=plain: nothing to share
        return []
    done = []
    for fn in paths:
        pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
        if rewrite._read_pyc(fn, pyc) is None and rewrite.try_makedirs(pyc.parent):
            try:
                stat, code = rewrite._rewrite_test(fn, config)
            except (SyntaxError, ValueError, OSError):  # the worker that imports it reports it
                continue
            except SystemError:  # CPython 3.11's AST builder counts its depth per interpreter, not per
                continue  # thread (gh-106905): a parse beside another thread's fails; the worker rewrites it
            if rewrite._write_pyc(state, code, stat, pyc):
                done.append(fn)
    return done


def start(config: pytest.Config) -> threading.Thread:
    """`written` for the run's modules in a thread (joined at the session's end: no half-written temporary
    file is left)."""
    thread = threading.Thread(target=lambda: written(config, modules(config)), name="rewrite-cache", daemon=True)
    thread.start()
    return thread
