"""Bad arguments: every CLI option and public constructor argument fails cleanly, naming itself.

For the command line a clean failure is a non-zero exit whose message names the option (and
the accepted values, where there is a list of them), with no traceback; for the library it is
a ValueError with the same content. Nothing is launched: the launch points are replaced by a
function that fails the test if a bad value gets that far.

Cases marked ``xfail(strict=True)`` are known gaps, reported to the owners of those modules;
each says what happens instead. When one is fixed its test passes, and strict xfail turns
that into a failure here, asking for the mark to be removed.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import ringtrain
from cli_harness import refusal
from ringtrain import plan, sim
from ringtrain.comm import Communicator
from ringtrain.transport.local import LocalHub

pytestmark = pytest.mark.timeout(30)


class Launched(Exception):
    """A bad value got as far as starting processes."""


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise Launched("a bad value was not refused before launching")

    import torch.distributed.run as torchrun

    import ringtrain.bench.allreduce
    import ringtrain.bench.train

    # `ringtrain train` puts the job's secret into os.environ; undone after each test
    monkeypatch.delenv("RINGTRAIN_SECRET", raising=False)
    monkeypatch.setattr(torchrun, "main", refuse)
    monkeypatch.setattr(ringtrain.bench.allreduce, "run_ranks", refuse)
    monkeypatch.setattr(ringtrain.bench.train, "run_ranks", refuse)


def gap(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


def names(message: str, option: str) -> bool:
    """True if ``message`` names ``option`` (``--gpus-per-node`` also as ``gpus_per_node``)."""
    word = option.lstrip("-")
    return any(re.search(rf"(?<![\w-])(?:--)?{re.escape(w)}(?![\w-])", message) for w in {word, word.replace("-", "_")})


def cli_failure(argv: list[str], capsys) -> str:
    """Run the CLI in this process; return its error message (it must refuse without a traceback)."""
    try:
        return refusal(argv, capsys, one_line=False)
    except Launched:
        pytest.fail(f"{argv}: accepted and launched")


# (argv, words the message must hold: the option first, then accepted values)
CLI_CASES = [
    (["train", "--workers", "0"], ["--workers"]),
    (["train", "--workers", "two"], ["--workers"]),
    (["train", "--model", "gpt5"], ["model", "charlm", "mlp", "resnet"]),
    (["train", "--steps", "0"], ["--steps"]),
    (["train", "--steps", "-3"], ["--steps"]),
    (["train", "--batch-size", "-1"], ["--batch-size"]),
    (["train", "--lr", "-1"], ["--lr"]),
    (["train", "--optimizer", "lamb"], ["--optimizer", "sgd", "adam", "adamw"]),
    (["train", "--lr", "nan"], ["--lr"]),
    (["train", "--schedule", "fast"], ["--schedule", "optimal", "mgwfbp", "wfbp", "fixed", "single"]),
    (["train", "--algorithm", "fast"], ["--algorithm", "ring", "naive", "halving_doubling", "auto"]),
    (["train", "--transport", "udp"], ["--transport", "tcp", "shm", "torch", "auto"]),
    (["train", "--bucket-cap-mb", "0"], ["--bucket-cap-mb"]),
    (["train", "--bucket-cap-mb", "nan"], ["--bucket-cap-mb"]),
    (["train", "--lr", "inf"], ["--lr"]),
    (["train", "--strategy", "ps-sync", "--transport", "tcp"], ["--transport", "parameter servers"]),
    (["train", "--strategy", "ps-async", "--timeline", "t.json"], ["--timeline"]),
    (["train", "--checkpoint-dir", "/proc/version/runs"], ["--checkpoint-dir"]),
    (["train", "--checkpoint-every", "-1"], ["--checkpoint-every"]),
    (["train", "--timeout", "0"], ["--timeout"]),
    (["train", "--timeout", "nan"], ["--timeout"]),
    (["train", "--join-timeout", "0"], ["--join-timeout", "seconds > 0"]),
    (["train", "--join-timeout", "-1"], ["--join-timeout", "seconds > 0"]),
    (["train", "--join-timeout", "nan"], ["--join-timeout", "seconds > 0"]),
    (["train", "--join-timeout", "abc"], ["--join-timeout", "invalid float value"]),
    (["train", "--resume=maybe"], ["--resume"]),
    (["train", "--strategy", "gossip"], ["--strategy", "ring", "ps-sync", "ps-async", "ps-sharded"]),
    (["train", "--servers", "-1"], ["--servers"]),
    (["train", "--strategy", "ps-async", "--max-staleness", "-2"], ["--max-staleness", ">= 0", "-1 for unbounded"]),
    (["train", "--strategy", "ps-sync", "--max-staleness", "1"], ["--max-staleness", "ps-async"]),
    (["train", "--max-staleness", "1"], ["--max-staleness", "ps-async", "ring"]),
    (["train", "--master-port", "70000"], ["--master-port"]),
    (["train", "--master-port", "-5"], ["--master-port"]),
    (["train", "--seed", "-1"], ["--seed"]),
    (["train", "--seed", str(2**64)], ["--seed"]),
    (["train", "--batch-size", "100000"], ["--batch-size"]),
    (["train", "--timeline", "/proc/version/trace.json"], ["--timeline"]),
    (["bench", "allreduce", "--world-sizes", "1"], ["--world-sizes"]),
    (["bench", "allreduce", "--world-sizes", "x"], ["--world-sizes"]),
    (["bench", "allreduce", "--sizes", "3"], ["--sizes"]),
    (["bench", "allreduce", "--sizes", "abc"], ["--sizes"]),
    (["bench", "allreduce", "--algorithms", "fast"], ["--algorithms", "ring", "naive", "auto"]),
    (["bench", "allreduce", "--transports", "udp"], ["--transports", "tcp", "shm"]),
    (["bench", "allreduce", "--repeats", "0"], ["--repeats"]),
    (["bench", "allreduce", "--net", "5gbit"], ["--net", "none", "1gbit", "10gbit"]),
    (["bench", "allreduce", "--timeout", "0"], ["--timeout"]),
    (["bench", "allreduce", "--timeout", "-1"], ["--timeout"]),
    (["bench", "allreduce", "--timeout", "nan"], ["--timeout"]),
    (["bench", "train", "--models", "gpt5"], ["model", "charlm", "mlp"]),
    (["bench", "train", "--schedules", "fast"], ["--schedules", "optimal", "mgwfbp"]),
    (["bench", "train", "--world-size", "1"], ["--world-size"]),
    (["bench", "train", "--transport", "udp"], ["--transport", "tcp", "shm"]),
    (["bench", "train", "--algorithm", "fast"], ["--algorithm", "ring"]),
    (["bench", "train", "--batch-size", "-1"], ["--batch-size"]),
    (["bench", "train", "--steps", "0"], ["--steps"]),
    (["bench", "train", "--rounds", "0"], ["--rounds"]),
    (["bench", "train", "--net", "5gbit"], ["--net", "1gbit"]),
    (["bench", "train", "--strategies", "gossip"], ["--strategies", "ring", "ps-sync", "ps-async", "ps-sharded"]),
    (["bench", "train", "--strategies", "ps-sharded:0"], ["--strategies"]),
    (["bench", "train", "--strategies", "ps-sharded:x"], ["--strategies"]),
    (["bench", "train", "--timeout", "-1"], ["--timeout"]),
    (["simulate", "--model", "gpt5"], ["--model", "resnet50", "bert-large"]),
    (["simulate", "--device", "z80"], ["--device", "k80", "v100", "a100", "h100"]),
    (["simulate", "--cluster", "5GbE"], ["--cluster", "1GbE", "10GbE", "56Gb-IB"]),
    (["simulate", "--gpus-per-node", "0"], ["--gpus-per-node"]),
    (["simulate", "--gpus", "0"], ["--gpus"]),
    (["simulate", "--gpus", "4,x"], ["--gpus"]),
    (["simulate", "--schedules", "fast"], ["--schedules", "optimal", "mgwfbp"]),
    (["simulate", "--algorithms", "fast"], ["--algorithms", "ring", "halving_doubling"]),
    (["simulate", "--bucket-mb", "0"], ["--bucket-mb"]),
    (["simulate", "--bucket-mb", "nan"], ["--bucket-mb"]),
    (["plan", "--model", "gpt5"], ["--model", "resnet50"]),
    (["plan", "--model", "resnet50", "--device", "z80"], ["--device", "v100"]),
    (["plan", "--model", "resnet50", "--cluster", "5GbE"], ["--cluster", "10GbE"]),
    (["plan", "--model", "resnet50", "--gpus-per-node", "0"], ["--gpus-per-node"]),
    (["plan", "--model", "resnet50", "--alpha", "-1", "--beta", "1e-9"], ["alpha"]),
    (["plan", "--model", "resnet50", "--alpha", "nan", "--beta", "1e-9"], ["alpha"]),
    (["plan", "--model", "resnet50", "--alpha", "1e-4"], ["--alpha", "--beta"]),
    (["plan", "--model", "resnet50", "--alpha", "0", "--beta", "-1"], ["beta"]),
    (["plan", "--model", "resnet50", "--methods", "fast"], ["--methods", "optimal", "mgwfbp", "wfbp"]),
    (["plan", "--model", "resnet50", "--gpus", "0"], ["--gpus"]),
    (["plan", "--model", "resnet50", "--algorithm", "fast"], ["--algorithm", "ring"]),
    (["plan", "--model", "resnet50", "--bucket-mb", "-1"], ["--bucket-mb"]),
    (["plan", "--model", "resnet50", "--max-groups", "-1"], ["--max-groups"]),
    (["launch", "--nproc-per-node", "0", "x.py"], ["--nproc-per-node"]),
    (["launch", "--nnodes", "0", "x.py"], ["--nnodes"]),
    (["launch", "--nnodes", "2", "--node-rank", "5", "--master-addr", "10.0.0.1", "x.py"], ["--node-rank"]),
    (["launch", "--node-rank", "-1", "x.py"], ["--node-rank"]),
    (["launch", "--master-port", "70000", "x.py"], ["--master-port"]),
    (["launch", "--nnodes", "2", "x.py"], ["--master-addr"]),
    (["launch", "--nnodes", "2", "--master-addr", "10.0.0.1", "x.py"], ["--secret-file", "RINGTRAIN_SECRET"]),
    (["launch", "--secret-file", "/nonexistent/secret", "x.py"], ["--secret-file"]),
]


@pytest.mark.parametrize("argv, words", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in
                         ("train", "bench", "simulate", "plan", "launch") else "")
def test_cli_rejects_bad_value_naming_the_option(argv, words, capsys):
    message = cli_failure(argv, capsys)
    option, accepted = words[0], words[1:]
    assert names(message, option), f"{argv}: the message does not name {option}: {message!r}"
    missing = [w for w in accepted if w not in message]
    assert not missing, f"{argv}: the message does not list {missing}: {message!r}"


@pytest.mark.parametrize("steps", ["0", "-5"])
def test_train_gives_one_bound_for_steps(steps, capsys):
    assert cli_failure(["train", "--steps", steps], capsys) == f"ringtrain train: --steps must be >= 1, got {steps}"


def test_train_names_the_model_flag(capsys):
    message = cli_failure(["train", "--model", "nope"], capsys)
    assert message.startswith("ringtrain train: --model must be one of charlm, charlm-lstm, "), message


@pytest.mark.parametrize("argv", [argv for argv, _ in CLI_CASES if argv[:2] == ["bench", "allreduce"]
                                  and argv[2] != "--net"],  # (--net: argparse's own choices error)
                         ids=" ".join)
def test_bench_allreduce_errors_name_the_subcommand(argv, capsys):
    message = cli_failure(argv, capsys)
    assert message.startswith("ringtrain bench allreduce: "), message


# --- library entry points ---------------------------------------------------------------------

def value_error(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    for w in words:
        assert w in message, f"{w!r} not in {message!r}"


def _init(**kw):
    args = dict(rank=0, world_size=2, master_addr="127.0.0.1", master_port=29999, transport="tcp", timeout=1.0)
    args.update(kw)
    return lambda: ringtrain.init(**args)


@pytest.mark.parametrize("kw, words", [
    ({"transport": "udp"}, ["transport", "tcp", "shm", "torch", "auto"]),
    ({"timeout": 0}, ["timeout"]),
    ({"timeout": -1.0}, ["timeout"]),
    ({"timeout": "five"}, ["timeout"]),  # (a numeric string is taken, as for rank and the port)
    ({"timeout": True}, ["timeout"]),
    ({"rank": -1}, ["rank"]),
    ({"rank": 2}, ["rank", "world_size"]),
    ({"world_size": 0}, ["world_size"]),
    ({"master_port": 0}, ["master_port", "65535"]),
    ({"master_port": 70000}, ["master_port", "65535"]),
    ({"master_port": "x"}, ["master_port"]),
    ({"timeout": math.nan}, ["timeout"]),
    ({"rank": 1.5}, ["rank"]),
    ({"rank": True}, ["rank"]),
    ({"master_addr": ""}, ["master_addr"]),
    ({"master_addr": 5}, ["master_addr"]),
])
def test_init_rejects_bad_arguments(kw, words):
    value_error(_init(**kw), *words)


def _transport():
    return LocalHub(1).transport(0)


@pytest.mark.parametrize("kw, words", [
    ({"timeout": 0}, ["timeout"]),
    ({"timeout": -3}, ["timeout"]),
    ({"timeout": math.nan}, ["timeout"]),
    ({"timeout": math.inf}, ["timeout"]),
    ({"timeout": "five"}, ["timeout"]),
    ({"host_ids": ["a", "b"]}, ["host_ids"]),
    ({"host_ids": "a"}, ["host_ids"]),
])
def test_communicator_rejects_bad_arguments(kw, words):
    value_error(lambda: Communicator(_transport(), **kw), *words)


def test_communicator_rejects_a_non_transport():
    value_error(lambda: Communicator(None), "transport")


@pytest.mark.parametrize("call, words", [
    (lambda c, b: c.allreduce(b, op="avg"), ["op", "sum", "mean", "prod"]),
    (lambda c, b: c.allreduce(b, algorithm="fast"), ["algorithm", "ring", "auto"]),
    (lambda c, b: c.allreduce([1.0, 2.0]), ["numpy", "torch"]),
    (lambda c, b: c.allreduce(np.zeros(3, np.uint16)), ["dtype", "float32"]),
    (lambda c, b: c.allreduce(np.zeros(3, np.int32), op="mean"), ["mean", "int32"]),
    (lambda c, b: c.broadcast(b, root=3), ["root"]),
    (lambda c, b: c.reduce_scatter(b, op="avg"), ["op", "sum"]),
])
def test_collectives_reject_bad_arguments(call, words):
    comm = Communicator(_transport())
    value_error(lambda: call(comm, np.zeros(4, np.float32)), *words)


def _ddp(**kw):
    comm = Communicator(_transport())
    args = dict(comm=comm, alpha=1e-4, beta=1e-9)
    args.update(kw)
    module = args.pop("module", torch.nn.Linear(2, 2))
    return lambda: ringtrain.DistributedDataParallel(module, **args)


@pytest.mark.parametrize("kw, words", [
    ({"schedule": "fast"}, ["schedule", "optimal", "mgwfbp", "wfbp", "fixed", "single"]),
    ({"bucket_cap_mb": 0}, ["bucket_cap_mb"]),
    ({"bucket_cap_mb": math.nan}, ["bucket_cap_mb"]),
    ({"algorithm": "fast"}, ["algorithm", "ring", "auto"]),
    ({"warmup_iterations": -1}, ["warmup_iterations"]),
    ({"profile_iterations": 0}, ["profile_iterations"]),
    ({"timeline_iterations": 0}, ["timeline_iterations"]),
    ({"replan_interval": -1}, ["replan_interval"]),
    ({"drift_threshold": 0}, ["drift_threshold"]),
    ({"alpha": -1.0}, ["alpha"]),
    ({"beta": None}, ["alpha", "beta"]),
    ({"cost": lambda n: 1e-4}, ["cost", "alpha", "not both"]),
    ({"cost": 5, "alpha": None, "beta": None}, ["cost", "callable"]),
    ({"timeline": 5}, ["timeline"]),
    ({"find_unused_parameters": "yes"}, ["find_unused_parameters"]),
    ({"broadcast_buffers": "no"}, ["broadcast_buffers"]),
    ({"comm": "x"}, ["comm"]),
    ({"module": "x"}, ["module"]),
])
def test_ddp_rejects_bad_arguments(kw, words):
    value_error(_ddp(**kw), *words)


@pytest.mark.parametrize("args, kw, words", [
    (([1e-3], [100], 1e-4, 1e-9), {"method": "fast"}, ["method", "optimal", "mgwfbp", "wfbp", "fixed", "single"]),
    (([1e-3, 1e-3], [100], 1e-4, 1e-9), {}, ["backward_times", "sizes_bytes"]),
    (([-1e-3], [100], 1e-4, 1e-9), {}, ["backward_times"]),
    (([math.nan], [100], 1e-4, 1e-9), {}, ["backward_times"]),
    (([1e-3], [-100], 1e-4, 1e-9), {}, ["sizes_bytes"]),
    (([1e-3], [100], -1e-4, 1e-9), {}, ["alpha"]),
    (([1e-3], [100], "x", 1e-9), {}, ["alpha"]),
    (([1e-3], [100], 1e-4, math.nan), {}, ["beta"]),
    (([1e-3], [100], 1e-4, 1e-9), {"method": "fixed", "bucket_cap_mb": 0}, ["bucket_cap_mb"]),
])
def test_plan_merge_rejects_bad_arguments(args, kw, words):
    value_error(lambda: plan.merge(*args, **kw), *words)


@pytest.mark.parametrize("args, kw, words", [
    ((-1, 4), {}, ["nbytes"]),
    ((math.nan, 4), {}, ["nbytes"]),
    (("x", 4), {}, ["nbytes"]),
    ((1e6, 0), {}, ["world_size"]),
    ((1e6, 2.5), {}, ["world_size"]),
    ((1e6, True), {}, ["world_size"]),
    ((1e6, 4), {"algorithm": "fast"}, ["algorithm", "ring", "halving_doubling"]),
    ((1e6, 4), {"alpha": -1}, ["alpha"]),
    ((1e6, 4), {"alpha": math.inf}, ["alpha"]),
    ((1e6, 4), {"beta": -1}, ["beta"]),
    ((1e6, 4), {"gamma": math.nan}, ["gamma"]),
    ((1e6, 4), {"beta": None}, ["beta"]),
])
def test_sim_allreduce_time_rejects_bad_arguments(args, kw, words):
    kw = {"beta": 1e-9, **kw}
    if kw["beta"] is None:
        del kw["beta"]
    value_error(lambda: sim.allreduce_time(*args, **kw), *words)
