"""PNG figures of a simulation sweep (matplotlib, Agg backend — no display needed).

* **scaling curves** — one file per model: a panel per cluster x algorithm, scaling
  efficiency against GPU count (log scale), one line per schedule.
* **Gantt chart** — one file per model: one iteration on the middle cluster x algorithm of
  the sweep (10GbE by default) at its middle GPU count above 1 (64 by default); for each
  schedule a compute row (forward, each gradient layer's backward, optimizer) and a
  communication row (each allreduce group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .simulator import Prediction
from .traces import Trace


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def scaling_curves(predictions: Sequence[Prediction], model: str, path: Path) -> Path:
    plt = _pyplot()
    rows = [p for p in predictions if p.model == model]
    panels = list(dict.fromkeys((p.cluster, p.algorithm) for p in rows))
    schedules = list(dict.fromkeys(p.schedule for p in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, (cluster, algorithm) in zip(axes[0], panels):
        for s in schedules:
            pts = sorted((p.world_size, p.efficiency) for p in rows if (p.cluster, p.algorithm, p.schedule) == (cluster, algorithm, s))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=s)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{cluster}, {algorithm}", fontsize=9)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("scaling efficiency")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{model}: scaling efficiency per schedule", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gantt(predictions: Sequence[Prediction], trace: Trace, path: Path) -> Path:
    """Compute and communication of one iteration, for each schedule in ``predictions``."""
    plt = _pyplot()
    names, times, _ = trace.gradient_layers()
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.7 * len(predictions)))
    ticks, labels = [], []
    ms = 1e3
    for row, p in enumerate(predictions):
        y = 2 * (len(predictions) - 1 - row)
        # compute: forward, then each gradient layer's backward, then backward's tail and the optimizer
        ax.broken_barh([(0, p.forward_s * ms)], (y + 1, 0.8), color="tab:blue")
        t, bars = p.forward_s, []
        for dt in times:
            bars.append((t * ms, dt * ms))
            t += dt
        ax.broken_barh(bars, (y + 1, 0.8), facecolors=("tab:orange", "tab:red"), linewidth=0)
        end_backward = p.forward_s + p.backward_s
        start_opt = p.forward_s + max(p.backward_s, p.comm_end_s)
        ax.broken_barh([(t * ms, (end_backward - t) * ms)], (y + 1, 0.8), color="tab:orange")
        ax.broken_barh([(start_opt * ms, p.optimizer_s * ms)], (y + 1, 0.8), color="tab:purple")
        comm = [((p.forward_s + s) * ms, (e - s) * ms) for s, e in zip(p.plan.starts, p.plan.ends)]
        ax.broken_barh(comm, (y + 0.1, 0.8), facecolors=("tab:green", "tab:olive"), linewidth=0)
        ticks += [y + 0.5, y + 1.4]
        labels += [f"{p.schedule} comm ({p.groups})", f"{p.schedule} compute"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms from the start of the iteration")
    first = predictions[0]
    ax.set_title(  # (two lines: one was cut off at the figure's right edge)
        f"{first.model} on {first.world_size} GPUs, {first.cluster}, {first.algorithm}\nforward (blue), "
        "backward (orange/red per layer), optimizer (purple), allreduce groups (green)", fontsize=8,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(predictions: Sequence[Prediction], traces: Sequence[Trace], clusters: Sequence[Any], out_dir: str | Path) -> list[Path]:
    """Scaling curves and a Gantt chart per model into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    # (the middle of the counts that communicate: --gpus 1,64 drew 1 GPU, no allreduce in the chart)
    gpus = sorted({p.world_size for p in predictions if p.world_size > 1}) or [1]
    mid = gpus[(len(gpus) - 1) // 2]
    pairs = list(dict.fromkeys((p.cluster, p.algorithm) for p in predictions))
    cluster, algorithm = pairs[(len(pairs) - 1) // 2]
    stems: set[str] = set()
    for trace in traces:
        # Models whose names differ only where _safe puts "_" ("my model", "my_model") get -2, -3...:
        # the second one's figures overwrote the first's.
        stem, k = _safe(trace.model), 2
        while stem in stems:
            stem, k = f"{_safe(trace.model)}-{k}", k + 1
        stems.add(stem)
        written.append(scaling_curves(predictions, trace.model, out / f"scaling_{stem}.png"))
        rows = [p for p in predictions if p.model == trace.model and p.world_size == mid
                and (p.cluster, p.algorithm) == (cluster, algorithm)]
        written.append(gantt(rows, trace, out / f"gantt_{stem}_{mid}gpus_{_safe(cluster)}.png"))
    return written
