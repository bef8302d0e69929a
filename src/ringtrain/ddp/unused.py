"""Unused parameters: which parameters a backward will give no gradient, and what to say when
the gradients that came do not match what was expected.

This module owns ``find_unused_parameters``' side of the wrapper and the errors about
gradients that are missing or should not have come. Words (those of :mod:`.wrapper`):

- *outputs*: the tensors of a forward's output that have a graph (:func:`output_tensors` finds them
  in nested tuples, lists, dicts and dataclasses).
- *reached*: the ids of the parameters whose gradient-accumulation nodes the outputs' autograd
  graph reaches (:func:`reachable_params`): at the forward from every output, then, at the
  :class:`OutputSink`'s backward, from the outputs the loss used; the others are *unused* for
  that backward.
- *used bitmap*: one byte per parameter, 1 where this rank has a gradient for it (used in this
  backward, or accumulated under ``no_sync()``); its allreduce (max) is queued ahead of every
  bucket, and a parameter no rank has a gradient for keeps ``.grad`` None, as with torch's DDP.

The functions here walk graphs and build messages; the wrapper keeps the state they read and
abandons the iteration before raising what they build (each error's ``__cause__`` is the
communication error that abandoning found, if any).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator, Sequence

import numpy as np
import torch

try:
    from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint
except ImportError:  # (a torch without it has no reentrant checkpoint to look for)
    _ReentrantCheckpoint = None


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists, dicts and dataclasses)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in output_tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in output_tensors(item)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name))]
    return []


def with_tensors(out: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``out`` with the tensors :func:`output_tensors` finds replaced, in that order, by ``tensors``
    (the same nesting and container types; a dataclass is copied, its fields set anew)."""
    if isinstance(out, torch.Tensor):
        return next(tensors)
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*(with_tensors(item, tensors) for item in out))
    if isinstance(out, (list, tuple)):
        return type(out)(with_tensors(item, tensors) for item in out)
    if isinstance(out, dict):
        copied = copy.copy(out)  # (keeps an OrderedDict's or a ModelOutput's type)
        for key, item in out.items():
            copied[key] = with_tensors(item, tensors)
        return copied
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        copied = copy.copy(out)
        for f in dataclasses.fields(out):
            object.__setattr__(copied, f.name, with_tensors(getattr(out, f.name), tensors))
        return copied
    return out


class OutputSink(torch.autograd.Function):
    """find_unused_parameters: the outputs that have a graph (and parameters returned as they are)
    pass through one node (cloned, as torch's DDP's ``_DDPSink`` does), whose backward runs before
    any node of the forward's graph and sees which outputs the loss used (a gradient) and which it
    did not (None). It calls ``on_backward(roots)`` with the graph nodes of the used outputs (None:
    all were used)."""

    @staticmethod
    def forward(ctx, on_backward, *outputs):
        ctx.on_backward = on_backward
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        roots = None
        if any(g is None for g in grads):
            roots = [edge[0] for edge, g in zip(ctx.next_functions, grads) if g is not None]  # (tensors only)
        ctx.on_backward(roots)
        return (None,) + grads


def reachable_params(outputs: list[torch.Tensor], pid_of: dict[int, int], nodes: Sequence = ()) -> set[int]:
    """Ids of the parameters whose gradient-accumulation nodes the outputs' graph (or the graph
    from ``nodes``) reaches."""
    found = {pid_of[id(t)] for t in outputs if t.grad_fn is None and id(t) in pid_of}  # (a parameter returned as is)
    seen: set = set()
    stack = [t.grad_fn for t in outputs] + list(nodes)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
        if var is not None and id(var) in pid_of:
            found.add(pid_of[id(var)])
        elif _ReentrantCheckpoint is not None and getattr(node, "_forward_cls", None) is _ReentrantCheckpoint:
            # Its backward runs a backward of its own, from a graph made then: the parameters inside
            # are not in this one. They would count as unused, and their gradients come after the
            # averaged pass has ended, so they would stay local.
            raise RuntimeError(
                "ringtrain.DistributedDataParallel: find_unused_parameters=True cannot see the parameters "
                "inside a reentrant torch.utils.checkpoint (their gradients would not be averaged): pass "
                "use_reentrant=False to checkpoint(), or drop find_unused_parameters")
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def used_bitmap(params: Sequence[torch.Tensor], unused: set[int]) -> np.ndarray:
    """This rank's used bitmap: 1 for every parameter but those in ``unused`` without a ``.grad``."""
    used = np.ones(len(params), dtype=np.uint8)
    for pid in unused:
        used[pid] = params[pid].grad is not None
    return used


def unused_everywhere(used: np.ndarray, unused: set[int]) -> set[int]:
    """Ids of the parameters no rank has a gradient for (``used``: the bitmap after its allreduce)."""
    return {pid for pid in unused if not used[pid]}


def missing_gradients_error(names: Sequence[str], params: Sequence[torch.Tensor], got: bytearray,
                            unused: set[int], find_unused_parameters: bool) -> RuntimeError:
    """A backward ended without a gradient for some parameter it expected (``got``: 1 for each
    parameter that had one; those in ``unused`` got none, as expected: not missing)."""
    missing = [pid for pid in range(len(params)) if not got[pid] and pid not in unused]
    frozen = [names[pid] for pid in missing if not params[pid].requires_grad]
    missing = [names[pid] for pid in missing]
    expected = len(params) - len(unused)
    hint = ("Some parameters were expected to get a gradient (find_unused_parameters=True found them in the "
            "autograd graph) but did not" if find_unused_parameters else
            "Pass find_unused_parameters=True to DistributedDataParallel if some parameters legitimately get no "
            "gradient in some iterations (they then contribute zeros; one no rank uses keeps .grad None), or "
            "make every parameter reach the loss")
    if frozen:
        hint = (f"Of these, some have requires_grad=False since the wrapper was made: {frozen}. Set requires_grad "
                "before wrapping (to change it during training, close this wrapper and wrap the module again), "
                "or pass find_unused_parameters=True: frozen parameters then count as unused")
    return RuntimeError(
        f"ringtrain.DistributedDataParallel: the previous backward pass ended without a gradient for "
        f"{len(missing)} of the {expected} parameters expected, so their allreduce never ran: {missing}. "
        f"{hint}. (A backward that raised an exception outside this wrapper's hooks ends so too: "
        "then that exception is the one to fix.)")


def second_gradient_error(name: str, missing: list[str]) -> RuntimeError:
    """Parameter ``name`` got a second gradient while the parameters ``missing`` had none yet."""
    return RuntimeError(
        f"ringtrain.DistributedDataParallel: parameter {name!r} got a second gradient in one synchronizing "
        f"backward pass, before {len(missing)} expected parameters had their first: {missing}. Either this backward "
        "accumulates its gradient twice: a module called more than once inside a reentrant "
        "torch.utils.checkpoint (use_reentrant=True), whose recomputations each run a backward of their own; "
        "pass use_reentrant=False (torch's DDP refuses this too unless static_graph=True, which this wrapper does "
        "not have). Or a second backward through the outputs of one forward came before the first had every "
        "gradient: backpropagate the sum of the losses once.")


def unused_got_gradient_error(name: str) -> RuntimeError:
    """Parameter ``name`` got a gradient though ``find_unused_parameters`` counted it unused."""
    return RuntimeError(
        f"ringtrain.DistributedDataParallel: parameter {name!r} got a gradient, but the forward's "
        "outputs that the loss uses do not reach it, so find_unused_parameters=True counted it as unused and its bucket was "
        "already averaged with zeros for it. Compute every term of the loss from the wrapper's outputs "
        "(not from the module's parameters directly), or run that part inside the wrapper's forward.")


def earlier_forward_error(names: list[str]) -> RuntimeError:
    """A backward through a superseded forward's outputs reaches ``names``, which the last
    forward counted unused."""
    return RuntimeError(
        "ringtrain.DistributedDataParallel: this backward pass goes through the outputs of an earlier forward "
        "of the wrapper than the last one before it. With find_unused_parameters=True each forward finds the "
        f"parameters its outputs reach and the last one decides: it counted {names} unused, so their gradients "
        "from this backward would not be averaged. Call the wrapper once for the loss (e.g. on the "
        "concatenated inputs), or backpropagate each forward's loss before the next forward.")
