"""The default text: the Python standard library's own source files.

Every machine that can run ringtrain has them, so the language-model workload needs no
download and no vocabulary file (the vocabulary is the 256 byte values).

Words:

- *corpus*: the concatenated bytes of the ``.py`` files under the standard-library
  directory (``sysconfig.get_paths()["stdlib"]``), walked in a fixed order (directories and
  files sorted by name), cut at ``max_bytes``. Skipped, because their contents vary between
  installs or builds of one Python version: the directories ``site-packages``,
  ``dist-packages``, ``__pycache__`` and ``config-*`` (the build's Makefile and
  ``python-config.py``), and the files ``_sysconfigdata*.py`` (the build's compiler flags and
  paths), ``site.py``, ``sitecustomize.py``, ``usercustomize.py`` and
  ``_distutils_system_mod.py`` (rewritten by distributions and environments).
- *digest*: SHA-256 of the corpus. Distributions still patch some standard modules, so two
  machines can read different corpora; ``check_same_corpus`` compares digests and lengths
  across the ranks of a job before training.
- *window* ``i``: bytes ``[i·L, i·L + L + 1)`` of a split, for sequence length ``L``; its
  first ``L`` bytes are the input and its last ``L`` the next-byte targets. Windows do
  not overlap, so the split holds ``(len - 1) // L`` samples.
- *split*: ``"train"`` is the first 95% of the corpus, ``"val"`` the rest.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

DEFAULT_MAX_BYTES = 4 * 2**20
SPLITS = ("train", "val")
_VAL_FRACTION = 0.05
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SKIP_DIR_PREFIXES = ("config-",)
_SKIP_FILES = frozenset({"site.py", "sitecustomize.py", "usercustomize.py", "_distutils_system_mod.py"})
_SKIP_FILE_PREFIXES = ("_sysconfigdata",)


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


def _walk_py_files(root: Path, dirs: list[str]):
    """The ``.py`` files under ``root`` in reading order; each directory is added to ``dirs`` as
    it is listed."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirs.append(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(_SKIP_DIR_PREFIXES))
        for name in sorted(filenames):
            if name.endswith(".py") and name not in _SKIP_FILES and not name.startswith(_SKIP_FILE_PREFIXES):
                yield Path(dirpath, name)


def _no_stdlib_source(base: Path) -> str:
    """Why the standard library's source cannot be read from ``base``, and what to do."""
    if not base.is_dir():
        found = "that directory does not exist"
    elif any(base.glob("*.pyc")) or any(base.glob("__pycache__/*.pyc")):
        found = "it holds compiled .pyc files but no .py source (a stripped install)"
    else:
        found = "it holds no .py files"
    zips = [p for p in sys.path if p.endswith(".zip") and os.path.isfile(p)]
    if zips:
        found += f"; this Python imports its standard library from {zips[0]}, which is not read"
    return (
        f"the 'text' data set reads the Python standard library's .py source, looked for in {str(base)!r} "
        f"(sysconfig's stdlib path of {sys.executable}), but {found}. Install the standard library's "
        f"source for Python {sys.version_info.major}.{sys.version_info.minor} (a full build: python.org, "
        "pyenv, conda, or the distribution's complete python package), pass root=DIRECTORY of .py files "
        "(ringtrain.data.text_corpus, dataset('text', root=...)), or use a model on the 'images' or "
        "'vectors' data set"
    )


#: The last reads of text_corpus, by (max_bytes, the directory's real path): each with the paths
#: it walked (directories as listed, files as read) and their stats then (see _stats).
_reads: OrderedDict[tuple[int, str], tuple[tuple[str, ...], tuple, TextCorpus]] = OrderedDict()
_reads_lock = threading.Lock()
_READS_KEPT = 4


def text_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> TextCorpus:
    """Read up to ``max_bytes`` of ``.py`` source under ``root`` (default: the stdlib).

    The last few reads are kept and one is returned again (the same object) while none of the
    directories and files it walked has changed since: a file edited, added or removed there is
    read anew, and a relative ``root`` is the directory it names now (after a chdir). A cache by
    the arguments alone returned the old text after either."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2:
        raise ValueError(f"max_bytes must be an integer >= 2, got {max_bytes!r}")
    base = Path(root) if root is not None else stdlib_dir()
    if root is None and not base.is_dir():
        raise ValueError(_no_stdlib_source(base))
    if not base.is_dir():
        raise ValueError(f"root must be a directory, got {str(base)!r}")
    key = (max_bytes, os.path.realpath(base))
    with _reads_lock:
        kept = _reads.get(key)
    if kept is not None and _stats(kept[0]) == kept[1]:
        return kept[2]
    dirs: list[str] = []
    read: list[str] = []
    read_stats: list = []
    chunks: list[bytes] = []
    files: list[str] = []
    size = 0
    for path in _walk_py_files(base, dirs):
        stat = _stats([path])  # (before the read: a change during it is seen at the next call)
        try:
            content = path.read_bytes()
        except OSError:  # unreadable file: skip it, the walk order stays fixed
            continue
        read.append(str(path))
        read_stats.extend(stat)
        content = content[:max_bytes - size]
        chunks.append(content)
        files.append(path.relative_to(base).as_posix())
        size += len(content)
        if size >= max_bytes:
            break
    if size < 2:
        raise ValueError(_no_stdlib_source(base) if root is None else f"no .py source found under {str(base)!r}")
    corpus = TextCorpus(b"".join(chunks), tuple(files), str(base))
    with _reads_lock:
        _reads[key] = ((*dirs, *read), (*_stats(dirs), *read_stats), corpus)
        _reads.move_to_end(key)
        while len(_reads) > _READS_KEPT:
            _reads.popitem(last=False)
    return corpus


def _stats(paths) -> tuple:
    """Each path's modification time (ns) and size; None for one that is gone."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


text_corpus.cache_clear = _reads.clear  # type: ignore[attr-defined]  # (as functools' caches have)


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

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the text (as ``TextCorpus.digest``)."""
        return hashlib.sha256(self.tokens.numpy()).hexdigest()

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both ``(n, seq_len)`` int64, for the ``n`` indices read flat (of any
        shape, a single index too, as the other data sets' ``batch`` reads them: a 2-D array of
        indices was a RuntimeError of torch's, or a batch with no columns)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)})")
        windows = self.tokens[idx[:, None] * self.seq_len + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]


_DIGEST_BYTES = 32


def _fingerprint(text: Any) -> bytes | None:
    """SHA-256 (32 bytes) and length (8, little-endian) of a text; None for anything else."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        digest, length = hashlib.sha256(text).hexdigest(), len(text)
    elif isinstance(text, TextCorpus):
        digest, length = text.digest, len(text.data)
    elif isinstance(text, TextWindows):
        digest, length = text.digest, len(text.tokens)
    else:
        return None
    return bytes.fromhex(digest) + length.to_bytes(8, "little")


def _raise_if_differ(rows: Sequence[bytes]) -> None:
    """The ValueError of check_same_corpus when the ranks' fingerprints ``rows`` differ."""
    ranks_of: dict[bytes, list[int]] = {}
    for r, row in enumerate(rows):
        ranks_of.setdefault(bytes(row), []).append(r)
    if len(ranks_of) == 1:
        return
    groups = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
        f"{int.from_bytes(key[_DIGEST_BYTES:], 'little')} bytes, sha256 {key[:6].hex()}..."
        for key, ranks in ranks_of.items()
    ]
    differ = [r for key, ranks in ranks_of.items() for r in ranks if 0 not in ranks]
    raise ValueError(
        f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, sorted(differ)))} read a different text "
        f"corpus from rank 0 ({'; '.join(groups)}). The 'text' data set is the Python standard library's "
        "source, which differs between Python builds and distributions: run every rank with the same "
        "Python build, or give every rank the same root= directory"
    )


def check_same_corpus(comm: Any, text: Any) -> None:
    """Raise ``ValueError`` on every rank of ``comm`` unless all of them hold the same text.

    ``text``: a ``TextCorpus``, ``TextWindows`` or bytes; its SHA-256 and length are gathered
    from every rank (one ``allgather`` of 40 bytes each) and compared, and the error names the
    ranks that differ from rank 0. Anything else (the synthetic data sets, a pure function of
    the seed) is not compared and nothing is sent: every rank must pass the same kind.
    """
    mine = _fingerprint(text)
    if mine is None:
        return
    width = len(mine)
    table = np.zeros(comm.world_size * width, dtype=np.uint8)
    table[comm.rank * width:(comm.rank + 1) * width] = np.frombuffer(mine, dtype=np.uint8)
    comm.allgather(table)
    _raise_if_differ([row.tobytes() for row in table.reshape(comm.world_size, width)])


def check_same_corpus_in_store(store: Any, rank: int, world_size: int, text: Any,
                               key: str = "ringtrain/corpus") -> None:
    """``check_same_corpus`` through a key-value store (``torch.distributed.TCPStore``: ``set``,
    and ``get`` that waits for the key within the store's timeout), for ranks with no
    communicator among them (the workers of a parameter-server job). A rank's n-th check with
    ``key`` in one store compares with the others' n-th (the "val" split after "train": a rank
    that checked its first never meets what a slower rank put for its first); a check that ran
    out of time is not counted, so trying it again meets the others' same one."""
    mine = _fingerprint(text)
    if mine is None:
        return
    try:
        done = _STORE_CHECKS.setdefault(store, {})
    except TypeError:  # (a store that takes no weak reference: every check under ``key`` itself)
        done = {}
    n = done.get((key, rank), 0)
    slot = key if n == 0 else f"{key}/{n + 1}"
    store.set(f"{slot}/{rank}", mine)
    rows = [store.get(f"{slot}/{r}") for r in range(world_size)]
    done[(key, rank)] = n + 1
    _raise_if_differ(rows)


#: Per store, the checks each (key, rank) of this process completed in it (threads may be ranks).
_STORE_CHECKS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, int], int]]" = weakref.WeakKeyDictionary()
