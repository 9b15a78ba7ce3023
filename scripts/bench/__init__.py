"""The benchmarks of `scripts/benchmark.py`, one module per subcommand.

Each module has `add_parser(sub)` (its subcommand, whose `run(args)` returns the result: a dict with
`rows` and figures) and a docstring saying what it measures; `common` holds what they share: timing
with warm-up, worker processes, argument helpers and the tables and JSON of the report; `workload`
the training step and random dataset several of them time.
"""
