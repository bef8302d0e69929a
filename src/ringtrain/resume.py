"""The checkpoint directory of a `ringtrain train` run, read by the parent before any worker
starts: which step the run resumes at, and whether it can resume there at all.

A resumed run keeps the strategy family (ring or parameter servers), the model, the optimizer,
the global batch and seed, and for parameter servers the kind (sync or async) of the checkpoints it
continues, and their number where asynchronous (synchronous servers cut a save of another number
of servers anew); anything else is refused here, naming the flag to pass, instead of failing on
some rank after startup or silently overwriting them. ``--no-resume`` moves the old checkpoints
aside.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoint

if TYPE_CHECKING:
    from .train import TrainConfig


def resume_step(cfg: TrainConfig) -> int | None:
    """The step a run in cfg.checkpoint_dir resumes at (None: step 0). Ring workers: their newest
    whole checkpoint; parameter servers: the newest step every server saved (ps.server, *resume*),
    which may be newer than the workers' own file of it (the servers save first)."""
    if cfg.strategy == "ring":
        found = checkpoint.latest(cfg.checkpoint_dir, warn=False)  # (the parent named the damaged ones)
        return None if found is None else found.step
    saved = _servers_save(cfg)
    return None if saved is None else saved.step


def _servers_save(cfg: TrainConfig):
    """The servers' save a parameter-server run resumes (ps.shard_resume.newest_whole), or None."""
    from .ps import shard_resume

    return shard_resume.newest_whole(Path(cfg.checkpoint_dir) / "servers", cfg.servers)


def _strategy_family(strategy: str) -> str:
    return "ring" if strategy == "ring" else "parameter-server"


@dataclass(frozen=True, slots=True)
class _Saved:
    """What the parent needs to know of one checkpoint in the directory."""

    path: Path
    step: int
    strategy: str
    """_strategy_family of the run that saved it."""
    model: str | None
    """Canonical model name (None in checkpoints made before it was recorded)."""
    model_shapes: dict[str, tuple[int, ...]]
    data: dict | None
    """The sampler's state (global batch size, seed)."""
    optimizer: str
    """--optimizer of the run that saved it (sgd in checkpoints made before there was a choice)."""


def _saved_checkpoints(directory: Path) -> list[_Saved]:
    """The valid checkpoints in ``directory``, newest first; each damaged one is named in one line
    (once per run: the workers skip them quietly) and left for the user to remove. Checkpoints
    made before the strategy was recorded tell it apart by the optimizer state: parameter-server
    workers save none."""
    saved = []
    for _, path in reversed(checkpoint.list_checkpoints(directory)):
        try:
            payload = checkpoint.load(path).payload
        except checkpoint.CheckpointError as exc:
            print(f"skipping {exc}; remove it", file=sys.stderr)
            continue
        if not isinstance(payload.get("model"), dict):
            raise ValueError(f"--checkpoint-dir {directory}: {path.name} is not a checkpoint of `ringtrain train` "
                             "(it holds no model state): give this run another --checkpoint-dir")
        extra = payload.get("extra") or {}
        strategy = extra.get("strategy") or ("ring" if payload.get("optimizer") is not None else "ps")
        shapes = {k: tuple(v.shape) for k, v in payload["model"].items()}
        saved.append(_Saved(path, int(payload["step"]), _strategy_family(strategy), extra.get("model_name"), shapes,
                            payload.get("data"), extra.get("optimizer_name", "sgd")))
    return saved


def prepare_checkpoint_dir(cfg: TrainConfig, workers: int) -> int | None:
    """Resuming: refuse checkpoints this run cannot continue (another strategy, model, global
    batch, seed, number of parameter-server workers or of asynchronous servers), and return the
    step it resumes at (resume_step, from the checkpoints read here: None, step 0). Starting
    afresh (--no-resume): move the old checkpoints aside; None."""
    directory = Path(cfg.checkpoint_dir)
    if not cfg.resume:
        if cfg.checkpoint_every:
            try:
                moved = checkpoint.supersede(directory, also=("servers",))
            except OSError as exc:
                raise ValueError(f"--no-resume: cannot move the old checkpoints in {directory} aside "
                                 f"({exc.strerror or exc}): remove them or give another --checkpoint-dir") from None
            if moved:  # (the servers' folder alone: no step of the workers' to name)
                what = f"the checkpoints of steps {moved[1]}" if moved[1] else "the parameter servers' checkpoints"
                print(f"--no-resume: moved {what} in {directory} to {moved[0]}", file=sys.stderr)
        return None
    saved = _saved_checkpoints(directory)
    if not saved and cfg.strategy == "ring" and checkpoint.list_checkpoints(directory):
        print(f"no whole checkpoint in {directory} to resume from: starting at step 0", file=sys.stderr)
    if saved:
        _check_same_strategy(cfg, saved)
        _check_same_model(cfg, saved[0])
        _check_same_optimizer(cfg, saved[0])
    if cfg.strategy == "ring":
        if saved:
            _check_same_data(cfg, workers, saved[0])
        else:
            _check_no_servers_save(cfg)
        return saved[0].step if saved else None  # (the newest whole one, as resume_step's checkpoint.latest)
    # The servers' number of workers before the global batch: a parameter-server run cannot change
    # --workers, so the data check's "--batch-size N on --workers W" would only lead to that refusal.
    found = _check_servers_hold_checkpoints(cfg, workers, saved)
    if saved:
        _check_same_data(cfg, workers, saved[0])
    return None if found is None else found.step


def _restart_hint() -> str:
    return "or start afresh with --no-resume (which moves them into a superseded-* subdirectory)"


def _check_same_strategy(cfg: TrainConfig, saved: list[_Saved]) -> None:
    mine = _strategy_family(cfg.strategy)
    other = [s.step for s in saved if s.strategy != mine]
    if other:
        theirs = "parameter-server" if mine == "ring" else "ring"
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir} holds checkpoints of a {theirs} run (steps "
                         f"{sorted(other)}); --strategy {cfg.strategy} cannot resume them and would overwrite them: "
                         f"give this run another --checkpoint-dir, {_restart_hint()}")


def _check_no_servers_save(cfg: TrainConfig) -> None:
    """A ring run in a directory of the parameter servers' files alone (the workers' first save cut
    short, or removed) would start at step 0 beside them, and a parameter-server run could then no
    longer resume them (_check_same_strategy): refused as the workers' files are."""
    from .ps import shard_resume

    servers = Path(cfg.checkpoint_dir) / "servers"
    steps = sorted(set().union(*shard_resume.held_steps(servers).values()))
    if steps:
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir} holds the checkpoints of a parameter-server run's "
                         f"servers (steps {steps} in {servers}); --strategy ring cannot resume them and would start "
                         f"at step 0 beside them: give this run another --checkpoint-dir, {_restart_hint()}")


def _check_same_model(cfg: TrainConfig, newest: _Saved) -> None:
    from . import models

    mine = models.spec(cfg.model).name
    if newest.model is not None:
        differs = newest.model != mine
    else:  # an older checkpoint: compare the tensors' names and shapes
        differs = newest.model_shapes != {k: tuple(v.shape) for k, v in models.build(mine).state_dict().items()}
    if differs:
        theirs = f"model {newest.model}" if newest.model else "another model"
        use = f"pass --model {newest.model}, " if newest.model else ""
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir}: {newest.path.name} is of {theirs}, not {mine}: "
                         f"{use}give this run another --checkpoint-dir, {_restart_hint()}")


def _check_same_optimizer(cfg: TrainConfig, newest: _Saved) -> None:
    """Its state (momentum buffers; Adam's moments and step) is of one optimizer: another one cannot
    take it over, and starting that one afresh would not be the run resumed."""
    if newest.optimizer != cfg.optimizer:
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir}: {newest.path.name} was made with --optimizer "
                         f"{newest.optimizer}, not {cfg.optimizer}: pass --optimizer {newest.optimizer}, give this run "
                         f"another --checkpoint-dir, {_restart_hint()}")


def _check_same_data(cfg: TrainConfig, workers: int, newest: _Saved) -> None:
    """The sampler resumes only the same global batch and seed (ringtrain.data.sampler)."""
    from . import models

    if not newest.data:
        return
    where = f"--checkpoint-dir {cfg.checkpoint_dir}: {newest.path.name}"
    if int(newest.data["seed"]) != cfg.seed:
        raise ValueError(f"{where} was made with --seed {int(newest.data['seed'])}, not {cfg.seed}: pass "
                         f"--seed {int(newest.data['seed'])}, {_restart_hint()}")
    saved = int(newest.data["global_batch_size"])
    batch = cfg.batch_size or models.spec(cfg.model).batch_size
    if saved == workers * batch:
        return
    if saved % workers == 0:
        fix = f"resume with --batch-size {saved // workers} (the same global batch on --workers {workers})"
    else:
        fix = f"no batch size gives {saved} on {workers} workers: use a --workers that divides {saved}"
    raise ValueError(f"{where} has a global batch of {saved} samples per step; --workers {workers} x --batch-size "
                     f"{batch} = {workers * batch} would change it: {fix}, {_restart_hint()}")


def _check_servers_hold_checkpoints(cfg: TrainConfig, workers: int, saved: list[_Saved]):
    """The servers' save the run resumes (ps.shard_resume.SavedStep; None: step 0), checked.
    Parameter-server workers resume at the servers' step; with worker checkpoints but none of
    the servers', the run would start at step 0 and overwrite the workers' checkpoints."""
    from .ps import shard_resume

    servers = Path(cfg.checkpoint_dir) / "servers"
    if not saved:  # (the servers' files alone: the workers' first save was cut short, or removed)
        found = _servers_save(cfg)
        if found is not None:
            _check_same_servers(cfg, workers, found)
        return found
    steps = {f"server-{k}": set(held) for k, held in shard_resume.held_steps(servers).items()}
    if not any(steps.values()):
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir} holds worker checkpoints (steps "
                         f"{sorted(s.step for s in saved)}) but no parameter-server checkpoints in {servers}, so "
                         f"there is nothing to resume: give this run another --checkpoint-dir, {_restart_hint()}")
    # Servers resume at the newest step every one of them saved (ps.shard_resume): with none whole
    # (the first save cut short) they would start at step 0 and overwrite the workers' files.
    found = _servers_save(cfg)
    if found is None:
        held = "; ".join(f"{name}: {sorted(s)}" for name, s in steps.items())
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir}: no step is saved by every parameter server "
                         f"in {servers} ({held}), so there is nothing to resume: give this run "
                         f"another --checkpoint-dir, {_restart_hint()}")
    _check_same_servers(cfg, workers, found)
    return found


def _check_same_servers(cfg: TrainConfig, workers: int, found) -> None:
    """The servers refuse a synchronous job's shards in an asynchronous job or the other way round,
    another optimizer's, another number of workers', an asynchronous job's on another number of
    servers, and a save to be cut anew for another number of servers whose files are not all here
    (ps.shard_resume), but only once every rank has started: say it here, before."""
    saved = found.payload
    where = f"--checkpoint-dir {cfg.checkpoint_dir}: the parameter servers' checkpoint of step {found.step}"
    made, flags = [], []  # (both said at once: resuming with one fixed was refused for the other)
    strategy = saved.get("strategy")  # (None: saved before the strategy was recorded)
    if strategy is not None and (strategy == "async") != (cfg.strategy == "ps-async"):
        theirs = "ps-async" if strategy == "async" else "ps-sync or ps-sharded"
        kind = "an asynchronous" if strategy == "async" else "a synchronous"
        made.append(f"by {kind} job (--strategy {theirs}), not --strategy {cfg.strategy}")
        flags.append(f"--strategy {theirs}")
    optimizer = saved.get("optimizer", "sgd")  # (saved before the servers applied Adam too: SGD)
    if optimizer != cfg.optimizer:
        made.append(f"with --optimizer {optimizer}, not {cfg.optimizer}")
        flags.append(f"--optimizer {optimizer}")
    made_for = len(saved.get("clocks", ()))  # (a step per worker)
    if made_for and made_for != workers:
        made.append(f"with {made_for} worker{'s' * (made_for != 1)}, this run has {workers}")  # (servers count them)
        flags.append(f"--workers {made_for}")
    made_by = found.servers
    if made_by != cfg.servers and "async" in (strategy, cfg.strategy.removeprefix("ps-")):
        made.append(f"by {made_by} server{'s' * (made_by != 1)}, this run has {cfg.servers}")  # (async: as many)
        flags.append(f"--servers {made_by}")
    if made:
        raise ValueError(f"{where} was made {' and '.join(made)}: resume with {' '.join(flags)}, {_restart_hint()}")
    if made_by != cfg.servers and found.absent:
        missing = ", ".join(str(found.files[k]) for k in found.absent)
        raise ValueError(f"{where} was made by {made_by} servers; resumed on {cfg.servers}, every file of it is read, "
                         f"but {missing} is missing: put it back, or resume with --servers {made_by}, "
                         f"{_restart_hint()}")
