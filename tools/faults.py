#!/usr/bin/env python3
"""Replay a table of faults and bad inputs against the tools and judge how each one ends.

    python tools/faults.py --md faults.md --json faults.json     # every case (~5 minutes on 2 cores)
    python tools/faults.py --only preprocess --jobs 2             # the cases whose name matches
    python tools/faults.py --list                                 # the cases, without running them

Each case (tools/faultcheck/: preprocess.py, train.py, evaluate.py, convert_weights.py, predict.py)
damages a copy of small synthetic inputs (4 classes, 72-pixel images, crop 67, model.width 0.125; made
once with scripts/make_synthetic.py and scripts/preprocess.py), runs one command and prints one row:
case, exit code, first line of the message (stderr, else stdout), verdict. OK: the expected exit code
(2 bad input or path, 1 a failure of the machine, 130 Ctrl-C, 0 good input), a message naming the
file, key or value at fault, no traceback, and nothing wrong left behind; else WEAK or DEFECT with the
reason (see tools/faultcheck/core.py); SKIP where a case cannot run here (a tmpfs needs root).
Exit code: 0 when no case is WEAK or DEFECT, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.cli import temporary_directory  # noqa: E402
from data.procs import in_threads  # noqa: E402
from tools.faultcheck import identity_cases, input_cases, preprocess_cases, report, tool_cases, train_cases  # noqa: E402
from tools.faultcheck.core import Case, Ctx, run_case  # noqa: E402

CASES: list[Case] = [*preprocess_cases.CASES, *train_cases.CASES, *tool_cases.CASES, *identity_cases.CASES,
                     *input_cases.CASES]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1], epilog="\n".join(__doc__.splitlines()[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", metavar="REGEX", help="run the cases whose name matches (re.search)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--md", metavar="FILE", help="write the table as markdown")
    p.add_argument("--json", metavar="FILE", help="write every outcome as JSON")
    p.add_argument("--jobs", type=int, default=1, help="cases run side by side (default 1: the machine is shared)")
    p.add_argument("--work", metavar="DIR", help="work folder, kept afterwards (default: a temporary one, removed)")
    return p.parse_args(argv)


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    chosen = [c for c in cases if pattern is None or re.search(pattern, c.name)]
    if not chosen:
        raise SystemExit(f"faults.py: error: no case matches --only {pattern!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = select(CASES, args.only)
    if args.list:
        for c in cases:
            print(f"{c.name:34} expect {c.expect:<3} {c.what}" + ("  (issue 19)" if c.listed else ""))
        return 0
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # started in the background (`&`, nohup): the tools it runs would inherit SIGINT ignored, and the
        # Ctrl-C cases would judge that instead of the tools; a handled signal is reset to default on exec
        signal.signal(signal.SIGINT, signal.default_int_handler)
    command = "python tools/faults.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    date = time.strftime("%Y-%m-%d")
    with contextlib.ExitStack() as stack:  # a folder of its own unless --work names one
        root = Path(args.work or stack.enter_context(temporary_directory(prefix="faults-", ignore_cleanup_errors=True)))
        root.mkdir(parents=True, exist_ok=True)
        ctx = Ctx(root.resolve())
        # A Ctrl-C stops the cases not yet started (in_threads); the running ones finish
        outcomes = in_threads(lambda c: run_case(ctx, c, CASES.index(c) + 1), cases, args.jobs,
                              lambda i, outcome: print(report.line(outcome), flush=True))
    print(report.summary(outcomes))
    report.write(args.md, report.markdown(outcomes, command, date))
    report.write_json(args.json, report.record(outcomes, command, date))
    return 0 if all(o.verdict in ("OK", "SKIP") for o in outcomes) else 1


if __name__ == "__main__":
    from alexnet.cli import protect_streams
    protect_streams("faults.py")  # `--list | head`: a reader that went away is not an error
    sys.exit(main())
