#!/usr/bin/env python3
"""Parameter servers against the ring with servers on machines of their own, as the simulator
sees a saved ``ringtrain bench train --strategies ring,ps-...`` result.

Usage:  python scripts/ps_projection.py benchmarks/train-1gbit-4r-<stamp>.json [--servers 1,2,4]

On the development machine the servers share the workers' cores, so the measured rows carry
their CPU. Here each model's compute-alone layer trace and the link its ring job's allreduce
sweep measured (``sim.costs.link_from_fit`` on the larger messages, as the bench's own
``sim_error`` of the server rows) are given to ``sim.predict_with_cost`` for the ring's optimal
schedule and for K servers ("ps"), with free overlap for both: what seed 002's comparison
would show where servers add CPUs and links. It prints the samples/s and the ratio to the ring.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ringtrain.bench.train import ring_link  # noqa: E402
from ringtrain.sim import costs  # noqa: E402
from ringtrain.sim.simulator import predict_with_cost  # noqa: E402


def project(rows: list[dict], servers: list[int]) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        measured = ring_link(rows, model)
        if measured is None:
            continue
        trace, p, alpha, beta = measured
        ring_s = predict_with_cost(trace, costs.allreduce_cost(p, "ring", alpha=alpha, beta=beta), p).iteration_s
        parts = [f"ring {ring_s * 1e3:.0f} ms"]
        for k in servers:
            cost = costs.allreduce_cost(p, "ps", alpha=alpha, beta=beta, servers=k)
            ps_s = predict_with_cost(trace, cost, p, algorithm="ps").iteration_s
            parts.append(f"{k} server{'s' if k > 1 else ''} {ps_s * 1e3:.0f} ms ({ring_s / ps_s:.2f}× the ring)")
        lines.append(f"{model} ({p} workers, link alpha={alpha:.3g} s, beta={beta:.3g} s/B): " + ", ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="a bench train --json result with ring and ps rows")
    parser.add_argument("--servers", default="1,2,4", help="server counts, comma-separated (default 1,2,4)")
    args = parser.parse_args(argv)
    try:
        servers = [int(k) for k in args.servers.split(",")]
        lines = project(json.loads(args.file.read_text())["rows"], servers)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ps_projection: {args.file}: {exc}", file=sys.stderr)
        return 2
    if not lines:
        print(f"ps_projection: {args.file}: no model with both a ring job and its compute-alone trace", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
