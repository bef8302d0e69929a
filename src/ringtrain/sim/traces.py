"""Layer traces: what one training iteration of a model costs on one GPU, layer by layer.

Words used here:

* **layer** — one unit of the model as the simulator sees it: a name, its forward and
  backward compute time in seconds, the bytes of gradient it produces and its parameter
  count. A layer may have no parameters (pooling, activation): it then costs time but
  produces no gradient.
* **trace** — the layers of one model in *forward* order, plus the per-GPU batch size, the
  unit a sample is counted in, the optimizer step's time and where the numbers came from.
  Backward runs the layers in reverse, so ``reversed(trace.layers)`` is backward order.
* **gradient layers** — the view the planner needs (``Trace.gradient_layers``): only the
  layers that produce a gradient, in backward order, each carrying the backward time of
  the parameter-free layers that run just before it, so that the running sum of times is
  exactly the moment its gradient is ready.

Traces come from three places: profiling a real ``torch.nn.Module`` on this machine
(``profile_module``), the reference models described by layer shapes (``models_zoo``), and
files written by ``save``/``load`` (JSON, or CSV whose ``# key: value`` comment lines hold
the model-level fields).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..paths import user_path

LAYER_FIELDS = ("name", "forward_s", "backward_s", "grad_bytes", "params")
TRACE_FIELDS = ("model", "batch_size", "sample_unit", "optimizer_s", "source")


@dataclass(frozen=True, slots=True)
class Layer:
    name: str
    """The layer's name (module path for profiled models)."""
    forward_s: float
    """Forward compute time in seconds, one GPU, the trace's batch size."""
    backward_s: float
    """Backward compute time in seconds (gradients of inputs and weights)."""
    grad_bytes: int
    """Bytes of gradient this layer produces (0 for a parameter-free layer)."""
    params: int
    """Number of trainable parameters."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("layer name must not be empty")
        # Numpy numbers are kept as Python ones: save() wrote np.float64(0.002) into a CSV that
        # load() refused, and JSON could not write an np.float32 at all.
        for key in ("forward_s", "backward_s"):
            object.__setattr__(self, key, _seconds(getattr(self, key), f"layer {self.name}: {key}"))
        for key in ("grad_bytes", "params"):
            object.__setattr__(self, key, _count(getattr(self, key), f"layer {self.name}: {key}"))
        if not (0 <= self.forward_s < math.inf and 0 <= self.backward_s < math.inf):
            raise ValueError(f"layer {self.name}: forward_s and backward_s must be finite and >= 0")
        if self.grad_bytes < 0 or self.params < 0:
            raise ValueError(f"layer {self.name}: grad_bytes and params must be >= 0")


@dataclass(frozen=True, slots=True)
class Trace:
    model: str
    """The model's name."""
    layers: tuple[Layer, ...]
    """Layers in forward order."""
    batch_size: int
    """Samples per GPU per iteration."""
    sample_unit: str = "samples"
    """What a sample is (images, sequences) — for display only."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer step after gradients are reduced (0 if not measured)."""
    source: str = ""
    """Where the times come from (device profile, or the machine that was profiled)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("trace model name must not be empty")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError(f"trace {self.model}: needs at least one layer")
        object.__setattr__(self, "batch_size", _count(self.batch_size, f"trace {self.model}: batch_size"))
        object.__setattr__(self, "optimizer_s", _seconds(self.optimizer_s, f"trace {self.model}: optimizer_s"))
        if self.batch_size < 1:
            raise ValueError(f"trace {self.model}: batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.optimizer_s < math.inf:
            raise ValueError(f"trace {self.model}: optimizer_s must be finite and >= 0, got {self.optimizer_s}")
        if not any(layer.grad_bytes for layer in self.layers):
            raise ValueError(f"trace {self.model}: no layer produces a gradient")
        if not math.isfinite(self.forward_s + self.backward_s + self.optimizer_s):  # each finite, the sum not
            raise ValueError(f"trace {self.model}: the layers' times add up past what a float holds; give seconds")
        for key in ("grad_bytes", "params", "batch_size"):  # (an int of 400 digits: OverflowError in the sweep)
            try:
                float(getattr(self, key))
            except OverflowError:
                raise ValueError(f"trace {self.model}: {key} is over 1.8e308, past what a float holds; give "
                                 "bytes, parameters and samples") from None

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def grad_bytes(self) -> int:
        return sum(layer.grad_bytes for layer in self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def gradient_layers(self) -> tuple[list[str], list[float], list[int]]:
        """(names, backward times, gradient bytes) of gradient-producing layers, backward order.

        Parameter-free layers lend their backward time to the next gradient layer in backward
        order; any left after the last one (layers nearest the input) is not in these lists —
        it is ``backward_s - sum(times)``, compute after the last gradient is ready.
        """
        names: list[str] = []
        times: list[float] = []
        sizes: list[int] = []
        pending = 0.0
        for layer in reversed(self.layers):
            pending += layer.backward_s
            if layer.grad_bytes:
                names.append(layer.name)
                times.append(pending)
                sizes.append(layer.grad_bytes)
                pending = 0.0
        return names, times, sizes

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in TRACE_FIELDS}
        d["layers"] = [asdict(layer) for layer in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        if not isinstance(d, dict):
            raise ValueError(f"a trace is an object with the fields model, batch_size and layers, got {type(d).__name__}")
        missing = [k for k in ("model", "batch_size", "layers") if k not in d]  # (the constructor's required fields)
        if missing:
            raise ValueError(f"trace is missing the field {missing[0]!r}")
        rows = d["layers"]
        if not isinstance(rows, list):
            raise ValueError(f"layers must be a list of layers, got {type(rows).__name__}")
        layers = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"layers[{i}] must be an object with the fields {', '.join(LAYER_FIELDS)}, "
                                 f"got {row!r}")
            absent = [k for k in LAYER_FIELDS if row.get(k) is None]  # (None: a CSV row short of columns)
            if absent:
                raise ValueError(f"layers[{i}] is missing the field {absent[0]!r}")
            layers.append(Layer(**{k: _typed(k, row[k], f"layers[{i}].{k}") for k in LAYER_FIELDS}))
        meta = {k: _typed(k, d[k], k) for k in TRACE_FIELDS if k in d}
        return cls(layers=tuple(layers), **meta)


def _seconds(value: Any, where: str) -> float:
    """A time given to ``Layer`` or ``Trace`` (Python or numpy number) as a float; the range is
    checked by the caller."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{where} = {value!r} is not a number of seconds")
    return float(value)


def _count(value: Any, where: str) -> int:
    """A count (bytes, parameters, batch size) given to ``Layer`` or ``Trace`` as an int: a
    Python or numpy integer, or a whole float (as in files); 4.5 or True is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{where} = {value!r} is not a whole number")
    if isinstance(value, (float, np.floating)):
        if not (math.isfinite(value) and float(value).is_integer()):
            raise ValueError(f"{where} = {value!r} is not a whole number")
    return int(value)


def _typed(key: str, value: Any, where: str) -> Any:
    """A file's ``value`` of field ``key`` as the field's type, or a ValueError naming ``where``.

    Counts (bytes, parameters, batch size) must be whole numbers: ``4e6`` is taken (JSON and CSV
    alike), ``10.7`` or ``true`` is refused rather than truncated.
    """
    if key in ("forward_s", "backward_s", "optimizer_s"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{where} = {value!r} is not a number")
        try:
            return float(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{where} = {value!r} is not a number") from None
    if key in ("grad_bytes", "params", "batch_size"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{where} = {value!r} is not a whole number")
        if isinstance(value, int):
            return value
        try:
            number = int(value) if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"{where} = {value!r} is not a whole number") from None
        if isinstance(number, float):
            if not math.isfinite(number) or not number.is_integer():
                raise ValueError(f"{where} = {value!r} is not a whole number")
            number = int(number)
        return number
    if value is None or isinstance(value, (bool, list, dict)):  # (null was read as the name 'None')
        raise ValueError(f"{where} = {value!r} is not text")
    return str(value)


# ---------------------------------------------------------------- files

def dumps_json(trace: Trace) -> str:
    return json.dumps(trace.to_dict(), indent=1)


def dumps_csv(trace: Trace) -> str:
    out = io.StringIO()
    for k in TRACE_FIELDS:
        out.write(f"# {k}: {_meta_text(getattr(trace, k))}\n")
    csv.DictWriter(out, fieldnames=LAYER_FIELDS, lineterminator="\n").writeheader()
    for layer in trace.layers:
        line = io.StringIO()
        csv.DictWriter(line, fieldnames=LAYER_FIELDS, lineterminator="\n").writerow(
            {k: repr(v) if isinstance(v, float) else v for k, v in asdict(layer).items()})
        text = line.getvalue()
        # A name like '#conv' quoted, or loads_csv would read a comment; one with a lone '\r' too
        # (csv quotes the line terminator's characters, '\n' here, and reads '\r' as a line's end).
        if not text.startswith('"') and (text.startswith("#") or "\r" in layer.name):
            text = f'"{layer.name}"{text[len(layer.name):]}'
        out.write(text)
    return out.getvalue()


def loads_csv(text: str) -> Trace:
    meta: dict[str, Any] = {}
    given_on: dict[str, int] = {}  # each metadata key's line
    body = []
    quoted = False  # inside a quoted value that goes on over a line break (a layer named 'a\nb')
    # (lines as csv reads them: str.splitlines also broke them at \u2028, \x1c..., quoted or not)
    for number, line in enumerate(io.StringIO(text, newline=""), start=1):
        if not quoted and line.startswith("#"):
            key, _, value = line[1:].partition(":")
            key = key.strip()
            if key in TRACE_FIELDS:
                if key in given_on:  # (as a column named twice: the last one was kept, silently)
                    raise ValueError(f"line {number} gives the metadata {key!r} again (line {given_on[key]} "
                                     "gave it first); keep one")
                given_on[key] = number
                meta[key] = _meta_value(value.strip())
            continue
        if quoted or line.strip():
            body.append(line)
            quoted = _ends_quoted(line, quoted)
    reader = csv.DictReader(body)
    if reader.fieldnames:  # 'name, forward_s, ...' (values may have the spaces too: float() strips them)
        reader.fieldnames = [f.strip() for f in reader.fieldnames]
        for k, column in enumerate(reader.fieldnames):  # (DictReader keeps the last one's values, silently)
            if column and column in reader.fieldnames[:k]:  # (empty ones, a spreadsheet's trailing commas: unread)
                raise ValueError(f"the header names the column {column!r} twice")
    meta["layers"] = list(reader)
    for i, row in enumerate(meta["layers"]):
        # DictReader keeps a row's values beyond the header under None (empty ones: a trailing comma)
        if any(v.strip() for v in row.get(None, ())):
            columns = len(reader.fieldnames or ())
            raise ValueError(f"layers[{i}] has {columns + len(row[None])} values for the {columns} columns "
                             f"of the header ({', '.join(reader.fieldnames or ())})")
    return Trace.from_dict(meta)


def _meta_text(value: Any) -> str:
    """A trace field's value as its comment line writes it: as is, or as a JSON string where the
    line would lose or break it (spaces at its ends, a line break, a leading quote)."""
    text = str(value)
    if text != text.strip() or text.startswith('"') or "\r" in text or "\n" in text:
        return json.dumps(text)
    return text


def _meta_value(text: str) -> str:
    """A comment line's value: the string a JSON string holds (see _meta_text), else as written."""
    if len(text) >= 2 and text.startswith('"') and text.endswith('"'):
        with contextlib.suppress(ValueError):
            value = json.loads(text)
            if isinstance(value, str):
                return value
    return text


def _ends_quoted(line: str, quoted: bool) -> bool:
    """Whether a CSV record is inside a quoted value at the end of ``line`` (``quoted``: it was at
    its start). csv's rules: a quote opens a value only at the value's start; inside one, a
    doubled quote is a quote and a single one closes it."""
    if '"' not in line:  # (most lines: nothing to walk)
        return quoted
    at_start, i = not quoted, 0
    while i < len(line):
        c = line[i]
        if quoted:
            if c == '"' and line[i + 1:i + 2] == '"':
                i += 1  # a doubled quote: a quote in the value
            elif c == '"':
                quoted = False
            at_start = False
        elif c == '"' and at_start:
            quoted, at_start = True, False
        else:
            at_start = c == ","
        i += 1
    return quoted


def save(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as JSON or CSV, chosen by the file's suffix."""
    path = Path(user_path(path))
    fmt = _format(path)
    # (UTF-8, as load reads it, whatever the locale: a POSIX or cp1252 one could not write 'модель')
    path.write_text(dumps_json(trace) if fmt == "json" else dumps_csv(trace), encoding="utf-8")


def load(path: str | Path) -> Trace:
    """Read a trace written by ``save`` (JSON or CSV, chosen by the suffix)."""
    path = Path(user_path(path))
    fmt = _format(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a BOM, as Excel's "CSV UTF-8" writes, is not text)
    except OSError as e:
        raise ValueError(f"cannot read trace file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read trace file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return Trace.from_dict(json.loads(text)) if fmt == "json" else loads_csv(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a valid trace: {e}") from None


def _format(path: Path) -> str:
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in ("json", "csv"):
        raise ValueError(f"trace file {path}: suffix must be .json or .csv")
    return suffix


# ---------------------------------------------------------------- profiling a real module
#
# Words used in this part:
#
# * **owner** — a module of the profiled model that is one layer of its trace: each leaf
#   module, and each module that holds trainable parameters directly (the root is named
#   ``(root)``). A shared parameter's gradient belongs to the first owner that holds it.
# * **stamp** — a ``now()`` reading in seconds; on a GPU, taken once the device has done its
#   queued work.
# * **step** — one training iteration (``_Step``): forward, loss, backward, optimizer step.
# * **sample** — the numbers of one hooked step (``_one_iteration``); the trace takes the
#   median of each over the samples, scaled to the median times of as many plain (hook-free)
#   steps.

@dataclass(slots=True)
class _Timings:
    forward: dict[str, float] = field(default_factory=dict)
    ready: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Step:
    """One training step of a profiled module, as ``profile_module`` runs it."""

    module: Any
    make_batch: Callable[[], tuple[Any, ...]]
    loss_fn: Callable[..., Any]
    optimizer: Any
    now: Callable[[], float]
    batch_size: int | None
    """As given, else the first input's leading dimension once a step has run."""

    def run(self, mark: Callable[[], Any] | None = None) -> tuple[Any, Any, Any, float]:
        """One training step: ``mark()`` (default ``now``) when forward starts, forward ends
        and backward ends, and the optimizer step's seconds."""
        mark = mark or self.now
        *inputs, target = self.make_batch()
        if self.batch_size is None:
            self.batch_size = int(inputs[0].shape[0]) if getattr(inputs[0], "ndim", 0) else 1
        self.module.zero_grad(set_to_none=True)
        t0 = mark()
        loss = self.loss_fn(self.module(*inputs), target)
        t1 = mark()
        loss.backward()
        t2 = mark()
        if self.optimizer is None:
            return t0, t1, t2, 0.0
        start = self.now()
        self.optimizer.step()
        return t0, t1, t2, self.now() - start


def profile_module(
    module: "Any",
    make_batch: Callable[[], tuple[Any, ...]],
    loss_fn: Callable[..., Any],
    *,
    name: str | None = None,
    optimizer: Any = None,
    repeats: int = 3,
    warmup: int = 1,
    sample_unit: str = "samples",
    batch_size: int | None = None,
) -> Trace:
    """Measure a torch ``nn.Module`` on this machine, layer by layer.

    On CPU as it is; on a CUDA device every timestamp first waits for the device
    (``torch.cuda.synchronize``), which serializes the work a little but times each layer.

    ``make_batch()`` returns the model's inputs followed by the target; ``loss_fn(output,
    target)`` gives a scalar. A layer is each leaf module (and each module that holds
    parameters directly). Layers are ordered by what was measured, not by the module tree:
    gradient layers by the median time their gradient became ready, latest first, so that
    backward order (``reversed(layers)``) is the order of arrival in ``loss.backward()`` — a
    parameter used at the input (a root's ``pos_embed``), one held by a module that is not a
    leaf (``nn.MultiheadAttention.in_proj_weight``) or by a leaf whose forward is never called
    (its ``out_proj``) lands where its gradient really arrives. Each parameter-free leaf
    follows the gradient leaf it followed in the first forward call (``_forward_order``).

    * forward: the time between a leaf's forward pre-hook and forward hook, summed over
      calls; forward time spent outside every leaf (functional ops) becomes a last layer
      named ``(other)``.
    * backward: each layer's gradient is *ready* when the last of its parameters has
      been accumulated (``register_post_accumulate_grad_hook``); a gradient layer's backward
      time is its ready time minus the previous ready time, so the running sum matches what
      a bucketed allreduce would see. Backward after the last ready gradient is given to
      the first layer. A gradient layer whose gradient never arrives (unused in forward) is
      ready first, with no backward time.
    * gradient bytes: numel x element size of each trainable parameter, counted once for
      shared parameters (at the first module that holds them).

    Each time is the median over ``repeats`` iterations after ``warmup`` unmeasured ones. The
    hooks cost time themselves, so ``repeats`` more iterations run without hooks and every
    layer's forward (backward) time is scaled so that their sum is the median hook-free
    forward (backward) time; the split between layers is the hooked run's.
    ``batch_size`` defaults to the first input's leading dimension.
    """
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    on_cuda = any(p.is_cuda for p in module.parameters())
    now = _clock(on_cuda)
    owners = _owners(module)
    param_owner = _param_owners(owners)
    grad_bytes, params = _gradient_sizes(owners)
    step = _Step(module, make_batch, loss_fn, optimizer, now, batch_size)
    samples, order = _hooked_samples(step, owners, param_owner, warmup, repeats)
    plain_f, plain_b = _plain_times(step, on_cuda, repeats)
    layers, optimizer_s = _layers(samples, owners, order, grad_bytes, params, plain_f, plain_b)
    return Trace(
        model=name or type(module).__name__,
        layers=tuple(layers),
        batch_size=step.batch_size,
        sample_unit=sample_unit,
        optimizer_s=optimizer_s,
        source=f"profiled on {_device_name(on_cuda)} (torch {torch.__version__}), median of {repeats}",
    )


def _clock(on_cuda: bool) -> Callable[[], float]:
    """``now()``, the function that takes a stamp."""
    import torch

    def now() -> float:
        # GPU work is asynchronous: wait for it, so each timestamp is when the work was done
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _owners(module: Any) -> dict[str, Any]:
    """``module``'s owners by name, in ``named_modules`` order."""
    owners: dict[str, Any] = {}
    for mod_name, mod in module.named_modules():
        has_own = any(p.requires_grad for p in mod.parameters(recurse=False))
        if has_own or not any(True for _ in mod.children()):
            owners[mod_name or "(root)"] = mod
    return owners


def _param_owners(owners: dict[str, Any]) -> dict[int, str]:
    """The owner of each trainable parameter, by the parameter's ``id``."""
    param_owner: dict[int, str] = {}
    for mod_name, mod in owners.items():
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                param_owner.setdefault(id(p), mod_name)
    return param_owner


def _gradient_sizes(owners: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Each owner's gradient bytes and trainable parameters, a shared parameter counted once."""
    grad_bytes = {n: 0 for n in owners}
    params = {n: 0 for n in owners}
    seen: set[int] = set()
    for mod_name, mod in owners.items():
        for p in mod.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                grad_bytes[mod_name] += p.numel() * p.element_size()
                params[mod_name] += p.numel()
    return grad_bytes, params


def _register_hooks(
    owners: dict[str, Any], param_owner: dict[int, str], now: Callable[[], float], timings: _Timings,
    order: list[str], handles: list[Any],
) -> None:
    """Hook the owners, each hook's handle appended to ``handles`` as it is made (so that a
    failure part way leaves none behind once the caller removes them).

    A leaf's forward pre-hook and forward hook add its forward seconds to ``timings.forward``
    (and append it to ``order`` at its first call); each trainable parameter's
    post-accumulate-grad hook stamps ``timings.ready`` for its owner.
    """
    starts: dict[str, float] = {}

    def pre(mod_name: str) -> Callable[..., None]:
        def hook(_mod: Any, _inp: Any) -> None:
            starts[mod_name] = now()
        return hook

    def post(mod_name: str) -> Callable[..., None]:
        def hook(_mod: Any, _inp: Any, _out: Any) -> None:
            if mod_name not in order:
                order.append(mod_name)
            timings.forward[mod_name] = timings.forward.get(mod_name, 0.0) + now() - starts[mod_name]
        return hook

    def ready(mod_name: str) -> Callable[..., None]:
        def hook(_p: Any) -> None:
            timings.ready[mod_name] = now()
        return hook

    for mod_name, mod in owners.items():
        if not any(True for _ in mod.children()):  # forward is timed on leaves only
            handles.append(mod.register_forward_pre_hook(pre(mod_name)))
            handles.append(mod.register_forward_hook(post(mod_name)))
        for p in mod.parameters(recurse=False):
            if p.requires_grad and param_owner[id(p)] == mod_name:
                handles.append(p.register_post_accumulate_grad_hook(ready(mod_name)))


def _hooked_samples(
    step: _Step, owners: dict[str, Any], param_owner: dict[int, str], warmup: int, repeats: int
) -> tuple[list[dict[str, float]], list[str]]:
    """The samples of ``repeats`` hooked steps after ``warmup`` unmeasured ones, and the leaves
    in order of their first forward call. The hooks are removed after, also on an error."""
    timings = _Timings()
    order: list[str] = []
    handles: list[Any] = []
    samples: list[dict[str, float]] = []
    try:
        _register_hooks(owners, param_owner, step.now, timings, order, handles)
        for i in range(warmup + repeats):
            timings.forward.clear()
            timings.ready.clear()
            t0, t1, t2, opt_s = step.run()
            if i >= warmup:
                samples.append(_one_iteration(timings, owners, t0, t1, t2, opt_s))
    finally:
        for h in handles:
            h.remove()
    return samples, order


def _plain_times(step: _Step, on_cuda: bool, repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of ``repeats`` plain steps."""
    import torch

    # The hooks themselves cost time (on a GPU each one waits for the device): time the same
    # steps without hooks — on a GPU with CUDA events, so the CPU may run ahead as usual —
    # and scale the layers' times to those totals.
    plain_f, plain_b = [], []
    for _ in range(repeats):
        if on_cuda:
            e0, e1, e2, _ = step.run(_cuda_event)
            torch.cuda.synchronize()
            plain_f.append(e0.elapsed_time(e1) / 1e3)
            plain_b.append(e1.elapsed_time(e2) / 1e3)
        else:
            t0, t1, t2, _ = step.run()
            plain_f.append(t1 - t0)
            plain_b.append(t2 - t1)
    return plain_f, plain_b


def _layers(
    samples: list[dict[str, float]], owners: dict[str, Any], order: list[str], grad_bytes: dict[str, int],
    params: dict[str, int], plain_f: list[float], plain_b: list[float],
) -> tuple[list[Layer], float]:
    """The trace's layers in forward order, times scaled to the plain steps', and the median
    optimizer seconds."""
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0] if not k.startswith("r:")}
    hooked_f = sum(v for k, v in med.items() if k.startswith("f:"))
    hooked_b = sum(v for k, v in med.items() if k.startswith("b:"))
    fs = statistics.median(plain_f) / hooked_f if hooked_f > 0 else 1.0
    bs = statistics.median(plain_b) / hooked_b if hooked_b > 0 else 1.0
    ready_at = {n: statistics.median(s[f"r:{n}"] for s in samples if f"r:{n}" in s)
                for n in owners if any(f"r:{n}" in s for s in samples)}
    names = _forward_order(order, [n for n in owners if grad_bytes[n]], ready_at)
    back = {n: med.get(f"b:{n}", 0.0) for n in names}
    if names:  # (none: profile_module's Trace says what is missing)
        back[names[0]] += med["b:(tail)"]
    layers = [Layer(n, fs * med.get(f"f:{n}", 0.0), bs * back[n], grad_bytes[n], params[n]) for n in names]
    if med["f:(other)"] > 0:
        layers.append(Layer("(other)", fs * med["f:(other)"], 0.0, 0, 0))
    return layers, med["optimizer"]


def _cuda_event() -> Any:
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _device_name(on_cuda: bool) -> str:
    import torch

    return torch.cuda.get_device_name() if on_cuda else "this machine's CPU"


def _one_iteration(
    timings: _Timings, owners: dict[str, Any], t0: float, t1: float, t2: float, opt_s: float
) -> dict[str, float]:
    """One hooked iteration's numbers: ``f:NAME`` forward seconds, ``b:NAME`` seconds from the
    previous ready gradient to NAME's, ``r:NAME`` NAME's ready time from the start of backward
    (only for gradients that arrived), ``b:(tail)`` backward after the last one, ``optimizer``."""
    out: dict[str, float] = {f"f:{n}": timings.forward.get(n, 0.0) for n in owners}
    out.update({f"b:{n}": 0.0 for n in owners})
    out["f:(other)"] = max(0.0, (t1 - t0) - sum(timings.forward.values()))
    prev = t1
    for n, t in sorted(timings.ready.items(), key=lambda kv: kv[1]):
        out[f"b:{n}"] = t - prev
        out[f"r:{n}"] = t - t1
        prev = t
    out["b:(tail)"] = max(0.0, t2 - prev)
    out["optimizer"] = opt_s
    return out


def _forward_order(order: list[str], gradient: list[str], ready_at: dict[str, float]) -> list[str]:
    """Layer names in the forward order whose reverse is the measured backward order.

    ``order``: leaves in order of their first forward call; ``gradient``: the layers that hold
    gradient bytes, in module order; ``ready_at``: seconds from the start of backward to each
    gradient's arrival (absent: it never arrived). Gradient layers are sorted latest-ready
    first (never-ready ones last: they are ready at once), ties in first-call then module
    order; every parameter-free leaf of ``order`` keeps its place after the gradient leaf
    that preceded it there (at the front if none did).
    """
    first_call = {n: i for i, n in enumerate(order)}
    rank = {n: (first_call.get(n, len(order)), i) for i, n in enumerate(gradient)}
    grads = sorted(gradient, key=lambda n: (-ready_at.get(n, -math.inf), rank[n]))
    is_grad = set(gradient)
    after: dict[str | None, list[str]] = {}
    anchor: str | None = None
    for n in order:
        if n in is_grad:
            anchor = n
        else:
            after.setdefault(anchor, []).append(n)
    out = list(after.get(None, []))
    for n in grads:
        out += [n] + after.get(n, [])
    return out


def profile_reference(name: str, batch_size: int | None = None, repeats: int = 3, seed: int = 0) -> Trace:
    """Profile one of ``ringtrain.models``' reference models on this machine's CPU.

    The optimizer is SGD with momentum, as ``ringtrain train`` uses; the batch is the model's
    default (or ``batch_size``) drawn from ``seed``.
    """
    import torch

    from .. import models

    model = models.build(name, seed=seed)
    x, y = models.make_batch(model, batch_size=batch_size, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return profile_module(model, lambda: (x, y), model.loss, name=name, optimizer=optimizer, repeats=repeats)
