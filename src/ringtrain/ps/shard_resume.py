"""Resuming a parameter server from its shard checkpoints: which step, and whether this job may.

The servers' shard folders are siblings (``<checkpoint_dir>/server-<k>``). A server resumes at
the newest step whose file is whole in every sibling folder it can see, so a save cut short on
some servers resumes at the step before it on all of them; a folder that does not exist at all
is taken for one on another machine's disk and not consulted (servers there that resumed at
other steps are told apart when the workers meet them). A checkpoint made for another layout,
by the other kind of job, with another optimizer or with another number of workers is refused
with how to resume.

A checkpoint holds the optimizer's name ("optimizer") and its state ("optimizer_state", see
``ParameterServer._optimizer_state``); one written before the servers applied Adam too has
neither, only SGD's "momentum" (the shard's momentum buffer, or None), and is read as SGD's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from .. import checkpoint
from ..errors import MismatchError
from .server_config import ServerConfig

log = logging.getLogger(__name__)


def newest_whole(cfg: ServerConfig, name: str) -> Optional[dict]:
    """The payload of the newest step whose shard file is whole in every server's folder that
    server ``cfg.index`` (``name``) can see (module docstring); None: start afresh (also without
    a checkpoint directory)."""
    if not cfg.shard_dir:
        return None
    root, me = Path(cfg.checkpoint_dir), cfg.index
    folders = {k: root / f"server-{k}" for k in range(cfg.servers)}
    saved = {k: dict(checkpoint.list_checkpoints(d)) for k, d in folders.items() if k == me or d.is_dir()}
    for step in sorted(set.intersection(*(set(files) for files in saved.values())), reverse=True):
        try:
            mine = checkpoint.load(saved[me][step])
            for k, files in saved.items():  # whole there too? (one at a time, each dropped at once)
                if k != me:
                    checkpoint.load(files[step])
        except checkpoint.CheckpointError as exc:
            log.warning("%s: skipping step %d, not whole on every server: %s", name, step, exc)
            continue
        if step != max(saved[me]):
            log.warning("%s resumes at step %d, the newest step every server saved (its own newest is %d)",
                        name, step, max(saved[me]))
        return mine.payload
    if saved[me]:
        log.warning("%s: no step is saved whole by every server in %s: starting afresh", name, root)
    return None


def optimizer_state(payload: dict) -> dict:
    """A checkpoint's optimizer state as ``ParameterServer._optimizer_state`` gives it, also from one
    written before the servers applied Adam too (SGD's momentum buffer, when it had one)."""
    if "optimizer_state" in payload:
        return payload["optimizer_state"]
    momentum = payload.get("momentum")
    return {"elements": {} if momentum is None else {"momentum_buffer": momentum}, "partitions": {}}


def check_resumable(payload: dict, digest: str, optimizer: str, cfg: ServerConfig, name: str) -> None:
    """MismatchError, saying how to resume, where this job cannot take the shard checkpoint
    ``payload``: it was made for another layout (``digest``: this job's; likeliest, another number
    of servers), by a job of the other kind (synchronous or asynchronous), with another optimizer
    than this job's ``optimizer`` (its state would not be the one that optimizer keeps), or with
    another number of workers."""
    if payload.get("layout") != digest:
        made_by = payload.get("servers")
        if isinstance(made_by, int) and made_by != cfg.servers:  # the likeliest cause: say it
            raise MismatchError(
                f"{name}: the checkpoint in {cfg.shard_dir} was made by {made_by} servers, this job has "
                f"{cfg.servers}: resume with {made_by} servers (`ringtrain train --servers {made_by}`, or "
                f"servers={made_by} in a script), or start a new "
                "checkpoint directory")
        raise MismatchError(f"{name}: the checkpoint in {cfg.shard_dir} is of another model layout")
    made_by = payload.get("strategy")  # (None: saved before the strategy was recorded)
    if made_by is not None and (made_by == "async") != (cfg.strategy == "async"):
        kind = "an asynchronous" if made_by == "async" else "a synchronous"
        raise MismatchError(
            f"{name}: the checkpoint in {cfg.shard_dir} was made by {kind} job (strategy "
            f"{made_by!r}), this job's strategy is {cfg.strategy!r}: resume with strategy {made_by!r} "
            "or start a new checkpoint directory")
    made_by = payload.get("optimizer", "sgd")  # (none: saved before the servers applied Adam too)
    if made_by != optimizer:
        raise MismatchError(
            f"{name}: the checkpoint in {cfg.shard_dir} was made with optimizer {made_by!r}, this job's optimizer is "
            f"{optimizer!r}: resume with optimizer {made_by!r} (PSOptions.optimizer) or start a new checkpoint "
            "directory")
    made_with, W = len(payload["clocks"]), cfg.workers
    if made_with != W:
        raise MismatchError(
            f"{name}: the checkpoint in {cfg.shard_dir} was made with {made_with} "
            f"worker{'s' * (made_with != 1)}, this job has {W}: resume with {made_with} "
            f"worker{'s' * (made_with != 1)} (--workers {made_with}) or start a new checkpoint directory")
