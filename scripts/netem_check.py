#!/usr/bin/env python3
"""Measure what the emulated network delivers: TCP throughput per rate and burst, and round trips.

Usage (root):  .venv/bin/python scripts/netem_check.py [--mib 128] [--quick] [--json]

For each configuration it builds a fresh two-host EmulatedNetwork, starts a receiver on
host 1 and a sender on host 0 (plain Python sockets, one TCP stream, 1 MiB writes) and
reports the goodput. A fully used link carries TCP payload at 1448/1538 = 94.1% of its
line rate (whole Ethernet frames at MTU 1500 and the 24 bytes a real link sends with each:
bench.netem.ETHERNET_OVERHEAD_BYTES), so "of line" near 94.1% means the link is saturated;
"of frames" divides that share out (100% = every bit of line rate used).
Round trips: 1-byte TCP ping-pong, inside one namespace over loopback and between two hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from ringtrain.bench.netem import EmulatedNetwork, NetemUnavailable  # noqa: E402

PORT = 5201
# TCP payload per Ethernet frame on the line: MSS 1448 (timestamps on), frame 1514 + 24 (preamble, FCS, gap)
PAYLOAD_SHARE = 1448 / 1538
CHUNK = 1 << 20


def _connect(host: str, port: int, deadline_s: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=deadline_s)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _listen(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1)
    s.settimeout(30)
    print("ready", flush=True)
    return s


def serve_bulk(host: str, nbytes: int, port: int = PORT) -> None:
    """Receive ``nbytes``; print seconds from the first byte to the last, then acknowledge."""
    conn, _ = _listen(host, port).accept()
    conn.settimeout(120)
    buf = memoryview(bytearray(CHUNK))
    got, start = 0, None
    while got < nbytes:
        n = conn.recv_into(buf)
        if n == 0:
            raise SystemExit(f"sender closed after {got} of {nbytes} bytes")
        if start is None:
            start = time.perf_counter()
        got += n
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - start}), flush=True)
    conn.sendall(b"k")


def send_bulk(host: str, nbytes: int, port: int = PORT) -> None:
    conn = _connect(host, port)
    data = bytes(CHUNK)
    sent = 0
    while sent < nbytes:
        n = min(CHUNK, nbytes - sent)
        conn.sendall(data[:n])
        sent += n
    conn.settimeout(120)
    conn.recv(1)


def serve_echo(host: str) -> None:
    conn, _ = _listen(host, PORT).accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(30)
    while (b := conn.recv(1)):
        conn.sendall(b)


def ping(host: str, count: int) -> None:
    """Print the median and 10th/90th percentile of ``count`` 1-byte round trips, in microseconds."""
    conn = _connect(host, PORT)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(30)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        conn.sendall(b"x")
        if conn.recv(1) != b"x":
            raise SystemExit("echo lost")
        times.append((time.perf_counter() - t0) * 1e6)
    q = statistics.quantiles(times, n=10)
    print(json.dumps({"median_us": statistics.median(times), "p10_us": q[0], "p90_us": q[-1]}), flush=True)


def gloo_allreduce(mib: int, iters: int) -> None:
    """One rank of a torch gloo all_reduce of ``mib`` MiB float32; rank 0 prints the median busbw."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    t = torch.ones(mib * 2**20 // 4)
    dist.all_reduce(t)  # warm-up: connections and buffers
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        seconds = statistics.median(times)
        busbw = 2 * (world - 1) / world * t.numel() * 4 * 8 / seconds / 1e9  # nccl-tests' busbw
        print(json.dumps({"seconds": seconds, "busbw_gbps": busbw}), flush=True)


def measure_gloo(rate: str, mib: int, world: int, iters: int) -> dict:
    with EmulatedNetwork(world, rate=rate, prefix="netemcheck") as net:
        procs = net.start_ranks([sys.executable, os.path.abspath(__file__), "gloo", str(mib), str(iters)],
                                stdout=subprocess.PIPE, text=True)
        codes = net.wait_ranks(procs, timeout=300)
        if codes != [0] * world:
            raise RuntimeError(f"gloo ranks exited with {codes}")
        r = json.loads(procs[0].stdout.read().strip().splitlines()[-1])
        return {"rate": rate, "world": world, "mib": mib, "seconds": round(r["seconds"], 4),
                "busbw_gbps": round(r["busbw_gbps"], 3),
                "of_line": round(r["busbw_gbps"] / (net.shape.rate_bps / 1e9), 4)}


def _worker(net: EmulatedNetwork, i: int, *args: str) -> subprocess.Popen:
    return net.popen(i, [sys.executable, os.path.abspath(__file__), *args],
                     stdout=subprocess.PIPE, text=True)


def _pair(net: EmulatedNetwork, server_args: list[str], client_host: int, client_args: list[str],
          server_host: int = 1) -> dict:
    server = _worker(net, server_host, *server_args)
    if server.stdout.readline().strip() != "ready":
        raise RuntimeError("receiver did not start")
    client = _worker(net, client_host, *client_args)
    out_server, _ = server.communicate(timeout=300)
    out_client, _ = client.communicate(timeout=60)
    if server.returncode or client.returncode:
        raise RuntimeError(f"worker failed: server {server.returncode}, client {client.returncode}")
    return json.loads((out_server.strip() or out_client.strip()).splitlines()[-1])


def _bulk_once(net: EmulatedNetwork, nbytes: int, both_ways: bool) -> float:
    """Gbit/s of host 0 -> host 1 (the slower direction when both ways run at once)."""
    pairs = [(0, 1)] + ([(1, 0)] if both_ways else [])
    servers = []
    for k, (_, dst) in enumerate(pairs):
        servers.append(_worker(net, dst, "serve-bulk", net.addr(dst), str(nbytes), str(PORT + k)))
        if servers[-1].stdout.readline().strip() != "ready":
            raise RuntimeError("receiver did not start")
    clients = [_worker(net, src, "send-bulk", net.addr(dst), str(nbytes), str(PORT + k))
               for k, (src, dst) in enumerate(pairs)]
    rates = []
    for server in servers:
        out, _ = server.communicate(timeout=300)
        r = json.loads(out.strip().splitlines()[-1])
        rates.append(r["bytes"] * 8 / r["seconds"] / 1e9)
    for client in clients:
        client.communicate(timeout=60)
    if any(p.returncode for p in servers + clients):
        raise RuntimeError("a worker failed")
    return min(rates)


def measure_bulk(rate: str | None, burst: int | None, nbytes: int, repeat: int,
                 both_ways: bool = False) -> dict:
    """Median goodput over ``repeat`` transfers, each on a fresh network."""
    runs = []
    for _ in range(repeat):
        with EmulatedNetwork(2, rate=rate, burst_bytes=burst, prefix="netemcheck") as net:
            runs.append(_bulk_once(net, nbytes, both_ways))
    gbps = statistics.median(runs)
    row = {"rate": net.rate, "burst_bytes": net.shape.burst_bytes if net.shape else None,
           "mib": nbytes / 2**20, "both_ways": both_ways, "goodput_gbps": round(gbps, 3),
           "runs": [round(r, 3) for r in runs]}
    if net.shape is not None:
        line = net.shape.rate_bps / 1e9
        row["of_line"] = round(gbps / line, 4)
        row["of_frames"] = round(gbps / line / PAYLOAD_SHARE, 4)
    return row


def measure_rtt(rate: str | None, across: bool, count: int) -> dict:
    with EmulatedNetwork(2, rate=rate, prefix="netemcheck") as net:
        if across:
            r = _pair(net, ["serve-echo", net.addr(1)], 0, ["ping", net.addr(1), str(count)])
        else:
            r = _pair(net, ["serve-echo", "127.0.0.1"], 1, ["ping", "127.0.0.1", str(count)])
        return {"rate": net.rate, "path": "host0->host1" if across else "loopback in host1",
                **{k: round(v, 1) for k, v in r.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve-bulk", "send-bulk", "serve-echo", "ping", "gloo"):
        cmd, *rest = argv
        {"serve-bulk": lambda: serve_bulk(rest[0], int(rest[1]), int(rest[2])),
         "send-bulk": lambda: send_bulk(rest[0], int(rest[1]), int(rest[2])),
         "serve-echo": lambda: serve_echo(rest[0]),
         "ping": lambda: ping(rest[0], int(rest[1])),
         "gloo": lambda: gloo_allreduce(int(rest[0]), int(rest[1]))}[cmd]()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128,
                        help="MiB per transfer at 1 Gbit/s (twice that at 10 Gbit/s and none)")
    parser.add_argument("--quick", action="store_true", help="only the default burst per rate")
    parser.add_argument("--repeat", type=int, default=3, help="transfers per configuration (median reported)")
    parser.add_argument("--gloo", action="store_true",
                        help="also time torch gloo all_reduce of 25 MiB on 2 ranks (needs torch)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    n1 = args.mib * 2**20
    plan: list[tuple[str | None, int | None, int]] = [(None, None, 2 * n1)]
    bursts_1g = [None] if args.quick else [4096, 32768, None, 524288]
    bursts_10g = [None] if args.quick else [131072, 524288, None, 4194304]
    plan += [("1gbit", b, n1) for b in bursts_1g] + [("10gbit", b, 2 * n1) for b in bursts_10g]
    try:
        bulk = [measure_bulk(rate, burst, n, args.repeat) for rate, burst, n in plan]
        bulk += [measure_bulk(rate, None, n, args.repeat, both_ways=True)
                 for rate, n in (("1gbit", n1), ("10gbit", 2 * n1))]
        rtt = [measure_rtt(rate, across, 2000) for rate, across in
               ((None, False), (None, True), ("1gbit", True), ("10gbit", True))]
        gloo = [measure_gloo(rate, 25, 2, 5) for rate in ("1gbit", "10gbit")] if args.gloo else []
    except NetemUnavailable as exc:
        print(f"skipped: {exc}")
        return 0
    if args.json:
        print(json.dumps({"bulk": bulk, "rtt": rtt, "gloo": gloo}, indent=2))
        return 0
    print(f"{'rate':>7} {'burst B':>9} {'MiB':>5} {'dir':>4} {'Gbit/s':>7} {'of line':>8} "
          f"{'of frames':>9}  runs")
    for r in bulk:
        burst = "-" if r["burst_bytes"] is None else str(r["burst_bytes"])
        share = (f"{r['of_line']:8.1%} {r['of_frames']:9.1%}" if "of_line" in r else f"{'-':>8} {'-':>9}")
        direction = "both" if r["both_ways"] else "one"
        print(f"{r['rate']:>7} {burst:>9} {r['mib']:5.0f} {direction:>4} {r['goodput_gbps']:7.3f} "
              f"{share}  {r['runs']}")
    print()
    for r in rtt:
        print(f"RTT {r['path']:<20} rate {r['rate']:<6}: median {r['median_us']:7.1f} us "
              f"(p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f})")
    for r in gloo:
        print(f"gloo all_reduce {r['mib']} MiB, {r['world']} ranks, {r['rate']}: {r['seconds'] * 1e3:.1f} ms, "
              f"busbw {r['busbw_gbps']:.3f} Gbit/s ({r['of_line']:.1%} of line)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
