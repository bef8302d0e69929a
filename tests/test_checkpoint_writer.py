"""checkpoint.CheckpointWriter: checkpoints written on a thread while training goes on.

The copy is the state at the call (the next optimizer step does not reach into it), one write at
a time in the order of the steps, every error raised on the caller's thread (never lost), and a
process killed during a background write resumes from the checkpoint before it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ringtrain import checkpoint
from ringtrain.checkpoint import CheckpointWriteError

pytestmark = pytest.mark.timeout(30)


class Disk:
    """checkpoint.atomic_save held at a gate: a write starts, then waits until ``open()`` (a slow disk)."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.entered = threading.Event()  # (set by the first write to start: wait for it, never sleep)
        self.started: list[int] = []
        self.fail: set[int] = set()
        real = checkpoint.atomic_save

        def held(obj, path):
            step = obj["step"]
            self.started.append(step)
            self.entered.set()
            assert self.gate.wait(10), "the test never opened the gate"
            if step in self.fail:
                raise CheckpointWriteError(28, "No space left on device", str(path))
            return real(obj, path)

        monkeypatch.setattr(checkpoint, "atomic_save", held)

    def open(self) -> None:
        self.gate.set()


def steps_in(directory) -> list[int]:
    return [step for step, _ in checkpoint.list_checkpoints(directory)]


def test_a_payload_given_as_copied_is_written_as_it_is_and_any_other_is_copied(tmp_path, monkeypatch):
    """``copied=True`` (a parameter server's shard, cloned under its lock): the write gets the
    caller's tensors themselves, not a second copy; without it, tensors of their own."""
    written = []
    monkeypatch.setattr(checkpoint, "atomic_save", lambda obj, path: written.append(obj["payload"]["params"]))
    given = torch.arange(6.0)
    with checkpoint.CheckpointWriter(tmp_path) as writer:
        writer.save(1, {"params": given}, copied=True)
        writer.save(2, {"params": given})
    assert written[0] is given
    assert written[1] is not given and written[1].data_ptr() != given.data_ptr() and torch.equal(written[1], given)


def test_the_checkpoint_is_the_state_at_the_call_not_after_the_next_step(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    writer = checkpoint.CheckpointWriter(tmp_path)
    t0 = time.perf_counter()
    writer.save(1, checkpoint.training_state(1, model, opt))
    assert time.perf_counter() - t0 < 1.0 and writer.writing == [1]  # returned while the disk holds the write
    for _ in range(3):  # the next steps change parameters and momentum in place
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    disk.open()
    writer.close()
    saved = checkpoint.latest(tmp_path).payload
    for name, tensor in at_save.items():
        assert torch.equal(saved["model"][name], tensor), name
    for i, m in enumerate(momentum):
        assert torch.equal(saved["optimizer"]["state"][i]["momentum_buffer"], m)


def test_one_write_at_a_time_a_save_waits_for_the_one_before(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    writer = checkpoint.CheckpointWriter(tmp_path, keep=5)
    writer.save(1, {"x": torch.ones(3)})
    second = threading.Thread(target=writer.save, args=(2, {"x": torch.zeros(3)}))
    second.start()
    assert disk.entered.wait(5)
    second.join(0.5)
    assert second.is_alive() and disk.started == [1], "the second save did not wait for the first write"
    disk.open()
    second.join(5)
    assert writer.close() == tmp_path / checkpoint.checkpoint_name(2)
    assert steps_in(tmp_path) == [1, 2]


def test_a_queued_save_returns_at_once_and_is_written_after_the_one_in_flight(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    writer = checkpoint.CheckpointWriter(tmp_path, keep=5)
    writer.save(1, {"x": torch.ones(3)})
    t0 = time.perf_counter()
    writer.save(2, {"x": torch.zeros(3)}, wait=False)
    assert time.perf_counter() - t0 < 1.0 and writer.writing == [1, 2]
    assert disk.entered.wait(5)
    time.sleep(0.2)
    assert disk.started == [1]  # the queued one waits for the write in flight
    disk.open()
    writer.close()
    assert disk.started == [1, 2] and steps_in(tmp_path) == [1, 2] and writer.writing == []


def test_a_failed_write_is_raised_by_the_next_save_which_writes_nothing(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    disk.fail = {1}
    writer = checkpoint.CheckpointWriter(tmp_path)
    writer.save(1, {"x": torch.ones(3)})
    disk.open()
    with pytest.raises(CheckpointWriteError, match="ckpt-000000001.pt: No space left on device"):
        writer.save(2, {"x": torch.ones(3)})
    assert writer.close() is None and steps_in(tmp_path) == []  # raised once; step 2 was not written
    writer.save(3, {"x": torch.ones(3)})  # the disk has room again
    writer.close()
    assert steps_in(tmp_path) == [3]


def test_the_error_of_the_last_write_is_raised_by_close_and_a_queued_one_is_not_written(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    disk.fail = {1}
    writer = checkpoint.CheckpointWriter(tmp_path)
    writer.save(1, {"x": torch.ones(3)})
    writer.save(2, {"x": torch.ones(3)}, wait=False)
    disk.open()
    with pytest.raises(CheckpointWriteError, match="ckpt-000000001.pt"):
        writer.close()
    assert steps_in(tmp_path) == []


def test_leaving_on_an_exception_waits_for_the_write_and_logs_its_error_instead_of_hiding_the_exception(
        tmp_path, monkeypatch, caplog):
    disk = Disk(monkeypatch)
    disk.fail = {2}
    with pytest.raises(ZeroDivisionError):
        with checkpoint.CheckpointWriter(tmp_path) as writer:
            writer.save(1, {"x": torch.ones(3)})
            writer.save(2, {"x": torch.ones(3)}, wait=False)
            threading.Timer(0.3, disk.open).start()
            1 / 0
    assert steps_in(tmp_path) == [1]  # waited for: whole
    assert "the checkpoint write in flight failed too" in caplog.text and "ckpt-000000002.pt" in caplog.text


def test_checkpoints_of_later_steps_are_warned_of_at_the_callers_line_not_the_writers(tmp_path):
    """A run resumed from step 5 (7 and 10 damaged): the warning points at the training script."""
    for step in (7, 10):
        checkpoint.save(tmp_path, step, {"x": torch.ones(1)})
    writer = checkpoint.CheckpointWriter(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"later steps \[7, 10\]") as caught:
        writer.save(6, {"x": torch.ones(1)})
    writer.close()
    assert [w.filename for w in caught] == [__file__]  # (was checkpoint_writer.py's thread)
    assert steps_in(tmp_path) == [6, 7, 10]
    quiet = checkpoint.CheckpointWriter(tmp_path, warn_later=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.save(8, {"x": torch.ones(1)})
        quiet.close()


def test_a_payload_of_another_type_is_refused_by_the_call_not_the_thread(tmp_path):
    writer = checkpoint.CheckpointWriter(tmp_path)
    with pytest.raises(TypeError, match="got object"):
        writer.save(1, {"x": object()})
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        writer.save(-1, {})
    with pytest.raises(ValueError, match="keep must be a positive integer"):
        checkpoint.CheckpointWriter(tmp_path, keep=0)
    assert writer.close() is None and steps_in(tmp_path) == []


def test_a_process_killed_during_a_background_write_resumes_from_the_checkpoint_before(tmp_path):
    """kill -9 while the thread writes step 2 (slow fsync), the main thread training on: step 1 is
    the newest valid checkpoint, and the next writer removes the dead one's temporary file."""
    script = textwrap.dedent(f"""
        import os, sys, time
        import torch
        from ringtrain import checkpoint
        fsync = os.fsync
        def slow(fd):
            if slow.on:
                print("writing", flush=True)
                time.sleep(60)
            fsync(fd)
        slow.on = False
        os.fsync = slow
        writer = checkpoint.CheckpointWriter({str(tmp_path)!r})
        writer.save(1, {{"x": torch.ones(1000)}})
        writer.wait()
        slow.on = True
        writer.save(2, {{"x": torch.zeros(1000)}})
        while True:
            time.sleep(0.01)  # training goes on
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "no temporary file of step 2"
    found = checkpoint.latest(tmp_path)
    assert found.step == 1 and torch.equal(found.payload["x"], torch.ones(1000))
    writer = checkpoint.CheckpointWriter(tmp_path)
    writer.save(3, {"x": torch.ones(1)})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt", "ckpt-000000003.pt"]


def test_snapshot_shares_no_memory_and_keeps_bits_dtypes_and_structure():
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # (not contiguous)
    payload = {"a": [x, (1, "s", None)], "b": {"c": torch.tensor([True, False])}}
    copy = checkpoint.snapshot(payload)
    assert checkpoint.digest(copy) == checkpoint.digest(payload)
    assert type(copy["a"][1]) is tuple and copy["a"][1] == (1, "s", None)
    x.add_(1)
    assert not torch.equal(copy["a"][0], x) and copy["a"][0].data_ptr() != x.data_ptr()

