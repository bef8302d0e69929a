#!/usr/bin/env python3
"""Is the emulated network usable here? Two hosts, a bridge, tbf at 1 Gbit/s, 64 MiB over one stream.

Usage (root): python3 scripts/netem_probe.py   — exits 0 and prints the goodput, or raises.
A saturated 1 Gbit/s link carries TCP payload at about 0.956 Gbit/s (scripts/netem_check.py measures more).
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from ringtrain.bench.netem import EmulatedNetwork  # noqa: E402

NBYTES = 64 << 20
# the receiver times from its first byte to its last: no interpreter start-up in the figure
RECV = ("import socket, time; s = socket.create_server(({a!r}, 5201)); c, _ = s.accept()\n"
        "b = c.recv(1 << 20); t0 = time.perf_counter(); n = len(b)\n"
        "while (b := c.recv(1 << 20)): n += len(b)\n"
        "print(n, time.perf_counter() - t0)")
SEND = ("import socket, time; time.sleep(0.5); c = socket.create_connection(({a!r}, 5201)); "
        f"c.sendall(bytes({NBYTES})); c.close()")

with EmulatedNetwork(2, rate="1gbit") as net:
    a = net.addr(0)
    server = net.popen(0, [sys.executable, "-c", RECV.format(a=a)], stdout=-1, text=True)
    net.run(1, [sys.executable, "-c", SEND.format(a=a)], timeout=30)
    got, dt = server.communicate(timeout=30)[0].split()
    got, dt = int(got), float(dt)
    print(f"netem: the 1 Gbit/s link carried {got >> 20} MiB in {dt:.2f} s: {got * 8 / dt / 1e9:.3f} Gbit/s")
    if got != NBYTES:
        raise SystemExit(f"netem: {got} of {NBYTES} bytes arrived")
