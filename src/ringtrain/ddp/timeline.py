"""Timeline: what each rank did when, as Chrome/Perfetto trace events, plus iteration stats.

Words used here:

- *span*: an interval of work on one *lane*: ``compute`` (the training thread: forward, each
  parameter's backward, then per bucket the wait for its allreduce and its copy into ``.grad``) or
  ``communication`` (the wrapper's communication thread: each bucket's allreduce, and the
  calibration exchanges). Spans are Chrome trace "complete" events (``ph: "X"``, times in
  microseconds of the host's monotonic clock, perf_counter's, so the ranks of one host line up;
  ranks on different hosts have clocks of their own); ``pid`` is the rank + 1 (named "rank r"),
  ``tid`` the lane (1 compute, 2 communication).
- *trace file*: one JSON file per rank, ``trace.json`` -> ``trace.rank0.json`` ...; it opens in
  Perfetto (ui.perfetto.dev) or chrome://tracing, and :func:`draw_timeline` draws it as a PNG.
  It is written after the 1st, 2nd, 4th, 8th... recorded iteration and at the last, so a run
  killed on the way (SIGKILL, or torchrun's SIGTERM after a peer died) keeps at least half of
  what it recorded.
- *hidden share*: the fraction of an iteration's communication time that overlaps its backward
  pass (from the backward start to the last gradient ready).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..paths import user_path

# Trace ids: pid rank + 1 and tids from 1 (Perfetto treats pid and tid 0 as the kernel's idle task;
# its maintainers advise against them in a synthesized trace). Files written before used pid rank
# and tids 0 and 1: draw_timeline reads the names of the metadata events, so it draws both.
LANES = {"compute": 1, "communication": 2}
_OLD_LANES = {0: "compute", 1: "communication"}


def trace_pid(rank: int) -> int:
    """The trace's process id of ``rank`` (named "rank <rank>" in the file's metadata)."""
    return rank + 1


@dataclass(frozen=True, slots=True)
class IterationStats:
    """Where one synchronizing iteration's time went (seconds)."""

    iteration: int
    """Count of synchronizing backward passes before this one."""
    forward_s: float
    """The wrapped module's forward."""
    backward_s: float
    """Backward start (gradient of the output) to the last gradient ready."""
    first_ready_s: float
    """Backward start to the first gradient ready."""
    comm_s: float
    """Sum of the buckets' allreduce times on the communication thread (an allreduce started
    before a slower rank was ready includes the wait for it)."""
    exposed_s: float
    """Communication left after backward: last allreduce end minus last gradient ready (>= 0)."""
    wait_s: float
    """Time the training thread blocked at the end of backward (waiting plus copying back)."""
    hidden_fraction: float
    """Share of comm_s that overlapped backward (1.0 when there was no communication)."""
    buckets: int
    """Allreduces in this iteration."""
    predicted_end_s: float
    """The plan's predicted end of the last allreduce, from backward start."""
    measured_end_s: float
    """Measured end of the last allreduce (or of backward when none), from backward start."""
    forward_backward_s: float
    """Forward start to the end of the copy into ``.grad`` (the step without the optimizer)."""
    broadcast_s: float = 0.0
    """Part of forward_s spent broadcasting rank 0's buffers (``broadcast_buffers``)."""
    hooks_s: float = 0.0
    """Part of backward_s spent in the wrapper's gradient hooks (copies into the buckets and
    launches): what backward costs more under the wrapper than alone, with or without overlap."""

    @property
    def overlap_bound_s(self) -> float:
        """The best forward + backward + communication time overlap allows:
        forward + max(backward, first gradient ready + all communication)."""
        return self.forward_s + max(self.backward_s, self.first_ready_s + self.comm_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overlap_bound_s": self.overlap_bound_s}


def overlap(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the parts of ``intervals`` that fall inside [lo, hi]."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def hidden_fraction(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Share of the intervals' total length inside [lo, hi]; 1.0 if they are empty."""
    total = sum(b - a for a, b in intervals)
    return 1.0 if total <= 0.0 else min(1.0, overlap(intervals, lo, hi) / total)


def trace_path(path: str | os.PathLike, rank: int) -> Path:
    """``trace.json`` -> ``trace.rank{rank}.json`` (the suffix kept, ``.json`` if none). A folder
    (one that exists, a path ending in a separator, '' or '.') is a ValueError: it would be taken
    for a file's stem and the files written beside it."""
    text = str(os.fspath(path))
    p = Path(path)
    if not text.strip() or text.endswith(("/", os.sep)) or p.name in ("", ".", "..") or p.is_dir():
        raise ValueError(f"timeline: {text!r} is a folder, not a trace file name; give a file such as "
                         f"{os.path.join(text or '.', 'trace.json')!r} (each rank writes trace.rank<r>.json there)")
    suffix = p.suffix or ".json"
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return p.with_name(f"{stem}.rank{rank}{suffix}")


class TraceRecorder:
    """Collects spans of the first ``max_iterations`` recorded iterations; writes one file.

    A write that fails (the disk full, the folder removed) warns once, naming the file, and ends
    the recording: a trace is not worth a training run."""

    def __init__(self, path: str | os.PathLike, rank: int, max_iterations: int, origin: Optional[float] = None):
        if max_iterations < 1:
            raise ValueError(f"timeline_iterations must be >= 1, got {max_iterations}")
        self.path = trace_path(path, rank)
        check_trace_file(self.path)
        self.rank = rank
        self.max_iterations = max_iterations
        self.origin = time.perf_counter() if origin is None else origin
        self.iterations = 0
        self.events: list[dict[str, Any]] = []
        self._written = False
        self.failed = False  # a write failed: nothing more is recorded or written
        key = str(self.path.resolve())
        if _IN_USE.get(key):  # (os.replace would silently put this one's trace over the other's)
            warnings.warn(f"timeline: another DistributedDataParallel in this process already writes {self.path}; "
                          "this one's trace will replace it: give each wrapper a timeline path of its own "
                          "(or close() the other first)", RuntimeWarning, stacklevel=3)
        _IN_USE[key] = _IN_USE.get(key, 0) + 1
        self._key: Optional[str] = key

    @property
    def recording(self) -> bool:
        return not self.failed and self.iterations < self.max_iterations

    def span(self, name: str, cat: str, lane: str, start: float, end: float, **args: Any) -> None:
        """Record [start, end] (perf_counter seconds) on ``lane``."""
        if not self.recording:
            return
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round((start - self.origin) * 1e6, 3),
            "dur": round(max(0.0, end - start) * 1e6, 3),
            "pid": trace_pid(self.rank),
            "tid": LANES[lane],
        }
        if args:
            event["args"] = args
        self.events.append(event)

    def end_iteration(self) -> None:
        if not self.recording:
            return
        self.iterations += 1
        n = self.iterations
        if not self.recording or n & (n - 1) == 0:  # the last, and every power of two (a kill keeps half)
            self.flush()

    def close(self) -> None:
        """The last write (the wrapper's close, or its collection); warns where no iteration
        was recorded, since then no file, or one of calibration alone, is all there is."""
        try:
            if self.iterations == 0 and not self.failed:
                warnings.warn(f"timeline: no iteration was traced into {self.path}: recording starts with the "
                              "first iteration under the settled plan (model.settled; the default schedule "
                              "'optimal' first profiles and tries plans for some tens of iterations), and this "
                              "run ended before it; train longer, or pass a schedule that needs no trial "
                              "(schedule='mgwfbp', 'wfbp', 'fixed' or 'single': a few iterations)",
                              RuntimeWarning, stacklevel=2)
            self.flush()
        finally:
            self.release()

    def release(self) -> None:
        """Let another recorder of the process take this file without a warning (close does;
        also a wrapper whose construction failed). Idempotent."""
        if self._key is not None:
            _IN_USE[self._key] -= 1
            if not _IN_USE[self._key]:
                del _IN_USE[self._key]
            self._key = None

    def flush(self) -> Optional[Path]:
        """Write the trace file (atomically: a temporary file, then a rename). Idempotent
        once all iterations are recorded; returns the path, or None when nothing was recorded."""
        if self._written or not self.events:
            return None
        pid = trace_pid(self.rank)
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": self.rank}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
            for lane, tid in LANES.items()
        ]
        doc = {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as exc:
            self._give_up(exc, tmp)
            return None
        if not self.recording:
            self._written = True
        return self.path

    def _give_up(self, exc: OSError, tmp: Path) -> None:
        """A write failed: warn (once: nothing is written after it) and stop recording."""
        self.failed = True
        self.events = []
        with contextlib.suppress(OSError):
            tmp.unlink()
        warnings.warn(f"timeline: cannot write the trace file {self.path}: {exc.strerror or exc}; "
                      "this rank's timeline is no longer recorded (training goes on)", RuntimeWarning, stacklevel=3)


_IN_USE: dict[str, int] = {}  # the trace files of this process's open recorders: how many write each


def check_trace_file(path: Path) -> None:
    """Make ``path``'s folder and try a file in it: a trace that cannot be written fails now, not
    at its first flush from inside a backward pass."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        probe = path.with_name(path.name + f".tmp{os.getpid()}")
        probe.touch()
        probe.unlink()
    except (FileExistsError, NotADirectoryError):  # (mkdir's errors where a folder of the path is a file)
        raise ValueError(f"timeline: cannot write the trace file {path}: {path.parent} is not a folder "
                         "(it, or a folder above it, is a regular file); give a path in a writable folder") from None
    except OSError as exc:
        raise ValueError(f"timeline: cannot write the trace file {path}: {exc.strerror or exc}; "
                         "give a path in a writable folder") from None


_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "wait": "#999999", "copy": "#8172b2",
           "allreduce": "#dd8452", "calibration": "#c44e52"}


def timeline_rows(files: Sequence[str | os.PathLike], iterations: Optional[int] = None) -> list[tuple[str, list[dict]]]:
    """The rows draw_timeline draws: per process of each file, in file order, a ``(label, spans)``
    row for each lane (compute, communication); ``iterations``: only the last that many. The
    names come from each file's metadata; files written before trace_pid (pid = rank, tids 0
    and 1) by the old lane numbers. Each file is read apart, so old and new ones mix."""
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1):
        raise ValueError(f"iterations must be a positive integer or None (all), got {iterations!r}")
    rows: list[tuple[str, list[dict]]] = []
    for f in files:
        events = json.loads(Path(f).read_text())["traceEvents"]
        process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
        lane_of = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "thread_name"}
        spans = [e for e in events if e.get("ph") == "X"]
        for pid in sorted({e["pid"] for e in spans}):
            for lane in LANES:
                rows.append((f"{process.get(pid, f'rank {pid}')} {lane}",
                             [e for e in spans if e["pid"] == pid
                              and lane_of.get((pid, e["tid"]), _OLD_LANES.get(e["tid"])) == lane]))
    if iterations is not None:
        its = sorted({e.get("args", {}).get("iteration", -1) for _, spans in rows for e in spans})
        keep = set(its[-iterations:])
        rows = [(label, [e for e in spans if e.get("args", {}).get("iteration", -1) in keep]) for label, spans in rows]
    if not any(spans for _, spans in rows):
        raise ValueError(f"no spans to draw in {[str(f) for f in files]}")
    return rows


def draw_timeline(trace_files: str | os.PathLike | Sequence[str | os.PathLike], png_path: str | os.PathLike,
                  iterations: Optional[int] = 3, title: str = "") -> Path:
    """Draw trace file(s) as a PNG: per rank a compute lane and a communication lane.

    ``iterations``: how many of the last recorded iterations to show (None: all). ``title``: what
    the run was (model, schedule, ranks), put before the picture's own title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    files = [user_path(f) for f in ([trace_files] if isinstance(trace_files, (str, os.PathLike)) else trace_files)]
    if not files:
        raise ValueError("draw_timeline needs at least one trace file")
    rows = timeline_rows(files, iterations)
    t0 = min(e["ts"] for _, spans in rows for e in spans)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.9 * len(rows)))
    labels = [label for label, _ in rows]
    for row, (_, spans) in enumerate(rows):
        for e in spans:
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)], (row - 0.4, 0.8),
                           facecolors=_COLORS.get(e["cat"], "#333333"), edgecolor="none")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title + ': ' if title else ''}ringtrain DDP timeline, backward and allreduce overlap")
    # Below the axes, where it hides no span.
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.45 / (0.4 + 0.45 * len(rows))), fontsize=8, ncol=len(_COLORS), frameon=False)
    fig.tight_layout()
    out = Path(user_path(png_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
