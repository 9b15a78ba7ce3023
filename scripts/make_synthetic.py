"""Write a small synthetic ImageNet-format JPEG tree (thin wrapper around data.synthetic.main)."""
import sys
from pathlib import Path

# runnable from any cwd: the repository root is the parent of scripts/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alexnet.startup import quiet_start  # noqa: E402

quiet_start(__name__, "make_synthetic.py")  # a Ctrl-C while torch imports: one line, not a traceback

from alexnet.cli import protect_streams  # noqa: E402
from data.synthetic import main  # noqa: E402

if __name__ == "__main__":
    protect_streams("make_synthetic.py")
    sys.exit(main())
