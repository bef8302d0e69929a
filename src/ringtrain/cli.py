"""The ``ringtrain`` command: train, bench, simulate, plan, launch.

Each subcommand lives in the module that owns the work; that module provides
``configure(parser)`` (adds its options) and ``run(args) -> int``. This file only wires
them up, importing a module when its subcommand is chosen so that ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

#: Exit status of a command that refused its input before running (bad options, --net without root),
#: as argparse's own; 1 is a run that failed, 128 + N a signal's (130: Ctrl-C).
REFUSED = 2

#: (words, module, one-line help)
COMMANDS = [
    (("train",), "ringtrain.train", "train the reference language model on N local workers"),
    (("launch",), "ringtrain.launch", "start a script on N processes / nodes via torch.distributed.run"),
    (("bench", "allreduce"), "ringtrain.bench.allreduce", "allreduce speed of every algorithm x transport, with gloo and MPI anchors"),
    (("bench", "train"), "ringtrain.bench.train", "training step time of every schedule against torch DDP"),
    (("simulate",), "ringtrain.sim.cli", "predict iteration time and scaling from 4 to 2048 GPUs"),
    (("plan",), "ringtrain.sim.plan_cli", "show how a model's gradients would be merged"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module, help_ in COMMANDS:
        if len(words) == 1:
            p = sub.add_parser(words[0], help=help_, add_help=False)
        else:
            if words[0] not in groups:
                g = sub.add_parser(words[0], help=f"{words[0]} subcommands")
                groups[words[0]] = g.add_subparsers(dest="subcommand", required=True)
            p = groups[words[0]].add_parser(words[1], help=help_, add_help=False)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Find the chosen subcommand first, then let its module add its own options.
    # Leaf parsers have add_help=False so that "--help" reaches the module's own parser.
    known, _ = parser.parse_known_args(argv)
    if known.command == "train" and "--worker" in argv:
        # A worker of `ringtrain train` ends with the command that started it from here on, before
        # torch loads: on an overloaded machine that took minutes (`--workers 500` on 2 cores), and
        # workers still loading it when the command died ran on as orphans until they were done.
        from .lifecycle import die_with_parent

        die_with_parent()
    try:
        module = importlib.import_module(known._module)
    except KeyboardInterrupt:  # Ctrl-C while torch loads (a second or so): the shell's 130, no traceback
        return 128 + signal.SIGINT  # (a `train` worker's parent says what was interrupted, in one line)
    words = [w for w in (known.command, getattr(known, "subcommand", None)) if w]
    full = argparse.ArgumentParser(
        prog="ringtrain " + " ".join(words), description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(full)
    args = full.parse_args(argv[len(words):])
    from .bench.netem import NetemUnavailable
    from .bench.procs import AS_INTERRUPT, RankFailed, as_interrupt, interrupted_status

    # SIGTERM, SIGHUP (`timeout` ran out, say): a benchmark keeps the rows it finished, as on Ctrl-C.
    # One ignored stays ignored: under nohup the terminal's hang-up must not stop the run.
    stops = [sig for sig in ((signal.SIGTERM, signal.SIGHUP) if known.command == "bench" else ())
             if signal.getsignal(sig) != signal.SIG_IGN]
    AS_INTERRUPT.clear()
    before = {sig: signal.signal(sig, as_interrupt) for sig in stops}
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:  # (one that came before the command's own handling began: no traceback)
        print(f"{full.prog}: interrupted", file=sys.stderr)
        return interrupted_status()  # (130; a bench's SIGTERM 143)
    except NetemUnavailable as exc:  # not a bug: say why in one line (e.g. --net without root)
        print(f"{full.prog}: {exc}", file=sys.stderr)
        return REFUSED
    except RankFailed as exc:  # a benchmark's rank failed or ran out of time: its own log tail, not ours
        print(f"{full.prog}: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        # A command refusing its input before it runs says why in one line (SystemExit("prog: why")):
        # argparse's status for a refused command line, so that 1 means a run that failed.
        print(exc.code, file=sys.stderr)
        return REFUSED
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
