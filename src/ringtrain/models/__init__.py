"""Reference workloads: models that need no download, built by name.

    model = ringtrain.models.build("resnet", seed=0)        # same seed -> same weights
    x, y = ringtrain.models.make_batch("resnet", seed=1)     # default batch for that model
    loss = model.loss(model(x), y)
    ds = ringtrain.models.dataset_for(model)                 # its real (no-download) data
    ringtrain.models.describe("resnet")                      # sizes, default batch, data set

Names (see each module's docstring):

==================== ========================================= =============== ==========
name                 what                                      default batch   data set
==================== ========================================= =============== ==========
charlm               = charlm-transformer                      32 x 64 bytes   text
charlm-transformer   byte-level GPT, d=128, 4 blocks           32 x 64 bytes   text
charlm-lstm          byte embedding + 2-layer LSTM (256)       32 x 64 bytes   text
resnet               ResNet-style CNN, 35 convs, BatchNorm     32 x 3x32x32    images
mlp                  1024-4096-4096-10 MLP                     32 x 1024       vectors
==================== ========================================= =============== ==========

Sizes and forward+backward time of one step at the default batch, one thread
(``python -m ringtrain.models``; development machine, measured while it was quiet — the
same run under load from other processes took 2-3x as long):

==================== ============ ======= ====== ==========
name                 parameters   tensors layers step (ms)
==================== ============ ======= ====== ==========
charlm-transformer        891,904      54     28        142
charlm-lstm               938,240      11      3         81
resnet                  4,375,770     107     71        106
mlp                    21,020,682       6      3         74
==================== ============ ======= ====== ==========

*Tensors* are parameter tensors (one gradient hook each); *layers* are modules owning
parameters. *Data set* names the matching :func:`ringtrain.data.dataset` kind. ``build`` creates the
weights under a private copy of torch's random state, so it neither depends on nor
disturbs the caller's random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import data
from .base import ReferenceModel, check_seed
from .charlm import CharLSTM, CharTransformer
from .mlp import MLP
from .resnet import ResNet


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How to build one registry entry."""

    name: str
    """Registry name."""
    cls: type[ReferenceModel]
    """The model class."""
    summary: str
    """One line for listings."""
    batch_size: int = 32
    """Default per-rank batch size."""
    dataset: str = ""
    """The :func:`ringtrain.data.dataset` kind this model trains on."""
    batch_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments to ``make_batch`` (the language models' ``seq_len``)."""


_SPECS = {
    s.name: s
    for s in (
        ModelSpec("charlm-transformer", CharTransformer, "byte-level transformer LM (d=128, 4 blocks)",
                  dataset="text", batch_kwargs={"seq_len": 64}),
        ModelSpec("charlm-lstm", CharLSTM, "byte-level LSTM LM (2 layers of 256)",
                  dataset="text", batch_kwargs={"seq_len": 64}),
        ModelSpec("resnet", ResNet, "ResNet-style CNN on 32x32 images, 35 convolutions, BatchNorm", dataset="images"),
        ModelSpec("mlp", MLP, "MLP 1024-4096-4096-10, few large layers", dataset="vectors"),
    )
}
_ALIASES = {"charlm": "charlm-transformer"}


def names() -> list[str]:
    """Every accepted model name, aliases included."""
    return sorted([*_SPECS, *_ALIASES])


def spec(name: str) -> ModelSpec:
    """The registry entry for ``name`` (aliases resolved)."""
    key = _ALIASES.get(name, name)
    if key not in _SPECS:
        raise ValueError(f"model must be one of {', '.join(names())}, got {name!r}")
    return _SPECS[key]


def build(name: str, seed: int = 0, **kwargs: Any) -> ReferenceModel:
    """Build model ``name`` with weights drawn from ``seed``; ``kwargs`` go to its constructor."""
    s = spec(name)
    seed = check_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return s.cls(**kwargs)
        except TypeError as exc:  # an unknown keyword: name the accepted ones
            raise ValueError(f"bad argument for model {name!r}: {exc}") from None


def make_batch(model: str | ReferenceModel, batch_size: int | None = None, seed: int = 0,
               **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch for ``model`` (a name, built with ``model_kwargs``, or an instance)."""
    if isinstance(model, str):
        s = spec(model)
        model = build(model, **model_kwargs)
    else:
        s = spec(model.family)
    size = s.batch_size if batch_size is None else batch_size  # (0 is refused by the model, not the default)
    return model.make_batch(size, seed=seed, **_batch_kwargs(s, model))


def _batch_kwargs(s: ModelSpec, model: ReferenceModel) -> dict[str, Any]:
    """The spec's ``batch_kwargs`` as far as this model takes them: the same values that
    :func:`dataset_for` uses (a transformer's ``seq_len`` capped at its ``max_seq_len``)."""
    fits = model.dataset_kwargs()
    return {k: fits.get(k, v) for k, v in s.batch_kwargs.items()}


def dataset_for(model: ReferenceModel, split: str = "train", seed: int = 0, **overrides: Any) -> data.Dataset:
    """The training (or ``"val"``) data set matching ``model``'s input shapes and classes."""
    s = spec(model.family)
    return data.dataset(s.dataset, split=split, seed=seed, **{**model.dataset_kwargs(), **overrides})


def describe(name: str, **kwargs: Any) -> dict[str, Any]:
    """Sizes and defaults of model ``name`` (built with ``kwargs``), as a JSON-ready dict."""
    s = spec(name)
    model = build(name, **kwargs)
    return {
        "name": s.name,
        "summary": s.summary,
        "num_params": model.num_params,
        "num_param_tensors": model.num_param_tensors,
        "num_layers": model.num_layers,
        "gradient_bytes": 4 * model.num_params,
        "batch_size": s.batch_size,
        "dataset": s.dataset,
        **_batch_kwargs(s, model),
    }


__all__ = ["MLP", "CharLSTM", "CharTransformer", "ModelSpec", "ReferenceModel", "ResNet",
           "build", "dataset_for", "describe", "make_batch", "names", "spec"]
