"""Reading checkpoints without torch: find one from any path a user gives, its meta, its rows.

The layout is written by ``recsys.train.checkpoint`` (see its module picture). This half
needs only pyarrow, so the lookup service and ``recsys export`` read checkpoints without
torch. Every command that takes a checkpoint resolves it with ``resolve``, which accepts:

    RUN_DIR                          a run directory      → its checkpoints/latest
    RUN_DIR/checkpoints              a checkpoints/ dir   → its latest
    RUN_DIR/checkpoints/latest       the pointer file     → the checkpoint it names
    RUN_DIR/checkpoints/step-00000100  one checkpoint     → itself
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1

__all__ = ["FORMAT_VERSION", "latest", "resolve", "load_meta", "load_sparse", "sparse_files"]


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """Return the newest complete checkpoint under ``ckpt_root``, or None."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def resolve(path: str | os.PathLike) -> Path:
    """Return the checkpoint directory meant by ``path`` (see the module doc for the forms)."""
    path = Path(path)
    if path.is_file() and path.name == "latest":
        found = latest(path.parent)
    elif (path / "meta.json").exists():
        return path
    elif (path / "latest").is_file():
        found = latest(path)
    elif (path / "checkpoints" / "latest").is_file():
        found = latest(path / "checkpoints")
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint, checkpoints/ directory or run directory")
    else:
        raise FileNotFoundError(
            f"{path}: not a checkpoint: expected a step directory (with meta.json), a run directory, "
            "a checkpoints/ directory or its 'latest' file"
        )
    assert found is not None  # latest() returns None only when the pointer is missing
    return found


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Return the checkpoint's meta.json, checking the format version."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: not a checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    return meta


def sparse_files(path: str | os.PathLike, table: str) -> list[Path]:
    """Return the shard files of ``table`` in the checkpoint at ``path`` (one per saving rank)."""
    folder = Path(path) / "sparse" / table
    files = sorted(folder.glob("rank-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{folder}: no shards of table {table!r}")
    return files


def load_sparse(path: str | os.PathLike, tables: list[str] | None = None) -> dict[str, pa.Table]:
    """Return every saved row per table (all ranks' shards concatenated)."""
    root = Path(path) / "sparse"
    names = tables if tables is not None else sorted(p.name for p in root.iterdir() if p.is_dir())
    return {name: pa.concat_tables(pq.read_table(f) for f in sparse_files(path, name)) for name in names}
