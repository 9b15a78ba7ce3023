#!/usr/bin/env python3
"""Preprocess ImageNet JPEGs into HDF5 batch files, a mean image, meta.json and report.json.

    python scripts/preprocess.py --train-dir ILSVRC2012/train --val-dir ILSVRC2012/val \\
        --val-labels LOC_val_solution.csv --out imagenet256

Re-running the same command resumes an interrupted run. See docs/preprocessing.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "preprocess.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import protect_streams  # noqa: E402
from data.preprocess_cli import main  # noqa: E402

if __name__ == "__main__":
    protect_streams("preprocess.py")
    sys.exit(main())
