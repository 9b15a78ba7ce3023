"""The session fixtures' data (`synth`, `prep`, `train_data`) under mutmut, made once per mutation run.

mutmut runs each mutant in a pytest session of its own, and each session made those fixtures' data again
(a synthetic tree and its preprocessing by a process pool): a third of a running mutant's time. What they
hold is written by data/'s code alone (data/ imports nothing of alexnet/ or layers/: tests/test_session_data.py
walks its imports), so it is the same for every mutant outside data/: those sessions share one build, made
under a lock in the mutation run's own folder (mutants/.session-data/, gone with it), checked against its
digest each time a session uses it, and made again when it differs. A mutant of
data/ builds its own, as every session did before. The normal suite (what CI runs) never shares.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

BUILT_BY = "data"  # the package whose code alone writes the fixtures' data


def mutant_builds_it(mutant: str) -> bool:
    """Whether a mutant (mutmut's name: module.x_function__mutmut_N) is in the code that writes the data."""
    return mutant.split(".", 1)[0] == BUILT_BY


def digest(root: Path) -> str:
    """Every file's path under root and bytes: what a session must find as the build left it."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _key(name: str, params: str, code: Path) -> str:
    """Which build: the fixture, its parameters and the bytes of the code that writes it (a mutation run's
    data/ holds every mutant of it, so the key changes only when that code does)."""
    h = hashlib.sha256(f"{name}\0{params}\0".encode())
    for path in sorted(code.rglob("*.py")):
        h.update(path.read_bytes())
    return f"{name}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes, or when a killed session's process ends
        yield


def built(name: str, params: str, fresh: Callable[[str], Path], build: Callable[[Path], object], *,
          shared: bool, cache: Path, code: Path) -> tuple[Path, object]:
    """A fixture's (folder, what `build(folder)` returned). With `shared` (a mutant's session outside
    `code`'s package), the build under `cache` that still matches its digest, made when there is none;
    otherwise a build in `fresh(name)`, the session's own. A build that a session changed is found changed
    by the next one and made again (a session beside the one that changed it would read the change too:
    only a mutant that writes into the tests' input data could do that)."""
    if not shared:
        out = fresh(name)
        return out, build(out)
    cache.mkdir(parents=True, exist_ok=True)
    key = _key(name, params, code)
    root, record = cache / key, cache / f"{key}.json"
    with _locked(cache / f"{key}.lock"):
        kept = json.loads(record.read_text()) if record.exists() else None
        if kept is None or kept["digest"] != digest(root):
            record.unlink(missing_ok=True)
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            # Kept as JSON: every session gets the value as JSON gives it back (the suite checks that the
            # fixtures' values come back equal, tests/test_session_data.py).
            value = json.loads(json.dumps(build(root)))
            kept = {"digest": digest(root), "value": value}
            tmp = record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(kept))
            os.replace(tmp, record)
    return root, kept["value"]
