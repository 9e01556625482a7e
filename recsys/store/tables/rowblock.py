"""Rows with everything a table keeps of them, outside a table: ``RowBlock``, and the Arrow
columns of a table's ``state_dict`` (what a table and its spill tier both read and write).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(slots=True)
class RowBlock:
    """Rows with everything a table keeps of them (``state_dict`` columns as numpy arrays)."""

    keys: np.ndarray
    """int64 [N]."""
    emb: np.ndarray
    """[N, D] in the table's storage dtype (float32 or float16)."""
    states: dict[str, np.ndarray]
    """Optimizer state per ``optim.state_columns`` name: [N, D] or [N]."""
    last_seen: np.ndarray
    """int64 [N]: step of each row's last access."""

    @property
    def num_rows(self) -> int:
        """Return N."""
        return int(self.keys.shape[0])

    def take(self, idx) -> "RowBlock":
        """Return the rows at ``idx`` (an index array or a boolean mask), copied."""
        return RowBlock(self.keys[idx], self.emb[idx], {k: v[idx] for k, v in self.states.items()},
                        self.last_seen[idx])

    @staticmethod
    def concat(blocks: "list[RowBlock]") -> "RowBlock":
        """Return the rows of ``blocks`` (at least one) one after another."""
        if len(blocks) == 1:
            return blocks[0]
        return RowBlock(
            np.concatenate([b.keys for b in blocks]),
            np.concatenate([b.emb for b in blocks]),
            {k: np.concatenate([b.states[k] for b in blocks]) for k in blocks[0].states},
            np.concatenate([b.last_seen for b in blocks]),
        )


# --------------------------------------------------------------------------- Arrow columns


def fixed_list(values_ND: np.ndarray, dim: int) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values_ND).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, dim)


def _column(rows: pa.Table, name: str, where: str) -> pa.Array:
    col = rows.column(name)
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if arr.null_count:
        raise ValueError(f"{where}: column {name!r} has {arr.null_count} null value(s)")
    return arr


def vector_column(rows: pa.Table, name: str, where: str, dtype) -> np.ndarray:
    arr = _column(rows, name, where)
    if arr.type != pa.from_numpy_dtype(dtype):
        raise ValueError(f"{where}: column {name!r} has type {arr.type}, expected {pa.from_numpy_dtype(dtype)}")
    return arr.to_numpy(zero_copy_only=False)


def int64_column(rows: pa.Table, name: str, where: str) -> np.ndarray:
    return vector_column(rows, name, where, np.int64)


def matrix_column(rows: pa.Table, name: str, dim: int, where: str, dtypes) -> np.ndarray:
    arr = _column(rows, name, where)
    allowed = [pa.list_(pa.from_numpy_dtype(d), dim) for d in dtypes]
    if arr.type not in allowed:
        raise ValueError(f"{where}: column {name!r} has type {arr.type}, expected one of {allowed}")
    flat = arr.flatten()  # honours slicing, unlike .values
    if flat.null_count:
        raise ValueError(f"{where}: column {name!r} has {flat.null_count} null element(s)")
    return flat.to_numpy(zero_copy_only=False).reshape(-1, dim)
