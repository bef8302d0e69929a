"""`ringtrain launch`: start a script on N processes per node, on one or several nodes.

This is torch's own launcher (torch.distributed.run, a.k.a. torchrun) with one addition: the
job's shared secret. Peers authenticate with HMAC over a nonce using RINGTRAIN_SECRET; on one
node the launcher makes a fresh secret, across nodes every node must be given the same one
(``--secret-file`` or the RINGTRAIN_SECRET variable), since nodes cannot agree on one
without an authenticated channel.

    ringtrain launch --nproc-per-node 4 train.py                      # one machine
    ringtrain launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
        --nproc-per-node 8 --secret-file ~/.ringtrain-secret train.py  # on each node (node-rank 0, 1)

For torchrun's other options (elastic rendezvous, restarts), call ``torchrun`` itself with
RINGTRAIN_SECRET set in the environment.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=int, default=29500, help="port of the rendezvous store on node 0")
    p.add_argument("--secret-file", default=None, help="file holding the job's shared secret (multi-node)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.nnodes > 1 and (args.master_addr in ("localhost", "::1") or args.master_addr.startswith("127.")):
        raise ValueError(f"--master-addr {args.master_addr} is this machine's loopback: with --nnodes "
                         f"{args.nnodes} every node must be given node 0's address on the network")


def job_secret(args: argparse.Namespace) -> str:
    if args.secret_file:
        try:
            text = Path(args.secret_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ValueError(f"--secret-file {args.secret_file}: cannot read it ({reason}); give a readable "
                             "text file holding the job's secret, or set RINGTRAIN_SECRET") from None
        if not text:
            raise ValueError(f"--secret-file {args.secret_file} is empty")
        return text
    if os.environ.get("RINGTRAIN_SECRET"):
        return os.environ["RINGTRAIN_SECRET"]
    if args.nnodes > 1:
        raise ValueError("several nodes need one shared secret: pass --secret-file or set RINGTRAIN_SECRET on every node")
    return secrets.token_hex(32)


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={args.master_addr}",
        f"--master-port={args.master_port}",
    ]
    return argv + [args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    try:
        validate(args)
        secret = job_secret(args)
    except ValueError as exc:
        raise SystemExit(f"ringtrain launch: {exc}")
    os.environ["RINGTRAIN_SECRET"] = secret  # inherited by the workers, never printed
    from torch.distributed import run as torchrun

    torchrun.main(torchrun_argv(args))
    return 0
