#!/usr/bin/env python3
"""Replay the hand-made mutants of the process-level paths (tools/mutants/catalogue.yaml).

    python tools/mutants.py [--only ID ...] [--list] [-j N] [--timeout S] [--no-check-clean]

Each mutant is applied to its own copy of the tree (git's tracked and unignored files) and its tests
run there; the table says killed, survived or stale per mutant. First, the tests are run once on an
unmutated copy (a test that fails anyway kills nothing). Exit 1 if a mutant survived, is stale, or the
clean run failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(REPO))  # data.procs

from mutants import catalogue, replay  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="ID", help="replay only these mutants")
    p.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutants replayed at once (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests (default 600)")
    p.add_argument("--no-check-clean", dest="check_clean", action="store_false",
                   help="skip the run of the tests on an unmutated copy")
    args = p.parse_args(argv)
    mutants = catalogue.load()
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutants})
        if unknown:
            p.error(f"no such mutant: {', '.join(unknown)}")
        mutants = [m for m in mutants if m.id in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.id}  {m.file}: {m.bug}\n    " + "\n    ".join(m.tests))
        return 0
    start = time.monotonic()
    if args.check_clean:
        ok, out = replay.check_clean(mutants, REPO, replay.tree_files(REPO), args.timeout)
        print(f"clean run: {'passed' if ok else 'FAILED'} ({time.monotonic() - start:.0f} s)", flush=True)
        if not ok:
            print(out, file=sys.stderr)
            return 1
    verdicts = replay.replay(mutants, REPO, args.timeout, args.jobs)
    print(replay.table(verdicts))
    print(f"wall time {time.monotonic() - start:.0f} s")
    return 0 if all(v.result == "killed" for v in verdicts) else 1


if __name__ == "__main__":
    from alexnet.cli import protect_streams
    protect_streams("mutants.py")  # `| head`: a reader that went away is not an error
    sys.exit(main())
