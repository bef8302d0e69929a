"""`ringtrain train` and `ringtrain launch` before and after the workers: what the parent checks
and how a failure reaches the user.

Before starting workers, `ringtrain train` refuses a checkpoint directory it cannot continue
(checkpoints of another strategy, another model, another global batch or seed, or parameter
servers' checkpoints of the other kind of job, of another number of asynchronous servers, or to be
cut anew for another number of servers with a file missing), a --timeline
it cannot write, and a batch larger than the data set; --no-resume moves old checkpoints
aside instead of overwriting them. Each refusal is one ``ringtrain train: ...`` line and
leaves the files as they were. After the workers, a failed rank is reported with its rank,
exit code and exception; torchrun's own errors (a port in use) with their text.

Most tests run the CLI in this process with torch's launcher replaced by a recorder; the
checkpoints they check are real ones, written by the functions the workers use. The tests
that need a real launcher start only torchrun's agent or a one-line script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ringtrain import checkpoint, cli, train
import cli_harness
import ps_harness
from torch_version import OLDER_TORCH

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def launches(monkeypatch):
    """torchrun.main replaced by a recorder: the list of argv it was called with."""
    import torch.distributed.run as torchrun

    calls = []
    _env_set_by_train_undone(monkeypatch)
    monkeypatch.setattr(torchrun, "main", lambda argv: calls.append(argv))
    return calls


def _env_set_by_train_undone(monkeypatch) -> None:
    """`ringtrain train` sets these in its own process (here, pytest's): unset now and as they
    were after the test (delenv of an unset name records nothing to undo; setenv first does)."""
    for name in ("RINGTRAIN_SECRET", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def refusal(argv: list[str], launches, capsys) -> str:
    """Run `ringtrain ARGV`, which must be refused before launching: its one-line message."""
    message = cli_harness.refusal(argv, capsys)
    assert not launches, f"{argv}: launched"
    assert message.startswith(f"ringtrain {argv[0]}: "), message
    return message


def save_run(directory: Path, steps=(1, 2), strategy: str = "ring", model: str = "charlm", workers: int = 1,
             batch: int = 4, seed: int = 0, legacy: bool = False, optimizer: str = "sgd") -> None:
    """Checkpoints as the workers of such a run save them (``legacy``: without the fields a
    checkpoint records since the parent checks them)."""
    cfg = train.TrainConfig(model=model, strategy=strategy, batch_size=batch, seed=seed, checkpoint_dir=str(directory),
                            optimizer=optimizer)
    net, loader, _ = train._workload(cfg, 0, workers)
    opt = train._optimizer(cfg)(net.parameters()) if strategy == "ring" else None
    for step in steps:
        if legacy:
            payload = checkpoint.training_state(step, net, opt, loader)
        else:
            payload = train._training_state(cfg, step, net, opt, loader)
        checkpoint.save(directory, step, payload)


def fingerprint(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and its SHA-256."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def train_argv(directory: Path, *more: str) -> list[str]:
    return ["train", "--workers", "1", "--batch-size", "4", "--checkpoint-dir", str(directory), "--no-progress", *more]


# --- 1. another strategy's checkpoints ----------------------------------------------------------

@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "older-checkpoints"])
def test_a_parameter_server_run_refuses_a_ring_runs_directory_and_leaves_it_alone(tmp_path, legacy, launches, capsys):
    save_run(tmp_path, legacy=legacy)
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sync"), launches, capsys)
    assert "ring run" in message and "--checkpoint-dir" in message and "[1, 2]" in message, message
    assert fingerprint(tmp_path) == before


@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "older-checkpoints"])
def test_a_ring_run_refuses_a_parameter_server_runs_directory(tmp_path, legacy, launches, capsys):
    save_run(tmp_path, strategy="ps-sync", legacy=legacy)
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path), launches, capsys)
    assert "parameter-server run" in message and "--checkpoint-dir" in message, message
    assert fingerprint(tmp_path) == before


def test_a_ring_run_refuses_a_directory_of_parameter_servers_files_alone(tmp_path, launches, capsys):
    # (the workers' first save cut short, or their files removed) The ring run started at step 0
    # beside them, and the parameter-server run was then refused for the ring's checkpoints.
    save_servers(tmp_path, 2)
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path), launches, capsys)
    assert f"holds the checkpoints of a parameter-server run's servers (steps [1] in {tmp_path / 'servers'})" in message
    assert "--strategy ring cannot resume them" in message and "--no-resume" in message, message
    assert fingerprint(tmp_path) == before
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sharded")) == 0  # (theirs resumes)
    assert cli.main(train_argv(tmp_path / "fresh")) == 0  # (an empty servers folder or none: no refusal)
    assert len(launches) == 2


def test_a_parameter_server_run_without_server_checkpoints_refuses_to_overwrite_its_workers_files(
        tmp_path, launches, capsys):
    save_run(tmp_path, strategy="ps-sync")
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sync"), launches, capsys)
    assert "no parameter-server checkpoints" in message, message


def test_a_parameter_server_run_whose_servers_share_no_saved_step_refuses(tmp_path, launches, capsys):
    # The first save was cut short: server 0 wrote step 2, server 1 only step 1. The servers would
    # start at step 0 (no step whole on both) and overwrite the workers' checkpoints.
    save_run(tmp_path, strategy="ps-sharded")
    checkpoint.save(tmp_path / "servers" / "server-0", 2, {"version": 2})
    checkpoint.save(tmp_path / "servers" / "server-1", 1, {"version": 1})
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sharded", "--servers", "2"), launches, capsys)
    assert "no step is saved by every parameter server" in message and "server-1: [1]" in message, message
    assert fingerprint(tmp_path) == before
    checkpoint.save(tmp_path / "servers" / "server-1", 2, {"version": 2})  # now step 2 is on both
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sharded", "--servers", "2")) == 0
    assert len(launches) == 1


def test_the_step_a_run_resumes_at_is_the_newest_every_server_saved(tmp_path):
    """What the line after Ctrl-C names: parameter servers resume at the newest step *every* server
    holds (server 1's save of step 3 was cut short: step 2); ring workers at their newest whole
    checkpoint (a damaged newer one is skipped)."""
    from ringtrain import resume

    for server, steps in ((0, (1, 2, 3)), (1, (1, 2))):
        for step in steps:
            checkpoint.save(tmp_path / "ps" / "servers" / f"server-{server}", step, {"version": step}, keep=5)
    cfg = train.TrainConfig(strategy="ps-sharded", servers=2, checkpoint_dir=str(tmp_path / "ps"))
    assert resume.resume_step(cfg) == 2
    none_common = train.TrainConfig(strategy="ps-sharded", servers=3, checkpoint_dir=str(tmp_path / "ps"))
    (tmp_path / "ps" / "servers" / "server-2").mkdir()  # a third server that saved nothing
    assert resume.resume_step(none_common) is None
    for step in (4, 5):
        checkpoint.save(tmp_path / "ring", step, {"step": step})
    (tmp_path / "ring" / checkpoint.checkpoint_name(6)).write_text("garbage\n")
    assert resume.resume_step(train.TrainConfig(checkpoint_dir=str(tmp_path / "ring"))) == 5


def save_servers(directory: Path, servers: int, strategy: str = "sync", optimizer: str = "sgd") -> None:
    """Real parameter servers (threads) save step 1 into ``directory``/servers, as a run's do."""
    from ringtrain.ps import ParameterServerTraining

    started = [ps_harness.start_server(b"entry", index=k, servers=servers, strategy=strategy,
                                       checkpoint_dir=str(directory / "servers")) for k in range(servers)]
    ps = ParameterServerTraining(ps_harness.tiny(), servers=[s.endpoint for s, _, _ in started], worker=0, workers=1,
                                 secret=b"entry", strategy=strategy, timeout=10.0, partition_mb=4 / (1 << 20),
                                 optimizer=optimizer)
    ps.module(torch.ones(2, 4)).sum().backward()
    ps.step()
    ps.save_checkpoint()
    ps.close()
    for _, thread, _ in started:
        thread.join(10)


@pytest.mark.parametrize("saved, run", [(2, 1), (1, 2)])
def test_a_synchronous_parameter_server_run_resumes_on_another_number_of_servers(tmp_path, saved, run, launches):
    # (refused before the servers cut a save anew for another number of servers: test_ps_reshard.py)
    save_run(tmp_path, steps=(1,), strategy="ps-sharded")
    save_servers(tmp_path, saved)
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sharded", "--servers", str(run))) == 0
    assert len(launches) == 1


def test_a_save_to_cut_anew_with_a_file_missing_is_refused_before_launching_naming_it(tmp_path, launches, capsys):
    save_run(tmp_path, steps=(1,), strategy="ps-sharded")
    save_servers(tmp_path, 2)
    shutil.rmtree(tmp_path / "servers" / "server-1")
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sync"), launches, capsys)
    missing = tmp_path / "servers" / "server-1" / checkpoint.checkpoint_name(1)
    assert f"was made by 2 servers; resumed on 1, every file of it is read, but {missing} is missing" in message, message
    assert "resume with --servers 2" in message, message
    assert fingerprint(tmp_path) == before
    # On as many servers as made it, server 1's folder may be on another machine's disk: it launches.
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sharded", "--servers", "2")) == 0
    assert len(launches) == 1


@pytest.mark.parametrize("saved, run", [(2, 1), (1, 2)])
def test_an_asynchronous_run_with_another_number_of_servers_refuses_before_launching(
        tmp_path, saved, run, launches, capsys):
    # The servers refused it too, but only once every rank had started (and the workers had waited).
    save_run(tmp_path, steps=(1,), strategy="ps-async")
    save_servers(tmp_path, saved, strategy="async")
    before = fingerprint(tmp_path)
    message = refusal(train_argv(tmp_path, "--strategy", "ps-async", "--servers", str(run)), launches, capsys)
    assert f"was made by {saved} server{'s' * (saved > 1)}, this run has {run}" in message, message
    assert f"resume with --servers {saved}" in message, message
    assert fingerprint(tmp_path) == before
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-async", "--servers", str(saved))) == 0
    assert len(launches) == 1


@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
def test_a_parameter_server_run_on_another_number_of_workers_refuses_before_launching(
        tmp_path, strategy, launches, capsys):
    # The same global batch on 2 workers: the ring resumes it, the servers refused it once every rank
    # had started, and the parent then said to run the same command again.
    save_run(tmp_path, steps=(1,), strategy=strategy)
    save_servers(tmp_path, 1, strategy=strategy.removeprefix("ps-"))
    argv = train_argv(tmp_path, "--strategy", strategy)
    argv[argv.index("--workers") + 1], argv[argv.index("--batch-size") + 1] = "2", "2"
    message = refusal(argv, launches, capsys)
    assert "was made with 1 worker, this run has 2: resume with --workers 1, " in message, message
    assert cli.main(train_argv(tmp_path, "--strategy", strategy)) == 0
    assert len(launches) == 1


@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
def test_a_parameter_server_run_on_more_workers_is_told_the_workers_not_a_batch_size_it_cannot_use(
        tmp_path, strategy, launches, capsys):
    # It was told "resume with --batch-size 2 (the same global batch on --workers 2)"; resumed so, it
    # was then refused for its 2 workers: the servers count their workers.
    save_run(tmp_path, steps=(1,), strategy=strategy)  # 1 worker x 4
    save_servers(tmp_path, 1, strategy=strategy.removeprefix("ps-"))
    argv = train_argv(tmp_path, "--strategy", strategy)
    argv[argv.index("--workers") + 1] = "2"
    message = refusal(argv, launches, capsys)
    assert "was made with 1 worker, this run has 2: resume with --workers 1, " in message, message
    assert "--batch-size" not in message, message
    # With its workers, another batch size is told as before.
    argv = train_argv(tmp_path, "--strategy", strategy)
    argv[argv.index("--batch-size") + 1] = "2"
    message = refusal(argv, launches, capsys)
    assert "global batch of 4" in message and "resume with --batch-size 4" in message, message


def test_more_servers_than_the_model_has_partitions_is_refused_before_launching(tmp_path, launches, capsys):
    # The workers refused it, but only once all W + K ranks had started: two tracebacks and a line
    # per rank, and a large --servers (200 processes) ran the machine out of memory first.
    message = refusal(train_argv(tmp_path, "--model", "charlm-lstm", "--strategy", "ps-sharded", "--servers", "12"),
                      launches, capsys)
    assert "--servers 12" in message and "11 partitions" in message and "at most 11 servers" in message, message
    assert cli.main(train_argv(tmp_path, "--model", "charlm-lstm", "--strategy", "ps-sharded", "--servers", "11")) == 0
    assert len(launches) == 1


def test_a_synchronous_parameter_server_run_refuses_an_asynchronous_runs_servers(tmp_path, launches, capsys):
    save_run(tmp_path, steps=(1,), strategy="ps-async")
    save_servers(tmp_path, 1, strategy="async")
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sync"), launches, capsys)
    assert "made by an asynchronous job (--strategy ps-async), not --strategy ps-sync" in message, message
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-async")) == 0


def test_a_run_with_another_strategy_and_number_of_servers_is_told_both_at_once(tmp_path, launches, capsys):
    # It was told the number of servers; resumed so, it was then told the strategy.
    save_run(tmp_path, steps=(1,), strategy="ps-async")
    save_servers(tmp_path, 1, strategy="async")
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sharded"), launches, capsys)
    assert ("was made by an asynchronous job (--strategy ps-async), not --strategy ps-sharded and by 1 server, this "
            "run has 2: resume with --strategy ps-async --servers 1, ") in message, message
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-async", "--servers", "1")) == 0


@pytest.mark.parametrize("strategy", ["ring", "ps-sync"])
def test_a_run_already_at_its_steps_says_so_without_starting_a_rank(tmp_path, launches, capsys, strategy):
    # Was: every rank started (~16 s) to print the same line.
    save_run(tmp_path, steps=(2, 4), strategy=strategy)
    if strategy != "ring":
        checkpoint.save(tmp_path / "servers" / "server-0", 4, {"version": 4})
    assert cli.main(train_argv(tmp_path, "--steps", "4", "--strategy", strategy)) == 0
    assert not launches
    assert "nothing to do: the checkpoint is already at step 4 (--steps 4)" in capsys.readouterr().out
    assert cli.main(train_argv(tmp_path, "--steps", "6", "--strategy", strategy)) == 0  # more steps: it trains
    assert cli.main(train_argv(tmp_path, "--steps", "4", "--strategy", strategy, "--json")) == 0  # (the summary's)
    assert len(launches) == 2


def test_runs_of_the_same_strategy_resume(tmp_path, launches, capsys):
    save_run(tmp_path / "ring")
    assert cli.main(train_argv(tmp_path / "ring")) == 0
    save_run(tmp_path / "ps", strategy="ps-sync")
    checkpoint.save(tmp_path / "ps" / "servers" / "server-0", 2, {"version": 2})
    assert cli.main(train_argv(tmp_path / "ps", "--strategy", "ps-async")) == 0
    assert len(launches) == 2


def test_a_damaged_checkpoint_is_named_in_one_line_kept_and_skipped(tmp_path, launches, capsys):
    """One line naming the file (not torch's advice, nor a Python warning with its source line);
    the file stays for the user to remove; the workers resume from the newest whole checkpoint."""
    import warnings

    save_run(tmp_path, steps=(1, 2))
    bad = tmp_path / checkpoint.checkpoint_name(99)
    bad.write_text("garbage\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main(train_argv(tmp_path)) == 0
        assert checkpoint.latest(tmp_path, warn=False).step == 2  # (the workers' choice: quiet, named once above)
    assert capsys.readouterr().err.splitlines() == [
        f"skipping {bad}: not a readable checkpoint: truncated, or not written by ringtrain (UnpicklingError); "
        "remove it"]
    assert len(launches) == 1 and bad.read_text() == "garbage\n"


def test_the_help_names_the_checkpoint_directory_a_run_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # (no runs/ of older runs here)
    monkeypatch.setenv("COLUMNS", "400")  # (argparse would break lines at hyphens)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for strategy in ("ring", "ps-sync"):
        used = train.TrainConfig(model="charlm", strategy=strategy).checkpoint_dir
        assert f" {used} " in text or f"({used})" in text, (used, text)
    assert "runs/<model>" not in text


def test_checkpoints_record_strategy_canonical_model_optimizer_and_lr(tmp_path):
    save_run(tmp_path, model="charlm", strategy="ps-sharded", optimizer="adam")
    extra = checkpoint.latest(tmp_path).payload["extra"]
    corpus = extra.pop("corpus")  # the text's sha256: a resume on other text says so
    assert extra == {"strategy": "ps-sharded", "model_name": "charlm-transformer", "optimizer_name": "adam",
                     "lr": train.USUAL_LR["adam"]}  # (--lr: a resume with another says so)
    assert isinstance(corpus, str) and len(corpus) == 64


def test_a_resume_on_another_text_corpus_says_so(tmp_path, capsys):
    from types import SimpleNamespace

    save_run(tmp_path, model="charlm")
    payload = checkpoint.latest(tmp_path).payload
    same = SimpleNamespace(dataset=SimpleNamespace(digest=payload["extra"]["corpus"]))
    train._note_other_corpus(payload, same, 0)
    assert capsys.readouterr().err == ""
    other = SimpleNamespace(dataset=SimpleNamespace(digest="0" * 64))
    train._note_other_corpus(payload, other, 1)  # (rank 0 speaks)
    assert capsys.readouterr().err == ""
    train._note_other_corpus(payload, other, 0)
    assert "another text corpus" in capsys.readouterr().err


# --- 2. a failed rank, torchrun's own errors --------------------------------------------------

def recorded_failure(tmp_path: Path, monkeypatch, rank: int, exc: Exception):
    """A ProcessFailure as torchrun makes it for a rank whose entry point (under @record) raised ``exc``."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure, record

    error_file = tmp_path / f"error-{rank}.json"

    def entry():
        raise exc

    with monkeypatch.context() as m:
        m.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        with pytest.raises(type(exc)):
            record(entry)()
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(error_file))


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # pytest's captured stderr has no fileno
def test_a_failed_server_rank_is_reported_with_its_exception(tmp_path, monkeypatch, capsys):
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {2: recorded_failure(tmp_path, monkeypatch, 2, IndexError("list index out of range")),
                0: ProcessFailure(local_rank=0, pid=1000, exitcode=-15, error_file="/nonexistent")}
    failures[0].timestamp = failures[2].timestamp + 1  # the server failed first

    def fail(argv):
        raise ChildFailedError("ringtrain.cli", failures)

    _env_set_by_train_undone(monkeypatch)
    monkeypatch.setattr(torchrun, "main", fail)
    code = cli.main(train_argv(tmp_path / "ck", "--strategy", "ps-sync"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert lines[-3].startswith("ringtrain train: rank 2 (parameter server) failed (exit code 1): "
                                "IndexError: list index out of range ["), lines
    assert "test_train_entry.py:" in lines[-3], lines
    assert lines[-2] == "ringtrain train: rank 0 (worker) failed (killed by SIGTERM)", lines
    # then what is left of the run (was: nothing, only Ctrl-C said where the same command goes on)
    assert lines[-1] == ("ringtrain train: no checkpoint yet (one every 20 steps): the same command starts again "
                         "from step 0"), lines


def _port_of(argv: list[str]) -> int:
    return next(int(a.split("=")[1]) for a in argv if a.startswith("--master-port="))


@pytest.mark.parametrize("taken", [1, "all", "given", "another port"])
def test_a_free_port_taken_before_torchrun_listens_is_replaced_by_another(tmp_path, monkeypatch, capsys, taken):
    """`ringtrain train` finds a free port a moment before torchrun's store listens there; a process
    binding it in between failed the run with torch's EADDRINUSE. Now it launches again on another
    port (PORT_TRIES launches at most); a port the user gave (--master-port) is not replaced, nor is
    the rendezvous port blamed for another in use (torch's health-check port, where one is set)."""
    import torch.distributed.run as torchrun

    from ringtrain import launch

    ports = []
    failing = {1: 1, "all": launch.PORT_TRIES, "given": 1, "another port": 1}[taken]

    def main(argv):
        ports.append(_port_of(argv))
        if len(ports) <= failing:  # (torch's DistNetworkError says it so)
            port = 1 if taken == "another port" else ports[-1]
            raise RuntimeError(f"The server socket has failed to listen on any local network address. port: "
                               f"{port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")

    _env_set_by_train_undone(monkeypatch)
    monkeypatch.setattr(torchrun, "main", main)
    given = ["--master-port", "29613"] if taken == "given" else []
    code = cli.main(train_argv(tmp_path / "ck", *given))
    lines = capsys.readouterr().err.strip().splitlines()
    if taken == 1:
        assert code == 0 and len(ports) == 2 and ports[0] != ports[1], ports
        assert lines == [f"ringtrain train: port {ports[0]}, free a moment before, was taken before torchrun's store "
                         "could listen there; launching on another"], lines
        return
    assert code == 1
    assert len(ports) == (launch.PORT_TRIES if taken == "all" else 1), ports
    assert lines[-1].startswith("ringtrain train: torchrun failed: RuntimeError: ") and "EADDRINUSE" in lines[-1]
    assert lines[-1].endswith("choose another --master-port"), lines
    if taken != "all":
        assert len(lines) == 1 and (taken != "given" or ports == [29613]), (ports, lines)


def test_a_worker_records_its_exception_for_the_parent(tmp_path):
    """The --worker entry point runs under torch's @record: its exception lands in the error file."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file))
    proc = subprocess.run([sys.executable, "-m", "ringtrain.cli", "train", "--worker", json.dumps({"model": "gpt5"})],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("ValueError: --model must be one of"), message


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # pytest's captured stderr has no fileno
def test_a_worker_that_loses_a_peer_records_it_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Rank 0's output is shown: its CommTimeout or PeerLost when another rank dies or stops was
    some 60 lines of traceback above the parent's line that says the same."""
    from ringtrain.errors import CommTimeout

    def lost(config_json, json_summary):
        raise CommTimeout("rank 0: timed out waiting for rank 1 to send its message during call #93 allreduce")

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(train, "_run_worker", lost)
    args = argparse.Namespace(worker="{}", json=False, interrupt_file="")
    assert train._worker_entry(args) == 1
    assert "Traceback" not in capsys.readouterr().err
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("CommTimeout: rank 0: timed out waiting for rank 1"), message


def test_sigterm_during_a_checkpoint_save_takes_effect_once_the_save_is_done():
    """torchrun passes SIGTERM (a scheduler stopping the job) on to the ranks: rank 0 died in the
    middle of its save and the run lost that checkpoint. It is held, as Ctrl-C is, until the save
    is done, then goes to the handler the process had."""
    events = []
    sigint = signal.getsignal(signal.SIGINT)
    before = signal.signal(signal.SIGTERM, lambda signum, frame: events.append("SIGTERM handled"))
    try:
        with train._interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            events.append("save done")
        assert events == ["save done", "SIGTERM handled"]
        assert signal.getsignal(signal.SIGINT) is sigint
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_during_a_background_checkpoint_write_takes_effect_once_the_write_is_done(tmp_path, monkeypatch):
    """Rank 0 writes checkpoints on a thread while it trains: a SIGTERM then (torchrun stopping the
    job) would end the process mid-write and lose that checkpoint; it waits for the write, then
    goes to the handler the process had."""
    from test_checkpoint_writer import Disk

    disk = Disk(monkeypatch)
    events = []

    def handler(signum, frame):
        events.append(f"SIGTERM handled, checkpoints {[s for s, _ in checkpoint.list_checkpoints(tmp_path)]}")

    before = signal.signal(signal.SIGTERM, handler)
    try:
        ckpt = train._Checkpoints(train.TrainConfig(checkpoint_dir=str(tmp_path)), 0, lambda step: {})
        writer = ckpt.writer
        with ckpt:
            writer.save(4, {"x": torch.ones(2)})
            threading.Timer(0.3, disk.open).start()
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # (the handler runs between bytecodes of the main thread)
                if events:
                    break
                time.sleep(0.01)
        assert events == ["SIGTERM handled, checkpoints [4]"]
        assert signal.getsignal(signal.SIGTERM) is handler and writer.writing == []
    finally:
        signal.signal(signal.SIGTERM, before)


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def run_cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RINGTRAIN_SECRET", None)
    return subprocess.run([sys.executable, "-m", "ringtrain.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=90)


@pytest.mark.multiprocess
def test_train_on_a_busy_port_says_so_in_one_line(tmp_path):
    with busy_port() as s:
        proc = run_cli(train_argv(tmp_path / "ck", "--master-port", str(s.getsockname()[1])), tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    errors = ("DistNetworkError", "RuntimeError") if OLDER_TORCH else ("DistNetworkError",)  # (torch 2.4's: RuntimeError)
    assert last.startswith(tuple(f"ringtrain train: torchrun failed: {e}: " for e in errors)), last
    assert "EADDRINUSE" in last, last
    assert "--master-port" in last, last


# --- 3. another global batch or seed -------------------------------------------------------------

def test_resuming_on_more_workers_suggests_the_batch_size_that_keeps_the_global_batch(tmp_path, launches, capsys):
    save_run(tmp_path, workers=2, batch=4)  # global batch 8
    message = refusal(["train", "--workers", "4", "--checkpoint-dir", str(tmp_path)], launches, capsys)
    assert "global batch of 8" in message and "--batch-size 2" in message, message
    assert cli.main(["train", "--workers", "4", "--batch-size", "2", "--checkpoint-dir", str(tmp_path)]) == 0
    assert len(launches) == 1


def test_a_global_batch_no_worker_count_divides_is_refused(tmp_path, launches, capsys):
    save_run(tmp_path, workers=2, batch=4)
    message = refusal(["train", "--workers", "3", "--batch-size", "4", "--checkpoint-dir", str(tmp_path)],
                      launches, capsys)
    assert "global batch of 8" in message and "--workers that divides 8" in message, message


def test_resuming_with_another_seed_is_refused(tmp_path, launches, capsys):
    save_run(tmp_path, seed=5)
    message = refusal(train_argv(tmp_path, "--seed", "6"), launches, capsys)
    assert "--seed 5" in message, message


@pytest.mark.parametrize("strategy", ["ring", "ps-sync"])
def test_resuming_with_another_optimizer_is_refused_naming_it(tmp_path, strategy, launches, capsys):
    save_run(tmp_path, steps=(1,), strategy=strategy, optimizer="adamw")
    if strategy != "ring":
        save_servers(tmp_path, 1, optimizer="adamw")
    message = refusal(train_argv(tmp_path, "--strategy", strategy), launches, capsys)
    assert "--optimizer adamw, not sgd" in message and "pass --optimizer adamw" in message, message
    assert cli.main(train_argv(tmp_path, "--strategy", strategy, "--optimizer", "adamw")) == 0
    assert launched_config(launches)["optimizer"] == "adamw"


def test_the_servers_files_alone_tell_their_optimizer(tmp_path, launches, capsys):
    """No worker checkpoint (the workers' first save cut short): the servers' files say it."""
    save_servers(tmp_path, 1, optimizer="adam")
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sync"), launches, capsys)
    assert "with --optimizer adam, not sgd: resume with --optimizer adam" in message, message
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sync", "--optimizer", "adam")) == 0


@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "older-checkpoints"])
def test_sgd_resumes_checkpoints_made_before_the_optimizer_was_recorded(tmp_path, legacy, launches, capsys):
    save_run(tmp_path, legacy=legacy)
    assert cli.main(train_argv(tmp_path)) == 0
    launches.clear()
    message = refusal(train_argv(tmp_path, "--optimizer", "adam"), launches, capsys)
    assert "--optimizer sgd, not adam" in message, message


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.05), ("adam", 1e-3), ("adamw", 1e-3)])
def test_each_optimizer_starts_at_its_usual_learning_rate_unless_given_one(optimizer, lr):
    from ringtrain.ps.server_optimizer import OPTIMIZERS

    assert train.OPTIMIZERS == OPTIMIZERS  # (the command line's list, kept without importing torch)
    assert train.TrainConfig(optimizer=optimizer).lr == lr
    assert train.TrainConfig(optimizer=optimizer, lr=0.2).lr == 0.2
    cfg = train.TrainConfig(optimizer=optimizer, lr=0.2)
    opt = train._optimizer(cfg)([torch.zeros(2, requires_grad=True)])
    assert type(opt).__name__.lower() == optimizer and opt.param_groups[0]["lr"] == 0.2
    assert opt.param_groups[0]["weight_decay"] == 0.0


def test_the_help_example_of_a_resume_on_more_workers_keeps_the_global_batch():
    example = next(line for line in train.__doc__.splitlines() if "--workers 4" in line)
    assert "--batch-size 16" in example, example  # 2 x 32 (the default) = 4 x 16


# --- 4. --timeline ----------------------------------------------------------------------------

def test_an_unwritable_timeline_is_refused_before_training(tmp_path, launches, capsys):
    (tmp_path / "afile").touch()
    message = refusal(train_argv(tmp_path / "ck", "--timeline", str(tmp_path / "afile" / "trace.json")),
                      launches, capsys)
    assert f"--timeline {tmp_path}/afile/trace.json: its directory {tmp_path}/afile: a file, not a folder" in message, \
        message


def test_a_ranks_trace_file_that_cannot_be_written_is_refused_before_training(tmp_path, launches, capsys):
    # A folder where worker 1's file goes, a name too long: a worker's traceback once it had started.
    (tmp_path / "t.rank1.json").mkdir()
    argv = train_argv(tmp_path / "ck", "--timeline", str(tmp_path / "t.json"))
    argv[argv.index("--workers") + 1] = "2"
    message = refusal(argv, launches, capsys)
    assert f"--timeline {tmp_path / 't.json'}: cannot write the trace file {tmp_path / 't.rank1.json'}" in message
    assert "is a directory" in message, message
    message = refusal(train_argv(tmp_path / "ck", "--timeline", str(tmp_path / ("a" * 250 + ".json"))), launches,
                      capsys)
    assert "rank0.json: File name too long" in message, message
    assert not launches


def test_the_timelines_directory_is_made(tmp_path, launches):
    assert cli.main(train_argv(tmp_path / "ck", "--timeline", str(tmp_path / "traces" / "t.json"))) == 0
    assert (tmp_path / "traces").is_dir() and len(launches) == 1


# --- 5. --no-resume -------------------------------------------------------------------------------

def test_no_resume_moves_the_old_checkpoints_aside(tmp_path, launches, capsys):
    save_run(tmp_path, steps=(20, 40))
    checkpoint.save(tmp_path / "servers" / "server-0", 40, {"version": 40})
    before = fingerprint(tmp_path)
    assert cli.main(train_argv(tmp_path, "--no-resume")) == 0
    assert len(launches) == 1
    assert checkpoint.list_checkpoints(tmp_path) == [] and not (tmp_path / "servers").exists()
    (aside,) = tmp_path.glob("superseded-*")
    assert {f"{aside.name}/{k}": v for k, v in before.items()} == fingerprint(tmp_path)
    assert f"moved the checkpoints of steps [20, 40] in {tmp_path} to {aside}" in capsys.readouterr().err
    # The servers' files alone (the workers' first save cut short): it said "the checkpoints of steps []".
    checkpoint.save(tmp_path / "servers" / "server-0", 3, {"version": 3})
    assert cli.main(train_argv(tmp_path, "--no-resume")) == 0
    (newer,) = set(tmp_path.glob("superseded-*")) - {aside}
    assert f"moved the parameter servers' checkpoints in {tmp_path} to {newer}" in capsys.readouterr().err


# --- 6. `ringtrain launch` ------------------------------------------------------------------------

def test_launch_refuses_a_missing_script(tmp_path, launches, capsys):
    message = refusal(["launch", "--master-port", "29999", str(tmp_path / "nonexistent.py")], launches, capsys)
    assert "nonexistent.py: no such file" in message, message


@pytest.mark.multiprocess
def test_launch_returns_the_scripts_exit_code_in_one_line(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with busy_port() as s:
        port = s.getsockname()[1]
    proc = run_cli(["launch", "--nproc-per-node", "2", "--master-port", str(port), str(script)], tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ringtrain launch: rank "), proc.stderr
    assert "failed (exit code 3)" in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.multiprocess
def test_launch_on_a_busy_port_says_so_in_one_line(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    with busy_port() as s:
        proc = run_cli(["launch", "--master-port", str(s.getsockname()[1]), str(script)], tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "EADDRINUSE" in proc.stderr.strip().splitlines()[-1], proc.stderr


# --- 7. a batch larger than the data set --------------------------------------------------------

def test_a_global_batch_larger_than_the_data_set_is_refused(tmp_path, launches, capsys):
    message = refusal(["train", "--workers", "2", "--batch-size", "100000", "--checkpoint-dir", str(tmp_path)],
                      launches, capsys)
    assert "--batch-size" in message and "200000" in message, message


# --- 7b. one run at a time in a checkpoint directory; the servers' folders -----------------------

def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_first(tmp_path, launches, capsys):
    """Two runs on one --checkpoint-dir each saved over and pruned the other's checkpoints, both
    ended 'done' (or the second failed with a 'different checkpoints on the ranks' error)."""
    held = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ringtrain import dirlock\n"
        "with dirlock.hold(Path(sys.argv[1]), '--checkpoint-dir'):\n"
        "    print('held', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        save_run(tmp_path)
        before = fingerprint(tmp_path)
        for more in ((), ("--no-resume",)):
            message = refusal(train_argv(tmp_path, *more), launches, capsys)
            assert f"--checkpoint-dir {tmp_path} is in use by another run (pid {held.pid} on " in message, message
            assert fingerprint(tmp_path) == before  # (--no-resume moved nothing aside)
    finally:
        held.kill()
        held.wait()
    cli.main(train_argv(tmp_path))  # its lock went with its process (a SIGKILL leaves none behind)
    assert len(launches) == 1
    assert not (tmp_path / ".ringtrain.lock").exists()  # removed by the run that held it last


def test_the_lock_is_taken_again_after_a_run_and_refused_while_held(tmp_path):
    from ringtrain import dirlock

    for _ in range(2):
        with dirlock.hold(tmp_path, "--checkpoint-dir"):
            assert "pid " in (tmp_path / ".ringtrain.lock").read_text()
        assert list(tmp_path.iterdir()) == []
    with dirlock.hold(tmp_path, "--checkpoint-dir"):  # (another descriptor: flock refuses it, same process too)
        with pytest.raises(dirlock.DirectoryInUse, match="is in use by another run"):
            with dirlock.hold(tmp_path, "--checkpoint-dir"):
                pass


def test_a_directory_of_damaged_checkpoints_alone_says_it_starts_at_step_0(tmp_path, launches, capsys):
    save_run(tmp_path)
    for _, path in checkpoint.list_checkpoints(tmp_path):
        path.write_bytes(b"\0" * 64)
    cli.main(train_argv(tmp_path))
    err = capsys.readouterr().err
    assert err.count("remove it") == 2 and f"no whole checkpoint in {tmp_path} to resume from: starting at step 0" in err


def test_a_link_in_the_place_of_the_lock_file_is_refused_and_its_target_untouched(tmp_path, launches, capsys):
    """The lock file was opened through a symbolic link put there, truncating what it points to."""
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".ringtrain.lock").symlink_to(target)
    message = refusal(train_argv(tmp_path / "ck"), launches, capsys)
    assert "is a symbolic link, not ringtrain's lock file; remove it" in message, message
    assert target.read_text() == "keep me"


def test_a_lock_file_of_another_user_is_still_locked_read_only(tmp_path):
    """A file this user cannot open for writing (another user's run made it) locked nothing."""
    from ringtrain import dirlock

    lock = tmp_path / ".ringtrain.lock"
    lock.write_text("pid 1 on elsewhere")
    real_open = os.open

    def open_as_another_user(path, flags, *mode):
        if str(path) == str(lock) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", open_as_another_user)
        with dirlock.hold(tmp_path, "--checkpoint-dir"):
            with pytest.raises(dirlock.DirectoryInUse, match=r"in use by another run \(pid 1 on elsewhere\)"):
                with dirlock.hold(tmp_path, "--checkpoint-dir"):
                    pass


@pytest.mark.parametrize("blocked", ["servers", "servers/server-1"])
def test_a_file_where_the_servers_keep_their_checkpoints_is_refused_before_training(tmp_path, launches, capsys,
                                                                                   blocked):
    """Each server failed after training had started (rank 0 had saved), then the advice to run
    the same command again was refused for the servers' missing checkpoints."""
    (tmp_path / blocked).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / blocked).write_text("x")
    message = refusal(train_argv(tmp_path, "--strategy", "ps-sharded", "--servers", "2"), launches, capsys)
    assert f"{tmp_path / blocked} is a file, where the parameter servers keep their checkpoints" in message, message


# --- 8. another model; one directory for a model's aliases ---------------------------------------

@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "older-checkpoints"])
def test_resuming_another_models_checkpoint_is_refused(tmp_path, legacy, launches, capsys):
    save_run(tmp_path, model="charlm", legacy=legacy)
    message = refusal(train_argv(tmp_path, "--model", "charlm-lstm"), launches, capsys)
    assert "charlm-lstm" in message and "--checkpoint-dir" in message, message
    if not legacy:
        assert "--model charlm-transformer" in message, message


def test_a_models_aliases_share_the_default_checkpoint_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dirs = {train.TrainConfig(model=m).checkpoint_dir for m in ("charlm", "charlm-transformer")}
    assert dirs == {str(Path("runs") / "charlm-transformer")}
    assert train.TrainConfig(model="charlm", strategy="ps-sync").checkpoint_dir == "runs/charlm-transformer-ps-sync"
    (tmp_path / "runs" / "charlm").mkdir(parents=True)  # made by a version that named it after the alias
    assert train.TrainConfig(model="charlm-transformer").checkpoint_dir == str(Path("runs") / "charlm")


def test_ps_sync_and_ps_sharded_share_the_default_checkpoint_directory(tmp_path, monkeypatch):
    # The same synchronous servers: `--strategy ps-sharded --servers 4` after `--strategy ps-sync`
    # resumes (docs/ps.md); it started afresh in a directory of its own.
    monkeypatch.chdir(tmp_path)
    dirs = {train.TrainConfig(model="mlp", strategy=s, servers=k).checkpoint_dir
            for s, k in (("ps-sync", 0), ("ps-sync", 4), ("ps-sharded", 0), ("ps-sharded", 4))}
    assert dirs == {"runs/mlp-ps-sync"}
    assert train.TrainConfig(model="mlp", strategy="ps-async").checkpoint_dir == "runs/mlp-ps-async"
    (tmp_path / "runs" / "mlp-ps-sharded").mkdir(parents=True)  # made by a version that kept them apart
    assert train.TrainConfig(model="mlp", strategy="ps-sharded").checkpoint_dir == "runs/mlp-ps-sharded"
    (tmp_path / "runs" / "mlp-ps-sync").mkdir()
    assert train.TrainConfig(model="mlp", strategy="ps-sharded").checkpoint_dir == "runs/mlp-ps-sync"


# --- Ctrl-C: what the parent says, and a save it does not cut short --------------------------------

def test_ctrl_c_while_a_command_loads_torch_is_130_without_a_traceback(monkeypatch, capsys):
    # A worker interrupted while it imported train.py (torch: a second or so) printed a 50-line
    # KeyboardInterrupt traceback above the parent's one line.
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["train", "--worker", "{}"]) == 130
    assert cli.main(["simulate"]) == 130
    assert capsys.readouterr() == ("", "")


def interrupted_line(directory: Path, *flags: str, step: str = "") -> str:
    """The parent's line for a run of ``train_argv(directory, *flags)`` stopped by Ctrl-C at ``step``."""
    parser = argparse.ArgumentParser()
    train.configure(parser)
    args = parser.parse_args(train_argv(directory, *flags)[1:])
    cfg = train.TrainConfig(**{k: getattr(args, k) for k in train.TrainConfig.__dataclass_fields__})
    marker = directory / "interrupt.step"
    if step:
        marker.write_text(step)
    return train._interrupted(cfg, signal.SIGINT, marker)


def test_an_interrupted_parameter_server_run_names_the_step_its_servers_resume_at(tmp_path):
    # The servers save before rank 0's own file: stopped between the two, the run resumes at the
    # servers' step (the line said the workers' older one).
    save_run(tmp_path, steps=(24,), strategy="ps-sync")
    checkpoint.save(tmp_path / "servers" / "server-0", 24, {"version": 24})
    checkpoint.save(tmp_path / "servers" / "server-0", 25, {"version": 25})
    line = interrupted_line(tmp_path, "--strategy", "ps-sync", step="25")
    assert line == "interrupted at step 25; run the same command again to resume from step 25 (the last checkpoint)"


def test_an_interrupted_run_without_checkpoints_of_its_own_names_the_older_ones_it_resumes(tmp_path):
    # --checkpoint-every 0 in a directory of older checkpoints: the same command resumes them (the
    # line said it starts again from step 0).
    save_run(tmp_path, steps=(2, 4))
    assert interrupted_line(tmp_path, "--checkpoint-every", "0") == (
        "interrupted; run the same command again to resume from step 4 (the last checkpoint)")
    assert interrupted_line(tmp_path / "empty", "--checkpoint-every", "0") == (
        "interrupted; checkpoints were off (--checkpoint-every 0): the same command starts again from step 0")
    # With --no-resume too it trained from step 0 and saved nothing: the line named the older run's
    # step 4, as if this run had got there and went on from it without --no-resume.
    assert interrupted_line(tmp_path, "--checkpoint-every", "0", "--no-resume", step="7") == (
        "interrupted at step 7; checkpoints were off (--checkpoint-every 0): the same command starts again from "
        "step 0")


def test_ctrl_c_that_ends_the_servers_during_their_save_still_leaves_rank_0s_file_of_the_step(tmp_path):
    # torchrun passes Ctrl-C on to every rank at once: servers that ended with it during the save
    # failed rank 0's call (PeerLost) after saving the step, and rank 0's own file of it was not
    # written, so the run resumed there with its random state and buffers afresh.
    from ringtrain.errors import PeerLost

    calls = []

    def servers_save():
        calls.append(1)
        if len(calls) == 2:  # (the first save went through)
            os.kill(os.getpid(), signal.SIGINT)
            raise PeerLost("parameter server 0 closed the connection (the server died or was stopped)")

    class Loader:
        def next_batch(self):
            return torch.zeros(2, 3), torch.zeros(2)

    cfg = train.TrainConfig(model="mlp", strategy="ps-sync", steps=10, checkpoint_every=2, progress=False,
                            checkpoint_dir=str(tmp_path / "run"))
    with pytest.raises(train._Interrupted) as info:
        with train._Checkpoints(cfg, 0, lambda step: {"step": step}, before_save=servers_save) as ckpt:
            train._loop(cfg, 0, 1, 0, Loader(), lambda x, y: torch.tensor(1.0), ckpt.save, "test")
    assert info.value.step == 4
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path / "run")] == [2, 4]
    assert checkpoint.load(tmp_path / "run" / checkpoint.checkpoint_name(4)).payload == {"step": 4}

    def lost():
        raise PeerLost("lost")

    # Servers that resumed a save hold one: the same from their first save in this run, the error raised.
    cfg.checkpoint_dir = str(tmp_path / "resumed")
    with pytest.raises(PeerLost):
        with train._Checkpoints(cfg, 0, lambda step: {"step": step}, before_save=lost, servers_saved=True) as ckpt:
            ckpt.save(6, False)
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path / "resumed")] == [6]
    # Before the servers' first save, rank 0 writes nothing: the next run would refuse its file alone.
    cfg.checkpoint_dir = str(tmp_path / "fresh")
    with pytest.raises(PeerLost):
        with train._Checkpoints(cfg, 0, lambda step: {"step": step}, before_save=lost) as ckpt:
            ckpt.save(2, False)
    assert checkpoint.list_checkpoints(tmp_path / "fresh") == []


def test_ctrl_c_during_a_save_lets_it_finish_then_stops_the_run(tmp_path):
    # torch.save turned the KeyboardInterrupt into a RuntimeError of its own: a traceback, the
    # checkpoint lost and no step for the parent's line.
    saved = []

    def save(step, last):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the checkpoint is being written
        saved.append(step)

    class Loader:
        def next_batch(self):
            return torch.zeros(2, 3), torch.zeros(2)

    cfg = train.TrainConfig(model="mlp", steps=10, checkpoint_every=2, progress=False, checkpoint_dir=str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(train._Interrupted) as info:
        train._loop(cfg, 0, 1, 0, Loader(), lambda x, y: torch.tensor(1.0), save, "test")
    assert saved == [2] and info.value.step == 2
    assert signal.getsignal(signal.SIGINT) is before


def test_the_launcher_puts_back_the_signal_handlers_torchrun_leaves(monkeypatch, capsys):
    # A second Ctrl-C after the ranks had stopped raised torchrun's SignalException: a traceback.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException

    from ringtrain.launch import run_torchrun

    def agent(argv):
        def raise_it(signum, frame):
            raise SignalException(f"got signal {signum}", sigval=signal.Signals(signum))

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, raise_it)
        raise SignalException("got signal 2", sigval=signal.SIGINT)

    seen = []
    monkeypatch.setattr(torchrun, "main", agent)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = run_torchrun([], "ringtrain train", interrupted=lambda sig: seen.append(signal.getsignal(signal.SIGINT)) or "x")
    assert rc == 130 and capsys.readouterr().err.strip() == "ringtrain train: x"
    assert seen == [signal.SIG_IGN]  # the line is written with a further Ctrl-C held off
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a 64 KiB tmpfs (root only): too small for one checkpoint."""
    where = tmp_path / "full"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_full_checkpoint_disk_is_one_line_naming_it(tmp_path, full_disk):
    proc = run_cli(["train", "--workers", "2", "--steps", "3", "--checkpoint-every", "2", "--no-progress",
                    "--checkpoint-dir", str(full_disk)], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(f"ringtrain train: rank 0 (worker) failed (exit code 1): CheckpointWriteError: could not "
                            f"write the checkpoint {full_disk}/ckpt-000000002.pt: No space left on device"), proc.stderr
    assert not [p for p in full_disk.iterdir()], "a temporary file was left"


def test_the_help_lists_the_choices_and_a_single_ring_option_reads_right(tmp_path, launches, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = "".join(capsys.readouterr().out.split())  # (argparse wraps lines, also at hyphens)
    for line in ("One of: charlm, charlm-lstm, charlm-transformer, mlp, resnet.",
                 "One of: optimal, mgwfbp, wfbp, fixed, single.", "Show a progress bar on rank 0. (default True)"):
        assert "".join(line.split()) in text, line
    message = refusal(["train", "--strategy", "ps-sync", "--algorithm", "ring", "--checkpoint-dir", str(tmp_path)],
                      launches, capsys)
    assert message.endswith("--algorithm is for the ring's allreduce only; --strategy ps-sync sends gradients to "
                            "parameter servers and would ignore it"), message
    message = refusal(["train", "--schedule", "wfbp", "--bucket-cap-mb", "0.001", "--checkpoint-dir", str(tmp_path)],
                      launches, capsys)  # (was run without a word: wfbp sends each gradient alone)
    assert message.endswith("--bucket-cap-mb sets the bucket (or push) size of --schedule fixed, and --schedule wfbp "
                            "would ignore it: give --schedule fixed, or leave --bucket-cap-mb out"), message
    for argv, said in ((["--strategy", "ps-async", "--compression", "fp16"], "--compression is for the ring's "
                        "allreduce only"), (["--compression", "int8"], "--compression must be one of none, fp16, bf16, "
                                            "powersgd, got 'int8'")):
        message = refusal(["train", *argv, "--checkpoint-dir", str(tmp_path)], launches, capsys)
        assert said in message, message


def test_compression_reaches_the_workers(tmp_path, launches, capsys):
    from ringtrain.ddp.options import COMPRESSIONS
    from ringtrain.train import COMPRESSION

    cli.main(["train", "--compression", "bf16", "--checkpoint-dir", str(tmp_path)])
    assert launched_config(launches)["compression"] == "bf16"
    assert COMPRESSION == ("none", *COMPRESSIONS, "powersgd")  # (the command line's list, kept without importing torch)


# --- --join-timeout: from the command line to the calls where the ranks meet ------------------------

def launched_config(launches) -> dict:
    """The TrainConfig, as JSON, that the one recorded launch gives its workers (``--worker JSON``)."""
    (argv,) = launches
    return json.loads(argv[argv.index("--worker") + 1])


@pytest.fixture
def in_a_worker(monkeypatch):
    """The worker's process-wide settings left alone (this is the test process)."""
    from ringtrain import lifecycle

    monkeypatch.setattr(lifecycle, "die_with_parent", lambda: True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with torch.random.fork_rng():  # (the worker seeds torch)
        yield


def test_a_parameter_server_worker_whose_peer_never_puts_its_corpus_is_a_timeout_naming_join_timeout():
    # The workers compare their text through the job's store: a worker that had not come within
    # --join-timeout was torch's "DistStoreError: wait timeout after 10ms, keys: /ringtrain/corpus/0".
    from datetime import timedelta

    import torch.distributed as dist
    from ringtrain import data, models
    from ringtrain.errors import CommTimeout

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.05))
    spec = models.spec("charlm")
    text = data.dataset(spec.dataset, seed=0, **spec.batch_kwargs)
    with pytest.raises(CommTimeout, match=r"^worker 1: not every one of the 2 workers put its text corpus in the job's "
                                          r"store within 0.05 s \(join_timeout\)"):
        train._same_corpus_on_every_worker(store, 1, 2, text, 0.05)
    store.set("ringtrain/corpus/0", store.get("ringtrain/corpus/1"))  # (worker 0 came: the same text)
    train._same_corpus_on_every_worker(store, 1, 2, text, 0.05)


@pytest.mark.parametrize("join", [None, 7.5])
def test_join_timeout_reaches_ringtrain_init(tmp_path, launches, in_a_worker, monkeypatch, join):
    # Before: no --join-timeout; init always got the default, max(--timeout, 60).
    import ringtrain

    flags = () if join is None else ("--join-timeout", str(join))
    assert cli.main(train_argv(tmp_path, "--timeout", "5", *flags)) == 0
    config = launched_config(launches)
    assert (config["timeout"], config["join_timeout"]) == (5.0, join)
    seen = {}

    def init(**kw):
        seen.update(kw)
        raise ps_harness.Met

    monkeypatch.setattr(ringtrain, "init", init)
    with pytest.raises(ps_harness.Met):
        train._run_worker(json.dumps(config), False)
    assert seen == {"transport": "auto", "timeout": 5.0, "join_timeout": join}


@pytest.mark.parametrize("join", [None, 7.5])
def test_join_timeout_reaches_the_parameter_servers_and_their_workers(tmp_path, launches, in_a_worker, monkeypatch,
                                                                      join):
    # Before: the servers and workers were given --timeout only, and the store was waited on for
    # max(--timeout, 60) whatever the command line said.
    from ringtrain import data, ps, rendezvous

    flags = () if join is None else ("--join-timeout", str(join))
    assert cli.main(train_argv(tmp_path, "--strategy", "ps-sync", "--model", "mlp", "--timeout", "5", *flags,
                               "--schedule", "fixed", "--bucket-cap-mb", "5")) == 0
    config = json.dumps(launched_config(launches))
    calls = ps_harness.stub_meeting(monkeypatch, ps)
    monkeypatch.setattr(rendezvous, "job_info", lambda: argparse.Namespace(rank=0, world_size=2))
    monkeypatch.setattr(rendezvous, "job_store", lambda info, timeout: calls.setdefault("store", timeout))
    monkeypatch.setattr(data, "check_same_corpus_in_store", lambda *args: None)
    monkeypatch.setattr(train, "_one_worker_rate", lambda *args: 1.0)  # (seconds of training steps)
    monkeypatch.setattr(ps, "is_server_rank", lambda servers: True)
    assert train._run_worker(config, False) == 0
    monkeypatch.setattr(ps, "is_server_rank", lambda servers: False)
    with pytest.raises(ps_harness.Met):
        train._run_worker(config, False)
    assert (calls["server"]["timeout"], calls["server"]["join_timeout"]) == (5.0, join)
    assert (calls["worker"]["timeout"], calls["worker"]["join_timeout"]) == (5.0, join)
    assert calls["store"] == (60.0 if join is None else join)  # (unset: --timeout, but at least 60)
    # (and the push size of schedule "fixed", which was refused as the ring's alone)
    assert (calls["worker"]["schedule"], calls["worker"]["bucket_cap_mb"]) == ("fixed", 5.0)
