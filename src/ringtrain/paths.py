"""Paths as the user gave them: a leading ``~`` is their home folder, as a shell would make it.

A shell expands ``--checkpoint-dir ~/ckpt`` but not ``--checkpoint-dir=~/ckpt``, and Python
never does: such a path was taken literally and made a folder named ``~`` in the working
directory (one that ``rm -rf ~`` then "cleans up" with the home folder). Every path a user
gives (an option, a positional, a path parameter of the Python API) goes through
:func:`user_path` once, where it is taken in: a command's argparse ``type``, a settings class's
``__post_init__``. What follows, messages included, sees the expanded path.
"""

from __future__ import annotations

import os


def user_path(path: str | os.PathLike) -> str:
    """``path`` with a leading ``~`` or ``~user`` made that user's home folder (os.path.expanduser);
    any other path as it is ('' stays '')."""
    return os.path.expanduser(path)


def user_paths(value: str) -> str:
    """A comma-separated list (``--model a.json,~/b.csv``) with :func:`user_path` applied to each item
    that begins with ``~`` (spaces around it taken); the others (names, ``key=value``) as given."""
    return ",".join(user_path(item.strip()) if item.strip().startswith("~") else item for item in value.split(","))
