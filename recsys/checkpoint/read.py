"""Reading checkpoints without torch: find one from any path a user gives, its meta, its rows.

The layout is written by ``recsys.checkpoint.write`` (see its module picture). This half
needs only pyarrow (``load_dense`` alone imports torch, when called), so the lookup service
and ``recsys export`` read checkpoints without torch. Every command that takes a checkpoint resolves it with ``resolve``, which accepts:

    RUN_DIR                          a run directory      → its checkpoints/latest
    RUN_DIR/checkpoints              a checkpoints/ dir   → its latest
    RUN_DIR/checkpoints/latest       the pointer file     → the checkpoint it names
    RUN_DIR/checkpoints/best         the best one (``train.eval.keep_best``)
    RUN_DIR/checkpoints/step-00000100  one checkpoint     → itself
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from recsys.errors import UserError

FORMAT_VERSION = 1
MARKER = "complete.json"
"""Written last into a checkpoint (before its rename into place): every file's size."""

class CheckpointError(UserError):
    """A checkpoint this recsys cannot read (another format, a damaged meta.json)."""


__all__ = ["CheckpointError", "FORMAT_VERSION", "MARKER", "SavedTables", "incomplete", "latest", "resolve", "load_meta", "load_sparse",
           "sparse_files"]

log = logging.getLogger(__name__)
_SHARD = re.compile(r"^rank-(\d{5})-of-(\d{5})\.parquet$")


def incomplete(path: str | os.PathLike) -> str | None:
    """Return why the checkpoint at ``path`` is not complete, or None when it is.

    Complete: ``meta.json`` and the marker, with every file the marker lists there at its
    size. The marker is required: a directory without it is a save in progress or cut
    short (a ``.tmp-step-*`` can hold every shard's name while a shard is still short)."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        return f"{path}: no meta.json"
    marker = path / MARKER
    if not marker.is_file():
        return (f"{path}: no {MARKER} (expected the completeness marker a finished save writes last; "
                "found none: a save in progress or cut short)")
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{marker}: unreadable"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f}: missing (listed in {MARKER})"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, {MARKER} says {size} (truncated or changed)"
    return None


def _complete_steps(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir() and incomplete(p) is None)


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """Return the newest complete checkpoint under ``ckpt_root`` (None: there is none).

    The ``latest`` pointer names it; if the pointer is missing or names a checkpoint that is
    not complete (a crash, a lost file), the newest complete ``step-*`` is taken instead."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        why = incomplete(path)
        if why is None:
            return path
        fallback = _complete_steps(root)
        if not fallback:
            raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint ({why}), "
                                    f"and no other complete checkpoint is in {root}")
        log.warning("%s names %s, which is not complete (%s); using %s", pointer, path.name, why,
                    fallback[-1].name)
        return fallback[-1]
    found = _complete_steps(root)
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """Return the checkpoint directory meant by ``path`` (see the module doc for the forms)."""
    path = Path(path)
    if path.is_file() and path.name == "best":
        found = path.parent / path.read_text().strip()
        why = incomplete(found)
        if why is not None:
            raise FileNotFoundError(f"{path} names {found.name}, which is not a complete checkpoint: {why}")
    elif path.is_file() and path.name == "latest":
        found = latest(path.parent)
    elif (path / "meta.json").exists():
        why = incomplete(path)
        if why is not None:
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {why}")
        return path
    elif (path / "latest").is_file() or any(path.glob("step-*")):
        found = latest(path)  # no pointer yet: a crash between the first rename and its write
    elif (path / "checkpoints" / "latest").is_file() or any(path.glob("checkpoints/step-*")):
        found = latest(path / "checkpoints")
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint, checkpoints/ directory or run directory")
    else:
        raise FileNotFoundError(
            f"{path}: not a checkpoint: expected a step directory (with meta.json), a run directory, "
            "a checkpoints/ directory or its 'latest' file"
        )
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint in it yet")
    return found


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's meta.json, checking the format version."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: not a checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{meta_path}: not JSON ({exc})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format_version {meta.get('format_version')}, this recsys reads "
                              f"{FORMAT_VERSION}")
    return meta


def sparse_files(path: str | os.PathLike, table: str) -> list[Path]:
    """Return the shard files of ``table`` in the checkpoint at ``path``: one per saving rank,
    all of them (``FileNotFoundError`` naming the missing ones otherwise)."""
    folder = Path(path) / "sparse" / table
    files = sorted(folder.glob("rank-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{folder}: no shards of table {table!r}")
    world = {int(m.group(2)) for f in files if (m := _SHARD.match(f.name))}
    if len(world) != 1:
        raise FileNotFoundError(f"{folder}: shards of different world sizes {sorted(world)}")
    (w,) = world
    missing = sorted({f"rank-{r:05d}-of-{w:05d}.parquet" for r in range(w)} - {f.name for f in files})
    if missing:
        raise FileNotFoundError(f"{folder}: shards {missing} of table {table!r} are missing")
    return files


class SavedTables(Mapping):
    """A checkpoint's saved rows per table (all ranks' shards concatenated), read from its
    files when a table is asked for and not kept: a caller that walks the tables (a store's
    restore) holds one table's rows at a time, not every table's. Every table's shards are
    checked to exist up front."""

    def __init__(self, path: str | os.PathLike, names: list[str]) -> None:
        self.path = Path(path)
        self._files = {name: sparse_files(path, name) for name in names}

    def __getitem__(self, name: str) -> pa.Table:
        return pa.concat_tables(pq.read_table(f) for f in self._files[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_sparse(path: str | os.PathLike, tables: list[str] | None = None) -> SavedTables:
    """Return every saved row per table (``SavedTables``: read per table on access)."""
    root = Path(path) / "sparse"
    names = tables if tables is not None else sorted(p.name for p in root.iterdir() if p.is_dir())
    return SavedTables(path, names)


def load_dense(path: str | os.PathLike) -> dict[str, Any]:
    """Return the dense state (tensors and plain data only; no code is unpickled). The one
    reader here that needs torch (imported on call): the trainer's restore and ``recsys eval``."""
    import torch

    return torch.load(Path(path) / "dense.pt", map_location="cpu", weights_only=True)
