"""Atomic, verifiable, exactly-resumable training checkpoints.

Words:

- *payload*: what the caller saves — nested dicts, lists and tuples of tensors, ints,
  floats, bools, strings and None (a model's and an optimizer's ``state_dict()``, a
  loader's ``state_dict()``, :func:`capture_rng`). Only those types, so loading runs
  ``torch.load(weights_only=True)``: a checkpoint file cannot execute code.
- *checkpoint file*: ``<directory>/ckpt-<step, 9 digits>.pt``, a plain ``torch.save`` of
  ``{"ringtrain_checkpoint": 1, "step": step, "digest": sha256, "payload": payload}``, so
  ``torch.load`` opens it without ringtrain. The *digest* is SHA-256 over the payload's
  structure and every tensor's bytes; torch's own format does not notice flipped bits in
  tensor data, the digest does.
- *atomic save*: the file is written under a temporary name in the same directory
  (``.ckpt-<step>.pt.<host>.<pid>.<random>.tmp``), flushed and fsynced, renamed over the
  final name with ``os.replace``, then the directory is fsynced. A reader sees the old
  set of checkpoints or the new one, never a partial file under a checkpoint name; a
  writer killed at any instant leaves at most a stale temporary file, which later saves
  on the same host remove once its writer is dead.
- *keep*: after saving step s, only the newest ``keep`` checkpoints with steps <= s remain.
  Checkpoints of later steps (a run resumed from an older checkpoint because the newer ones
  were damaged, or a fresh run in an old directory) are left alone, with a warning, so a
  save never deletes the file it just wrote.
- *superseded*: a run that starts afresh in a directory of checkpoints first moves them
  (:func:`supersede`) into ``<directory>/superseded-<UTC time>/``, so it neither overwrites
  them nor leaves later steps behind that a later resume would prefer to its own.
- *latest valid*: :func:`latest` tries checkpoints from the highest step down; a file that
  is truncated, corrupt, not a checkpoint, or holds another step than its name says (copied
  or renamed) is skipped with a warning, never raised, so a resume always starts from the
  newest checkpoint that is whole.

Who writes: with data parallelism every rank holds the same parameters and optimizer
state, so the caller usually saves on rank 0 only and every rank loads the same file.
The RNG state captured is the saving process's; it restores other ranks exactly only if
they drew the same random numbers (same seed, same calls) — ringtrain's reference models
and loaders draw none per rank. A job whose ranks draw different random numbers saves
one file per rank (one directory each). A loader's state is the same on every rank (the
position in the global batch sequence), so rank 0's file restores every rank's loader.

    payload = checkpoint.training_state(step, model, optimizer, loader)
    if rank == 0:
        checkpoint.save(run_dir, step, payload, keep=3)
    ...
    found = checkpoint.latest(run_dir, comm=comm) # None: start from scratch; the same step on every rank
    if found is not None:
        step = checkpoint.restore_training_state(found.payload, model, optimizer, loader)

``save`` holds rank 0 for the whole write while the other ranks wait for it in their next
collective: a write longer than the communicator's timeout fails them. :class:`CheckpointWriter`
(checkpoint_writer) copies the payload at the step and writes the same file on a thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import random
import re
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .collectives.ops import numpy_of
from .lifecycle import pid_alive
from .paths import user_path

log = logging.getLogger(__name__)

FORMAT_KEY = "ringtrain_checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
_TMP = re.compile(r"^\.ckpt-\d+\.pt\.(?P<host>[^.]+)\.(?P<pid>\d+)\..+\.tmp$")


class CheckpointError(RuntimeError):
    """A file is not a whole, valid ringtrain checkpoint."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only file system, a write error, a
    directory that is a file); the checkpoints saved before it are untouched. Its ``errno`` and
    ``strerror`` are the operating system's, ``filename`` the checkpoint's path."""

    def __str__(self) -> str:
        return (f"could not write the checkpoint {self.filename}: {self.strerror} (errno {self.errno}); "
                "the checkpoints saved before it are untouched")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One loaded checkpoint."""

    path: Path
    """The file it came from."""
    step: int
    """The training step recorded when it was saved."""
    payload: dict[str, Any]
    """What the caller saved."""


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step``."""
    return f"ckpt-{step:09d}.pt"


def digest(payload: Any) -> str:
    """SHA-256 over the structure of ``payload`` and the bytes of every tensor in it."""
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


def _feed(h: "hashlib._Hash", obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            # hashed in place, no copy; the storage left resizable (Tensor.numpy() marks it not)
            h.update(numpy_of(t.reshape(-1).view(torch.uint8)))
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)};".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)};".encode())
        for value in obj:
            _feed(h, value)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        h.update(f"S{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(
            f"checkpoint payloads may hold tensors, dicts, lists, tuples, int, float, bool, str "
            f"and None; got {type(obj).__name__}"
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = Path(user_path(path))
    directory = path.parent
    prefix = f".{path.name}.{_host()}.{os.getpid()}."
    tmp = None
    try:  # (making the temporary file fails too: a read-only file system, a directory gone)
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
        tmp = Path(tmp_name)
        os.fchmod(fd, 0o666 & ~_umask())  # (mkstemp makes it 0600: as open() would, with the umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):  # (on a file system gone read-only: a later save removes it)
                tmp.unlink(missing_ok=True)
        if _in_chain(exc, KeyboardInterrupt) is not None:  # (torch's writer turns Ctrl-C into its RuntimeError)
            raise KeyboardInterrupt from None
        cause = _os_error(exc)
        if cause is None:
            raise
        raise CheckpointWriteError(cause.errno, cause.strerror or str(cause), str(path)) from exc
    _fsync_dir(directory)
    return path


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (itself, or one in its chain): torch's writer reports a full disk
    as a RuntimeError about a position in its zip container, caused by the OSError that says it."""
    return _in_chain(exc, OSError)


def _in_chain(exc: BaseException | None, kind: type) -> BaseException | None:
    """``exc`` or the first exception of type ``kind`` in its chain of causes (None if there is none)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def save(directory: str | os.PathLike[str], step: int, payload: dict[str, Any], keep: int = 3, *,
         warn_later: bool = True) -> Path:
    """Write the checkpoint of ``step`` atomically, then keep only the newest ``keep``.
    ``warn_later=False``: no warning about checkpoints of later steps (a caller that resumed from
    the newest whole one, so those are damaged, and has named them already)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive integer, got {keep!r}")
    if not isinstance(payload, dict):
        raise ValueError(f"payload must be a dict, got {type(payload).__name__}")
    directory = Path(user_path(directory))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        path = str(directory / checkpoint_name(step))
        if directory.exists() and not directory.is_dir():  # (mkdir says "File exists")
            raise CheckpointWriteError(errno.ENOTDIR, f"{directory} is not a directory", path) from exc
        raise CheckpointWriteError(exc.errno, exc.strerror or str(exc), path) from exc
    record = {FORMAT_KEY: FORMAT_VERSION, "step": step, "digest": digest(payload), "payload": payload}
    path = atomic_save(record, directory / checkpoint_name(step))
    existing = list_checkpoints(directory)
    for _, old in [c for c in existing if c[0] <= step][:-keep]:
        old.unlink(missing_ok=True)
    if warn_later:
        warn_of_later_steps(directory, step, [s for s, _ in existing if s > step], stacklevel=2)
    _remove_stale_temporaries(directory)
    return path


def warn_of_later_steps(directory: str | os.PathLike[str], step: int, later: list[int], *,
                        stacklevel: int = 2) -> None:
    """The warning of :func:`save` when ``directory`` holds checkpoints of ``later`` steps than
    ``step`` (none if ``later`` is empty); ``stacklevel`` as :func:`warnings.warn`'s, counted from
    the caller of this function."""
    if later:
        warnings.warn(f"{directory} holds checkpoints of later steps {later} than this one ({step}); "
                      f"latest() prefers them while they are valid", RuntimeWarning, stacklevel=stacklevel + 1)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every file named like a checkpoint, lowest step first (not validated)."""
    directory = Path(user_path(directory))
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def load(path: str | os.PathLike[str]) -> Checkpoint:
    """Load and verify one checkpoint file; raise :class:`CheckpointError` if it is not whole."""
    path = Path(user_path(path))
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a truncated or foreign file
        # Its type only: torch's text (chained, for a debugger) is pages long and, for a file the
        # safe unpickler refuses, recommends weights_only=False, which would run code from the file.
        kind = type(exc).__name__
        kind = f"{type(exc).__module__}.{kind}" if kind == "error" else kind  # (struct.error, not "error")
        raise CheckpointError(f"{path}: not a readable checkpoint: truncated, or not written by ringtrain "
                              f"({kind})") from exc
    version = record.get(FORMAT_KEY) if isinstance(record, dict) else None
    if type(version) is not int or version != FORMAT_VERSION:  # (True and 1.0 equal 1 as well)
        raise CheckpointError(f"{path}: not a ringtrain checkpoint of format {FORMAT_VERSION}")
    payload = record.get("payload")
    try:
        actual = digest(payload)
    except TypeError as exc:
        raise CheckpointError(f"{path}: payload holds a type checkpoints do not ({exc})") from exc
    if actual != record.get("digest"):
        raise CheckpointError(f"{path}: contents do not match the recorded digest (corrupt file)")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: records no valid step ({step!r})")
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != step:  # (the digest covers the payload, not the step beside it)
        raise CheckpointError(f"{path}: holds step {step}, not the step {int(named.group(1))} its name says "
                              "(a file copied or renamed from another step)")
    return Checkpoint(path, step, payload)


def latest(directory: str | os.PathLike[str], *, warn: bool = True, comm: Any = None) -> Checkpoint | None:
    """The valid checkpoint with the highest step in ``directory``, or None if there is none.
    A damaged one is skipped with a warning (``warn=False``: quietly, for a caller that has named
    it already).

    ``comm``: a communicator every rank of which calls this at once; they compare the steps they
    found, and where those differ every rank raises :class:`ringtrain.MismatchError` naming who
    found which (only the step: a job whose ranks save a file each finds different contents).
    On several nodes each reads its own disk: a rank that found none, or an older one, would
    train on from another step with other optimizer state, and nothing would say so (its
    parameters drift from the others')."""
    directory = user_path(directory)
    found = None
    for step, path in reversed(list_checkpoints(directory)):
        try:
            found = load(path)
            break
        except CheckpointError as exc:
            if warn:
                warnings.warn(f"skipping checkpoint of step {step}: {exc}", RuntimeWarning, stacklevel=2)
                if log.hasHandlers():  # (unconfigured, logging's last resort printed the same line again)
                    log.warning("skipping checkpoint of step %d: %s", step, exc)
    if comm is not None and comm.world_size > 1:
        _same_on_every_rank(found, directory, comm)
    return found


def _same_on_every_rank(found: Checkpoint | None, directory: str | os.PathLike[str], comm: Any) -> None:
    """Raise MismatchError on every rank unless every rank of ``comm`` found the same checkpoint."""
    from .errors import MismatchError, ranks_by_value

    steps = np.full(comm.world_size, -1, np.int64)
    steps[comm.rank] = -1 if found is None else found.step
    comm.allgather(steps)
    if len(set(steps.tolist())) == 1:
        return
    what = ranks_by_value(steps.tolist(), lambda step: "none" if step < 0 else f"step {step}")
    raise MismatchError(f"the ranks found different checkpoints in {os.fspath(directory)}: {what}. Every rank "
                        "must see the same files: keep the directory on a file system every node shares, or copy "
                        "rank 0's checkpoints to every node")


def supersede(directory: str | os.PathLike[str], also: tuple[str, ...] = ()) -> tuple[Path, list[int]] | None:
    """Move every checkpoint file of ``directory`` (and the entries named in ``also``, such as a
    subdirectory of other checkpoints) into a new ``superseded-<UTC time>`` subdirectory, so that
    a fresh run there overwrites nothing and a later resume finds only its checkpoints.
    Returns that subdirectory and the steps moved, or None when there was nothing to move."""
    directory = Path(user_path(directory))
    moving = [path for _, path in list_checkpoints(directory)]
    moving += [directory / name for name in also if (directory / name).exists()]
    if not moving:
        return None
    target = _new_subdirectory(directory, "superseded-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    for path in moving:
        os.rename(path, target / path.name)  # same file system: atomic, nothing copied
    _fsync_dir(directory)
    return target, [step for step, _ in list_checkpoints(target)]


def _new_subdirectory(directory: Path, name: str) -> Path:
    """``directory/name``, or ``name-2``, ``name-3`` ... when taken; made empty."""
    for n in range(1, 1000):
        target = directory / (name if n == 1 else f"{name}-{n}")
        try:
            target.mkdir()
            return target
        except FileExistsError:
            continue
    raise FileExistsError(f"{directory}: too many {name}-* subdirectories")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files of dead writers on this host (a writer killed mid-save)."""
    host = _host()
    for entry in directory.iterdir():
        m = _TMP.match(entry.name)
        if m and m.group("host") == host and not pid_alive(int(m.group("pid"))):
            entry.unlink(missing_ok=True)


# --- random number generator state -------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """The state of torch's CPU generator, numpy's global generator and Python's ``random``,
    as tensors and plain values (loadable with ``weights_only=True``)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned: the next random numbers are the same."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["internal"].tolist()), p["gauss_next"]))


# --- the whole training state ------------------------------------------------------------

def training_state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   loader: Any = None, **extra: Any) -> dict[str, Any]:
    """A payload with everything an exact resume needs.

    ``model`` is the plain module (unwrap a DistributedDataParallel first); ``loader`` anything
    with ``state_dict()`` (a :class:`ringtrain.data.ShardedLoader`); ``extra`` more plain values.
    """
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "data": loader.state_dict() if loader is not None else None,
        "rng": capture_rng(),
        "extra": extra,
    }


def restore_training_state(payload: dict[str, Any], model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer | None = None, loader: Any = None) -> int:
    """Load what :func:`training_state` made into live objects; returns the step to continue after."""
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload.get("optimizer") is None:
            raise ValueError("the checkpoint holds no optimizer state, but an optimizer was given")
        optimizer.load_state_dict(payload["optimizer"])
    if loader is not None:
        if payload.get("data") is None:
            raise ValueError("the checkpoint holds no data position, but a loader was given")
        loader.load_state_dict(payload["data"])
    restore_rng(payload["rng"])
    return int(payload["step"])


# --- written in the background (checkpoint_writer: a save that does not hold up the other ranks) ---------

from . import checkpoint_writer as _writer  # noqa: E402  (checkpoint_writer imports this module lazily)

CheckpointWriter, snapshot = _writer.CheckpointWriter, _writer.snapshot
