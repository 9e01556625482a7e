"""Making writes survive a crash: fsync of files and directories (no torch here).

A file renamed into place is whole after a power loss only if its bytes were fsynced
before the rename and its directory after it; the checkpoint writer, ``recsys convert``
and ``recsys eval --predictions`` all go through these.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s bytes to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush ``path``'s entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and directory under ``root`` (``root`` included)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(dirpath)
