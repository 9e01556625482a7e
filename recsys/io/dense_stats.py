"""The dense statistics pass: one read of (a sample of) the training split's dense columns.

Row groups are the unit: a sample takes whole row groups spread evenly over the split
(``schema.dense_stats_rows``), each rank sketches every ``world_size``-th of them, and the
per-row-group sketches are merged in row-group order, so the result is the same for any
number of ranks (``recsys.features.dense.merge_all``). Values are read as the reader reads them
(float32; nulls counted, not valued); a non-finite value is a ``ReadError`` as in the reader.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pyarrow as pa

from recsys.features.dense import ColumnSketch, DenseStats, merge_all
from recsys.io.config import ReaderConfig
from recsys.io.errors import ReadError
from recsys.io.units import build_units, expand_paths, hold_out, open_parquet
from recsys.features.schema import Schema

_F32_MAX = float(np.finfo(np.float32).max)


def sampled_units(unit_rows: np.ndarray, max_rows: int) -> np.ndarray:
    """Return the indices of the row groups to read: all, or evenly spread ones holding
    about ``max_rows`` rows (at least one row group; 0 = no limit)."""
    U = unit_rows.shape[0]
    total = int(unit_rows.sum())
    if not max_rows or total <= max_rows:
        return np.arange(U)
    k = max(1, min(U, math.ceil(U * max_rows / total)))
    return np.unique(np.round(np.linspace(0, U - 1, k)).astype(np.int64))


def column_sketch(arr: pa.ChunkedArray | pa.Array, where: Callable[[int, str], ReadError]) -> ColumnSketch:
    """Return the sketch of one dense column chunk; ``where(row, found)`` makes the error
    for a non-finite value."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    valid = None
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
    x = arr.cast(pa.float64(), safe=False).fill_null(0.0).to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(x)
    if valid is not None:
        bad &= valid
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise where(row, repr(float(x[row])))
    # the reader's float32 (a value beyond its range only ever reaches the model through
    # signed_log1p, whose float64 path the statistics need not follow: clipped)
    return ColumnSketch.of(np.clip(x, -_F32_MAX, _F32_MAX).astype(np.float32), valid)


def unit_sketches(cfg: ReaderConfig, schema: Schema, rank: int = 0, world_size: int = 1,
                  filesystem=None) -> tuple[list[tuple[int, dict[str, ColumnSketch]]], int, int]:
    """Return (this rank's [(row group index, {column: sketch})], row groups sampled, row
    groups in the split) for the split ``cfg`` reads (its validation hold-out applied)."""
    files = expand_paths(cfg.paths, filesystem)
    table = build_units(files, schema, list(cfg.passthrough), cfg.on_bad_file)
    if cfg.holdout_fraction:
        table, _ = hold_out(table, cfg.holdout_fraction, cfg.holdout_seed, cfg.holdout, cfg.holdout_fold)
    chosen = sampled_units(table.unit_rows, schema.dense_stats_rows)
    out = []
    for u in chosen[rank::world_size]:
        u = int(u)
        sf = table.files[int(table.unit_file[u])]
        rg = int(table.unit_rg[u])
        pf = open_parquet(sf)
        try:
            data = pf.read_row_group(rg, columns=list(schema.dense))
        except (pa.ArrowException, OSError) as exc:
            raise ReadError(file=sf.display, row_group=rg, expected="a readable row group", found=str(exc)) from None
        finally:
            pf.close()
        sketches = {}
        for c in schema.dense:
            def where(row: int, found: str, c=c) -> ReadError:
                return ReadError(file=sf.display, row_group=rg, column=c, row=row,
                                 expected="a finite number or null", found=f"{found} (row {row} of the row group)")
            sketches[c] = column_sketch(data.column(c), where)
        out.append((u, sketches))
    return out, int(chosen.shape[0]), table.num_units


def compute(cfg: ReaderConfig, schema: Schema, rank: int = 0, world_size: int = 1,
            gather: Callable[[list], list[list]] | None = None, filesystem=None) -> DenseStats:
    """Return the dense statistics of the split ``cfg`` reads. With several ranks, each
    sketches its share and ``gather(mine) -> [every rank's]`` (a collective) combines them."""
    mine, sampled, total = unit_sketches(cfg, schema, rank, world_size, filesystem)
    parts = [mine] if gather is None else gather(mine)
    ordered = sorted((t for part in parts for t in part), key=lambda t: t[0])
    sketches = merge_all([s for _, s in ordered], list(schema.dense))
    return DenseStats.of(sketches, schema.dense_buckets, sampled, total)
