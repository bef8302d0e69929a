"""Resuming parameter servers on another number of servers (or another partition size): the
servers' saved shards are cut anew (``ps.shard_resume``, *repartition*) and training goes on
bitwise as the uninterrupted run, SGD with momentum and Adam, over two workers; what is still
refused (a missing shard file, named; another model, optimizer or number of workers; an
asynchronous job's checkpoint; shards that cannot be cut anew exactly).

Servers run in threads of this process (ps_harness), workers in threads too (on_threads).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from ringtrain import checkpoint
from ringtrain.errors import MismatchError
from ringtrain.ps import ParameterServerTraining
from ringtrain.transport.local import on_threads
import ps_harness

pytestmark = pytest.mark.timeout(60)
SECRET = b"reshard-secret"
W = 2
ELEMENTS = 4 / (1 << 20)  # partition_mb of one-element partitions: a layout unlike any other K's
FOUR = 16 / (1 << 20)  # four-element partitions: every tensor but the last cut in pieces
SETTINGS = {"sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
            "adam": dict(optimizer="adam", lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def batch(w: int, step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + w))


def run(root, servers: int, steps: int, save_after: tuple[int, ...] = (), resume: bool = False,
        optimizer: str = "sgd", partition_mb: float = FOUR, workers: int = W, strategy: str = "sync",
        make=model) -> list:
    """A job of ``servers`` servers and ``workers`` workers (threads) from the workers' step to
    ``steps``; worker 0 saves after the steps listed. Each worker's (first step, parameters)."""
    started = [ps_harness.start_server(SECRET, index=k, servers=servers, workers=workers, strategy=strategy,
                                       checkpoint_dir=str(root), resume=resume) for k in range(servers)]
    endpoints = [s.endpoint for s, _, _ in started]
    models = [make() for _ in range(workers)]  # (here: torch's global generator is no thread's own)

    def worker(w: int):
        with ParameterServerTraining(models[w], servers=endpoints, worker=w, workers=workers, secret=SECRET,
                                     strategy=strategy, timeout=10.0, partition_mb=partition_mb,
                                     **SETTINGS[optimizer]) as pst:
            first = pst.step_count
            for s in range(first, steps):
                (pst(batch(w, s)) - 1).pow(2).mean().backward()
                pst.step()
                if w == 0 and s + 1 in save_after:
                    pst.save_checkpoint()
            pst.wait()
            return first, [p.detach().clone() for p in pst.module.parameters()]

    results = on_threads(workers, worker, timeout=40)
    for _, thread, _ in started:
        thread.join(10)
        assert not thread.is_alive(), "a server did not finish"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def assert_same(got: list, want: list) -> None:
    for w, ((_, a), (_, b)) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"worker {w}, parameter #{i}: {(x - y).abs().max().item()} off"


def shard(root, k: int, step: int):
    return root / f"server-{k}" / checkpoint.checkpoint_name(step)


# --- resumed on another number of servers: bitwise the uninterrupted run --------------------------

@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("before, after, partitions", [(1, 2, FOUR), (2, 1, FOUR), (2, 3, FOUR), (1, 3, ELEMENTS),
                                                       (3, 2, ELEMENTS)],
                         ids=["1to2", "2to1", "2to3", "1to3-one-element", "3to2-one-element"])
def test_resumed_on_another_number_of_servers_equals_the_run_uninterrupted(tmp_path, optimizer, before, after,
                                                                            partitions):
    want = run(tmp_path / "whole", before, 6, optimizer=optimizer, partition_mb=partitions)
    run(tmp_path / "cut", before, 3, save_after=(3,), optimizer=optimizer, partition_mb=partitions)
    got = run(tmp_path / "cut", after, 6, resume=True, optimizer=optimizer, partition_mb=partitions)
    assert [first for first, _ in got] == [3] * W
    assert_same(got, want)


def test_resumed_with_another_partition_size_equals_the_run_uninterrupted(tmp_path):
    want = run(tmp_path / "whole", 2, 6, optimizer="adam")
    run(tmp_path / "cut", 2, 3, save_after=(3,), optimizer="adam", partition_mb=FOUR)
    got = run(tmp_path / "cut", 2, 6, resume=True, optimizer="adam", partition_mb=ELEMENTS)
    assert [first for first, _ in got] == [3] * W
    assert_same(got, want)


def test_a_chain_of_resumes_on_1_2_1_3_servers_in_one_directory_equals_the_run_uninterrupted(tmp_path):
    """Each job saves into the folders of its own servers: after 2 -> 1, server-1 keeps the 2-server
    job's files, older than server-0's newest; the 3-server job takes server-0's step 6 (made by
    one server) and not the newest step every folder holds (step 4)."""
    want = run(tmp_path / "whole", 1, 8)
    root = tmp_path / "cut"
    run(root, 1, 2, save_after=(2,))
    run(root, 2, 4, save_after=(4,), resume=True)
    run(root, 1, 6, save_after=(6,), resume=True)
    assert [s for s, _ in checkpoint.list_checkpoints(root / "server-1")] == [4]
    got = run(root, 3, 8, resume=True)
    assert [first for first, _ in got] == [6] * W
    assert_same(got, want)


def test_a_save_cut_short_resumes_at_the_step_before_on_another_number_of_servers(tmp_path):
    want = run(tmp_path / "whole", 2, 6)
    root = tmp_path / "cut"
    run(root, 2, 4, save_after=(2, 4))
    shard(root, 1, 4).unlink()  # server 1's save of step 4 was cut short
    got = run(root, 3, 6, resume=True)
    assert [first for first, _ in got] == [2] * W
    assert_same(got, want)


def test_a_job_stopped_before_a_new_servers_first_save_resumes_the_save_before(tmp_path):
    """1 -> 2 servers, stopped once server 0 had saved step 4 and server 1 nothing: server 1 made
    its folder at start, so its missing file is a save cut short (the step before, cut anew), not
    a folder on another machine's disk (which would refuse the run)."""
    want = run(tmp_path / "whole", 1, 6)
    root = tmp_path / "cut"
    run(root, 1, 2, save_after=(2,))
    run(root, 2, 3, resume=True)  # no save: server 1 had its folder all the same
    assert (root / "server-1").is_dir() and not checkpoint.list_checkpoints(root / "server-1")
    run(root, 2, 4, save_after=(4,), resume=True)
    shard(root, 1, 4).unlink()  # (the stop: server 0's file of step 4 written, server 1's not)
    got = run(root, 2, 6, resume=True)
    assert [first for first, _ in got] == [2] * W
    assert_same(got, want)


# --- refused (one worker: with two, the one whose HELLO comes second may hear PeerLost instead) -------

@pytest.mark.parametrize("after", [1, 2])
def test_a_missing_shard_file_is_refused_naming_it(tmp_path, after):
    """Server 1's folder is gone: 2 -> 1 needs its file to cut the shards anew; 2 -> 2, server 1
    needs its own (it started afresh and the workers met servers at different steps)."""
    run(tmp_path, 2, 2, save_after=(2,), workers=1)
    shutil.rmtree(tmp_path / "server-1")
    with pytest.raises(MismatchError, match=f"{shard(tmp_path, 1, 2)} is missing"):
        run(tmp_path, after, 4, resume=True, workers=1)


def test_another_model_is_refused_naming_the_parameter(tmp_path):
    run(tmp_path, 1, 1, save_after=(1,), workers=1)

    def wider() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))

    with pytest.raises(MismatchError, match=r"is of another model: its parameter #0 has 24 elements, this job's 20"):
        run(tmp_path, 2, 2, resume=True, make=wider, workers=1)


def test_a_model_of_the_same_sizes_and_other_shapes_is_refused(tmp_path):
    def tall() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 4, bias=False))

    def wide() -> nn.Module:  # (the same sizes, 24 and 24: only the shapes tell them apart)
        return nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh(), nn.Linear(4, 6, bias=False))

    run(tmp_path, 1, 1, save_after=(1,), make=tall, workers=1)
    with pytest.raises(MismatchError, match=r"its parameter #0 has shape \(6, 4\), this job's \(4, 6\)"):
        run(tmp_path, 2, 1, resume=True, make=wide, workers=1)


def test_another_optimizer_or_number_of_workers_is_refused_on_another_number_of_servers(tmp_path):
    run(tmp_path / "one", 1, 1, save_after=(1,), workers=1)
    with pytest.raises(MismatchError, match="made with optimizer 'sgd', this job's optimizer is 'adam'"):
        run(tmp_path / "one", 2, 2, resume=True, optimizer="adam", workers=1)
    run(tmp_path / "two", 1, 1, save_after=(1,), workers=2)
    with pytest.raises(MismatchError, match="made with 2 workers, this job has 1"):
        run(tmp_path / "two", 2, 2, resume=True, workers=1)


def test_an_asynchronous_jobs_checkpoint_is_refused_on_another_number_of_servers(tmp_path):
    run(tmp_path, 2, 1, save_after=(1,), strategy="async", workers=1)
    with pytest.raises(MismatchError, match=r"made by 2 servers, this job has 1: an asynchronous job's checkpoint "
                                            r"resumes on as many servers as made it .* resume with 2 servers"):
        run(tmp_path, 1, 2, resume=True, strategy="async", workers=1)


def test_shards_whose_adam_steps_differ_are_refused_as_not_exact(tmp_path):
    """Forged: server 1's partitions one Adam step ahead of server 0's (the files are whole, and
    agree on the version)."""
    run(tmp_path, 2, 2, save_after=(2,), optimizer="adam", partition_mb=ELEMENTS, workers=1)
    payload = checkpoint.load(shard(tmp_path, 1, 2)).payload
    payload["optimizer_state"]["partitions"]["step"] += 1
    checkpoint.save(tmp_path / "server-1", 2, payload)
    # (four-element partitions, each of elements from both servers' one-element ones)
    with pytest.raises(MismatchError, match="cannot be cut anew exactly: its partitions of parameter #0 hold "
                                            "different 'step' "):
        run(tmp_path, 1, 3, resume=True, optimizer="adam", partition_mb=FOUR, workers=1)
