"""The GPU check's parts (entry: scripts/gpu_check.py).

context.py      sizes per device, what a step sees (Ctx), its outcome and failures
commands.py     the commands a step runs: output to logs, its deadline, a kill of their whole tree
runs.py         training runs and their comparison, shared by the steps
basics.py, training.py, replicas.py, model_parallel.py, evaluation.py, speed.py, benchmarks.py
                the steps, by concern
table.py        the table of steps and the three sequences (check, quick, bench)
budget.py       the run's time budget (Budget), shared by the runner and the report
runner.py       each step in its own process under a time limit cut to the budget; the verdicts
report.py       gpu_check.md and gpu_check.json
cli.py          the command line
"""
