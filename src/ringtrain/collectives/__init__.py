"""The collective algorithms, one module per algorithm, and a registry of them by name.

Every algorithm module provides ``allreduce(t, buf, reduce, header, deadline, group=None)``
on a flat numpy buffer, in place (see schedule.py for the shared words and conventions);
``ring`` also provides reduce_scatter, allgather, broadcast and barrier, and ``tree`` a
binomial broadcast and the dissemination barrier. ``native`` (torch.distributed) is not here:
the communicator calls torch directly.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Algorithm name -> module under ringtrain.collectives.
ALGORITHMS = {
    "ring": "ring",
    "naive": "naive",
    "central": "central",
    "halving_doubling": "halving_doubling",
    "hierarchical": "hierarchical",
}


def get(name: str) -> ModuleType:
    """The module implementing allreduce algorithm ``name``."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{ALGORITHMS[name]}")
