"""Small Parquet data sets and helpers shared by the reader tests.

Every row has a unique ``row_id``; ``DataSet.rows[row_id]`` keeps its raw values so a test
can recompute what the reader must yield (hashing with the reference implementation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.features import hashing
from recsys.io.config import ReaderConfig
from recsys.features.schema import FeatureSpec, Schema, TableSpec

DENSE = ["d1", "d2", "d3"]


def make_schema(**changes) -> Schema:
    """Return the test schema: 3 dense, int/string single-hot, int/string multi-hot."""
    schema = Schema(
        label="label",
        dense=list(DENSE),
        dense_transform="signed_log1p",  # the reader's own transform (others need the training data's statistics)
        sparse=[
            FeatureSpec(name="item", column="item_id", kind="int64", table="item"),
            FeatureSpec(name="hist", column="hist", kind="int64", multi_hot=True, table="item"),
            FeatureSpec(name="cat", column="cat", kind="string", table="cat"),
            FeatureSpec(name="tags", column="tags", kind="string", multi_hot=True, table="tags"),
        ],
        tables={
            "item": TableSpec(dim=8),
            "cat": TableSpec(dim=4, num_rows=97),
            "tags": TableSpec(dim=4),
        },
    )
    return schema.replace(**changes) if changes else schema


@dataclass
class DataSet:
    root: Path
    files: list[Path]
    rows: dict[int, dict] = field(default_factory=dict)

    @property
    def row_ids(self) -> list[int]:
        return sorted(self.rows)

    def config(self, **kw) -> ReaderConfig:
        kw.setdefault("paths", [str(self.root)])
        kw.setdefault("batch_size", 16)
        kw.setdefault("passthrough", ["row_id"])
        return ReaderConfig(**kw)


def _table(rng: np.random.Generator, first_id: int, n: int, large: bool) -> tuple[pa.Table, list[dict]]:
    rows = []
    for i in range(n):
        r = {"row_id": first_id + i, "label": int(rng.integers(0, 2))}
        r["d1"] = None if rng.random() < 0.2 else float(np.float32(rng.normal() * 100))
        r["d2"] = None if rng.random() < 0.2 else float(rng.normal() * 5)
        r["d3"] = None if rng.random() < 0.2 else int(rng.integers(-1000, 1000))
        r["item_id"] = None if rng.random() < 0.2 else int(rng.integers(-(2**62), 2**62))
        r["cat"] = None if rng.random() < 0.2 else f"c{int(rng.integers(0, 50))}-é"
        u = rng.random()
        if u < 0.15:
            r["hist"] = None
        elif u < 0.3:
            r["hist"] = []
        else:
            r["hist"] = [
                None if rng.random() < 0.1 else int(rng.integers(0, 1000))
                for _ in range(int(rng.integers(1, 6)))
            ]
        u = rng.random()
        r["tags"] = (
            None if u < 0.15 else [] if u < 0.3
            else [f"t{int(rng.integers(0, 30))}" * int(rng.integers(1, 4)) for _ in range(int(rng.integers(1, 4)))]
        )
        rows.append(r)
    str_t = pa.large_string() if large else pa.string()
    list_t = pa.large_list if large else pa.list_
    table = pa.table(
        {
            "row_id": pa.array([r["row_id"] for r in rows], pa.int64()),
            "label": pa.array([r["label"] for r in rows], pa.int8()),
            "d1": pa.array([r["d1"] for r in rows], pa.float32()),
            "d2": pa.array([r["d2"] for r in rows], pa.float64()),
            "d3": pa.array([r["d3"] for r in rows], pa.int32()),
            "item_id": pa.array([r["item_id"] for r in rows], pa.int64()),
            "cat": pa.array([r["cat"] for r in rows], str_t),
            "hist": pa.array([r["hist"] for r in rows], list_t(pa.int64())),
            "tags": pa.array([r["tags"] for r in rows], list_t(str_t)),
            "unused": pa.array([f"x{i}" for i in range(n)]),
        }
    )
    return table, rows


def write_dataset(
    root: Path,
    *,
    files: int = 3,
    row_groups: int = 3,
    rows_per_group: tuple[int, int] = (20, 45),
    seed: int = 0,
    compression: str = "zstd",
) -> DataSet:
    """Write ``files`` Parquet files of ``row_groups`` row groups (sizes vary) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ds = DataSet(root=root, files=[])
    next_id = 0
    for f in range(files):
        path = root / f"part-{f:02d}.parquet"
        with pq.ParquetWriter(path, _table(rng, 0, 1, f % 2 == 1)[0].schema, compression=compression) as w:
            for _ in range(row_groups):
                n = int(rng.integers(*rows_per_group))
                table, rows = _table(rng, next_id, n, large=f % 2 == 1)
                w.write_table(table, row_group_size=n)
                for r in rows:
                    ds.rows[r["row_id"]] = r
                next_id += n
        ds.files.append(path)
    return ds


# --------------------------------------------------------------------------- expectations


def signed_log1p(x: float) -> float:
    return math.copysign(math.log1p(abs(x)), x)


def expected_dense(row: dict, schema: Schema) -> list[float]:
    out = []
    for c in schema.dense:
        v = row[c] if row[c] is not None else schema.dense_fill_null
        out.append(signed_log1p(float(v)) if schema.dense_transform == "signed_log1p" else float(v))
    return out


def expected_keys(row: dict, schema: Schema) -> dict[str, list[int]]:
    """Return feature → the hashed (and folded) keys of this row's bag, by the reference hash."""
    out = {}
    for feat in schema.sparse:
        raw = row[feat.column]
        ids = [] if raw is None else (raw if feat.multi_hot else [raw])
        ids = [v for v in ids if v is not None]
        if feat.kind == "int64":
            keys = hashing.hash_int64_reference(ids, feat.table)
        else:
            keys = hashing.hash_string_reference(ids, feat.table)
        num_rows = schema.tables[feat.table].num_rows
        if num_rows is not None:
            keys = [(k & ((1 << 64) - 1)) % num_rows for k in keys]
        out[feat.name] = keys
    return out


def batch_rows(batch) -> list[int]:
    return batch.extra["row_id"].tolist()


def kjt_rows(batch) -> list[dict[str, list[int]]]:
    """Return, per row of the batch, feature → keys (decoded from the KJT)."""
    kjt = batch.sparse
    B = batch.size
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    out = [dict() for _ in range(B)]
    pos = 0
    for f, key in enumerate(kjt.keys()):
        for i in range(B):
            n = lengths[f * B + i]
            out[i][key] = values[pos : pos + n]
            pos += n
    return out


def collect(reader) -> list:
    return list(reader)


def ids_of(batches) -> list[int]:
    return [i for b in batches for i in batch_rows(b)]
