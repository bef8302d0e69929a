"""The PowerSGD state of a `ringtrain train --compression powersgd` job, in its checkpoints.

Words:

- *state*: what torch's ``PowerSGDState`` keeps between iterations: per bucket index the
  *error feedback* (``error_dict``: this rank's residual, one per element of the bucket's
  buffer; it differs from rank to rank), the *warm-start* matrices (``p_memory_dict``,
  ``q_memory_dict``), the iteration counter ``iter`` (PowerSGD compresses from
  ``start_powerSGD_iter`` on), the generator ``rng`` that seeds fresh Q matrices, and its
  compression statistics.
- *layout*: the wrapper's buckets the state is keyed by (``DistributedDataParallel.comm_hook_layout``),
  saved with it: a resumed wrapper that lays its buckets out alike keeps all of it; one that
  lays them out otherwise (the profiling iterations' single bucket, the trial of plans of
  ``--schedule optimal``) moves the error feedback parameter by parameter and draws new
  warm-start matrices, as the run does at its own layout changes (``ddp.comm_hook.forget_buckets``).
- *entry*: ``payload["power_sgd"]`` of rank 0's checkpoint: every rank's state, gathered to
  rank 0 at the step (:func:`gather`, one allgather of bytes that only rank 0 unpacks) and written
  by rank 0 in the checkpoint itself, so it is atomic with the model and optimizer state it goes with: a job
  killed mid-checkpoint leaves the checkpoint before, whole, never a model of one step with
  another step's PowerSGD state. Tensors, ints, floats and strings only (``checkpoint``'s
  payload types: loaded with ``weights_only=True``).

A resume uses the entry only where it is of this job: recorded at the checkpoint's step, by as
many workers as this run has (each worker's error feedback is its own), with the same
``POWER_SGD`` settings. Otherwise, and for a checkpoint without one (a run without
``--compression powersgd``, or saved before the entry existed), PowerSGD begins anew, which
rank 0 says in one line (:func:`restore` returns it).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from .bench.machine import plural

KEY = "power_sgd"
#: What is kept per bucket index, as the entry names it: the state's attribute.
PER_BUCKET = {"error": "error_dict", "p": "p_memory_dict", "q": "q_memory_dict"}
#: Compression statistics (logging only), restored as they were.
STATS = ("total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


def capture(state: Any) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's per-bucket tensors: {bucket index: {"error", "p", "q": tensor}} (those it has)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for short, name in PER_BUCKET.items():
        for index, tensor in getattr(state, name).items():
            out.setdefault(int(index), {})[short] = tensor
    return out


def _flat(mine: dict[int, dict[str, torch.Tensor]]) -> tuple[list[tuple[int, str, torch.dtype, tuple]], torch.Tensor]:
    """The structure (index, name, dtype, shape) of ``mine`` in a fixed order, and its bytes."""
    parts, structure = [], []
    for index in sorted(mine):
        for short in sorted(mine[index]):
            t = mine[index][short].detach().cpu().contiguous()
            structure.append((index, short, t.dtype, tuple(t.shape)))
            parts.append(t.reshape(-1).view(torch.uint8))
    return structure, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def gather(comm: Any, state: Any) -> list[dict[int, dict[str, torch.Tensor]]] | None:
    """Every rank's :func:`capture` on rank 0, which writes them; None on the other ranks (a
    collective: every rank calls it at the same step, between a backward and the next forward,
    when the wrapper's communicator is idle). The ranks' states have one structure (the same
    buckets on every rank): checked on every rank.

    The communicator has no gather to one rank: the bytes come by one allgather, and only rank 0
    unpacks them; the others drop the buffer at once (they kept p states each, at every checkpoint)."""
    structure, mine = _flat(capture(state))
    p = comm.world_size
    sizes = np.zeros(2 * p, np.int64)
    form = int.from_bytes(hashlib.sha256(repr(structure).encode()).digest()[:7], "little")  # (not hash(): salted)
    sizes[2 * comm.rank:2 * comm.rank + 2] = (mine.numel(), form)
    comm.allgather(sizes)
    if len(set(sizes[0::2].tolist())) != 1 or len(set(sizes[1::2].tolist())) != 1:
        raise RuntimeError(f"PowerSGD state: the ranks keep differently laid out states (bytes per rank "
                           f"{sizes[0::2].tolist()}): the hook's buckets differ between ranks")
    n = mine.numel()
    buf = np.zeros(p * n, np.uint8)
    buf[comm.rank * n:(comm.rank + 1) * n] = mine.numpy()
    del mine
    if n:
        comm.allgather(buf)
    if comm.rank != 0:
        return None
    return [_unpack(torch.from_numpy(buf[r * n:(r + 1) * n]), structure) for r in range(p)]


def _unpack(chunk: torch.Tensor, structure: list[tuple[int, str, torch.dtype, tuple]]) -> dict[int, dict[str, torch.Tensor]]:
    """One rank's bytes (``chunk``, laid out as :func:`_flat`'s ``structure``) back as its :func:`capture`."""
    theirs: dict[int, dict[str, torch.Tensor]] = {}
    at = 0
    for index, short, dtype, shape in structure:
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        # (copied into a tensor of its own: a view's byte offset need not suit the dtype, and
        # torch.save refuses views of one storage as several types)
        tensor = torch.empty(shape, dtype=dtype)
        tensor.reshape(-1).view(torch.uint8).copy_(chunk[at:at + size])
        theirs.setdefault(index, {})[short] = tensor
        at += size
    return theirs


def layout_entry(layout: list | None) -> list[dict] | None:
    """The wrapper's ``comm_hook_layout`` (BucketSpecs) as plain values."""
    if layout is None:
        return None
    return [{"index": s.index, "pids": list(s.pids), "offsets": list(s.offsets), "numel": s.numel,
             "dtype": str(s.dtype).removeprefix("torch."), "itemsize": s.itemsize} for s in layout]


def layout_of(entry: list[dict] | None) -> list | None:
    """:func:`layout_entry` back as BucketSpecs."""
    from .ddp.buckets import BucketSpec

    if entry is None:
        return None
    return [BucketSpec(index=int(s["index"]), pids=tuple(int(v) for v in s["pids"]),
                       offsets=tuple(int(v) for v in s["offsets"]), numel=int(s["numel"]),
                       dtype=getattr(torch, s["dtype"]), itemsize=int(s["itemsize"])) for s in entry]


def entry(step: int, state: Any, layout: list | None, every: list[dict], settings: dict) -> dict:
    """The checkpoint's ``power_sgd`` entry at ``step`` (``every``: :func:`gather`'s result)."""
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    return {
        "step": step, "world_size": len(every), "settings": dict(settings), "iter": int(state.iter),
        "rng": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "stats": {key: int(getattr(state, key)) for key in STATS},
        "layout": layout_entry(layout),
        "ranks": every,
    }


def check(payload: dict, step: int, world_size: int, settings: dict) -> str | None:
    """Why the checkpoint's entry cannot be resumed by this job (None: it can), in words that end
    a sentence beginning "PowerSGD begins anew: "."""
    saved = payload.get(KEY)
    if saved is None:
        return ("the checkpoint holds no PowerSGD state (it was made by a run without --compression powersgd, "
                "or by a ringtrain that did not save it)")
    if saved.get("step") != step:
        return f"the checkpoint's PowerSGD state is of step {saved.get('step')}, not of its step {step}"
    if saved.get("world_size") != world_size or len(saved.get("ranks", ())) != world_size:
        return (f"the checkpoint's PowerSGD state is of {plural(int(saved.get('world_size') or 0), 'worker')} and "
                f"this run has {world_size} (each worker's error feedback is its own)")
    if saved.get("settings") != settings:
        return f"the checkpoint's PowerSGD state was made with {saved.get('settings')}, this run uses {settings}"
    return None


def restore(payload: dict, step: int, rank: int, world_size: int, settings: dict, state: Any, ddp: Any) -> str:
    """Put this rank's part of the checkpoint's entry into ``state`` (a fresh PowerSGDState,
    registered on ``ddp`` and not yet used), and the layout it is keyed by into ``ddp``; every
    rank decides alike from the same file. Returns the line rank 0 says: what was resumed, or
    why PowerSGD begins anew."""
    why = check(payload, step, world_size, settings)
    if why is not None:
        return f"note: PowerSGD begins anew: {why}; its error feedback starts at zero"
    saved = payload[KEY]
    for short, name in PER_BUCKET.items():
        setattr(state, name, {index: kept[short].clone() for index, kept in saved["ranks"][rank].items()
                              if short in kept})
    state.iter = int(saved["iter"])
    r = saved["rng"]
    state.rng.set_state((r["name"], r["keys"].numpy().astype(np.uint32), r["pos"], r["has_gauss"],
                         r["cached_gaussian"]))
    for key in STATS:
        setattr(state, key, int(saved["stats"][key]))
    ddp.comm_hook_layout = layout_of(saved["layout"])
    return (f"resumed PowerSGD's state of step {step} (iteration {state.iter}; each of the {world_size} workers' "
            "error feedback and the warm-start matrices)")
