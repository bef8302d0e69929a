#!/usr/bin/env python3
"""The README's figures from saved benchmark results.

Usage:  python scripts/bench_summary.py benchmarks/train-1gbit-2r-*.json [more.json ...]

For each ``ringtrain bench train`` file it prints, in Markdown:

* the ring table of the README (a row per model; cells are the median iteration in ms, and
  for ringtrain's schedules: the groups in force (optimal only), the speed-up over torch DDP,
  the share of communication hidden, the simulator's error and the iteration over the overlap
  bound; bold: the fastest ringtrain schedule), then what the optimal schedule's trial timed;
* for parameter-server rows: samples/s per strategy, 2 sharded servers against 1 (over the
  whole run and round by round) and the simulator's error per synchronous row;
* for a run with the Horovod anchor: per model, Horovod / torch DDP as timed side by side in
  Horovod's own launch, against optimal / torch DDP in the main launch.

After the files, one line sums up the ring rows of them all: how often optimal is within 3% of
the fastest schedule (and where not, which was faster, by how much, and whether it ran the same
single allreduce, so that the difference is the run's noise), how often below torch DDP and by
how much, and the simulator's errors.

A ``ringtrain bench allreduce`` file gives the README's allreduce table (per world size and
size: gloo, Open MPI, Horovod when the run timed it, and the best ringtrain configuration,
median time and busbw); a ``python -m ringtrain.ddp.overhead`` file the wrapper's cost on one
rank per model.
Pure reading of the JSON: it measures nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SCHEDULES = ("optimal", "mgwfbp", "wfbp", "fixed", "single")
NEAR = 0.03  # "within 3% of the fastest", the noise margin


def _ring_columns(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """model -> column -> row, for the ring job's rows: a column per schedule, "alone", "torch-ddp"."""
    by_model: dict[str, dict[str, dict]] = {}
    for row in rows:
        if row["impl"] in ("ringtrain", "alone", "torch-ddp"):
            key = row["schedule"] if row["impl"] == "ringtrain" else row["impl"]
            by_model.setdefault(row["model"], {})[key] = row
    return by_model


def ring_cells(rows: list[dict]) -> dict[str, dict[str, str]]:
    """model -> column -> Markdown cell, for the ring rows of one result."""
    table = {}
    for model, cols in _ring_columns(rows).items():
        ddp = cols.get("torch-ddp")
        ours = {s: cols[s] for s in SCHEDULES if s in cols}
        fastest = min(ours, key=lambda s: ours[s]["median_iter_s"]) if ours else None
        cells = {}
        for name in ("alone", "torch-ddp"):
            if name in cols:
                cells[name] = f"{cols[name]['median_iter_s'] * 1e3:.0f}"
        for sched, row in ours.items():
            parts = [f"{row['groups']} group{'s' if row['groups'] != 1 else ''}"] if sched == "optimal" else []
            if ddp:
                parts.append(f"{ddp['median_iter_s'] / row['median_iter_s']:.2f}×")
            parts.append(f"{row.get('hidden_fraction', 0.0) * 100:.0f}%")
            if row.get("sim_error") is not None:
                parts.append(f"{row['sim_error'] * 100:+.0f}%")
            if row.get("vs_bound") is not None:
                parts.append(f"{row['vs_bound']:.2f}")
            ms = f"{row['median_iter_s'] * 1e3:.0f}"
            cells[sched] = f"{f'**{ms}**' if sched == fastest else ms} ({'; '.join(parts)})"
        table[model] = cells
    return table


def ring_stats(rows: list[dict]) -> dict:
    """Per model: optimal against the fastest schedule and torch DDP; the simulator's errors."""
    errors = [abs(r["sim_error"]) for r in rows if r["impl"] == "ringtrain" and r.get("sim_error") is not None]
    near, below, misses = [], [], []
    for model, cols in _ring_columns(rows).items():
        if "optimal" not in cols:
            continue
        opt = cols["optimal"]["median_iter_s"]
        fastest = min((s for s in SCHEDULES if s in cols), key=lambda s: cols[s]["median_iter_s"])
        best = cols[fastest]["median_iter_s"]
        near.append(opt <= best * (1 + NEAR))
        if not near[-1]:
            misses.append((model, fastest, opt / best - 1, _same_plan(cols["optimal"], cols[fastest])))
        if "torch-ddp" in cols and opt > cols["torch-ddp"]["median_iter_s"]:
            below.append((model, opt / cols["torch-ddp"]["median_iter_s"] - 1))
    return {"configs": len(near), "near_fastest": sum(near), "below_ddp": below, "sim_errors": errors,
            "misses": misses}


def _same_plan(a: dict, b: dict) -> bool:
    """True where two rows ran the same grouping: one allreduce after backward each (the rows keep
    the group count in force at the end only), so that their difference is the run's noise."""
    return a.get("groups") == b.get("groups") == 1


def ps_lines(rows: list[dict]) -> list[str]:
    ps = [r for r in rows if r["impl"] == "ps"]
    if not ps:
        return []
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ring = next((r for r in rows if r["model"] == model and r["schedule"] == "optimal"), None)
        ddp = next((r for r in rows if r["model"] == model and r["impl"] == "torch-ddp"), None)
        mine = {r["schedule"]: r for r in ps if r["model"] == model}
        if not mine:
            continue
        parts = [f"ring {ring['samples_per_s']:.0f}"] if ring else []
        parts += [f"DDP {ddp['samples_per_s']:.0f}"] if ddp else []
        for sched, r in mine.items():
            sim = f" (sim {r['sim_error'] * 100:+.0f}%)" if r.get("sim_error") is not None else ""
            parts.append(f"{sched} {r['samples_per_s']:.0f}{sim}")
        lines.append(f"- {model} samples/s: " + ", ".join(parts))
        one, two = mine.get("ps-sync:1"), mine.get("ps-sharded:2")
        if one and two:
            rounds = [a / b for a, b in zip(one["round_medians"], two["round_medians"])]
            lines.append(f"  2 sharded servers / 1: {two['samples_per_s'] / one['samples_per_s']:.2f}× "
                         f"(rounds {'/'.join(f'{x:.2f}' for x in rounds)})")
        if ring:
            lines.append("  against the ring: " + ", ".join(
                f"{s} {r['samples_per_s'] / ring['samples_per_s']:.2f}×" for s, r in mine.items()))
    return lines


def trial_lines(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        trial = row.get("trial") or []
        if row.get("schedule") == "optimal" and trial:
            timed = ", ".join(f"{t['label']} ({t['groups']}) {t['median_s'] * 1e3:.1f} ms"
                              + (" kept" if t["kept"] else "") for t in trial)
            lines.append(f"- {row['model']} trial: {timed}")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 999.5e-6:  # (what rounds to 1000 µs reads as 1 ms, and to 1000 ms as 1 s)
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def compression_lines(rows: list[dict]) -> list[str]:
    """Per model with ``--compression`` rows: the optimal schedule in half precision on the wire
    against torch's DDP (defaults) and torch's DDP with the matching compression hook."""
    out = []
    for r in rows:
        if r["impl"] != "ringtrain-compressed":
            continue
        same = {x["impl"]: x for x in rows if x["model"] == r["model"]}
        ratios = [f"{same[k]['median_iter_s'] / r['median_iter_s']:.2f}x {name}"
                  for k, name in (("torch-ddp", "torch DDP"), ("torch-ddp-compressed", "torch DDP with the hook"))
                  if k in same]
        out.append(f"- {r['model']}: {r['schedule']} {r['median_iter_s'] * 1e3:.0f} ms ({', '.join(ratios)}; "
                   f"{r['groups']} group{'s' * (r['groups'] != 1)}, {r['hidden_fraction'] * 100:.0f}% hidden)")
    return out + [""] if out else out


def group_lines(rows: list[dict]) -> list[str]:
    """Per model: torch's DDP over ringtrain.TorchProcessGroup against torch's DDP over gloo (the
    same buckets and reducer; only the collectives differ)."""
    out = []
    for r in rows:
        ddp = next((x for x in rows if x["model"] == r["model"] and x["impl"] == "torch-ddp"), None)
        if r["impl"] == "torch-ddp-ringtrain" and ddp:
            out.append(f"- {r['model']}: torch DDP over ringtrain's process group {r['median_iter_s'] * 1e3:.0f} ms, "
                       f"over gloo {ddp['median_iter_s'] * 1e3:.0f} ms "
                       f"({ddp['median_iter_s'] / r['median_iter_s']:.2f}x)")
    return out + [""] if out else out


def horovod_lines(rows: list[dict]) -> list[str]:
    """Per model with a Horovod row: Horovod and the torch DDP that took turns with it in their
    launch, and optimal against the torch DDP of the main launch (each iteration / its DDP's)."""
    out = []
    for r in rows:
        hvd_ddp = next((x for x in rows if x["model"] == r["model"] and x["impl"] == "torch-ddp-horovod-launch"), None)
        if r["impl"] != "horovod" or hvd_ddp is None:
            continue
        line = (f"- {r['model']}: Horovod {r['median_iter_s'] * 1e3:.0f} ms, torch DDP {hvd_ddp['median_iter_s'] * 1e3:.0f}"
                f" ms in Horovod's launch (Horovod / DDP {r['median_iter_s'] / hvd_ddp['median_iter_s']:.2f})")
        ddp = next((x for x in rows if x["model"] == r["model"] and x["impl"] == "torch-ddp"), None)
        opt = next((x for x in rows if x["model"] == r["model"] and x["impl"] == "ringtrain"
                    and x["schedule"] == "optimal"), None)
        if ddp and opt:
            line += (f"; optimal {opt['median_iter_s'] * 1e3:.0f} ms, torch DDP {ddp['median_iter_s'] * 1e3:.0f} ms "
                     f"in the main launch (optimal / DDP {opt['median_iter_s'] / ddp['median_iter_s']:.2f})")
        out.append(line)
    return out + [""] if out else out


def allreduce_lines(doc: dict) -> list[str]:
    """Per (world size, size): gloo, Open MPI, Horovod (a column only in a run that timed it) and
    the fastest ringtrain configuration (busbw GB/s in brackets), and that one against gloo."""
    rows = doc["rows"]
    horovod = any(r["impl"] == "horovod" for r in rows)
    out = ["| ranks | size | gloo | Open MPI |" + " Horovod |" * horovod + " ringtrain best | configuration | vs gloo |",
           "|---|---|---|---|---|---|---|" + "---|" * horovod]
    for p, n in sorted({(r["world_size"], r["nbytes"]) for r in rows}):
        here = [r for r in rows if r["world_size"] == p and r["nbytes"] == n]
        anchor = {r["impl"]: r for r in here if r["impl"] != "ringtrain"}
        ours = [r for r in here if r["impl"] == "ringtrain"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["median_s"])
        cell = lambda r: f"{_duration(r['median_s'])} ({r['busbw_GBps']:.2f})" if r else ""  # noqa: E731
        gloo = anchor.get("gloo")
        ratio = f"{gloo['median_s'] / best['median_s']:.2f}×" if gloo else ""
        hvd = f" {cell(anchor.get('horovod'))} |" if horovod else ""
        out.append(f"| {p} | {_size(n)} | {cell(gloo)} | {cell(anchor.get('mpi'))} |{hvd} {cell(best)} | "
                   f"{best['transport']}/{best['algorithm']} | {ratio} |")
    return out


def overhead_lines(doc: dict) -> list[str]:
    out = ["| model | plain step | wrapped step | overhead | per step | same parameters |", "|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['plain_step_ms']:.2f} ms | {r['ddp_step_ms']:.2f} ms | {r['overhead_percent']:+.2f}% | "
            f"{r['overhead_us_per_step']:.0f} µs | {r['same_parameters']} |" for r in doc["rows"]]
    return out


def summarize(path: Path) -> tuple[list[str], dict]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):  # (JSON, but not one document of ours: a list, a number)
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    rows = doc["rows"]
    kind = str(doc.get("benchmark", ""))
    if kind.startswith(("allreduce", "overhead")):
        head = [f"## {path.name} (commit {doc.get('commit', '?')}): `{doc.get('command', '?')}`", ""]
        body = allreduce_lines(doc) if kind.startswith("allreduce") else overhead_lines(doc)
        return head + body, ring_stats([])
    out = [f"## {path.name} (commit {doc.get('commit', '?')}, {doc.get('net')}, "
           f"{doc.get('world_size')} ranks)", ""]
    table = ring_cells(rows)
    if table:
        cols = ("alone", "torch-ddp") + SCHEDULES
        out += ["| model | alone | torch DDP | " + " | ".join(SCHEDULES) + " |",
                "|" + "---|" * (len(cols) + 1)]
        out += [f"| {m} | " + " | ".join(c.get(k, "") for k in cols) + " |" for m, c in table.items()]
        out.append("")
    out += trial_lines(rows) + compression_lines(rows) + group_lines(rows) + horovod_lines(rows) + ps_lines(rows)
    return out, ring_stats(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path,
                        help="saved results of `ringtrain bench train`, `ringtrain bench allreduce` or "
                             "`python -m ringtrain.ddp.overhead`")
    args = parser.parse_args(argv)
    configs = near = 0
    below, errors, misses = [], [], []
    for path in args.files:
        try:
            lines, stats = summarize(path)
        except (OSError, ValueError, KeyError) as exc:
            print(f"bench_summary: {path}: not a saved bench train, bench allreduce or overhead result ({exc!r})",
                  file=sys.stderr)
            return 2
        print("\n".join(lines) + "\n")
        configs += stats["configs"]
        near += stats["near_fastest"]
        below += [(path.name, m, d) for m, d in stats["below_ddp"]]
        errors += stats["sim_errors"]
        misses += stats["misses"]
    if configs:
        gaps = ", ".join(f"{m} {d * 100:.1f}%" for _, m, d in below)
        same_one = " with the same one allreduce: noise"
        missed = ", ".join(f"{m}: {s} {d * 100:.1f}% faster" + (same_one if same else "") for m, s, d, same in misses)
        print(f"optimal within {NEAR:.0%} of the fastest schedule in {near}/{configs}"
              + (f" ({missed})" if missed else "")
              + f"; below torch DDP in {len(below)}/{configs}" + (f" ({gaps})" if gaps else ""))
    if errors:
        print(f"simulator: within 15% on {sum(e <= 0.15 for e in errors)}/{len(errors)}, "
              f"within 5% on {sum(e <= 0.05 for e in errors)}, max {max(errors) * 100:.1f}%, "
              f"median {statistics.median(errors) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
