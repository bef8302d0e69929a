#!/usr/bin/env bash
# The test suite under another torch than constraints.txt's pin: the package accepts torch >= 2.4.
#
#   bash scripts/torch_compat.sh 2.4.1            # makes .venv-torch-2.4.1/, then runs every test
#   bash scripts/torch_compat.sh 2.14.1 -x -q tests/test_torch_group.py   # pytest's arguments after it
#
# A torch other than the pinned 2.13.0 comes from PyPI as its CUDA build (about 3 GB with its
# nvidia-* packages; it runs on the CPU). Never part of `make test`. Results: README, "Compatibility".
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash scripts/torch_compat.sh TORCH_VERSION [pytest arguments]}"
shift
venv=".venv-torch-$version"
python="${PYTHON:-python3}"
if [ ! -f "$venv/.installed" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --upgrade pip
    "$venv/bin/pip" install --quiet "torch==$version"
    "$venv/bin/pip" install --quiet -e '.[dev]'   # torch>=2.4 is met: the one above stays
    touch "$venv/.installed"
fi
"$venv/bin/python" -c 'import sys, torch, numpy; print(f"torch {torch.__version__}, numpy {numpy.__version__}, Python {sys.version.split()[0]}")'
exec "$venv/bin/python" -m pytest "${@:--q}"
