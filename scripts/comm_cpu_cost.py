#!/usr/bin/env python3
"""What communication costs the computation beside it: training alone against training with
allreduces running on a thread of the same rank (or in a process beside it), over the emulated network.

Usage (root):  .venv/bin/python scripts/comm_cpu_cost.py [--net 1gbit] [--model charlm] [--mib 0.43] [--paced-hz 80]

Two ranks, each a host of its own (``EmulatedNetwork``), each one process with torch on one
thread. Each rank runs 40 training iterations (forward and backward) per round, in rounds that
alternate between nothing else running and a background thread running allreduces of
``--mib`` MiB: ringtrain's back to back (``comm``), ringtrain's paced to at most
``--paced-hz`` per second (``paced``: about gloo's rate at 0.43 MiB, to compare the two at
equal throughput), or torch.distributed's over gloo back to back (``gloo``, the anchor; the
two threads agree through a 1-element allreduce when to stop), or ringtrain's back to back from
a second process on each rank's host (``process``: the same traffic with no interpreter, GIL or
scheduler share in common with the training; its CPU is the children's). Per round it reports the
mean iteration (the round's wall time over its iterations: what training loses), the
median forward and backward (after 3 warm-ups), allreduces per second, the CPU the process
used outside the training thread (the background thread plus, for gloo, its worker threads:
their Python, reductions and system calls), per second and per MiB moved, and the machine's
user, system and softirq time from /proc/stat, in ms per second of the round.

Read the mean iteration, not the medians: gloo's threads take their CPU in bursts that land
in a few iterations, so its median backward can barely move while its mean iteration slows
as much as ringtrain's, or more, per MiB moved. Measured (AMD EPYC VM, 1 Gbit/s, the LM,
0.43 MiB; two runs, four rounds of each, against the same run's rounds alone, 146-159 ms):
ringtrain back to back 212-224 allreduces/s (91-96 MiB/s) +25-40%; paced 62-68/s (27-29
MiB/s) +6-16%; gloo 88-95/s (38-41 MiB/s) +11-36%. Per MiB/s moved the iteration loses
0.27-0.42% under ringtrain back to back, 0.21-0.55% paced, 0.27-0.95% under gloo: what the
wrapper's trial measures as interference is the CPU any allreduce takes on two busy cores.
With ``--mib 3.4`` (2026-12-07, the same VM, three runs of two rounds each, about 100 MiB/s, 145-157
ms alone): ``process`` +9-36%, ``comm`` +7-27%, ``gloo`` +0-19%: the same traffic from another
process costs the training as much, so it is the machine's (the kernel's network path on two busy
cores), not an interpreter or GIL shared with the training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

ROUNDS = ("none", "comm", "paced", "gloo", "process", "none", "comm", "paced", "gloo", "process")
#: The port the ``process`` rounds' own job meets at (the ranks' job takes MASTER_PORT).
TRAFFIC_PORT_OFFSET = 7
ITERATIONS = 40
WARM_UPS = 3


def _machine() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:8]]


def rank_main() -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import ringtrain
    from ringtrain import data, models
    from ringtrain.bench.procs import emit

    cfg = json.loads(os.environ["COMM_CPU_COST"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    comm = ringtrain.init(transport="tcp", timeout=120)
    spec = models.spec(cfg["model"])
    model = models.build(cfg["model"], seed=0)
    loader = data.ShardedLoader(data.dataset(spec.dataset, seed=0, **spec.batch_kwargs), spec.batch_size,
                                rank=comm.rank, world_size=comm.world_size, seed=0)
    x, y = loader.next_batch()
    buf = np.ones(int(cfg["mib"] * (1 << 20)) // 4, np.float32)
    tbuf = torch.ones(buf.size)
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    rows = []
    for mode in ROUNDS:
        stop = threading.Event()
        done = [0, 0.0]

        def background() -> None:
            if mode != "gloo":
                done[0] = allreduces_until(stop, comm, buf, cfg["paced_hz"] if mode == "paced" else None)
                return
            tflag = torch.zeros(1)
            while True:
                tflag[0] = 1.0 if stop.is_set() else 0.0
                dist.all_reduce(tflag, dist.ReduceOp.MAX)  # both ranks stop after the same allreduce
                if tflag[0]:
                    return
                dist.all_reduce(tbuf)
                done[0] += 1

        thread = threading.Thread(target=background) if mode not in ("none", "process") else None
        if thread:
            thread.start()
        child = _start_traffic(comm.rank, cfg["mib"]) if mode == "process" else None
        forwards, backwards = [], []
        m0, w0 = _machine(), time.perf_counter()
        cpu0, own0 = time.process_time(), time.thread_time()  # the process's CPU, and the training thread's
        for _ in range(ITERATIONS):
            t0 = time.perf_counter()
            loss = model.loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            forwards.append(t1 - t0)
            backwards.append(time.perf_counter() - t1)
            model.zero_grad(set_to_none=True)
        wall, m1 = time.perf_counter() - w0, _machine()
        done[1] = (time.process_time() - cpu0) - (time.thread_time() - own0)  # CPU outside the training thread
        if thread:
            stop.set()
            thread.join()
        if child is not None:
            done[:] = _stop_traffic(child)
        delta = {k: (b - a) * tick_ms / wall for k, a, b in zip(
            ("user", "nice", "system", "idle", "iowait", "irq", "softirq"), m0, m1)}
        rows.append({"mode": mode, "iteration_mean_ms": 1e3 * wall / ITERATIONS,
                     "forward_ms": 1e3 * statistics.median(forwards[WARM_UPS:]),
                     "backward_ms": 1e3 * statistics.median(backwards[WARM_UPS:]),
                     "allreduces_per_s": done[0] / wall, "comm_cpu_ms_per_s": 1e3 * done[1] / wall,
                     "comm_cpu_ms_per_mib": 1e3 * done[1] / (done[0] * cfg["mib"]) if done[0] else None,
                     "machine_ms_per_s": {k: delta[k] for k in ("user", "system", "softirq", "idle")}})
    if comm.rank == 0:
        emit({"rows": rows, **cfg})
    comm.close()
    dist.destroy_process_group()


def _start_traffic(rank: int, mib: float):
    """The ``process`` round's traffic: a child of this rank (in its network namespace) that joins
    the other rank's child in a ringtrain job of their own and runs allreduces of ``mib`` MiB back
    to back until its stdin closes. Returns once both children have met (their first allreduce)."""
    import subprocess

    env = dict(os.environ, RANK=str(rank), MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + TRAFFIC_PORT_OFFSET))
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--traffic", str(mib)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"rank {rank}: the traffic process did not start (exit {child.wait()})")
    return child


def _stop_traffic(child) -> list:
    """Stop ``child``; [its allreduces, its CPU seconds since it was ready]."""
    child.stdin.close()
    count, cpu = child.stdout.readline().split()
    child.wait(timeout=60)
    return [int(count), float(cpu)]


def traffic_main(mib: float) -> None:
    """The child of :func:`_start_traffic`: allreduces until stdin closes; prints how many it ran
    and the CPU seconds it used since it was ready (not its start-up). The two children stop
    together (:func:`allreduces_until`)."""
    import numpy as np

    import ringtrain

    comm = ringtrain.init(transport="tcp", timeout=120)
    buf = np.ones(int(mib * (1 << 20)) // 4, np.float32)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    comm.allreduce(buf, "sum")
    print("ready", flush=True)
    cpu0 = time.process_time()
    count = allreduces_until(stop, comm, buf)
    print(count, time.process_time() - cpu0, flush=True)
    comm.close()


def allreduces_until(stop: threading.Event, comm, buf, paced_hz: float | None = None) -> int:
    """ringtrain allreduces of ``buf`` back to back (at most ``paced_hz`` a second) until ``stop``
    is set on some rank: each is preceded by a 1-element max of "stop", so every rank ends after
    the same one. Returns how many ran."""
    import numpy as np

    flag = np.zeros(1, np.float32)
    count = 0
    while True:
        flag[0] = 1.0 if stop.is_set() else 0.0
        comm.allreduce(flag, "max")
        if flag[0]:
            return count
        started = time.perf_counter()
        comm.allreduce(buf, "sum")
        if paced_hz:
            time.sleep(max(0.0, 1.0 / paced_hz - (time.perf_counter() - started)))
        count += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--net", default="1gbit", choices=("1gbit", "10gbit"))
    p.add_argument("--model", default="charlm")
    p.add_argument("--mib", type=float, default=0.43, help="MiB per background allreduce")
    p.add_argument("--paced-hz", type=float, default=80.0,
                   help="allreduces per second at most in the paced rounds (default %(default)s)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from ringtrain.bench.netem import EmulatedNetwork
    from ringtrain.bench.procs import run_ranks

    if not args.paced_hz > 0:
        p.error(f"--paced-hz must be > 0, got {args.paced_hz}")
    cfg = {"net": args.net, "model": args.model, "mib": args.mib, "paced_hz": args.paced_hz}
    here = os.path.dirname(os.path.abspath(__file__))
    env = {"COMM_CPU_COST": json.dumps(cfg), "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    with EmulatedNetwork(2, rate=args.net) as net:
        doc, = run_ranks("comm_cpu_cost", ["--rank"], 2, timeout=600, net=net, extra_env=env)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    for r in doc["rows"]:
        m = r["machine_ms_per_s"]
        per_mib = "" if r["comm_cpu_ms_per_mib"] is None else f" ({r['comm_cpu_ms_per_mib']:.2f} ms/MiB)"
        print(f"{r['mode']:5} iteration {r['iteration_mean_ms']:6.1f} ms (mean) | forward {r['forward_ms']:5.1f}, "
              f"backward {r['backward_ms']:6.1f} ms (medians) | {r['allreduces_per_s']:5.0f} allreduces/s | "
              f"communication CPU {r['comm_cpu_ms_per_s']:4.0f} ms/s{per_mib} | machine: user {m['user']:5.0f}, "
              f"system {m['system']:4.0f}, softirq {m['softirq']:4.0f}, idle {m['idle']:3.0f} ms/s (2 cores: 2000)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank_main()
    elif sys.argv[1:2] == ["--traffic"]:
        traffic_main(float(sys.argv[2]))
    else:
        main()
