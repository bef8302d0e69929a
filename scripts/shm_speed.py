"""Measure the shm transport between 2 real processes on this host.

For each slot geometry (slot size x slot count) the two processes connect one transport, and
the repeats go round-robin over the geometries, so that the machine's changing load hits them
alike. Per geometry it prints medians over the repeats (and the best repeat) of:
- one-way: rank 0 sends SIZE bytes to rank 1, which acknowledges (GB/s = SIZE / time);
- sendrecv: both ranks send SIZE bytes to each other in one exchange (GB/s per direction);
- allreduce: the 2-rank ring allreduce of SIZE bytes of float32 built from two exchanges
  (send the peer's half / receive-and-add my half, then send my reduced half / receive the
  peer's reduced half); algbw = SIZE / time; the result is checked exactly every repeat;
- latency: one 4 KiB sendrecv round (both ranks send and receive 4 KiB), in microseconds.

    .venv/bin/python scripts/shm_speed.py                  # the default geometry only
    .venv/bin/python scripts/shm_speed.py --geometries 256Kx8 512Kx8 1Mx4 4Mx4 --repeats 20
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import numpy as np


def parse_geometry(text: str) -> tuple[int, int]:
    """'512Kx8' -> (524288, 8)."""
    size, _, count = text.lower().partition("x")
    scale = {"k": 1 << 10, "m": 1 << 20}.get(size[-1:], 1)
    try:
        return int(size.rstrip("km")) * scale, int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"geometry must look like 512Kx8, got {text!r}") from None


def _worker(rank: int, port: int, size: int, geometries: list, repeats: int, out) -> None:
    import torch.distributed as dist

    from ringtrain.transport.base import CallHeader, Recv, Send
    from ringtrain.transport.shm import ShmTransport

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    transports = [
        ShmTransport.connect(rank, 2, store, timeout=60, prefix=f"speed{i}", slot_bytes=sb, slots=k)
        for i, (sb, k) in enumerate(geometries)
    ]
    peer = 1 - rank
    seq = itertools.count()
    n = size // 4
    half = n // 2
    mine = slice(0, half) if rank == 0 else slice(half, n)
    theirs = slice(half, n) if rank == 0 else slice(0, half)

    def add(out_, incoming):
        np.add(out_, incoming, out=out_)

    token, token_in = np.zeros(1, np.float32), np.zeros(1, np.float32)
    data = np.arange(n, dtype=np.float32) % 1024 + rank * 1024
    expected = np.arange(n, dtype=np.float32) % 1024 * 2 + 1024
    other, buf = np.empty_like(data), data.copy()
    small, small_in = np.full(1024, rank, np.float32), np.empty(1024, np.float32)
    results = {g: {"oneway": [], "sendrecv": [], "allreduce": [], "latency": []} for g in geometries}

    for rep in range(repeats + 1):  # round 0 warms up and is dropped
        for g, t in zip(geometries, transports):

            def call(sends, recvs):
                h = CallHeader(next(seq), "send", dtype="float32")
                t.exchange([Send(peer, b) for b in sends], [Recv(peer, b, r) for b, r in recvs], h, time.monotonic() + 60)

            def timed(key, fn):
                call([token], [(token_in, None)])  # start together
                t0 = time.perf_counter()
                fn()
                if rep:
                    results[g][key].append(time.perf_counter() - t0)

            def oneway():
                if rank == 0:
                    call([data], [])
                    call([], [(token_in, None)])  # the receiver's acknowledgement
                else:
                    call([], [(other, None)])
                    call([token], [])

            def allreduce():
                call([buf[theirs]], [(buf[mine], add)])
                call([buf[mine]], [(buf[theirs], None)])

            timed("oneway", oneway)
            timed("sendrecv", lambda: call([data], [(other, None)]))
            np.copyto(buf, data)
            timed("allreduce", allreduce)
            if not np.array_equal(buf, expected):
                raise SystemExit(f"rank {rank}: allreduce result is wrong at {np.flatnonzero(buf != expected)[0]}")
            for i in range(200):
                t0 = time.perf_counter()
                call([small], [(small_in, None)])
                if rep and i >= 20:
                    results[g]["latency"].append(time.perf_counter() - t0)
    for t in transports:
        t.close()
    if rank == 0:
        out.put(results)


def measure(size: int, geometries: list, repeats: int) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, size, geometries, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                return out.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise SystemExit("a worker failed (see its traceback above)") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main(argv=None) -> int:
    from ringtrain.transport.shm import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64, help="message size for the bandwidth figures")
    ap.add_argument("--geometries", type=parse_geometry, nargs="+", default=[(DEFAULT_SLOT_BYTES, DEFAULT_SLOTS)],
                    help="slot size x slot count, e.g. 512Kx8 (default: the transport's default)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    size = args.size_mib << 20
    print(f"# {args.size_mib} MiB, {args.repeats} repeats, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start")
    results = measure(size, args.geometries, args.repeats)
    print(f"{'geometry':>10} {'oneway GB/s':>12} {'sendrecv GB/s':>14} {'allreduce algbw GB/s':>21} {'(best)':>7} {'4KiB round us':>14}")
    for (slot_bytes, slots), r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        print(
            f"{slot_bytes >> 10:>6}Kx{slots:<2} {size / med['oneway'] / 1e9:>12.2f} {size / med['sendrecv'] / 1e9:>14.2f} "
            f"{size / med['allreduce'] / 1e9:>21.2f} {size / min(r['allreduce']) / 1e9:>7.2f} {med['latency'] * 1e6:>14.1f}"
        )
    print(f"# load {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
