"""The default text: the Python standard library's own source files.

Every machine that can run ringtrain has them, so the language-model workload needs no
download and no vocabulary file (the vocabulary is the 256 byte values).

Words:

- *corpus*: the concatenated bytes of the ``.py`` files under the standard-library
  directory (``sysconfig.get_paths()["stdlib"]``), walked in a fixed order (directories and
  files sorted by name), skipping ``site-packages``, ``dist-packages`` and ``__pycache__``
  (their contents vary between installs), and cut at ``max_bytes``.
- *digest*: SHA-256 of the corpus. The corpus is the same on two machines exactly when
  they run the same Python build; ranks on different hosts can compare digests before
  training.
- *window* ``i``: bytes ``[i·L, i·L + L + 1)`` of a split, for sequence length ``L``; its
  first ``L`` bytes are the input and its last ``L`` the next-byte targets. Windows do
  not overlap, so the split holds ``(len - 1) // L`` samples.
- *split*: ``"train"`` is the first 95% of the corpus, ``"val"`` the rest.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

DEFAULT_MAX_BYTES = 4 * 2**20
SPLITS = ("train", "val")
_VAL_FRACTION = 0.05
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class TextCorpus:
    """Bytes of text and where they came from."""

    data: bytes
    """The corpus."""
    files: tuple[str, ...]
    """Paths read, relative to ``root``, in reading order (the last may be cut short)."""
    root: str
    """The directory walked."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def split(self, name: str) -> bytes:
        """The ``"train"`` (first 95%) or ``"val"`` (last 5%) part."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        cut = len(self.data) - int(len(self.data) * _VAL_FRACTION)
        return self.data[:cut] if name == "train" else self.data[cut:]


def stdlib_dir() -> Path:
    """The standard library's directory of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk_py_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


@functools.lru_cache(maxsize=4)
def text_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> TextCorpus:
    """Read up to ``max_bytes`` of ``.py`` source under ``root`` (default: the stdlib)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2:
        raise ValueError(f"max_bytes must be an integer >= 2, got {max_bytes!r}")
    base = Path(root) if root is not None else stdlib_dir()
    if not base.is_dir():
        raise ValueError(f"root must be a directory, got {str(base)!r}")
    chunks: list[bytes] = []
    files: list[str] = []
    size = 0
    for path in _walk_py_files(base):
        try:
            content = path.read_bytes()
        except OSError:  # unreadable file: skip it, the walk order stays fixed
            continue
        content = content[:max_bytes - size]
        chunks.append(content)
        files.append(path.relative_to(base).as_posix())
        size += len(content)
        if size >= max_bytes:
            break
    if size < 2:
        raise ValueError(f"no .py source found under {str(base)!r}")
    return TextCorpus(b"".join(chunks), tuple(files), str(base))


class TextWindows:
    """Language-model samples: non-overlapping windows of a byte string."""

    def __init__(self, data: bytes, seq_len: int = 64):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        if len(data) < seq_len + 1:
            raise ValueError(f"text of {len(data)} bytes is shorter than one window (seq_len + 1 = {seq_len + 1})")
        self.seq_len = seq_len
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # widened per batch
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both ``(len(indices), seq_len)`` int64."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)})")
        windows = self.tokens[idx[:, None] * self.seq_len + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]
