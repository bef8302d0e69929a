"""`ringtrain bench allreduce`: every algorithm x transport against gloo, Open MPI and Horovod.

For each world size the ranks run as separate processes (``bench.procs``). In one run and
interleaved repeat by repeat, they time: torch.distributed's gloo ``all_reduce`` (the anchor),
ringtrain's algorithms on each transport; then, in launches of their own: MPI_Allreduce through
``mpirun`` when mpi4py and Open MPI are installed (not under --net: mpirun cannot start its
ranks on the emulated hosts), and Horovod's ``hvd.allreduce_`` over gloo when an interpreter
imports ``horovod.torch`` (this one, or the one --horovod-python names: Horovod 0.28.1 builds
against this torch only patched, in a venv of its own, ``scripts/horovod/install.sh``). Horovod's
workers are started as horovodrun's gloo launcher starts them, but by ``bench.horovod``, which
can put each on its emulated host: under --net too. Per size: median time over repeats (each
repeat's time is the slowest rank's), algbw = bytes / time and busbw = algbw · 2(p−1)/p
(the nccl-tests convention). Every configuration's result is checked exactly once before it
is timed: a wrong answer aborts the benchmark. Rank 0 sends each size's rows as soon as that
size is timed, so a run stopped early (Ctrl-C, a failed rank, --timeout) saves what it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from ..paths import user_path
from .horovod import anchor_python
from .horovod import launch as launch_horovod
from .machine import plural, utc_now
from .netem import NetemUnavailable
from .procs import (RESULT_PREFIX, RankFailed, check_hosts, emit, emulated, interrupted, interruption, network, progress,
                    run_ranks, signals_held)

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "4K,64K,1M,16M,64M"
DEFAULT_ALGORITHMS = "ring,naive,central,halving_doubling,auto"
NETS = ("none", "1gbit", "10gbit")


DEFAULT_REPEATS = 7
QUICK_REPEATS = 5
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: Copies of the largest message one rank holds at once: the buffer, and while its result is
#: checked the expected sum and numpy's temporaries (the transports' scratch comes on top).
MESSAGE_COPIES = 4


def parse_size(text: str) -> int:
    """Bytes of '4096', '4K', '64M', '1G', '1T' (powers of 1024; a trailing 'B' or 'iB' is allowed)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = _SIZE_UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SIZE_UNITS else text
    try:
        value = int(float(number) * mult)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise ValueError(f"--sizes: cannot read {text!r} (a number of bytes with suffix K, M, G or T: 4K, 64M, 1G)") from None
    if value < 4 or value % 4:
        raise ValueError(f"--sizes: {text!r} must be a positive multiple of 4 bytes (float32)")
    return value


def csv_choices(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """The comma-separated items of ``text``, each one of ``allowed`` and none twice (ValueError
    naming ``option`` otherwise)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{option}: {bad or text!r} not in {allowed}")
    return unique(items, option)


def unique(items: list, option: str) -> list:
    """``items`` unchanged; ValueError naming ``option`` if one is given twice (it would run twice)."""
    twice = sorted({str(x) for i, x in enumerate(items) if x in items[:i]})
    if twice:
        raise ValueError(f"{option}: {', '.join(twice)} given twice")
    return items


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", default="2,4", help="comma-separated numbers of ranks (default %(default)s)")
    p.add_argument("--sizes", default=None, help="message sizes in bytes, suffixes K, M, G, T (powers of 1024) "
                   f"(default {DEFAULT_SIZES}; {QUICK_SIZES} with --quick)")
    p.add_argument("--algorithms", default=None,
                   help=f"ringtrain algorithms to time (default {DEFAULT_ALGORITHMS}; ring,auto with --quick)")
    p.add_argument("--transports", default="shm,tcp",
                   help="ringtrain transports to time: shm, tcp, torch, auto (default %(default)s; under --net shm cannot "
                        "cross the hosts, tcp is timed instead)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration, median reported "
                   f"(default {DEFAULT_REPEATS}; {QUICK_REPEATS} with --quick)")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, algorithms ring and auto, "
                   f"{QUICK_REPEATS} repeats (each unless given)")
    p.add_argument("--net", default="none", choices=NETS, help="emulate a network: one namespace per rank, tc tbf "
                   "(default %(default)s); the tbf burst (1 ms of line rate: 128 KiB at 1gbit, 1.25 MiB at 10gbit) "
                   "lets smaller messages through faster than the line rate")
    p.add_argument("--no-mpi", action="store_true", help="skip the Open MPI anchor")
    p.add_argument("--no-horovod", action="store_true", help="skip the Horovod anchor")
    p.add_argument("--horovod-python", default=None, metavar="PYTHON", type=user_path,
                   help="the interpreter that runs the Horovod anchor, one that imports horovod.torch (default: "
                        "this one; scripts/horovod/install.sh builds Horovod into .venv-horovod/); its workers are "
                        "started without horovodrun, on the emulated hosts under --net")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed (default %(default)g)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--out", default="benchmarks", type=user_path, help="directory for the result file (default %(default)s; '' to skip saving)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mpi-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--horovod-worker", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(json.loads(args.worker))
    if args.mpi_worker:
        return _mpi_worker(json.loads(args.mpi_worker))
    if args.horovod_worker:
        return _horovod_worker(json.loads(args.horovod_worker))
    try:
        world_sizes, sizes, algorithms, transports, repeats = _settings(args)
        check_hosts("--world-sizes", max(world_sizes), args.net)
        warning = _check_machine(world_sizes, sizes)
    except ValueError as exc:
        raise SystemExit(f"ringtrain bench allreduce: {exc}")
    if warning:
        print(f"ringtrain bench allreduce: warning: {warning}", file=sys.stderr)
    transports, notes = _transports_on(args.net, transports)
    if args.no_mpi:
        notes.append("Open MPI anchor skipped: --no-mpi")
    elif args.net != "none":
        notes.append(f"Open MPI anchor skipped: under --net {args.net} mpirun would not start its ranks "
                     "on the emulated hosts")
    # the interpreter that runs the Horovod anchor, None when it is skipped (and the note why)
    horovod, note = anchor_python(args.no_horovod, args.horovod_python)
    if note:
        notes.append(note)
        if args.horovod_python:  # (asked for by name: said now, while the run can still be stopped, and in the notes)
            print(f"ringtrain bench allreduce: {note}", file=sys.stderr)
    cfg = {"sizes": sizes, "algorithms": algorithms, "transports": transports, "repeats": repeats}
    rows: list[dict] = []
    started = utc_now()  # (the result's name, "started" and "when")
    stopped, failure = None, None  # why the run ended before its last world size, if it did
    # The result's machine names torch's version: loaded now, as a Ctrl-C when the run ends met its import.
    importlib.import_module("torch")

    try:
        _measure(world_sizes, cfg, args, notes, rows, horovod)
    except KeyboardInterrupt:  # the ranks and namespaces are gone with the with-blocks that made them
        stopped = f"interrupted ({interruption()})"
    except (RankFailed, NetemUnavailable) as exc:  # (or a later world size's network that could not be made)
        stopped, failure = f"stopped ({str(exc).splitlines()[0].rstrip(':')})", exc  # (the log tail left out)
    if stopped and not rows:
        if failure is not None:
            raise failure  # the one-line error the command line makes of it
        return interrupted("ringtrain bench allreduce")
    from .machine import print_result, result_document, save_result

    with signals_held() as came:  # (a Ctrl-C now waits until the rows are saved)
        notes += above_line_rate(rows, args.net)
        if stopped:
            notes.append(f"{stopped} before the run ended: the rows finished by then, for {finished(rows, sizes)}")
        # One document, saved and printed: --json's stdout records the machine too (with --out '' only it does).
        doc = result_document(f"allreduce-{args.net}", {"world_sizes": world_sizes, "net": args.net,
                                                        "network": network(args.net), "rows": rows, "notes": notes},
                              started=started)
        doc["machine"].update(mpi_library(rows))
        kept = "the rows finished so far printed"
        if args.out:
            doc["saved_to"] = str(save_result(doc["benchmark"], doc, args.out))
            kept = f"the rows finished so far saved to {doc['saved_to']}"
    print_result(doc, format_table(rows), args.json)
    if came and not stopped:
        return interrupted("ringtrain bench allreduce", f"after the run; {kept}")
    if failure is not None:
        print(f"ringtrain bench allreduce: {failure}", file=sys.stderr)
        return 1
    return interrupted("ringtrain bench allreduce", kept) if stopped else 0


def _measure(world_sizes: list[int], cfg: dict, args: argparse.Namespace, notes: list[str],
             rows: list[dict], horovod: str | None = None) -> None:
    """Measure into ``rows`` every world size's rows (ringtrain and gloo size by size, as rank 0
    sends them, then Open MPI's, then Horovod's when ``horovod`` names its interpreter): a run
    stopped early keeps in them what it finished. What went wrong with MPI or Horovod goes to
    ``notes``."""
    for p in world_sizes:
        configs = len(cfg["transports"]) * len(cfg["algorithms"]) + 1
        print(f"# world size {p}: {plural(len(cfg['sizes']), 'size')} x {plural(configs, 'configuration')}",
              file=sys.stderr)
        _launch(p, cfg, args, rows)
        if not args.no_mpi and args.net == "none":
            try:
                mpi_rows, note = _launch_mpi(p, cfg, args.timeout)
            except KeyboardInterrupt:  # (its rows come when mpirun ends: none of this world size's)
                notes.append(f"Open MPI anchor interrupted at world size {p}: none of its rows there")
                raise
            rows += mpi_rows
            if note:
                notes.append(note)
        if horovod:
            note = _launch_horovod(p, cfg, args, horovod, rows)
            if note:
                notes.append(note)


def finished(rows: list[dict], sizes: list[int]) -> str:
    """What a stopped run's ``rows`` cover, world size by world size: 'world size 2 at 4K, 64K
    (2 of 3 sizes)'. A size counts once any configuration has its row: rank 0 sends them all
    together, when the size is done."""
    covered = []
    for p in dict.fromkeys(r["world_size"] for r in rows):
        done = sorted({r["nbytes"] for r in rows if r["world_size"] == p})
        covered.append(f"world size {p} at {', '.join(map(_fmt_size, done))} "
                       f"({len(done)} of {plural(len(sizes), 'size')})")
    return "; ".join(covered)


def _settings(args: argparse.Namespace) -> tuple[list[int], list[int], list[str], list[str], int]:
    """The checked world sizes, sizes, algorithms, transports and repeats (ValueError naming the flag)."""
    from ..comm import ALGORITHMS
    from ..transport import TRANSPORTS

    try:
        world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        world_sizes = []
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise ValueError(f"--world-sizes: expected integers >= 2, got {args.world_sizes!r}")
    unique(world_sizes, "--world-sizes")
    if args.sizes is not None and not args.sizes.replace(",", "").strip():
        raise ValueError(f"--sizes: give at least one size (e.g. 4K,1M), got {args.sizes!r}")
    sizes = unique([parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)).split(",")
                    if s.strip()], "--sizes")
    given = args.algorithms if args.algorithms is not None else ("ring,auto" if args.quick else DEFAULT_ALGORITHMS)
    algorithms = csv_choices(given, ALGORITHMS, "--algorithms")  # ('' given: refused, as --sizes '')
    transports = csv_choices(args.transports, TRANSPORTS, "--transports")
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout: seconds before the ranks are killed must be finite and > 0, got {args.timeout}")
    if args.out:
        from .machine import check_out_dir

        check_out_dir(args.out)
    return world_sizes, sizes, algorithms, transports, repeats


def _transports_on(net: str, transports: list[str]) -> tuple[list[str], list[str]]:
    """The transports timed under ``net`` and a note for each left out: the emulated hosts are
    namespaces that cannot share memory, so shm is dropped (tcp timed instead if nothing is left)."""
    if net == "none" or "shm" not in transports:
        return transports, []
    left = [t for t in transports if t != "shm"]
    why = f"shm not timed: under --net {net} each rank is a host of its own and shared memory cannot cross them"
    if left:
        return left, [why]
    return ["tcp"], [why + "; tcp timed instead"]


def line_rate_GBps(net: str) -> float | None:
    """The emulated link's line rate in GB/s (10**9 bytes), None for no emulation."""
    from .netem import parse_rate

    rate = parse_rate(net)
    return None if rate is None else rate / 8 / 1e9


def above_line_rate(rows: list[dict], net: str) -> list[str]:
    """A note naming the sizes whose busbw beats the emulated line rate: the tbf bucket lets a
    burst through unshaped, so smaller messages look faster than the link (marked * in the table)."""
    line = line_rate_GBps(net)
    if line is None:
        return []
    fast = sorted({r["nbytes"] for r in rows if r["busbw_GBps"] > line})
    if not fast:
        return []
    from .netem import LinkShape

    burst = LinkShape.for_rate(net).burst_bytes
    return [f"* busbw above the emulated {net} line rate ({line:.3g} GB/s) at {', '.join(map(_fmt_size, fast))}: "
            f"messages within the tbf burst ({_fmt_burst(burst)}) "
            "pass unshaped, so these figures are not the link's"]


def _fmt_burst(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:g} KiB"


def _check_machine(world_sizes: list[int], sizes: list[int]) -> str | None:
    """Refuse (ValueError) a largest size or world size this machine's memory cannot hold; a
    warning when the ranks outnumber the cores many times over (see machine.check_ranks)."""
    from .machine import RANK_MEMORY_BYTES, check_ranks, memory_bytes

    memory = memory_bytes()
    p, largest = max(world_sizes), max(sizes)
    per_rank = RANK_MEMORY_BYTES + MESSAGE_COPIES * largest
    if memory is not None and p * per_rank > memory and p * RANK_MEMORY_BYTES <= memory:  # the ranks alone fit
        raise ValueError(f"--sizes: {_fmt_size(largest)} does not fit in this machine's {memory / 2**30:.1f} GiB of "
                         f"memory ({p} ranks x ({MESSAGE_COPIES} copies of the message + "
                         f"{RANK_MEMORY_BYTES >> 20} MiB): {p * per_rank / 2**30:.1f} GiB)")
    return check_ranks("--world-sizes", p, per_rank, memory=memory)


def _launch(p: int, cfg: dict, args, rows: list[dict]) -> None:
    """Run world size ``p``'s ranks, adding to ``rows`` each size's rows as rank 0 sends them:
    when the ranks are then stopped (Ctrl-C, a failed rank, the deadline), ``rows`` holds the
    sizes they finished."""
    def arrived(doc: dict) -> None:
        rows.extend([dict(r, net=args.net) for r in doc["rows"]])  # (one call: a size is kept whole or not at all)

    with emulated(args.net, p) as net:
        run_ranks("ringtrain.cli", ["bench", "allreduce", "--worker", json.dumps(cfg)], p, timeout=args.timeout,
                  net=net, on_result=arrived)


def _launch_mpi(p: int, cfg: dict, timeout: float) -> tuple[list[dict], str | None]:
    mpirun = shutil.which("mpirun")
    if importlib.util.find_spec("mpi4py") is None:
        return [], "Open MPI anchor skipped: mpi4py is not installed (pip install mpi4py; apt-get install openmpi-bin libopenmpi-dev)"
    if not mpirun:
        return [], "Open MPI anchor skipped: mpirun not found (apt-get install openmpi-bin)"
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(p), "--bind-to", "none",
           sys.executable, "-m", "ringtrain.cli", "bench", "allreduce", "--mpi-worker", json.dumps(cfg)]
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none", OMP_NUM_THREADS="1")
    # (a session of its own: a Ctrl-C reaches mpirun from here alone, as a SIGTERM once this process
    # has its KeyboardInterrupt, and mpirun's signals to its group never reach this process)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_mpirun(proc)
        return [], f"Open MPI anchor timed out after {timeout:.0f}s"
    except KeyboardInterrupt:
        _stop_mpirun(proc)
        raise
    docs = [json.loads(l[len(RESULT_PREFIX):]) for l in stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if proc.returncode or not docs:
        return [], f"Open MPI anchor failed (status {proc.returncode}): {stderr.strip()[-300:]}"
    return [r for d in docs for r in d["rows"]], None


def mpi_library(rows: list[dict]) -> dict:
    """The MPI library the Open MPI anchor's ranks ran on (``MPI.Get_library_version()``'s first
    line) and mpi4py's version, for the result's machine description; empty where the anchor did
    not run (--no-mpi, --net, no mpi4py, a failed launch)."""
    mpi = next((r for r in rows if r["impl"] == "mpi" and r.get("version")), None)
    return {} if mpi is None else {"mpi": mpi["version"], "mpi4py": mpi.get("mpi4py")}


def _stop_mpirun(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop mpirun as a terminal's Ctrl-C would (SIGTERM: it stops its ranks and removes their shared
    memory segment, which a SIGKILL left in /dev/shm), killing it only past ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _launch_horovod(p: int, cfg: dict, args, python: str, rows: list[dict]) -> str | None:
    """Horovod's rows for world size ``p`` into ``rows`` as its rank 0 sends them (in a launch of
    its own under ``python``, on an emulated network like the other launches'); None, or the note
    saying why it failed (``bench.horovod.launch``)."""
    def arrived(doc: dict) -> None:
        rows.extend([dict(r, net=args.net) for r in doc["rows"]])

    print(f"# world size {p}: the Horovod anchor", file=sys.stderr)
    return launch_horovod(python, ["bench", "allreduce", "--horovod-worker", json.dumps(cfg)], p, rate=args.net,
                          timeout=args.timeout, on_result=arrived)


# --- the timed loop, shared by the ringtrain/gloo worker and the MPI and Horovod workers -----


def _iters_for(nbytes: int) -> int:
    """Back-to-back calls per timed repeat: enough that a repeat of small messages lasts ~10 ms."""
    return int(min(200, max(1, (4 << 20) // nbytes)))


def _time_configs(configs, sizes, repeats, rank, p, sync, slowest, done) -> None:
    """configs: list of (label dict, fn(buf)). sync(): a barrier; slowest(x): max over ranks.
    done(nbytes, rows): one size's rows, given as soon as that size is timed, so that a run
    stopped later keeps them."""
    for nbytes in sizes:
        n = nbytes // 4
        buf = np.empty(n, dtype=np.float32)
        times = {i: [] for i in range(len(configs))}
        for i, (label, fn) in enumerate(configs):  # check once, exactly, then warm up
            buf[:] = np.arange(n, dtype=np.float32) % 1024 + rank
            fn(buf)
            expect = p * (np.arange(n, dtype=np.float32) % 1024) + p * (p - 1) / 2
            if not np.array_equal(buf, expect):
                bad = int(np.flatnonzero(buf != expect)[0])
                raise RuntimeError(f"{label} gave a wrong sum at index {bad}: {buf[bad]} != {expect[bad]}")
        iters = _iters_for(nbytes)
        buf[:] = 0
        for _ in range(repeats):
            for i, (label, fn) in enumerate(configs):
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(buf)
                times[i].append(slowest((time.perf_counter() - t0) / iters))
        rows = []
        for i, (label, _) in enumerate(configs):
            med = float(np.median(times[i]))
            algbw = nbytes / med / 1e9 if med > 0 else 0.0
            rows.append(dict(label, world_size=p, nbytes=nbytes, iters=iters, median_s=med,
                             times_s=times[i], algbw_GBps=algbw, busbw_GBps=algbw * 2 * (p - 1) / p))
        done(nbytes, rows)


def _worker(cfg: dict) -> int:
    from ..lifecycle import die_with_parent

    die_with_parent()
    import torch
    import torch.distributed as dist

    import ringtrain

    torch.set_num_threads(1)
    # The user's own process group first: ringtrain must work beside it and leave it alone.
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    comms = {t: ringtrain.init(transport=t, timeout=300) for t in cfg["transports"]}

    def gloo(buf):
        dist.all_reduce(torch.from_numpy(buf))

    configs = [({"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed"}, gloo)]
    for t, comm in comms.items():
        for alg in cfg["algorithms"]:
            configs.append(({"impl": "ringtrain", "transport": comm.transport.name if t != "auto" else "auto",
                             "algorithm": alg}, lambda b, c=comm, a=alg: c.allreduce(b, algorithm=a)))

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def done(nbytes: int, rows: list[dict]) -> None:
        if rank == 0:
            emit({"rows": rows})
            sizes = cfg["sizes"]
            progress(f"# world size {p}: {_fmt_size(nbytes)} done ({sizes.index(nbytes) + 1} of "
                     f"{plural(len(sizes), 'size')})")

    _time_configs(configs, cfg["sizes"], cfg["repeats"], rank, p, dist.barrier, slowest, done)
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    return 0


def _mpi_worker(cfg: dict) -> int:
    import mpi4py
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()

    def allreduce(buf):
        world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    # (Open MPI's string ends in a NUL; MPICH's runs over several lines: the first names the version)
    library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    configs = [({"impl": "mpi", "transport": "openmpi", "algorithm": "MPI_Allreduce", "version": library,
                 "mpi4py": mpi4py.__version__}, allreduce)]

    def done(nbytes: int, rows: list[dict]) -> None:
        if rank == 0:  # (_launch_mpi reads every document when mpirun has ended)
            emit({"rows": rows})

    _time_configs(configs, cfg["sizes"], cfg["repeats"], rank, p, world.Barrier,
                  lambda x: world.allreduce(x, op=MPI.MAX), done)
    return 0


def _horovod_worker(cfg: dict) -> int:
    from ..lifecycle import die_with_parent

    die_with_parent()
    import horovod
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    rank, p = hvd.rank(), hvd.size()

    def allreduce(buf):
        # One name per size, as a training step names each gradient: Horovod's response cache
        # then knows the tensor from the second call on (an unnamed call is new every time).
        hvd.allreduce_(torch.from_numpy(buf), op=hvd.Sum, name=f"bench.{buf.size}")

    configs = [({"impl": "horovod", "transport": "gloo", "algorithm": "hvd.allreduce_",
                 "version": horovod.__version__}, allreduce)]

    def slowest(x: float) -> float:
        return float(hvd.allreduce(torch.tensor([x], dtype=torch.float64), op=hvd.Max, name="bench.slowest")[0])

    def done(nbytes: int, rows: list[dict]) -> None:
        if rank == 0:
            emit({"rows": rows})

    _time_configs(configs, cfg["sizes"], cfg["repeats"], rank, p, hvd.barrier, slowest, done)
    hvd.shutdown()
    return 0


# --- the table --------------------------------------------------------------------------------


def _fmt_size(n: int) -> str:
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f}us" if s < 1e-3 else f"{s * 1e3:.2f}ms"


def _cell(r: dict | None, line_rate: float | None) -> str:
    """'1.23ms (0.45)': median time and busbw; '*' after a busbw above the emulated line rate."""
    if r is None:
        return "-"
    mark = "*" if line_rate is not None and r["busbw_GBps"] > line_rate else ""
    return f"{_fmt_time(r['median_s'])} ({r['busbw_GBps']:.2f}){mark}"


def format_table(rows: list[dict]) -> str:
    """Per world size and size: each configuration's median time and busbw; best ringtrain vs gloo."""
    out = []
    line_rate = line_rate_GBps(rows[0].get("net", "none")) if rows else None
    for p in sorted({r["world_size"] for r in rows}):
        prow = [r for r in rows if r["world_size"] == p]
        labels = []
        for r in prow:
            lab = r["impl"] if r["impl"] != "ringtrain" else f"{r['transport']}/{r['algorithm']}"
            if lab not in labels:
                labels.append(lab)
        out.append(f"\nworld size {p}: median time (busbw GB/s); speedup = best ringtrain / gloo")
        out.append("size    " + "".join(f"{l:>24}" for l in labels) + f"{'speedup':>10}")
        for nbytes in sorted({r["nbytes"] for r in prow}):
            cells = {}
            for r in prow:
                if r["nbytes"] == nbytes:
                    lab = r["impl"] if r["impl"] != "ringtrain" else f"{r['transport']}/{r['algorithm']}"
                    cells[lab] = r
            line = f"{_fmt_size(nbytes):<8}" + "".join(f"{_cell(cells.get(l), line_rate):>24}" for l in labels)
            ours = [r["median_s"] for r in cells.values() if r["impl"] == "ringtrain"]
            if ours and "gloo" in cells:
                line += f"{cells['gloo']['median_s'] / min(ours):>9.2f}x"
            out.append(line)
    return "\n".join(out)
