"""Hand-made mutants of the process-level paths, replayed one at a time against the tests that must kill them.

`catalogue.yaml` lists them; `catalogue.py` reads and checks it and applies a mutant to a text;
`replay.py` copies the tree, applies one mutant per copy, runs its tests and gives the verdicts.
The entry is tools/mutants.py.
"""
