#!/usr/bin/env bash
# Run the tests on another Python / torch pair, in a virtual environment of its own (docs/testing.md,
# "Tested versions"). Usage, from anywhere:
#   tools/compat.sh PYTHON TORCH_VERSION VENV_DIR [--full | PYTEST_ARGS...]
#   tools/compat.sh /usr/bin/python3.10 2.4.1 /tmp/venv-py310-torch24          # the unit subset
#   tools/compat.sh /usr/bin/python3.10 2.4.1 /tmp/venv-py310-torch24 --full   # the whole suite
# Creates VENV_DIR with PYTHON if it does not exist, installs torch==TORCH_VERSION and the other pins of
# constraints.txt and requirements-test.txt; a pin with no release for that Python (numpy 2.4 and scipy 1.17 need Python >= 3.11)
# is replaced by the newest release at or below it that installs, and said so. Then prints the versions
# and runs the subset below (one process, stops at the first failure), or with --full the suite as
# `make test` runs it, or pytest with the arguments given. The exit code is pytest's.
# torch from PyPI brings its CUDA libraries (3-4 GB); without a GPU it runs on the CPU.
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
PY=$1 TORCH=$2 VENV=$3
shift 3
ROOT=$(cd "$(dirname "$0")/.." && pwd)

# The fast unit families: every module but the process-level paths, in ~2 minutes on 2 cores.
SUBSET=(tests/test_models.py tests/test_lrn.py tests/test_optim.py tests/test_config.py
        tests/test_checkpoint.py tests/test_reader.py tests/test_augment.py tests/test_weights_package.py
        tests/test_xxh3.py tests/test_preprocess.py tests/test_train.py tests/test_exchange.py)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
"$VPY" -m pip install -q "torch==$TORCH"
# Each pin alone, so that one with no release for this Python falls back without hiding the others.
cat "$ROOT/constraints.txt" "$ROOT/requirements-test.txt" | grep -vE '^\s*(#|$)|^torch==' | while read -r pin; do
    if ! "$VPY" -m pip install -q "$pin" 2>/dev/null; then
        "$VPY" -m pip install -q "${pin/==/<=}"
        echo "compat.sh: $pin has no release for this Python; installed $("$VPY" -m pip show "${pin%%==*}" \
            | sed -n 's/^Version: //p') instead"
    fi
done
# pip may have moved torch while installing the others; the pair asked for is the pair tested.
"$VPY" -c "import sys, torch; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH' else
    f'compat.sh: torch {torch.__version__} is installed, not $TORCH')"
"$VPY" -c "import platform, torch, numpy, h5py, scipy, PIL, yaml, pytest
print('python', platform.python_version(), '| torch', torch.__version__, '| numpy', numpy.__version__,
      '| h5py', h5py.__version__, '| scipy', scipy.__version__, '| pillow', PIL.__version__,
      '| pyyaml', yaml.__version__, '| pytest', pytest.__version__)"

cd "$ROOT"
if [ "${1:-}" = "--full" ]; then
    set -- -q -p no:cacheprovider
elif [ $# -eq 0 ]; then
    set -- -p no:xdist -x -q -p no:cacheprovider "${SUBSET[@]}"
fi
start=$(date +%s)
rc=0
nice -n 10 "$VPY" -m pytest "$@" || rc=$?
echo "compat.sh: pytest exit $rc after $(( $(date +%s) - start )) s"
exit $rc
