#!/usr/bin/env bash
# Install what the tests need (CPU torch first) and run the CI test suite (everything but @slow).
#   bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test]"
# megatron-core 0.19.2, the reference the Megatron-LM compatibility tests compare against (it declares
# Python >= 3.12 and would pull CUDA packages; the tests need only its pure-Python parts).
pip install --no-deps --ignore-requires-python megatron-core==0.19.2
# The GPU validation machine's Triton, for the ahead-of-time kernel check (docs/gpu.md): a folder that
# shadows the venv's Triton on PYTHONPATH, built once and kept (git-ignored).
TRITON_36=.ci/triton-3.6.0
[ -d "$TRITON_36/triton" ] || pip install -q --no-deps --target "$TRITON_36" triton==3.6.0
# numpy >= 2.4, as on that machine (2.5 there; 2.4 is the newest for Python 3.11): its triton 3.6.0
# interpreter fails on it where the kernels convert a 1-element array to an int; the dry-run leg on
# triton 3.6.0 (tests/unit_tests/gpu/test_gpu_validate_dryrun.py) checks that none does.
python -c "import numpy, sys; sys.exit(tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4))" \
  || pip install -q "numpy>=2.4"
export MEGATRON_CAI_TRITON_36="$PWD/$TRITON_36"
# pytest exits 5 when it collects no tests; `set -e` turns that into a failure too. The real-Slurm tests
# (tests/cluster, marker `cluster`) have their own command: README.md, Tests.
exec python -m pytest -m "not slow and not cluster" -q -p no:cacheprovider "$@"
