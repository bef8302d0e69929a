"""What a benchmark result file records about where and how it was measured."""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator


#: What one rank of a benchmark holds before its messages or models: python, torch, numpy, a
#: gloo process group and ringtrain's transports. Measured: 236 MiB resident per rank of
#: ``bench allreduce`` (2 ranks, shm and tcp, 4 KiB messages); rounded up.
RANK_MEMORY_BYTES = 300 << 20
#: More ranks than this many per core and each waits for a core most of the time: timings
#: then measure the scheduler, not the algorithms.
RANKS_PER_CORE_WARNING = 4


def memory_bytes() -> int | None:
    """The machine's memory (MemTotal of /proc/meminfo) in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an s unless ``n`` is 1: '1 worker', '2 workers'."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_ranks(option: str, ranks: int, per_rank_bytes: int = RANK_MEMORY_BYTES, *,
                memory: int | None = None, cores: int | None = None) -> str | None:
    """Refuse (ValueError naming ``option``) ``ranks`` processes of ``per_rank_bytes`` each that
    this machine's memory cannot hold; return a one-line warning when they outnumber the cores
    RANKS_PER_CORE_WARNING times over (None otherwise). ``memory``/``cores``: the machine's by default."""
    memory = memory_bytes() if memory is None else memory
    cores = (os.cpu_count() or 1) if cores is None else cores
    need = ranks * per_rank_bytes
    if memory is not None and need > memory:
        raise ValueError(f"{option}: {ranks} ranks need about {_gib(need)} ({per_rank_bytes / 2**20:.0f} MiB each), "
                         f"more than this machine's {_gib(memory)} of memory")
    if ranks > RANKS_PER_CORE_WARNING * cores:
        return (f"{option}: {ranks} ranks on {cores} CPU cores (more than {RANKS_PER_CORE_WARNING} per core): "
                "the ranks mostly wait for a core, so the timings will mean little")
    return None


def describe_machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = memory_bytes()
    mem_gib = None if mem is None else round(mem / 2**30, 1)
    import numpy
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "hostname": platform.node(),
    }


def git_commit() -> str | None:
    """The short commit the code runs from, ``-dirty`` added where tracked files differ from it."""
    where = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=where).stdout.strip() or None
        if commit is not None and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                 capture_output=True, text=True, timeout=5, cwd=where).stdout.strip():
            commit += "-dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return None


def utc_now() -> _dt.datetime:
    """Now in UTC, to the second (the resolution of a result's name and its times)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


def run_stamp(started: _dt.datetime | None = None) -> str:
    """The UTC time that names a run's files (its result and its timelines): its start, ``started``
    (by default now)."""
    return (started or utc_now()).strftime("%Y%m%dT%H%M%SZ")


@contextlib.contextmanager
def reserve_stamp(out_dir: Path | None, kind: str, stamp: str) -> Iterator[str]:
    """``stamp``, or ``<stamp>-<pid>`` where another run of ``kind`` has it (one started in the same
    second), for the names of this run's files in ``out_dir``: ``<kind>-<stamp>.json``, the charts
    and timelines ``<kind>-<stamp>-*``. Held until the block ends by an empty file
    ``.<kind>-<stamp>.running`` in ``out_dir``, made exclusively, holding the host and pid of its
    run: one left by a run killed outright (SIGKILL, the OOM killer) is removed by the next run
    on that host. Without ``out_dir``: ``stamp``, nothing held."""
    if out_dir is None:
        yield stamp
        return
    out_dir = Path(out_dir)
    _remove_dead_holds(out_dir)
    # (after the pid, a count: several runs of one process in one second, as tests make)
    pid = os.getpid()
    for mine in itertools.chain([stamp, f"{stamp}-{pid}"], (f"{stamp}-{pid}-{k}" for k in itertools.count(2))):
        stem = f"{kind}-{mine}"
        try:
            held = out_dir / f".{stem}.running"
            fd = os.open(held, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:  # (another run holds it now)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{platform.node()} {pid}\n")
        # a run that ended holds nothing: its files say the name is taken
        if not ((out_dir / f"{stem}.json").exists() or any(out_dir.glob(f"{stem}-*"))
                or any(out_dir.glob(f"timelines/{stem}-*"))):
            break
        held.unlink()
    try:
        yield mine
    finally:
        with contextlib.suppress(OSError):
            held.unlink()


def _remove_dead_holds(out_dir: Path) -> None:
    """Remove the ``.*.running`` files of ``out_dir`` that this host's runs left when killed
    outright: those naming this host and a pid no process has. (Others, and a file not yet
    written, are left: a run elsewhere, or one starting now.)"""
    for held in out_dir.glob(".*.running"):
        try:
            host, pid = held.read_text().split()
            if host != platform.node() or int(pid) <= 0:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                held.unlink()
        except (OSError, ValueError):  # (unreadable, being written, another's, alive: left)
            continue


def check_out_dir(out_dir: str | Path) -> Path:
    """Make ``--out`` now and check it takes files: a run that cannot be saved fails before it
    runs, not after (its results lost)."""
    from ..outputs import check_folder

    return check_folder(out_dir, "--out", make=True)


def result_document(kind: str, doc: dict, started: _dt.datetime | None = None) -> dict:
    """``doc`` headed by what was run, where and when: benchmark, when, started, ended, command,
    commit, machine. The one document a benchmark both saves and prints with --json.

    ``started``: when the run began (by default now), the time its file is named by
    (:func:`run_stamp`); ``ended``: now. ``when`` is ``started``, the name's time. (Files saved
    before these two fields: ``when`` is the time the result was saved; a train result's name
    its start, an allreduce or overhead result's name that same time.)"""
    ended = utc_now()
    started = started or ended
    return {
        "benchmark": kind,
        "when": started.isoformat(),
        "started": started.isoformat(),
        "ended": ended.isoformat(),
        "command": "ringtrain " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "commit": git_commit(),
        "machine": describe_machine(),
        **doc,
    }


def print_result(doc: dict, table: str, as_json: bool) -> None:
    """What a benchmark prints: its document (--json), or its table, notes, and where it was saved."""
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    print(table)
    for note in doc.get("notes", []):
        print(f"note: {note}")
    if "saved_to" in doc:
        print(f"saved {doc['saved_to']}")
    for chart in doc.get("charts", []):
        print(f"chart {chart}")


def save_result(kind: str, doc: dict, out_dir: str | Path = "benchmarks", stamp: str | None = None) -> Path:
    """Write ``doc`` (plus machine, command, commit, time) to out_dir/<kind>-<stamp>.json, the
    stamp by default the run's start (``started`` of a ``doc`` from :func:`result_document`,
    which is written as it is), else now (:func:`run_stamp`)."""
    full = doc if "benchmark" in doc else result_document(kind, doc)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if stamp is None:
        stamp = run_stamp(_dt.datetime.fromisoformat(full["started"]) if "started" in full else None)
    path = out / f"{kind}-{stamp}.json"
    if path.exists():  # (another run started in the same second: both kept)
        path = path.with_name(f"{path.stem}-{os.getpid()}.json")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(full, indent=1) + "\n")  # (then renamed: never a half-written result)
    os.replace(tmp, path)
    return path
