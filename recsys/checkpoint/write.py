"""Checkpoints keyed by id, restorable at any world size; atomic, with a ``latest`` pointer.

Layout::

    RUN_DIR/checkpoints/
    ├── latest                      text: the name of the newest complete checkpoint
    ├── best                        text: the best one by train.eval.keep_best (kept past keep_last)
    ├── step-00000100/
    │   ├── meta.json               step, world size, reader state, time, format version
    │   ├── dense.pt                model + dense optimizer + scheduler + RNG (tensors only;
    │   │                           loaded with weights_only=True: no pickle of code)
    │   ├── sparse/<table>/rank-00000-of-00002.parquet
    │   │                           (key, embedding, optimizer state, last_seen) rows
    │   └── complete.json           written last: every file above with its size
    ├── .tmp-step-00000200/         being written; never read; removed by the next save
    └── .del-step-00000050/         being deleted; never read; removed by the next save

Every rank writes its own sparse shard into the temp dir; after a barrier rank 0 writes the
marker, fsyncs, renames the directory into place, then replaces ``latest`` (write temp,
fsync, rename) and prunes. Loading checks the marker (``recsys.checkpoint.read.incomplete``):
a checkpoint with a file missing or of another size is never loaded, and ``latest()`` falls
back to the newest complete one. Loading reads every shard of every table and keeps the rows
this rank owns, so N ranks → M ranks works.

A crash (even ``kill -9``) at any point of a save leaves ``latest`` naming a complete
checkpoint that loads, and never leaves a half-written or half-deleted directory under a
``step-*`` name:

- before the rename, the new checkpoint is only ``.tmp-step-*`` (never read);
- between the rename and the pointer update, ``latest`` still names the previous one; the
  renamed one is complete, and the next save of that step replaces it (a resumed run's state
  is the one to keep, e.g. after a resize) unless ``latest`` or ``best`` names it, in which
  case it is the same state and is kept;
- a checkpoint is removed (by ``keep_last``, or replaced) by renaming it to ``.del-step-*``
  first, so a crash while deleting its files leaves no partial ``step-*``;
- the next save removes every ``.tmp-step-*`` and ``.del-step-*`` left behind.

Test hook (no effect and no cost when unset): ``RECSYS_FAULT_CHECKPOINT=<point>[:step=N][:rank=R]``
makes the process SIGKILL itself when a save (of step ``N``, on rank ``R``) reaches
``<point>``, in the first launch attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or
0, so a job restarted by ``--max-restarts`` runs through). Points, in save order:
``before-sparse`` (temp dir made), ``mid-sparse`` (this rank wrote its first table's shard),
``after-sparse`` (all its shards), ``after-marker`` (rank 0: marker written, before the
rename), ``before-latest`` (renamed, pointer not yet updated), ``after-latest`` (before the
prune), ``prune`` (an old checkpoint moved aside and partly deleted).
tests/test_checkpoint_crash.py kills processes at each of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

# the read side (no torch but for load_dense; the lookup service, `recsys export` and `recsys eval` use it)
from recsys.checkpoint.read import (FORMAT_VERSION, MARKER, incomplete, latest, load_dense,  # noqa: F401
                                    load_meta, load_sparse, resolve)
from recsys.runtime.durable import fsync_dir as _fsync_dir
from recsys.runtime.durable import fsync_file
from recsys.runtime.durable import fsync_tree as _fsync_tree


FAULT_ENV = "RECSYS_FAULT_CHECKPOINT"
"""The test hook's environment variable (module doc)."""
FAULT_POINTS = ("before-sparse", "mid-sparse", "after-sparse", "after-marker", "before-latest", "after-latest",
                "prune")


def _fault_point(step: int, rank: int) -> str | None:
    """Return the point where this save must kill the process (the test hook), or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    point, *conditions = spec.split(":")
    if point not in FAULT_POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown point {point!r}, expected one of {', '.join(FAULT_POINTS)}")
    for cond in conditions:
        key, _, value = cond.partition("=")
        if key not in ("step", "rank") or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected <point>[:step=N][:rank=R], found {cond!r}")
        if int(value) != (step if key == "step" else rank):
            return None
    return point


def _reached(fault: str | None, point: str) -> None:
    """The test hook: SIGKILL this process if ``fault`` is ``point``."""
    if fault == point:
        print(f"{FAULT_ENV}: killing process {os.getpid()} at {point}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


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
    sparse: Mapping[str, pa.Table] | Callable[[Callable[[str, pa.Table], None]], None],
    dense: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a checkpoint (collective: every rank calls it); return its final path.

    ``sparse``: the rows per table, or a store's ``write_state``, which hands them over one
    table at a time (so only one table's copy is in memory besides the store)."""
    root = Path(ckpt_root)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}"
    fault = _fault_point(step, rank)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    _reached(fault, "before-sparse")
    tables: list[str] = []

    def write(table: str, rows: pa.Table) -> None:
        out = tmp / "sparse" / table
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows, out / f"rank-{rank:05d}-of-{world:05d}.parquet", compression="zstd")
        tables.append(table)
        if len(tables) == 1:
            _reached(fault, "mid-sparse")

    if callable(sparse):
        sparse(write)
    else:
        for table, rows in sparse.items():
            write(table, rows)
    _reached(fault, "after-sparse")
    if rank == 0:
        torch.save(dense, tmp / "dense.pt")
        info = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                "saved_at": time.time(), "tables": sorted(tables), **meta}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2))
    _barrier()
    final = root / name
    if rank == 0:
        if incomplete(final) is None and name in _pointed(root):
            # a re-save of a step a pointer names (e.g. SIGTERM right after a periodic save,
            # or the final save right after one): the same training state is already saved;
            # replacing it would leave ``latest`` naming nothing if we died in between
            shutil.rmtree(tmp)
        else:
            _write_marker(tmp)
            _fsync_tree(tmp)
            _reached(fault, "after-marker")
            if final.exists():  # incomplete, or left by a crash before its pointer update
                _discard(final)
            os.replace(tmp, final)
        _fsync_dir(root)
        _reached(fault, "before-latest")
        set_pointer(root, "latest", name)
        _reached(fault, "after-latest")
        _prune(root, keep_last, keep=name, fault=fault)
    _barrier()
    return final


def set_pointer(root: str | os.PathLike, pointer: str, name: str) -> None:
    """Make the file ``root/pointer`` (``latest``, ``best``) name checkpoint ``name``, atomically."""
    root = Path(root)
    tmp = root / f".{pointer}.tmp"
    tmp.write_text(name + "\n")
    fsync_file(tmp)
    os.replace(tmp, root / pointer)
    _fsync_dir(root)


def _write_marker(tmp: Path) -> None:
    """Write the completeness marker: every file of the checkpoint with its size (written last)."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MARKER).write_text(json.dumps({"files": files}, indent=1))


def _pointed(root: Path) -> set[str]:
    """Return the names the ``latest`` and ``best`` pointers hold."""
    out = set()
    for pointer in ("latest", "best"):
        try:
            out.add((root / pointer).read_text().strip())
        except (OSError, UnicodeDecodeError):
            pass
    return out


def _discard(path: Path, fault: str | None = None) -> None:
    """Delete a checkpoint directory: first renamed out of the ``step-*`` names (atomic), so a
    crash while its files go leaves nothing that looks like a checkpoint."""
    aside = path.parent / f".del-{path.name}"
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(path, aside)
    if fault == "prune":
        (aside / MARKER).unlink(missing_ok=True)  # partly deleted, as a crash inside rmtree leaves it
        _reached(fault, "prune")
    shutil.rmtree(aside, ignore_errors=True)


def _prune(root: Path, keep_last: int, keep: str, fault: str | None = None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (and what a pointer names); remove
    what crashes left: ``.tmp-step-*`` (unfinished saves) and ``.del-step-*`` (unfinished deletes)."""
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and incomplete(p) is None)
    keep_names = _pointed(root) | {keep}  # the best checkpoint outlives keep_last
    for old in done[:-keep_last] if keep_last > 0 else []:
        if old.name not in keep_names:
            _discard(old, fault)
    for stale in [*root.glob(".tmp-step-*"), *root.glob(".del-step-*")]:
        shutil.rmtree(stale, ignore_errors=True)
