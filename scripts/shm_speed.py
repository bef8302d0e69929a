"""Measure the shm transport between 2 real processes on this host.

Prints, as medians over repeats:
- one-way: rank 0 sends SIZE bytes to rank 1 (GB/s = SIZE / time);
- sendrecv: both ranks send SIZE bytes to each other in one exchange (GB/s per direction);
- allreduce: the 2-rank ring allreduce of SIZE bytes of float32 built from two exchanges
  (send the peer's half / receive-and-add my half, then send my reduced half / receive the
  peer's reduced half); algbw = SIZE / time, and the result is checked exactly;
- latency: one 4 KiB sendrecv round (both ranks send and receive 4 KiB), in microseconds.

    .venv/bin/python scripts/shm_speed.py                       # defaults: 64 MiB, 1 MiB x 4 slots
    .venv/bin/python scripts/shm_speed.py --slot-kib 256 1024 4096 --slots 2 4 8
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing as mp
import queue
import statistics
import sys
import time

import numpy as np


def _worker(rank: int, port: int, prefix: str, size: int, slot_kib: int, slots: int, repeats: int, out) -> None:
    import torch.distributed as dist

    from ringtrain.transport.base import CallHeader
    from ringtrain.transport.shm import ShmTransport

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    t = ShmTransport.connect(rank, 2, store, timeout=60, prefix=prefix, slot_bytes=slot_kib << 10, slots=slots)
    peer = 1 - rank
    seq = itertools.count()
    n = size // 4
    half = n // 2

    def call(sends, recvs):
        from ringtrain.transport.base import Recv, Send

        h = CallHeader(next(seq), "send", dtype="float32")
        t.exchange([Send(peer, b) for b in sends], [Recv(peer, b, r) for b, r in recvs], h, time.monotonic() + 60)

    def add(out_, inc):
        np.add(out_, inc, out=out_)

    token, token_in = np.zeros(1, np.float32), np.zeros(1, np.float32)

    def barrier():
        call([token], [(token_in, None)])

    data = np.arange(n, dtype=np.float32) % 1024 + rank * 1024
    other = np.empty_like(data)
    buf = data.copy()
    results = {"oneway": [], "sendrecv": [], "allreduce": [], "latency": []}
    for rep in range(repeats + 1):  # the first round warms up
        barrier()
        t0 = time.perf_counter()
        if rank == 0:
            call([data], [])
            call([], [(token_in, None)])  # the receiver's acknowledgement
        else:
            call([], [(other, None)])
            call([token], [])
        results["oneway"].append(time.perf_counter() - t0)

        barrier()
        t0 = time.perf_counter()
        call([data], [(other, None)])
        results["sendrecv"].append(time.perf_counter() - t0)

        np.copyto(buf, data)
        barrier()
        t0 = time.perf_counter()
        mine = slice(rank * half, (rank + 1) * half if rank == 0 else n)
        theirs = slice(peer * half, (peer + 1) * half if peer == 0 else n)
        call([buf[theirs]], [(buf[mine], add)])
        call([buf[mine]], [(buf[theirs], None)])
        results["allreduce"].append(time.perf_counter() - t0)
        expected = np.arange(n, dtype=np.float32) % 1024 * 2 + 1024
        if not np.array_equal(buf, expected):
            raise SystemExit(f"rank {rank}: allreduce result is wrong at {np.flatnonzero(buf != expected)[0]}")

    small = np.full(1024, rank, np.float32)
    small_in = np.empty_like(small)
    for _ in range(200):
        call([small], [(small_in, None)])
    for _ in range(2000):
        t0 = time.perf_counter()
        call([small], [(small_in, None)])
        results["latency"].append(time.perf_counter() - t0)
    t.close()
    if rank == 0:
        out.put({k: statistics.median(v[1:] if k != "latency" else v) for k, v in results.items()})


def measure(size: int, slot_kib: int, slots: int, repeats: int) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    out = ctx.Queue()
    prefix = f"speed-{slot_kib}-{slots}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_worker, args=(r, store.port, prefix, size, slot_kib, slots, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                result = out.get(timeout=0.5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise SystemExit("a worker failed (see its traceback above)") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--slot-kib", type=int, nargs="+", default=[1024])
    ap.add_argument("--slots", type=int, nargs="+", default=[4])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    size = args.size_mib << 20
    print(f"{'slot':>8} {'slots':>5} {'oneway GB/s':>12} {'sendrecv GB/s':>14} {'allreduce algbw GB/s':>21} {'4KiB round us':>14}")
    for slot_kib, slots in itertools.product(args.slot_kib, args.slots):
        r = measure(size, slot_kib, slots, args.repeats)
        print(
            f"{slot_kib:>6}Ki {slots:>5} {size / r['oneway'] / 1e9:>12.2f} {size / r['sendrecv'] / 1e9:>14.2f} "
            f"{size / r['allreduce'] / 1e9:>21.2f} {r['latency'] * 1e6:>14.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
