"""Data without download: the stdlib's source as text, synthetic images and vectors.

    corpus = ringtrain.data.text_corpus()                  # bytes of stdlib .py files
    ds = ringtrain.data.dataset("text", seq_len=64)        # or "images", "vectors"
    loader = ringtrain.data.ShardedLoader(ds, batch_size=32, rank=r, world_size=p, seed=0)
    x, y = loader.next_batch()
    state = loader.state_dict()                            # save in the checkpoint

Rank slices of one step, concatenated in rank order, are the batch of one process with
``batch_size = p·b`` (see :mod:`ringtrain.data.sampler`).
"""

from __future__ import annotations

from typing import Any

from .loader import Dataset, ShardedLoader
from .sampler import ShardedSampler, mix, permutation, splitmix64
from .synthetic import SyntheticImages, SyntheticVectors
from .text import (DEFAULT_MAX_BYTES, TextCorpus, TextWindows, check_same_corpus, check_same_corpus_in_store,
                   stdlib_dir, text_corpus)

KINDS = ("text", "images", "vectors")


def dataset(kind: str, split: str = "train", seed: int = 0, **kwargs: Any) -> Dataset:
    """The data set ``kind`` (a model's ``describe()["dataset"]``).

    ``text``: ``seq_len`` (64), ``max_bytes`` (4 MiB), ``root`` (the stdlib); ``split`` picks
    train or val. ``images``/``vectors``: the constructor arguments of
    :class:`SyntheticImages`/:class:`SyntheticVectors`; ``split="val"`` gives other samples
    of the same task (same teacher, sample stream 1).
    """
    if kind not in KINDS:
        raise ValueError(f"dataset kind must be one of {KINDS}, got {kind!r}")
    if kind == "text":
        seq_len = kwargs.pop("seq_len", 64)
        unknown = set(kwargs) - {"max_bytes", "root"}
        if unknown:
            raise ValueError(f"dataset 'text' accepts seq_len, max_bytes, root; got {sorted(unknown)}")
        corpus = text_corpus(**kwargs)
        return TextWindows(corpus.split(split), seq_len=seq_len)
    if split not in ("train", "val"):
        raise ValueError(f"split must be one of ('train', 'val'), got {split!r}")
    cls = SyntheticImages if kind == "images" else SyntheticVectors
    try:
        return cls(seed=seed, stream=0 if split == "train" else 1, **kwargs)
    except TypeError as exc:  # an unknown keyword
        raise ValueError(f"bad argument for dataset {kind!r}: {exc}") from None


__all__ = ["DEFAULT_MAX_BYTES", "KINDS", "Dataset", "ShardedLoader", "ShardedSampler", "SyntheticImages",
           "SyntheticVectors", "TextCorpus", "TextWindows", "check_same_corpus", "check_same_corpus_in_store", "dataset",
           "mix", "permutation", "splitmix64", "stdlib_dir", "text_corpus"]
