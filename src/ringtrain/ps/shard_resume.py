"""Resuming a parameter server from its shard checkpoints: which step, whether this job may take
it, and, for a job with another number of servers, the shard this server would have saved.

Words (``sharding.py``'s layout words):

- *save of step s*: the files ``<root>/server-<k>/ckpt-<s>.pt`` of servers k = 0..K-1 of the job
  that saved it (its K is in every file, "servers"). It is *whole* where each of those files is in
  its folder and loads (``checkpoint.load``), and they agree with each other (the same K, layout,
  strategy, optimizer, clocks; the same version for a synchronous job). A folder that holds the
  files of other steps but not this one's had its save cut short; a folder that does not exist
  at all is taken for one on another machine's disk and not consulted (*absent*).
- The newest whole save is resumed, by every server alike: a save cut short on some servers
  resumes at the step before on all of them. Which K saved a step is read from the lowest-numbered
  file of it: after a resume with fewer servers, higher folders keep an older job's files, never
  a newer one's.
- *repartition*: a save made for another layout (another number of servers, or another partition
  size) of the same model, by a synchronous job, is cut anew: the server reads every old shard file
  that holds elements of its partitions and takes those elements, of the values and of every entry
  of the optimizer's state (one value per element: SGD's momentum buffer, Adam's moments; one value
  per partition: Adam's step, equal in every old partition a new one takes elements from). The
  optimizers are elementwise, so training goes on bitwise as it would have on the old servers.
  Every file of the save must be on this machine's disk then.

A checkpoint of another model, by the other kind of job (synchronous or asynchronous), with another
optimizer or another number of workers is refused with how to resume, and so is an asynchronous
job's on another number of servers (its servers save their shards at different moments: no one
state to cut anew).

A checkpoint holds the optimizer's name ("optimizer") and its state ("optimizer_state", see
``ParameterServer._optimizer_state``); one written before the servers applied Adam too has
neither, only SGD's "momentum" (the shard's momentum buffer, or None), and is read as SGD's. One
written before the servers recorded their model ("numels", "shapes", "partition_bytes") is taken
for this job's model and partition size where its layout digest says so.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import checkpoint
from ..errors import MismatchError
from .server_config import ServerConfig, format_shape
from .sharding import Layout, Partition, layout_digest, make_layout

log = logging.getLogger(__name__)

#: What every file of one save records alike.
_AGREE = ("servers", "layout", "strategy", "optimizer", "clocks")


@dataclass(frozen=True, slots=True)
class SavedStep:
    """The newest whole save (module docstring)."""

    step: int
    servers: int
    """K of the job that saved it."""
    files: tuple[Path, ...]
    """Server k's file of the step, k = 0..servers-1."""
    absent: tuple[int, ...]
    """The servers among them whose folder is not on this disk."""
    payload: dict
    """The asking server's own file's payload where it is one of them, else the lowest-numbered's."""
    own: bool
    """Whether ``payload`` is the asking server's own file's."""


def server_folders(root: Path) -> dict[int, Path]:
    """Every ``server-<k>`` folder under ``root``, by k."""
    if not root.is_dir():
        return {}
    out = {}
    for entry in root.iterdir():
        number = entry.name.removeprefix("server-")
        if entry.name.startswith("server-") and number.isdigit() and str(int(number)) == number and entry.is_dir():
            out[int(number)] = entry
    return out


def held_steps(root: Path) -> dict[int, dict[int, Path]]:
    """Per server folder under ``root``: its checkpoint files by step, unverified."""
    return {k: dict(checkpoint.list_checkpoints(d)) for k, d in sorted(server_folders(root).items())}


def newest_whole(root: Path, servers: int, me: Optional[int] = None, name: str = "the parameter servers"
                 ) -> Optional[SavedStep]:
    """The newest whole save in ``root`` (module docstring) for a job of ``servers`` servers, read by
    server ``me`` (None: by the job's parent); None: start afresh. ``servers`` is also the K of a
    file that does not record it."""
    held = held_steps(root)
    for step in sorted(set().union(*held.values()), reverse=True):
        try:
            saved = _whole(root, step, held, servers, me)
        except checkpoint.CheckpointError as exc:
            log.warning("%s: skipping step %d, not whole on every server: %s", name, step, exc)
            continue
        if saved is None:
            continue
        mine = held.get(me, {})
        if mine and step < max(mine):
            log.warning("%s resumes at step %d, the newest step every server saved (its own newest is %d)",
                        name, step, max(mine))
        return saved
    if held.get(me):
        log.warning("%s: no step is saved whole by every server in %s: starting afresh", name, root)
    return None


def _whole(root: Path, step: int, held: dict[int, dict[int, Path]], servers: int, me: Optional[int]
           ) -> Optional[SavedStep]:
    """The save of ``step`` if it is whole; None where a folder of it lacks its file (cut short);
    CheckpointError where a file does not load or disagrees with the others."""
    first = min(k for k, files in held.items() if step in files)
    header = checkpoint.load(held[first][step]).payload
    made_by = header.get("servers", servers)
    if (isinstance(made_by, bool) or not isinstance(made_by, int) or not first < made_by <= 1 << 20
            or header.get("server", first) != first):
        raise checkpoint.CheckpointError(f"{held[first][step]}: in folder server-{first}, records server "
                                         f"{header.get('server')!r} of {made_by!r}")
    if any(step not in held[k] for k in range(made_by) if k in held):
        return None
    payload, own = header, first == me
    for k in range(first + 1, made_by):
        if k not in held:
            continue
        other = checkpoint.load(held[k][step]).payload
        differ = [key for key in _AGREE if other.get(key) != header.get(key)]
        if header.get("strategy") != "async" and other.get("version") != header.get("version"):
            differ.append("version")
        if other.get("server", k) != k:
            differ.append("server")
        if differ:
            raise checkpoint.CheckpointError(f"{held[k][step]}: not of the same save as {held[first][step]} "
                                             f"(their {', '.join(differ)} differ)")
        if k == me:
            payload, own = other, True
    files = tuple(root / f"server-{k}" / checkpoint.checkpoint_name(step) for k in range(made_by))
    return SavedStep(step, made_by, files, tuple(k for k in range(made_by) if k not in held), payload, own)


def optimizer_state(payload: dict) -> dict:
    """A checkpoint's optimizer state as ``ParameterServer._optimizer_state`` gives it, also from one
    written before the servers applied Adam too (SGD's momentum buffer, when it had one)."""
    if "optimizer_state" in payload:
        return payload["optimizer_state"]
    momentum = payload.get("momentum")
    return {"elements": {} if momentum is None else {"momentum_buffer": momentum}, "partitions": {}}


def check_resumable(saved: SavedStep, layout: Layout, hello: dict, cfg: ServerConfig, name: str) -> Layout:
    """The layout ``saved`` was made for, where this job (its ``layout``, its first worker's
    ``hello``) can take it; MismatchError saying how to resume where it cannot: made by a job of
    the other kind (synchronous or asynchronous), with another optimizer, with another number of
    workers, of another model, or, asynchronous, for another layout."""
    payload, where = saved.payload, f"{name}: the checkpoint in {cfg.shard_dir}"
    made_by = payload.get("strategy")  # (None: saved before the strategy was recorded)
    if made_by is not None and (made_by == "async") != (cfg.strategy == "async"):
        kind = "an asynchronous" if made_by == "async" else "a synchronous"
        raise MismatchError(
            f"{where} was made by {kind} job (strategy "
            f"{made_by!r}), this job's strategy is {cfg.strategy!r}: resume with strategy {made_by!r} "
            "or start a new checkpoint directory")
    made_by = payload.get("optimizer", "sgd")  # (none: saved before the servers applied Adam too)
    if made_by != hello["optimizer"]:
        raise MismatchError(
            f"{where} was made with optimizer {made_by!r}, this job's optimizer is "
            f"{hello['optimizer']!r}: resume with optimizer {made_by!r} (PSOptions.optimizer) or start a new "
            "checkpoint directory")
    made_with, W = len(payload["clocks"]), cfg.workers
    if made_with != W:
        raise MismatchError(
            f"{where} was made with {made_with} "
            f"worker{'s' * (made_with != 1)}, this job has {W}: resume with {made_with} "
            f"worker{'s' * (made_with != 1)} (--workers {made_with}) or start a new checkpoint directory")
    old = _saved_layout(saved, hello, where)
    if old.digest() != layout.digest() and not cfg.synchronous:
        K = old.servers
        if K == cfg.servers:
            raise MismatchError(
                f"{where} was made with {old.partition_bytes}-byte partitions, this job's are {layout.partition_bytes} "
                "bytes: an asynchronous job's checkpoint resumes on the layout that made it (its servers saved their "
                "shards at different moments), so resume with that partition size, or start a new checkpoint "
                "directory")
        raise MismatchError(
            f"{where} was made by {K} servers, this job has {cfg.servers}: an asynchronous job's checkpoint "
            f"resumes on as many servers as made it (they saved their shards at different moments), so resume "
            f"with {K} servers (`ringtrain train --servers {K}`, or servers={K} in a script), or start a new "
            "checkpoint directory")
    return old


def _saved_layout(saved: SavedStep, hello: dict, where: str) -> Layout:
    """The layout of ``saved``'s model, number of servers and partition size; MismatchError where its
    model is not the one of this job's ``hello``."""
    payload = saved.payload
    numels, partition_bytes = payload.get("numels"), payload.get("partition_bytes")
    if numels is None or partition_bytes is None:  # (saved before they were recorded: only K may differ)
        numels, partition_bytes = hello["numels"], hello["partition_bytes"]
        if layout_digest(numels, saved.servers, partition_bytes) != payload.get("layout"):
            raise MismatchError(f"{where} is of another model layout (other parameter sizes or another partition "
                                "size than this job's)")
    differs = _first_difference(list(numels), hello["numels"], payload.get("shapes"), hello["shapes"])
    if differs:
        raise MismatchError(f"{where} is of another model: {differs}. Resume with the model it was made with, or "
                            "start a new checkpoint directory")
    old = make_layout(numels, saved.servers, partition_bytes)
    if old.digest() != payload.get("layout"):
        raise MismatchError(f"{where} records a layout digest that is not the one of its model and servers: it was "
                            "not written by this ringtrain")
    return old


def _first_difference(numels: list, ours: list, shapes: Optional[list], our_shapes: list) -> str:
    if len(numels) != len(ours):
        return f"it holds {len(numels)} parameters, this job's model {len(ours)}"
    for i, (n, m) in enumerate(zip(numels, ours)):
        if n != m:
            return f"its parameter #{i} has {n} elements, this job's {m}"
    for i, (a, b) in enumerate(zip(shapes or (), our_shapes)):
        if list(a) != list(b):
            return f"its parameter #{i} has shape {format_shape(a)}, this job's {format_shape(b)}"
    return ""


def repartition(saved: SavedStep, old: Layout, new: Layout, me: int, name: str) -> dict:
    """The payload server ``me`` of layout ``new`` would have saved at ``saved.step`` (params,
    optimizer_state, version, clocks; module docstring, *repartition*), from the files of the save
    made for layout ``old``; MismatchError where a file is missing or the shards cannot be cut anew
    exactly."""
    where = f"{name}: the checkpoint of step {saved.step} (made by {old.servers} servers)"
    if saved.absent:
        missing = ", ".join(str(saved.files[k]) for k in saved.absent)
        raise MismatchError(f"{where} is to be cut anew for {new.servers} servers, which needs every server's file "
                            f"of it, but {missing} is missing: put the folder back (or run on the number of servers "
                            "that made it), or start a new checkpoint directory")
    mine = new.shard(me)
    index = {p.id: j for j, p in enumerate(mine)}
    offsets, n = new.offsets(me), new.shard_numel(me)
    by_param: dict[int, list[Partition]] = {}
    for p in mine:  # (shard order: by parameter, then start)
        by_param.setdefault(p.param, []).append(p)
    stops = {param: [p.stop for p in parts] for param, parts in by_param.items()}
    params = torch.empty(n, dtype=torch.float32)
    elements: dict[str, torch.Tensor] = {}
    partitions: dict[str, list] = {}
    keys: Optional[tuple] = None
    taken = 0
    for k in range(old.servers):
        pieces = _overlaps(old.shard(k), by_param, stops)
        if not pieces:
            continue
        try:
            payload = checkpoint.load(saved.files[k]).payload
        except checkpoint.CheckpointError as exc:
            raise MismatchError(f"{where}: {exc}") from None
        state = optimizer_state(payload)
        if keys is None:
            keys = (sorted(state["elements"]), sorted(state["partitions"]))
            elements = {key: torch.empty(n, dtype=state["elements"][key].dtype) for key in keys[0]}
            partitions = {key: [None] * len(mine) for key in keys[1]}
        elif keys != (sorted(state["elements"]), sorted(state["partitions"])):
            raise MismatchError(f"{where} cannot be cut anew exactly: its shards hold different optimizer state "
                                f"({keys} against {saved.files[k].name}'s)")
        old_offsets = old.offsets(k)
        old_index = {p.id: j for j, p in enumerate(old.shard(k))}
        for p_old, p_new, lo, hi in pieces:
            src = slice(old_offsets[p_old.id] + lo - p_old.start, old_offsets[p_old.id] + hi - p_old.start)
            dst = slice(offsets[p_new.id] + lo - p_new.start, offsets[p_new.id] + hi - p_new.start)
            params[dst] = payload["params"][src]
            for key, flat in elements.items():
                flat[dst] = state["elements"][key][src]
            for key, values in partitions.items():
                value, j = state["partitions"][key][old_index[p_old.id]], index[p_new.id]
                if values[j] is not None and not torch.equal(values[j], value):
                    raise MismatchError(f"{where} cannot be cut anew exactly: its partitions of parameter "
                                        f"#{p_new.param} hold different {key!r} ({values[j].item()} and "
                                        f"{value.item()})")
                values[j] = value
            taken += hi - lo
    if taken != n:  # (the old layout's partitions cover every element once: cannot happen)
        raise MismatchError(f"{where}: the old shards gave {taken} of this server's {n} elements")
    log.info("%s takes its shard of %d elements from the checkpoint of step %d made by %d servers",
             name, n, saved.step, old.servers)
    return {**{key: saved.payload[key] for key in ("version", "clocks")}, "params": params,
            "optimizer_state": {"elements": elements,
                                "partitions": {key: torch.stack(values) for key, values in partitions.items()}}}


def _overlaps(old_shard: list[Partition], by_param: dict[int, list[Partition]], stops: dict[int, list[int]]
              ) -> list[tuple[Partition, Partition, int, int]]:
    """(old partition, new partition, first element, element after the last) of every run of
    elements an old shard's partition shares with a new one of ``by_param`` (by parameter, in order;
    ``stops``: their ends)."""
    out = []
    for p in old_shard:
        new = by_param.get(p.param, [])
        j = bisect.bisect_right(stops.get(p.param, []), p.start)  # the first new one ending after p starts
        while j < len(new) and new[j].start < p.stop:
            out.append((p, new[j], max(p.start, new[j].start), min(p.stop, new[j].stop)))
            j += 1
    return out
