"""Clusters: the network a simulated job runs on, and the allreduce cost it implies.

Words used here:

* **link** — the α–β(–γ) constants of one network hop: ``alpha`` seconds of start-up per
  message, ``beta`` seconds per byte, ``gamma`` seconds per byte reduced. The allreduce
  formulas of ``sim.costs`` turn link constants into the time of one allreduce for any
  world size and algorithm.
* **cluster** — a link between nodes, GPUs per node, network cards per node and the link
  inside a node (NVLink by default) — used by ``hierarchical`` — and the number of parameter
  servers (used by ``ps``).
* **cluster spec** — what a user writes after ``--cluster``:

  - a name from ``sim.costs.NETWORKS`` (case-insensitive), e.g. ``10GbE``, ``56Gb-IB``,
    ``mgwfbp-10GbE-16``;
  - ``alpha=SECONDS,beta=SECONDS_PER_BYTE`` with optional ``gamma=``, ``gpus_per_node=``,
    ``nics_per_node=``, ``intra_alpha=``, ``intra_beta=``, ``servers=``, ``name=`` —
    user-given constants (named, unless ``name=`` is given, by every field not at its default);
  - the path of a ``ringtrain bench allreduce --json`` file: α and β fitted to its rows
    (``from_bench``).

Results are keyed by cluster name, so ``resolve_many`` adds ``#2``, ``#3``... to a name that
repeats (two bench files of one stem, a name given twice).

Profiles published as *fitted allreduce times* (``fitted_world_size`` set, e.g. the MG-WFBP
authors' ``a + b*n`` on 16 workers) are turned into the link constants that give exactly that
time for a ring allreduce on that many workers; at other world sizes they scale as a ring does.
The same conversion is used for α/β fitted from a bench file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import costs
from .costs import link_from_fit
from .calibrate import fit_alpha_beta

INTRA_NODE = "NVLink"


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    alpha: float
    """Start-up time of one message between nodes, seconds."""
    beta: float
    """Seconds per byte between nodes."""
    gamma: float = 0.0
    """Seconds per byte reduced."""
    gpus_per_node: int = 8
    """GPUs sharing the fast intra-node link (hierarchical)."""
    intra_alpha: float = costs.NETWORKS[INTRA_NODE].alpha
    """Start-up time inside a node, seconds."""
    intra_beta: float = costs.NETWORKS[INTRA_NODE].beta
    """Seconds per byte inside a node."""
    nics_per_node: int = 1
    """Network cards per node, shared by the inter-node rings of hierarchical."""
    servers: int = 1
    """Parameter servers (algorithm ``ps``)."""
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("--cluster: the cluster's name must not be empty (name=)")
        # Numpy numbers are numbers too (np.float32, np.int64: were refused as "must be a finite
        # number"); kept as Python floats and ints, which the --json document can write.
        for key in ("alpha", "beta", "gamma", "intra_alpha", "intra_beta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--cluster: {key}={value!r}; it must be a finite number >= 0")
            object.__setattr__(self, key, float(value))
        if self.beta == 0 and self.alpha == 0:
            raise ValueError("--cluster: alpha and beta cannot both be 0")
        for key in ("gpus_per_node", "nics_per_node", "servers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= costs.MAX_COUNT:
                raise ValueError(f"--cluster: {key} must be an integer >= 1 and at most {costs.MAX_COUNT:.0e}, got {value!r}")
            object.__setattr__(self, key, int(value))

    def options(self, algorithm: str) -> dict[str, Any]:
        """The extra arguments ``costs.allreduce_time`` takes for ``algorithm``."""
        if algorithm == "hierarchical":
            return {"gpus_per_node": self.gpus_per_node, "intra_alpha": self.intra_alpha, "intra_beta": self.intra_beta,
                    "nics_per_node": self.nics_per_node}
        if algorithm == "ps":
            return {"servers": self.servers}
        return {}

    def cost(self, world_size: int, algorithm: str = "ring") -> costs.AllreduceCost:
        """``cost(nbytes) -> seconds`` of one allreduce on ``world_size`` GPUs of this cluster."""
        if algorithm not in costs.ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(costs.ALGORITHMS)}")
        if algorithm == "hierarchical" and world_size > self.gpus_per_node and world_size % self.gpus_per_node:
            raise ValueError(
                f"--gpus: {world_size} GPUs do not fill nodes of {self.gpus_per_node} (algorithm hierarchical)"
            )
        return costs.allreduce_cost(world_size, algorithm, self.alpha, self.beta, self.gamma, **self.options(algorithm))


def named(name: str, gpus_per_node: int = 8) -> Cluster:
    """The cluster of a ``sim.costs.NETWORKS`` profile (case-insensitive name)."""
    by_lower = {k.lower(): v for k, v in costs.NETWORKS.items()}
    prof = by_lower.get(name.strip().lower())
    if prof is None:
        raise ValueError(
            f"--cluster: unknown network {name!r}; choose from {', '.join(costs.NETWORKS)}, "
            "give alpha=...,beta=..., or a bench allreduce JSON file"
        )
    alpha, beta = prof.alpha, prof.beta
    source = prof.source
    if prof.fitted_world_size is not None:
        alpha, beta = link_from_fit(alpha, beta, prof.fitted_world_size)
        source += f"; scaled from {prof.fitted_world_size} workers as a ring allreduce"
    return Cluster(prof.name, alpha, beta, prof.gamma, gpus_per_node=gpus_per_node, source=source)


def custom(spec: str, gpus_per_node: int = 8) -> Cluster:
    """``alpha=..,beta=..`` and optionally ``gamma, gpus_per_node, nics_per_node, intra_alpha,
    intra_beta, servers, name``; ``gpus_per_node`` (``--gpus-per-node``) unless the spec gives it."""
    fields: dict[str, Any] = {"gpus_per_node": gpus_per_node}
    allowed = ("alpha", "beta", "gamma", "gpus_per_node", "nics_per_node", "servers", "intra_alpha", "intra_beta", "name")
    given: set[str] = set()
    for part in spec.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise ValueError(f"--cluster {spec!r}: expected key=value pairs with keys {', '.join(allowed)}")
        if key in given:  # (the last one was used, silently)
            raise ValueError(f"--cluster {spec!r}: {key} given twice")
        given.add(key)
        counts = ("gpus_per_node", "nics_per_node", "servers")
        try:
            fields[key] = value.strip() if key == "name" else int(value) if key in counts else float(value)
        except ValueError:
            kind = "an integer" if key in counts else "a number"  # (servers=2.5 was "not a number")
            raise ValueError(f"--cluster {spec!r}: {key}={value!r} is not {kind}") from None
    if "alpha" not in fields or "beta" not in fields:
        raise ValueError(f"--cluster {spec!r}: both alpha= and beta= are required")
    name = fields.pop("name") if "name" in fields else auto_name(fields, gpus_per_node)
    return Cluster(name, source="user-given", **fields)


def auto_name(fields: dict[str, Any], gpus_per_node: int = 8) -> str:
    """``alpha=..,beta=..`` and every other field of ``fields`` that is not its default (for
    ``gpus_per_node``: the run's ``--gpus-per-node``), so clusters that differ get different
    names. Numbers are written in full (``%g`` where that loses nothing)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Cluster)} | {"gpus_per_node": gpus_per_node}
    keys = ("alpha", "beta", "gamma", "gpus_per_node", "nics_per_node", "intra_alpha", "intra_beta", "servers")
    return ",".join(
        f"{k}={_exact(fields[k])}" for k in keys if k in fields and (k in ("alpha", "beta") or fields[k] != defaults[k])
    )


def load_bench_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``bench allreduce --json`` document (extra keys are kept and ignored)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8-sig"))  # (UTF-8 as the traces, not the locale's)
    except UnicodeDecodeError as e:  # (was the codec's message alone, naming neither option nor file)
        raise ValueError(f"--cluster {path}: cannot read a bench JSON file: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--cluster {path}: cannot read a bench JSON file: {e}") from None
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise ValueError(f"--cluster {path}: no 'rows' list in the bench JSON file")
    need = ("algorithm", "world_size", "nbytes", "median_s")
    good = [r for r in rows if isinstance(r, dict) and all(k in r for k in need)]
    if not good:
        raise ValueError(f"--cluster {path}: no row has all of {', '.join(need)}")
    return good


def from_bench(
    path: str | Path,
    algorithm: str = "ring",
    transport: str | None = None,
    world_size: int | None = None,
    gpus_per_node: int = 8,
) -> Cluster:
    """Link α/β fitted (``calibrate.fit_alpha_beta``) to a bench file's ``algorithm`` rows.

    Uses the rows of ``world_size`` (default: the largest measured with ``algorithm``) and
    ``transport`` (default: ``tcp`` when several were run, since a cluster is a network), then converts the whole-allreduce fit to link
    constants with ``link_from_fit``.
    """
    rows = [r for r in load_bench_rows(path) if r["algorithm"] == algorithm]
    transports = list(dict.fromkeys(r.get("transport") for r in rows))
    if transport is None and len(transports) > 1:
        # a cluster is a network: prefer TCP over same-host transports (shm) when both were run
        transport = "tcp" if "tcp" in transports else transports[0]
    if transport is not None:
        rows = [r for r in rows if r.get("transport") == transport]
    if not rows:
        raise ValueError(f"--cluster {path}: no rows with algorithm={algorithm!r}" + (f", transport={transport!r}" if transport else ""))
    try:
        ranks = [_whole(r["world_size"]) for r in rows]
    except (TypeError, ValueError, OverflowError):  # (2.5 and true were taken as 2 and 1 ranks)
        raise ValueError(f"--cluster {path}: a row's world_size is not an integer (of up to 1e308 ranks)") from None
    p = world_size if world_size is not None else max(ranks)
    rows = [r for r, ranks_of_row in zip(rows, ranks) if ranks_of_row == p]
    if not rows:
        raise ValueError(f"--cluster {path}: no rows with world_size={p}")
    if p < 2:
        raise ValueError(f"--cluster {path}: its {algorithm} rows are at {p} rank; a link is fitted to rows at "
                         "2 or more ranks (run bench allreduce with --world-sizes 2 or more)")
    try:
        sizes, times = [float(r["nbytes"]) for r in rows], [float(r["median_s"]) for r in rows]
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int of 400 digits)
        raise ValueError(f"--cluster {path}: a row's nbytes or median_s is not a number (of up to 1e308)") from None
    try:
        a, b = fit_alpha_beta(sizes, times)
    except ValueError as e:
        # (the advice only where it helps: a negative or NaN time was told to add --sizes too)
        advice = ": run bench allreduce with at least two --sizes" if "distinct sizes" in str(e) else ""
        raise ValueError(f"--cluster {path}: cannot fit alpha and beta to its {algorithm} rows at {p} ranks "
                         f"({e}){advice}") from None
    alpha, beta = link_from_fit(a, b, p, algorithm if algorithm in costs.ALGORITHMS else "ring")
    return Cluster(
        f"bench:{Path(path).stem}", alpha, beta, gpus_per_node=gpus_per_node,
        source=f"fitted to {len(rows)} rows of {path} ({algorithm}, {p} ranks): a={a:.3g} s, b={b:.3g} s/B",
    )


def _whole(value: Any) -> int:
    """A bench row's count as an int: an integer, a whole float or a string of digits, that a float
    can hold (else OverflowError); anything else is a ValueError."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    float(value)
    return value


def resolve(spec: str, gpus_per_node: int = 8) -> Cluster:
    """A cluster from one spec string (see the module docstring)."""
    spec = spec.strip()
    if spec.lower().endswith(".json"):
        return from_bench(spec, gpus_per_node=gpus_per_node)
    if "=" in spec:
        return custom(spec, gpus_per_node)
    return named(spec, gpus_per_node)


def resolve_many(specs: list[str], gpus_per_node: int = 8) -> list[Cluster]:
    """Clusters for ``--cluster`` values: names may be comma-separated; key=value specs may not."""
    out: list[Cluster] = []
    for spec in specs:
        parts = [spec] if "=" in spec else [s for s in spec.split(",") if s.strip()]
        out += [resolve(s, gpus_per_node) for s in parts]
    if not out:
        raise ValueError(f"--cluster: needs at least one value, got {specs!r}")
    return unique_names(out)


def _exact(value: float) -> str:
    if isinstance(value, int):  # (exact as it is; %g of an int of 400 digits was an OverflowError)
        return str(value)
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def unique_names(clusters: list[Cluster]) -> list[Cluster]:
    """``clusters`` with ``#2``, ``#3``... added to repeated names: results are keyed by the
    cluster's name, so two clusters of one name would overwrite each other's rows."""
    out: list[Cluster] = []
    taken: set[str] = set()
    for c in clusters:
        name, k = c.name, 2
        while name in taken:
            name, k = f"{c.name}#{k}", k + 1
        taken.add(name)
        out.append(c if name == c.name else dataclasses.replace(c, name=name))
    return out
