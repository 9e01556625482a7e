"""A checkpoint survives a machine crash (RELIABILITY.md, "A machine crash"): every file of a
save is on disk before the directory is renamed to ``step-*``, the rename is on disk before
``latest`` names it, and ``latest`` itself is written to a temporary file, fsynced, moved in
and its directory fsynced. Checked on the order of the calls ``save`` makes (as
test_convert_crash does for ``recsys convert``)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import torch

from recsys.checkpoint import write
from recsys.runtime import durable


def test_every_file_is_on_disk_before_the_rename_and_the_rename_before_latest(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    events: list[tuple[str, Path]] = []
    real_file, real_dir, real_replace = durable.fsync_file, durable.fsync_dir, os.replace

    def fsync_file(p):
        events.append(("fsync", Path(p)))
        real_file(p)

    def fsync_dir(p):
        events.append(("fsync dir", Path(p)))
        real_dir(p)

    def replace(a, b):
        events.append(("move", Path(b)))
        real_replace(a, b)

    # write.py calls fsync_file and fsync_dir by its own names, fsync_tree through durable's
    monkeypatch.setattr(durable, "fsync_file", fsync_file)
    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    monkeypatch.setattr(write, "fsync_file", fsync_file)
    monkeypatch.setattr(write, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(write, "_fsync_tree", durable.fsync_tree)
    monkeypatch.setattr(os, "replace", replace)
    rows = pa.table({"key": pa.array([1, 2, 3], pa.int64()), "embedding": pa.array([[0.5], [0.25], [0.125]])})
    final = write.save(root, 7, sparse={"t": rows}, dense={"w": torch.ones(2)}, meta={}, keep_last=2)

    moves = [i for i, (what, p) in enumerate(events) if what == "move"]
    into_step = next(i for i in moves if events[i][1] == final)
    into_latest = next(i for i in moves if events[i][1] == root / "latest")
    files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    assert {Path("complete.json"), Path("dense.pt"), Path("meta.json")} <= set(files)
    tmp = root / f".tmp-{final.name}"
    synced = {p for what, p in events[:into_step] if what == "fsync"}
    for name in files:
        assert tmp / name in synced, f"{name} was renamed into {final.name} before it was fsynced"
    synced_dirs = {p for what, p in events[:into_step] if what == "fsync dir"}
    assert {tmp, tmp / "sparse", tmp / "sparse" / "t"} <= synced_dirs
    assert ("fsync dir", root) in events[into_step:into_latest], "the rename was not fsynced before latest named it"
    assert ("fsync", root / ".latest.tmp") in events[:into_latest], "latest was moved in before it was fsynced"
    assert ("fsync dir", root) in events[into_latest:], "latest's directory was not fsynced after the move"
    assert (root / "latest").read_text().strip() == final.name
