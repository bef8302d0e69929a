"""Checks, before a run, that the file or folder its output goes to can be written.

A run that found out only at its end that its results could not be saved lost them (a sweep
of minutes, a benchmark, the first checkpoint). Each check makes a file where the output goes
and removes it (``os.access`` says yes to root where writes fail, /sys say), and raises
ValueError naming the option that gave the path, in the same words for every command.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_file(path: str | Path, option: str) -> Path:
    """``path`` as a Path; ValueError naming ``option`` unless it can be written: not a folder,
    in a folder that exists and takes files."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: a folder, not a file")
    if not target.parent.is_dir():
        raise ValueError(f"{option} {path}: no folder {target.parent}")
    _try_a_file(target.parent, f"{option} {path}")
    return target


def check_folder(path: str | Path, option: str, *, make: bool = False) -> Path:
    """``path`` as a Path; ValueError naming ``option`` unless it is a folder, or can be made as
    one, that takes files. ``make``: make it now (a run that saves as it goes); else it is left
    to the run, and the nearest folder above it that exists is tried (a run refused later
    leaves no empty folder behind)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {path}: a file, not a folder")
    above = next(p for p in (folder, *folder.parents) if p.exists())
    if not above.is_dir():
        raise ValueError(f"{option} {path}: {above} is a file, not a folder")
    if make:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{option} {path}: cannot make it ({exc.strerror or exc})") from None
        above = folder
    _try_a_file(above, f"{option} {path}")
    return folder


def _try_a_file(folder: Path, prefix: str) -> None:
    """A file made in ``folder`` and removed; ValueError starting with ``prefix`` if it cannot be."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{prefix}: cannot write in {folder} ({exc.strerror or exc})") from None
