"""Soak: thousands of allreduces of random sizes, dtypes, ops and algorithms, every one checked.

    python -m ringtrain.bench.soak                                   # 10,000 ops, 4 ranks, tcp then shm
    python -m ringtrain.bench.soak --ops 500 --world-size 2 --transport shm --json

Words:

- *op i*: the i-th allreduce of the run. Its *plan* — element count, dtype, reduction,
  algorithm, and whether the buffer is a numpy array or a torch tensor — is a pure function
  of (seed, i, world size), so every rank makes the same call without talking.
- *input*: rank r's buffer for op i, integer valued and small (0..15, or 1..2 for ``prod``),
  so that the reduction is exact in every dtype (float16 and bfloat16 included) whatever
  the order of the additions and whatever the world size: for ``sum`` and ``mean`` at most
  SUM_TERMS ranks give an element a nonzero value (16 * 15 = 240 fits uint8 and bfloat16's
  exact integers), for ``prod`` at most PROD_TWOS ranks give it a 2 (2^7 fits uint8); which
  ranks rotates with the element, so every rank's data is checked. Every rank computes the
  expected result of op i from every rank's input itself, and compares it with what the
  allreduce gave, element for element.
- *error*: an op whose result differs from the expected one anywhere, or that raised.
  A CommError ends the run (the communicator is broken after it).
- *sample*: open file descriptors (``/proc/self/fd``) and resident memory
  (``/proc/self/statm``) of a rank, read every ``--every`` ops. The report compares the
  first sample (after the first thousand ops: buffers, sockets and segments are all made
  by then) with the last.

Ranks run as separate processes through :mod:`ringtrain.bench.procs`; rank 0 gathers every
rank's counts and samples and prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..collectives.ops import OPS
from ..paths import user_path

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")
ALGORITHMS = ("ring", "naive", "central", "halving_doubling", "hierarchical", "native", "auto")
TRANSPORTS = ("tcp", "shm", "torch")
_FLOATS = ("float16", "bfloat16", "float32", "float64")
#: Ranks that may give one element a nonzero value in a sum, or a 2 in a product (see *input*).
SUM_TERMS = 16
PROD_TWOS = 7


@dataclass(kw_only=True, slots=True)
class SoakConfig:
    """One soak run on one transport."""

    ops: int = 10_000
    """Allreduces in total."""
    world_size: int = 4
    """Ranks (local processes)."""
    transport: str = "tcp"
    """One of TRANSPORTS."""
    max_elems: int = 1 << 18
    """Largest element count; counts are log-uniform in [0, max_elems]."""
    seed: int = 0
    """Every op's plan derives from it."""
    every: int = 1000
    """Ops between two samples of file descriptors and memory."""
    timeout: float = 60.0
    """The communicator's timeout (seconds)."""
    algorithms: tuple[str, ...] = ALGORITHMS
    """Algorithms drawn from."""

    def __post_init__(self) -> None:
        for name in ("ops", "world_size", "max_elems", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (a soak needs peers), got {self.world_size}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a number > 0, got {self.timeout!r}")
        self.algorithms = tuple(self.algorithms)
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad or not self.algorithms:
            raise ValueError(f"algorithms must be a non-empty subset of {ALGORITHMS}, got {list(self.algorithms)}")


@dataclass(frozen=True, slots=True)
class OpPlan:
    numel: int
    dtype: str
    op: str
    algorithm: str
    torch_buffer: bool


def plan(cfg: SoakConfig, i: int) -> OpPlan:
    """Op i's arguments: the same on every rank (a pure function of the seed and i)."""
    rng = np.random.default_rng([cfg.seed, i])
    numel = int(math.exp(rng.uniform(0.0, math.log(cfg.max_elems + 1)))) - 1
    dtype = DTYPES[rng.integers(len(DTYPES))]
    ops = [o for o in OPS if o != "mean" or (dtype in _FLOATS and _power_of_two(cfg.world_size))]
    op = ops[rng.integers(len(ops))]
    algorithm = cfg.algorithms[rng.integers(len(cfg.algorithms))]
    return OpPlan(numel, dtype, op, algorithm, dtype == "bfloat16" or bool(rng.integers(2)))


def _power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


def rank_input(p: OpPlan, i: int, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s values for op i, as int64 (small integers whose reduction is exact in every dtype)."""
    j = np.arange(p.numel, dtype=np.int64)
    base = j * 7 + i + 3 * rank
    if p.op in ("min", "max"):
        return base % 16
    limit = PROD_TWOS if p.op == "prod" else SUM_TERMS
    contributes = (j + i + rank) % world_size < limit  # min(limit, world_size) ranks per element
    return np.where(contributes, 1 + base % 2, 1) if p.op == "prod" else np.where(contributes, base % 16, 0)


def expected(p: OpPlan, i: int, world_size: int) -> np.ndarray:
    """The exact result of op i, as float64 (every value is exactly representable)."""
    inputs = np.stack([rank_input(p, i, r, world_size) for r in range(world_size)]) if p.numel else np.zeros((world_size, 0))
    fold = {"sum": np.sum, "mean": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[p.op]
    out = fold(inputs, axis=0).astype(np.float64)
    return out / world_size if p.op == "mean" else out


def make_buffer(p: OpPlan, values: np.ndarray):
    import torch

    if p.dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    arr = values.astype(p.dtype)
    return torch.from_numpy(arr) if p.torch_buffer else arr


def as_float64(buf) -> np.ndarray:
    import torch

    if isinstance(buf, torch.Tensor):
        return buf.to(torch.float64).numpy()
    return buf.astype(np.float64)


def sample() -> tuple[int, int]:
    """(open file descriptors, resident bytes) of this process."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return len(os.listdir("/proc/self/fd")), resident_pages * os.sysconf("SC_PAGE_SIZE")


def soak_rank(comm, cfg: SoakConfig) -> dict:
    """Run every op on this rank; the counts, the first error seen, and the samples."""
    from ..errors import CommError

    errors, first_error, samples = 0, None, []
    t0 = time.perf_counter()
    done = 0
    for i in range(cfg.ops):
        p = plan(cfg, i)
        buf = make_buffer(p, rank_input(p, i, comm.rank, comm.world_size))
        try:
            comm.allreduce(buf, op=p.op, algorithm=p.algorithm)
        except CommError as exc:
            errors += 1
            first_error = first_error or f"op {i} {p}: {type(exc).__name__}: {exc}"
            break
        got, want = as_float64(buf), expected(p, i, comm.world_size)
        if not np.array_equal(got, want):
            errors += 1
            bad = int(np.flatnonzero(got != want)[0])
            first_error = first_error or f"op {i} {p}: element {bad} is {got[bad]}, expected {want[bad]}"
        done += 1
        if done % cfg.every == 0 or done == cfg.ops:
            samples.append((done, *sample()))
    return {"rank": comm.rank, "ops": done, "errors": errors, "first_error": first_error,
            "seconds": time.perf_counter() - t0, "samples": samples}


def gather_reports(comm, mine: dict) -> list[dict]:
    """Every rank's report on every rank (JSON bytes through an allgather of a byte buffer)."""
    raw = json.dumps(mine).encode()
    sizes = np.zeros(comm.world_size, np.int64)
    sizes[comm.rank] = len(raw)
    comm.allreduce(sizes, op="max")
    width = int(sizes.max())
    buf = np.zeros(width * comm.world_size, np.uint8)
    buf[comm.rank * width : comm.rank * width + len(raw)] = np.frombuffer(raw, np.uint8)
    comm.allreduce(buf, op="max")
    return [json.loads(bytes(buf[r * width : r * width + int(sizes[r])])) for r in range(comm.world_size)]


def summarize(cfg: SoakConfig, reports: list[dict]) -> dict:
    """One document: totals, and first/last samples of fds and memory per rank."""
    first = [r["samples"][0] for r in reports if r["samples"]]
    last = [r["samples"][-1] for r in reports if r["samples"]]
    return {
        "config": asdict(cfg),
        "ops": min(r["ops"] for r in reports),
        "errors": sum(r["errors"] for r in reports),
        "first_error": next((r["first_error"] for r in reports if r["first_error"]), None),
        "seconds": max(r["seconds"] for r in reports),
        "fds_first": [s[1] for s in first],
        "fds_last": [s[1] for s in last],
        "rss_mb_first": [round(s[2] / 2**20, 1) for s in first],
        "rss_mb_last": [round(s[2] / 2**20, 1) for s in last],
        "sampled_at": [first[0][0], last[0][0]] if first else [],
        "per_rank": reports,
    }


def worker(cfg: SoakConfig) -> int:
    import torch

    import ringtrain

    from ..lifecycle import die_with_parent
    from .procs import emit

    die_with_parent()  # an interrupted soak must not leave its ranks running
    torch.set_num_threads(1)
    comm = ringtrain.init(transport=cfg.transport, timeout=cfg.timeout)
    mine = soak_rank(comm, cfg)
    reports = gather_reports(comm, mine)
    comm.close()
    if comm.rank == 0:
        emit(summarize(cfg, reports))
    return 0


def run(cfg: SoakConfig, deadline_s: float = 3600.0) -> dict:
    """Start ``cfg.world_size`` ranks and return rank 0's summary."""
    from .procs import run_ranks

    docs = run_ranks("ringtrain.bench.soak", ["--worker", json.dumps(asdict(cfg))], cfg.world_size,
                     timeout=deadline_s)
    if not docs:
        raise RuntimeError("rank 0 printed no result")
    return docs[0]


def describe(doc: dict) -> str:
    c = doc["config"]
    return (f"soak {c['transport']}: {doc['ops']} allreduces x {c['world_size']} ranks, {doc['errors']} errors, "
            f"{doc['seconds']:.0f} s; fds {doc['fds_first']} -> {doc['fds_last']}; "
            f"RSS MB {doc['rss_mb_first']} -> {doc['rss_mb_last']} (after op {doc['sampled_at'][0]} -> "
            f"{doc['sampled_at'][-1]})")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--transport", default="tcp,shm", help=f"comma-separated, of {TRANSPORTS}")
    parser.add_argument("--max-elems", type=int, default=1 << 18)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--out", default="", type=user_path, help="also write the JSON documents to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON document per transport")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(SoakConfig(**json.loads(args.worker)))  # __post_init__ makes algorithms a tuple again
    try:
        cfgs = [SoakConfig(ops=args.ops, world_size=args.world_size, transport=t.strip(), max_elems=args.max_elems,
                           seed=args.seed, every=min(args.every, args.ops))
                for t in args.transport.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    docs = []
    for cfg in cfgs:
        doc = run(cfg)
        docs.append(doc)
        print(json.dumps({k: v for k, v in doc.items() if k != "per_rank"}) if args.json else describe(doc), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(docs, indent=1) + "\n")
    return 0 if all(d["errors"] == 0 for d in docs) else 1


if __name__ == "__main__":
    sys.exit(main())
