"""Row audit: which training rows the final trajectory of a run consumed, per epoch.

With ``train.record_rows = true`` (and ``row_id`` among ``data.train.passthrough``) every
rank appends, after each step, the ``row_id`` of the rows it trained on to
``RUN_DIR/rows/<attempt>/rank-<r>.i64``: little-endian int64 triples
``(epoch, step, row_id)``, written straight to the kernel with ``os.write`` (a ``kill -9``
loses nothing already written; nothing is buffered in the process). An *attempt* is one
start of the training processes (a launch, a torchrun restart, a membership change); its
directory is named by rank 0::

    attempt-<index, 5 digits>-from-<step it resumed from, 8 digits>-<time_ns>

``index`` counts the attempts already in ``rows/``, so the names sort in the order the
attempts ran (on every node of a multi-node job: the directory is on the shared run
directory, and only rank 0 names it).

An attempt that resumed from step ``c`` rolled back every step after ``c`` of the attempts
before it: ``consumed`` replays the attempts in order, dropping earlier records of steps
``> c`` before adding the attempt's own, and returns what is left: the rows the checkpoints
and the final model actually saw. Exactly-once delivery means each epoch's array is a
permutation of the split's row ids (``check_exactly_once``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

ROWS_DIR = "rows"


def attempt_name(rows_dir: Path, start_step: int) -> str:
    """Return the next attempt's directory name (called by rank 0 only)."""
    index = len([p for p in rows_dir.glob("attempt-*") if p.is_dir()]) if rows_dir.is_dir() else 0
    return f"attempt-{index:05d}-from-{start_step:08d}-{time.time_ns()}"


class RowRecorder:
    """Appends one rank's ``(epoch, step, row_id)`` records of one attempt."""

    def __init__(self, run_dir: Path, attempt: str, rank: int) -> None:
        where = Path(run_dir) / ROWS_DIR / attempt
        where.mkdir(parents=True, exist_ok=True)
        self.path = where / f"rank-{rank:05d}.i64"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, epoch: int, step: int, row_ids: np.ndarray) -> None:
        """Append the rows of one step (nothing for an empty batch)."""
        n = int(row_ids.size)
        if not n:
            return
        out = np.empty((n, 3), dtype="<i8")
        out[:, 0] = epoch
        out[:, 1] = step
        out[:, 2] = row_ids
        data = memoryview(out.tobytes())
        while data:  # os.write may write less than asked
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_attempt(path: Path) -> np.ndarray:
    parts = []
    for f in sorted(path.glob("rank-*.i64")):
        raw = np.fromfile(f, dtype="<i8")
        if raw.size % 3:
            raise ValueError(f"{f}: {raw.size * 8} bytes is not a whole number of 24-byte records")
        parts.append(raw.reshape(-1, 3))
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype="<i8")


def consumed(run_dir: str | os.PathLike) -> dict[int, np.ndarray]:
    """Return ``{epoch: row ids}`` of the run's final trajectory (see the module doc)."""
    rows_dir = Path(run_dir) / ROWS_DIR
    attempts = sorted(p for p in rows_dir.glob("attempt-*") if p.is_dir())
    if not attempts:
        raise FileNotFoundError(f"{rows_dir}: no recorded rows (train with train.record_rows = true)")
    kept = np.empty((0, 3), dtype="<i8")
    for path in attempts:
        start = int(path.name.split("-")[3])
        kept = np.concatenate([kept[kept[:, 1] <= start], _read_attempt(path)])
    return {int(e): kept[kept[:, 0] == e, 2] for e in np.unique(kept[:, 0])}


def check_exactly_once(run_dir: str | os.PathLike, row_ids: np.ndarray, epochs: int) -> dict:
    """Compare each epoch's consumed rows with the split's ``row_ids``.

    Returns ``{"epochs": {e: {"rows", "missing", "repeated", "foreign"}}, "ok": bool}``:
    ``missing`` rows never consumed, ``repeated`` extra deliveries of a row, ``foreign`` ids
    not in the split."""
    want = np.sort(np.asarray(row_ids, dtype=np.int64))
    got = consumed(run_dir)
    report: dict = {"epochs": {}, "ok": True}
    for epoch in range(epochs):
        ids = np.sort(got.get(epoch, np.empty(0, np.int64)))
        uniq, counts = np.unique(ids, return_counts=True)
        entry = {
            "rows": int(ids.size),
            "missing": int(np.setdiff1d(want, uniq, assume_unique=True).size),
            "repeated": int((counts - 1).sum()),
            "foreign": int(np.setdiff1d(uniq, want, assume_unique=True).size),
        }
        report["epochs"][epoch] = entry
        report["ok"] &= entry["missing"] == entry["repeated"] == entry["foreign"] == 0
    extra = sorted(set(got) - set(range(epochs)))
    if extra:
        report["ok"] = False
        report["unexpected_epochs"] = extra
    return report
