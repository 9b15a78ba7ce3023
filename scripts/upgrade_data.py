#!/usr/bin/env python3
"""Convert a preprocessed folder's batch files in place to the current (faster to read) format.

    python scripts/upgrade_data.py imagenet256

Resumable (re-run the same command), atomic per file; the folder stays readable throughout. See
data/upgrade.py and README.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "upgrade_data.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import protect_streams  # noqa: E402
from data.upgrade import main  # noqa: E402

if __name__ == "__main__":
    protect_streams("upgrade_data.py")
    sys.exit(main())
