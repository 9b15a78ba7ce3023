#!/usr/bin/env python3
"""Benchmarks, each measured side by side in one run and reported as a table (and JSON with --json).

    python scripts/benchmark.py preprocess [--images 600] [--workers N]
    python scripts/benchmark.py train [--batch-size 256] [--arch alexnet] [--device auto]
    python scripts/benchmark.py loading [--batch-size 256] [--data DIR] [--device auto]
    python scripts/benchmark.py exchange [--replicas 2] [--devices cuda:0 cuda:1] [--table1]
    python scripts/benchmark.py read [--files 40] [--batch-sizes 256 128] [--threads N] [--data DIR]
    python scripts/benchmark.py checkpoint [--dir DIR] [--device auto]
    python scripts/benchmark.py parallel [--batch-size 256] [--width 1.0] [--device auto]
    python scripts/benchmark.py large-batch [--archs alexnet alexnet_bn] [--seeds 0 1 2] [--no-sweep] [--quick]
    python scripts/benchmark.py lrn [--batch-size 128] [--width 1.0] [--device auto]

Each subcommand is one module of scripts/bench/ (preprocess.py, train.py, loading.py, exchange.py,
read.py, checkpoint.py, parallel.py, large_batch.py, lrn.py), whose docstring says what it measures; what
they share (timing with warm-up, worker processes, arguments, tables and JSON) is scripts/bench/common.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "benchmark.py")  # a Ctrl-C while torch imports: one line, not a traceback
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import checkpoint, exchange, large_batch, loading, lrn, parallel, preprocess, read, train  # noqa: E402
from bench.common import report  # noqa: E402

from alexnet.cli import guarded, protect_streams  # noqa: E402
from data.domains import OneLineParser, OutputPath, json_holding  # noqa: E402

BENCHMARKS = (preprocess, train, loading, read, exchange, checkpoint, parallel, large_batch, lrn)  # the order of --help

# What an existing --json file must be for --force to replace it: every benchmark's report holds these.
EARLIER_JSON = json_holding("a benchmark.py --json output (JSON with benchmark, rows)", ("benchmark", "rows"))


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Each subcommand's --help lists its options; every one takes --json FILE "
                                       "(the results as JSON too).\n\n"
                                       "example: python scripts/benchmark.py train --json train.json")
    sub = p.add_subparsers(dest="what", required=True)
    for bench in BENCHMARKS:
        q = bench.add_parser(sub)
        q.add_argument("--json", type=OutputPath("file", earlier=EARLIER_JSON),
                       help="also write the results to this JSON file (a new file: an existing one, "
                       "such as the measurements docs/benchmarks/ keeps, is replaced only with --force)")
        q.add_argument("--force", action="store_true", help="replace an existing --json file")
    args = p.parse_args(argv)
    if args.json and Path(args.json).exists() and not args.force:  # before the run: it may take an hour
        p.error(f"--json {args.json} exists (a kept measurement?): name a new file, or add --force to replace it")
    # Stopped by a signal (SIGTERM, SIGHUP: a scheduler's limit, a closed terminal) as by Ctrl-C: the temporary
    # data is removed on the way out, and one line says so
    code, result = guarded("benchmark.py", lambda: args.run(args))
    if code:
        return code
    return guarded("benchmark.py", lambda: report(result, args.tables, args.json))[0]


if __name__ == "__main__":
    protect_streams("benchmark.py")
    sys.exit(main())
