#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release, 2023) with its PyTorch extension, in a venv of its own,
# for the Horovod anchor of `ringtrain bench allreduce` (--horovod-python VENV/bin/python).
#
# Optional and slow (about 10 minutes of two cores): CI does not run it. The venv gets the
# torch the repository pins (constraints.txt; the CPU build on the development machines' disk)
# and numpy, never anything from this repository's own venv. Horovod's sdist is patched to
# build as C++17 (horovod-0.28.1-cxx17.patch says why); its controllers are gloo and MPI
# (Debian's Open MPI, libopenmpi-dev), and its CPU collectives gloo's.
#
# Usage: bash scripts/horovod/install.sh [VENV]   (default .venv-horovod, ignored by git)
#   then: ringtrain bench allreduce --world-sizes 2 --horovod-python .venv-horovod/bin/python
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-$repo/.venv-horovod}
python=${PYTHON:-python3}
torch_pin=$(grep -E '^torch==' "$repo/constraints.txt")

"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet "$torch_pin" numpy packaging wheel setuptools pyyaml psutil cloudpickle
# (no cmake from PyPI: its 4.x refuses gloo's cmake_minimum_required(2.8.12); Horovod needs >= 3.13)
cmake --version | head -1

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" download --quiet --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
(cd "$work/horovod-0.28.1" && patch -p1 < "$here/horovod-0.28.1-cxx17.patch")
(cd "$work/horovod-0.28.1" &&
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS=${MAKEFLAGS:--j2} nice -n 10 "$venv/bin/pip" install --no-cache-dir --no-build-isolation .)
"$venv/bin/horovodrun" --check-build
