# Everything a new machine needs lives here: `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup mpi horovod demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Open MPI + mpi4py: the benchmarks' MPI anchor. Best effort (needs root and Debian's apt).
mpi: $(STAMP)
	-@{ command -v mpirun && command -v mpicc; } >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; }
	-@$(BIN)/python -c 'import mpi4py' 2>/dev/null || $(BIN)/pip install --quiet mpi4py

# Horovod 0.28.1, patched to build against this torch, in .venv-horovod/: the benchmarks' Horovod
# anchor (--horovod-python .venv-horovod/bin/python). Slow (~10 min on 2 cores); never part of test.
# After `mpi`: Horovod's build needs Open MPI's headers (libopenmpi-dev, which has mpicc), and fails without them.
horovod: mpi
	PYTHON=$(PYTHON) bash scripts/horovod/install.sh

demo: $(STAMP)
	$(BIN)/ringtrain train

bench: $(STAMP) mpi
	$(BIN)/ringtrain bench allreduce --world-sizes 2 --quick

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
