"""Reduction operators and the conversion of user buffers to flat numpy views.

A *flat view* is a 1-D contiguous numpy array that shares memory with the user's buffer
(numpy array or CPU torch tensor); collectives work on flat views only. bfloat16 has no numpy
dtype, so its flat view is uint16 and its reducer goes through torch; float16's does too (numpy's
float16 arithmetic is scalar).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..transport.base import Reducer

OPS = ("sum", "mean", "min", "max", "prod")
_UFUNC = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
_NUMPY_DTYPES = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
    np.dtype(np.int16): "int16",
    np.dtype(np.bool_): "bool",
    np.dtype(np.complex64): "complex64",
}
#: The numpy dtype of each torch dtype that has one, by name.
_NUMPY_OF_TORCH = {name: dtype for dtype, name in _NUMPY_DTYPES.items()}
#: Dtypes without a mean (sum and divide), and without an order (no min or max).
_INTEGRAL = ("int32", "int64", "uint8", "int8", "int16", "bool")
_UNORDERED = ("complex64",)


#: The torch dtypes (names) a CPU tensor may have: numpy's (it is viewed through them) and bfloat16.
_TORCH_DTYPES = ("bfloat16",) + tuple(_NUMPY_DTYPES.values())
#: What torch.distributed's gloo reduces (algorithm="native"): every dtype here but int16.
NATIVE_DTYPES = tuple(d for d in _TORCH_DTYPES if d != "int16")


@dataclass(frozen=True, slots=True)
class FlatView:
    array: np.ndarray  # 1-D, contiguous, shares memory with the user's buffer
    dtype: str  # logical dtype name (see transport.base.DTYPES)
    shape: tuple[int, ...]


def check_cpu_module(module: Any, who: str) -> None:
    """ValueError naming the first parameter or buffer of ``module`` (a torch.nn.Module) that is
    not on the CPU: ``who`` keeps its gradients and parameters in CPU memory, which is what
    ringtrain's own transports move."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for name, t in tensors:
        if t.device.type != "cpu":
            raise ValueError(
                f"{who}: {name!r} is on {t.device}, but ringtrain keeps gradients and parameters in "
                "CPU memory for its own transports; move the module to the CPU (for a module on a "
                "GPU use torch.nn.parallel.DistributedDataParallel)"
            )


def staged(buf: Any) -> tuple[Any, Optional[Callable[[], None]]]:
    """``buf`` as a collective can work on in place, and how to copy the result back: a dense
    buffer that is not laid out row-major (a transposed tensor, channels_last, a step slice, a
    Fortran-ordered array) or a complex tensor viewed conjugated goes through a row-major copy
    written back afterwards (as gloo does for the first of those); anything else is taken as it
    is (``flat_view`` refuses what it cannot take). A buffer whose elements share memory (an
    expanded tensor, a broadcast array) cannot be written in place: refused."""
    if isinstance(buf, np.ndarray):
        if buf.flags.c_contiguous or not buf.flags.writeable or buf.dtype not in _NUMPY_DTYPES:
            return buf, None
        _refuse_overlap(buf.shape, buf.strides)
        copy = np.ascontiguousarray(buf)
        return copy, lambda: np.copyto(buf, copy)
    torch = _torch()
    if torch is None or not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or buf.layout != torch.strided:
        return buf, None
    if buf.is_contiguous() and not buf.is_conj() and not buf.is_neg():
        return buf, None
    if buf.requires_grad and not buf.is_leaf:
        return buf, None  # (refused by flat_view: writing it would change what backward computes)
    _refuse_overlap(buf.shape, buf.stride())
    copy = buf.detach().resolve_conj().resolve_neg().contiguous()
    target = buf.detach()  # (shares the version counter: the write counts as an in-place op's)
    return copy, lambda: target.copy_(copy)


def _refuse_overlap(shape: Sequence[int], strides: Sequence[int]) -> None:
    if any(st == 0 and n > 1 for n, st in zip(shape, strides)):
        raise ValueError("the buffer's elements share memory (an expanded tensor or a broadcast array), so a "
                         "collective cannot write it in place: pass a copy (t.clone(), np.array(a))")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return torch


def flat_view(buf: Any) -> FlatView:
    """A flat view of ``buf`` or a ValueError that says what is wrong with it."""
    if isinstance(buf, np.ndarray):
        name = _NUMPY_DTYPES.get(buf.dtype)
        swapped = _NUMPY_DTYPES.get(buf.dtype.newbyteorder("=")) if buf.dtype.byteorder not in "=|" else None
        if swapped is not None:  # (">f4" reads as float32, which the list below names)
            raise ValueError(f"unsupported dtype {buf.dtype.str} (a numpy array): {swapped} in non-native byte order; "
                             f"pass a copy in native order (a.astype('{swapped}')) and copy the result back")
        if name is None:
            raise ValueError(
                f"unsupported dtype {buf.dtype} (a numpy array); use one of {sorted(set(_NUMPY_DTYPES.values()))}"
            )
        if not buf.flags.writeable:
            raise ValueError("buffer is read-only; collectives work in place")
        if not buf.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous (use np.ascontiguousarray and copy back)")
        # As a plain ndarray: a subclass may not flatten (np.matrix stays 2-D under reshape).
        return FlatView(buf.view(np.ndarray).reshape(-1), name, tuple(buf.shape))
    torch = _torch()
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(
                f"tensor is on {buf.device}; ringtrain's collectives move CPU memory (copy it to the "
                "CPU and back, or use torch.distributed with nccl for GPU tensors)"
            )
        if buf.layout != torch.strided:
            raise ValueError(f"sparse tensors are not supported (layout {buf.layout}); pass a dense one (t.to_dense())")
        if str(buf.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {buf.dtype} (a torch tensor); use one of {sorted(_TORCH_DTYPES)}")
        if buf.requires_grad:
            if not buf.is_leaf:
                raise ValueError(
                    "tensor requires grad and is the result of an operation autograd recorded: writing "
                    "it in place would change what backward computes; pass t.detach() (a copy: "
                    "t.detach().clone()) or a leaf tensor such as a parameter"
                )
            buf = buf.detach()  # shares memory and the version counter (see mark_written)
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous (call .contiguous() and copy back)")
        if buf.dtype == torch.bfloat16:
            return FlatView(numpy_of(buf.view(torch.int16)).view(np.uint16), "bfloat16", tuple(buf.shape))
        try:
            arr = numpy_of(buf)
        except TypeError as exc:
            raise ValueError(f"unsupported tensor dtype {buf.dtype}: {exc}") from None
        return FlatView(arr, _NUMPY_DTYPES[arr.dtype], tuple(buf.shape))
    raise ValueError(f"expected a numpy array or a CPU torch tensor, got {type(buf).__name__}")


class _TensorMemory:
    """A contiguous CPU tensor's memory as numpy's array interface, holding the tensor (the
    array made from it keeps this object, so the tensor, alive)."""

    def __init__(self, tensor: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.__array_interface__ = {"version": 3, "shape": (tensor.numel(),), "typestr": dtype.str,
                                    "data": (tensor.data_ptr(), False)}


def numpy_of(tensor: Any) -> np.ndarray:
    """A 1-D numpy view of the contiguous CPU ``tensor``'s elements, its storage left resizable:
    ``Tensor.numpy()`` marks it non-resizable for good, and a later ``resize_`` of the user's
    tensor (a reused buffer; a comm hook's bucket, as torch's batched PowerSGD) then fails with
    "Trying to resize storage that is not resizable" (gloo's collectives leave it resizable).
    TypeError for a dtype numpy has not (bfloat16: view it as int16 first)."""
    if tensor.is_conj() or tensor.is_neg():  # (its memory holds other values than it shows)
        raise ValueError("a tensor whose conjugate or negative bit is set has no numpy view of its values: "
                         "pass t.resolve_conj().resolve_neg() and copy the result back")
    if tensor.numel() == 0:  # (no memory to point at: a null pointer numpy may refuse)
        return tensor.detach().new_empty(0).numpy()
    dtype = _NUMPY_OF_TORCH.get(str(tensor.dtype).removeprefix("torch."))
    if dtype is None:
        raise TypeError(f"numpy has no dtype for {tensor.dtype}")
    return np.asarray(_TensorMemory(tensor, dtype))


def mark_written(buf: Any) -> None:
    """Count a collective's write into ``buf`` in its autograd version counter, as a torch
    in-place op would, whether or not it requires grad: a tensor saved for backward (an input
    ``x`` of ``w * x``, as well as a parameter) and then overwritten makes backward raise instead
    of using the new values. Numpy arrays and inference tensors (no counter): nothing."""
    if isinstance(buf, np.ndarray) or buf.is_inference():
        return
    from torch.autograd.graph import increment_version

    increment_version(buf)


def reducer(op: str, dtype: str) -> Reducer:
    """out[:] = op(out, incoming) for the logical dtype. 'mean' reduces as 'sum'."""
    if op not in _UFUNC:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype == "bfloat16" or (dtype == "float16" and op in ("sum", "mean", "prod")):
        # (float16: numpy's arithmetic is scalar, 40x torch's on a 2.5M-element add, 20 ms against
        # 0.5. Both round each float32 sum or product of two float16 values to float16, which is
        # exact: the same bits. min and max stay numpy's, as for every numpy dtype: torch's
        # minimum(0, -0) is -0, numpy's the first.)
        return _torch_reducer(op, dtype)
    ufunc = _UFUNC[op]

    def reduce(out: np.ndarray, incoming: np.ndarray) -> None:
        with np.errstate(all="ignore"):  # (an inf or NaN reduces as IEEE says, silently, as in torch and gloo)
            ufunc(out, incoming, out=out)

    return reduce


def as_bfloat16(bits: np.ndarray):
    """The bfloat16 tensor whose bits the uint16 array ``bits`` holds (sharing its memory)."""
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _torch_reducer(op: str, dtype: str) -> Reducer:
    import torch

    fn = {"sum": torch.add, "mean": torch.add, "min": torch.minimum, "max": torch.maximum, "prod": torch.mul}[op]
    tensor = as_bfloat16 if dtype == "bfloat16" else torch.from_numpy

    def reduce(out: np.ndarray, incoming: np.ndarray) -> None:
        o = tensor(out)
        fn(o, tensor(np.ascontiguousarray(incoming)), out=o)

    return reduce


def finish_mean(view: FlatView, world_size: int) -> None:
    """Divide a summed buffer by the world size, in place (floating dtypes only)."""
    if view.dtype == "bfloat16":
        as_bfloat16(view.array).div_(world_size)
    elif view.dtype == "float16":  # (torch's: numpy's float16 division is scalar; the same bits)
        import torch

        torch.from_numpy(view.array).div_(world_size)
    else:
        np.divide(view.array, world_size, out=view.array)


#: torch.distributed's ReduceOp names and the ops they are here (a script ported from it runs as it is).
TORCH_OPS = {"SUM": "sum", "AVG": "mean", "MAX": "max", "MIN": "min", "PRODUCT": "prod"}


def op_name(op: Any) -> Any:
    """``op``, or the name of torch.distributed's ``ReduceOp.SUM`` / ``AVG`` / ``MAX`` / ``MIN`` /
    ``PRODUCT`` (check_op_dtype refuses the rest, naming them)."""
    if type(op).__name__ == "ReduceOp" and hasattr(op, "op"):  # (a ReduceOp made from a RedOpType)
        op = op.op
    if type(op).__name__ == "RedOpType" and getattr(op, "name", None) in TORCH_OPS:
        return TORCH_OPS[op.name]
    return op


def check_op_dtype(op: str, dtype: str) -> None:
    if op not in OPS:
        torchs = (f" (torch's ReduceOp.{op.name} has no counterpart here; its SUM, AVG, MAX, MIN and PRODUCT are "
                  "taken)" if type(op).__name__ == "RedOpType" else "")
        raise ValueError(f"op must be one of {OPS}, got {op!r}{torchs}")
    if op == "mean" and dtype in _INTEGRAL:
        raise ValueError(f"op='mean' needs a floating dtype, got {dtype} (use op='sum' and divide)")
    if op in ("min", "max") and dtype in _UNORDERED:
        raise ValueError(f"op={op!r} needs ordered values, got {dtype}")
