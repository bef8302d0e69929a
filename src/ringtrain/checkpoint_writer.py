"""Checkpoints written on a background thread while training goes on.

Why: with data parallelism rank 0 saves and the other ranks go on to the next step's
allreduce, where they wait for rank 0. A save in the training loop (:func:`checkpoint.save`)
holds rank 0 for the whole write, so on a slow disk (NFS, a big model) a write longer than the
communicator's ``timeout`` fails every other rank with CommTimeout naming rank 0. A barrier
with a longer deadline around the save would need a deadline that covers an unknown write
time and would still stall every rank for it; instead, :meth:`CheckpointWriter.save` copies
the payload's tensors at the step (a memory copy, milliseconds) and writes that copy on a
thread, so the ranks never wait for the disk.

What it keeps of :func:`checkpoint.save`: the same file, written atomically (temporary file,
fsync, rename, fsync of the directory) and ``keep`` pruned after it, so a process killed
mid-write leaves the checkpoints before it whole and a resume starts from the newest of them.
The state saved is the state at the call, whatever the optimizer does to the parameters next.

Its rules:

- at most one write in flight: ``save`` first waits for the write before it, so a disk slower
  than the checkpoints come holds the training loop there rather than piling copies up in
  memory (on several ranks the others then wait for it: the timeout must cover the part of a
  write that outlasts the steps between two saves). ``save(..., wait=False)`` queues the copy
  behind the write in flight instead (two copies at most: it waits for any write queued
  before): for the last save of a run, whose caller waits with :meth:`close` once the ranks'
  last communication is done;
- an error of a write (a full disk: :class:`checkpoint.CheckpointWriteError`) is raised by the
  next ``save`` (which then writes nothing) or by :meth:`wait` / :meth:`close`, never lost;
- :meth:`close` (and leaving a ``with`` block) waits for the write in flight, so the last
  checkpoint is whole before the program ends; leaving on an exception waits too, and logs a
  write error rather than hiding the exception with it.

Cost: one more copy of the payload's tensors (model and optimizer state) in memory while a
write is in flight.

    writer = checkpoint.CheckpointWriter("runs/ddp", keep=3)
    ...
    if comm.rank == 0:
        writer.save(step + 1, checkpoint.training_state(step + 1, net, opt, loader))
    ...
    writer.close()  # after the last collective: the other ranks need not wait for the disk
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def snapshot(payload: Any) -> Any:
    """A copy of ``payload`` that shares no tensor memory with it: every tensor cloned (bitwise
    equal, same dtype, shape and strides), dicts, lists and tuples rebuilt, plain values as they
    are. Raises the TypeError :func:`checkpoint.digest` would for any other type, at once rather
    than on the writer's thread."""
    if isinstance(payload, torch.Tensor):
        return payload.detach().clone()
    if isinstance(payload, dict):
        return {key: snapshot(value) for key, value in payload.items()}
    if isinstance(payload, list):
        return [snapshot(value) for value in payload]
    if isinstance(payload, tuple):
        return tuple(snapshot(value) for value in payload)
    if payload is None or isinstance(payload, (bool, int, float, str)):
        return payload
    raise TypeError(f"checkpoint payloads may hold tensors, dicts, lists, tuples, int, float, bool, str and None; "
                    f"got {type(payload).__name__}")


class CheckpointWriter:
    """Writes :func:`checkpoint.save` checkpoints of ``directory`` on a background thread (see the
    module's docstring). ``keep`` and ``warn_later`` are :func:`checkpoint.save`'s."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3, *, warn_later: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self.warn_later = warn_later
        self.last_path: Path | None = None
        """The file of the last write that finished."""
        self._writes: list[tuple[int, threading.Thread]] = []  # (step, thread), oldest first: 2 at most
        self._error: BaseException | None = None

    @property
    def writing(self) -> list[int]:
        """The steps whose writes are in flight or queued, oldest first ([]: none)."""
        return [step for step, thread in self._writes if thread.is_alive()]

    def save(self, step: int, payload: dict[str, Any], *, wait: bool = True, copied: bool = False) -> None:
        """Copy ``payload`` now and write it as the checkpoint of ``step`` on a thread of its own.
        Waits for the write before it first (``wait=False``: queues behind it) and raises the
        error of an earlier write (this one is then not written). ``copied``: the payload's
        tensors are already copies the caller gives away (a parameter server's shard, copied
        under its lock): written as they are, not copied a second time."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(payload, dict):
            raise ValueError(f"payload must be a dict, got {type(payload).__name__}")
        self._join(keep=0 if wait else 1)
        self._raise_error()
        if self.warn_later:  # here, so that the warning names the caller's line, not the writer's
            from . import checkpoint

            later = {s for s, _ in checkpoint.list_checkpoints(self.directory) if s > step}
            later.update(s for s in self.writing if s > step)
            checkpoint.warn_of_later_steps(self.directory, step, sorted(later), stacklevel=2)
        copy = payload if copied else snapshot(payload)
        before = self._writes[-1][1] if self._writes else None
        # Not a daemon: an interpreter that exits normally waits for the file to be whole.
        thread = threading.Thread(target=self._write, args=(step, copy, before), name=f"checkpoint-writer-{step}")
        self._writes.append((step, thread))
        thread.start()

    def _write(self, step: int, payload: dict[str, Any], before: threading.Thread | None) -> None:
        from . import checkpoint

        if before is not None:
            before.join()  # one write at a time, in the order of the steps
        if self._error is not None:
            return  # (the error before is raised; this checkpoint is not written: a later one would be)
        try:
            self.last_path = checkpoint.save(self.directory, step, payload, self.keep, warn_later=False)
        except BaseException as exc:  # (raised on the caller's thread by the next save or wait)
            self._error = exc

    def _join(self, keep: int) -> None:
        """Wait until at most ``keep`` writes are in flight or queued."""
        while len(self._writes) > keep:
            self._writes[0][1].join()
            self._writes.pop(0)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self, *, at_most: int = 0) -> Path | None:
        """Wait until no write is in flight (``at_most=1``: none queued behind the one in flight);
        raise the error of a write that failed (once). Returns the file of the last write that
        finished."""
        self._join(keep=at_most)
        self._raise_error()
        return self.last_path

    def close(self) -> Path | None:
        """:meth:`wait`: the last checkpoint is whole (or its error raised) when this returns."""
        return self.wait()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
            return
        try:  # leaving on an exception: the write in flight ends whole; its error must not hide this one
            self.wait()
        except Exception as error:
            log.error("the checkpoint write in flight failed too: %s", error)
