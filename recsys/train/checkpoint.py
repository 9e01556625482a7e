"""Checkpoints keyed by id, restorable at any world size; atomic, with a ``latest`` pointer.

Layout::

    RUN_DIR/checkpoints/
    ├── latest                      text: the name of the newest complete checkpoint
    ├── best                        text: the best one by train.keep_best (kept past keep_last)
    ├── step-00000100/
    │   ├── meta.json               step, world size, reader state, time, format version
    │   ├── dense.pt                model + dense optimizer + scheduler + RNG (tensors only;
    │   │                           loaded with weights_only=True: no pickle of code)
    │   ├── sparse/<table>/rank-00000-of-00002.parquet
    │   │                           (key, embedding, optimizer state, last_seen) rows
    │   └── complete.json           written last: every file above with its size
    └── .tmp-step-00000200/         being written; never read; removed on restart

Every rank writes its own sparse shard into the temp dir; after a barrier rank 0 fsyncs,
renames the directory into place, then replaces ``latest`` (write temp, fsync, rename).
A crash at any point leaves ``latest`` naming a complete checkpoint. Loading checks the
marker (``recsys.checkpoint_files.incomplete``): a checkpoint with a file missing or of
another size is never loaded, and ``latest()`` falls back to the newest complete one. Loading
reads every shard of every table and keeps the rows this rank owns, so N ranks → M ranks works.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

# the read side needs no torch (the lookup service and `recsys export` use it)
from recsys.checkpoint_files import (FORMAT_VERSION, MARKER, incomplete, latest, load_meta,  # noqa: F401
                                    load_sparse, resolve)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(Path(dirpath) / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def checkpoint_name(step: int) -> str:
    """Return the directory name of the checkpoint taken after ``step`` steps."""
    return f"step-{step:08d}"


def save(
    ckpt_root: str | os.PathLike,
    step: int,
    *,
    sparse: dict[str, pa.Table],
    dense: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a checkpoint (collective: every rank calls it); return its final path."""
    root = Path(ckpt_root)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    for table, rows in sparse.items():
        out = tmp / "sparse" / table
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, out / f"rank-{rank:05d}-of-{world:05d}.parquet", compression="zstd")
    if rank == 0:
        torch.save(dense, tmp / "dense.pt")
        info = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                "saved_at": time.time(), "tables": sorted(sparse), **meta}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
    _barrier()
    final = root / name
    if rank == 0:
        if (final / "meta.json").exists():
            # a re-save of the same step (e.g. SIGTERM right after a periodic save): the same
            # training state is already saved, and ``latest`` may name it; deleting it before
            # the rename would leave ``latest`` naming nothing if we died in between
            shutil.rmtree(tmp)
        else:
            _write_marker(tmp)
            _fsync_tree(tmp)
            if final.exists():  # a directory without meta.json is no checkpoint
                shutil.rmtree(final)
            os.replace(tmp, final)
        _fsync_dir(root)
        set_pointer(root, "latest", name)
        _prune(root, keep_last, keep=name)
    _barrier()
    return final


def set_pointer(root: str | os.PathLike, pointer: str, name: str) -> None:
    """Make the file ``root/pointer`` (``latest``, ``best``) name checkpoint ``name``, atomically."""
    root = Path(root)
    tmp = root / f".{pointer}.tmp"
    tmp.write_text(name + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, root / pointer)
    _fsync_dir(root)


def _write_marker(tmp: Path) -> None:
    """Write the completeness marker: every file of the checkpoint with its size (written last)."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MARKER).write_text(json.dumps({"files": files}, indent=1))


def _prune(root: Path, keep_last: int, keep: str) -> None:
    done = sorted(p for p in root.glob("step-*") if incomplete(p) is None)
    best = (root / "best").read_text().strip() if (root / "best").is_file() else None
    for old in done[:-keep_last] if keep_last > 0 else []:
        if old.name not in (keep, best):  # the best checkpoint outlives keep_last
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        if stale.name != f".tmp-{keep}":
            shutil.rmtree(stale, ignore_errors=True)


def load_dense(path: str | os.PathLike) -> dict[str, Any]:
    """Return the dense state (tensors and plain data only; no code is unpickled)."""
    return torch.load(Path(path) / "dense.pt", map_location="cpu", weights_only=True)
