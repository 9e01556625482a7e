"""What a served version holds: its tables, the features that look them up, and how raw ids
become keys — exactly as training hashed them — and what an unseen key reads.

A ``Catalog`` is built from a checkpoint (its meta.json carries the resolved job config) and
travels inside the manifest of every published version, so a server hashes a raw id with
the same table salt, folding and kind checks as the reader did, and gives a key that was
never trained the vector ``recsys eval`` reads for it: the store's initial vector (a pure
function of seed, table and key; ``recsys.store.init``) when ``store.min_count == 1``,
zeros when admission was on (an unadmitted key reads zeros in training and evaluation).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsys import hashing
from recsys.store.init import init_vectors

MANIFEST_FORMAT = 1
ID_KINDS = ("int64", "string")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class IdError(ValueError):
    """A raw id does not fit its feature; ``index`` is its position in the request's ids."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True, slots=True)
class TableInfo:
    """One served table."""

    name: str
    dim: int
    rows: int
    """Rows the version holds (the checkpoint's rows, spilled ones included)."""
    seed: int
    """``store.seed`` of the job: with the table name and the key, the initial vector."""
    init_bound: float
    """``a`` of the initial distribution U(-a, a)."""
    min_count: int
    """``store.min_count``: 1 means an unseen key reads its initial vector, else zeros."""
    num_rows: int | None = None
    """Fixed-size table: keys are folded into ``[0, num_rows)`` after hashing."""
    salt: int = 0
    """``recsys.hashing.table_salt(name)`` when published; checked on load."""
    checksum: str = ""
    """Order-independent checksum of (key, row bytes) over the published rows."""

    def defaults(self, keys: np.ndarray) -> np.ndarray:
        """Return the float32 [N, dim] vectors ``recsys eval`` reads for unseen ``keys``."""
        if self.min_count == 1:
            return init_vectors(keys, self.dim, self.name, self.seed, self.init_bound)
        return np.zeros((keys.shape[0], self.dim), dtype=np.float32)


@dataclass(frozen=True, slots=True)
class FeatureInfo:
    """One sparse feature: which table it reads and what its raw ids are."""

    name: str
    table: str
    kind: str
    multi_hot: bool = False
    pooling: str = "sum"


@dataclass(frozen=True, slots=True)
class Catalog:
    """Tables and features of one served version (see the module doc)."""

    tables: dict[str, TableInfo]
    features: dict[str, FeatureInfo]
    step: int = 0
    source: str = ""
    dense: dict = dataclasses.field(default_factory=dict)
    """The dense columns and how the job transformed them (``dense_settings``); {} if none."""

    # ------------------------------------------------------------------ building

    @classmethod
    def from_checkpoint(cls, path: str | Path, meta: dict, rows: dict[str, int],
                        tables: list[str] | None = None) -> "Catalog":
        """Return the catalog of checkpoint ``path`` (its ``meta``), with ``rows`` per table;
        ``tables`` limits it to those tables (and the features that read them)."""
        from recsys import config as config_mod

        job = config_mod.from_dict(config_mod.JobConfig, tomllib.loads(meta["config"]), f"{path}/meta.json:config")
        names = list(job.schema.tables) if tables is None else list(tables)
        unknown = sorted(set(names) - set(job.schema.tables))
        if unknown:
            raise ValueError(f"tables {unknown} are not in the checkpoint {path}; its tables: {sorted(job.schema.tables)}")
        infos = {}
        for name in names:
            spec = job.schema.tables[name]
            infos[name] = TableInfo(name=name, dim=spec.dim, rows=int(rows.get(name, 0)), seed=job.store.seed,
                                    init_bound=float(job.store.init_bound(spec.dim)), min_count=job.store.min_count,
                                    num_rows=spec.num_rows, salt=hashing.table_salt(name))
        feats = {f.name: FeatureInfo(name=f.name, table=f.table, kind=f.kind, multi_hot=f.multi_hot, pooling=f.pooling)
                 for f in job.schema.sparse if f.table in infos}
        dense = dense_settings(job.schema, meta.get("dense_stats"))
        if dense:  # a checkpoint without the statistics its transforms need is refused here, not per request
            dense_transform_of(dense, f"{path}/meta.json")
        return cls(tables=infos, features=feats, step=int(meta.get("step", 0)), source=str(Path(path).resolve()),
                   dense=dense)

    def with_tables(self, **changes: TableInfo) -> "Catalog":
        """Return a copy with some tables replaced (e.g. their row counts and checksums)."""
        return dataclasses.replace(self, tables={**self.tables, **changes})

    def to_manifest(self, **extra: Any) -> dict:
        """Return the JSON-ready manifest of this catalog plus ``extra`` fields."""
        return {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "source_checkpoint": self.source,
            "hashing": {"function": "recsys.hashing (fmix64, per-table salt)",
                        "salts": {n: f"{t.salt:016x}" for n, t in self.tables.items()}},
            "tables": {n: {k: v for k, v in dataclasses.asdict(t).items() if k not in ("name", "salt")}
                       for n, t in self.tables.items()},
            "features": [dataclasses.asdict(f) for f in self.features.values()],
            "dense": self.dense,
            **extra,
        }

    @classmethod
    def from_manifest(cls, manifest: dict, where: str) -> "Catalog":
        """Return the catalog in ``manifest`` (published by ``recsys export``), checked."""
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{where}: manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
        salts = manifest["hashing"]["salts"]
        tables = {}
        for name, t in manifest["tables"].items():
            salt = hashing.table_salt(name)
            if int(salts[name], 16) != salt:
                raise ValueError(f"{where}: table {name!r} was hashed with salt {salts[name]}, this server's "
                                 f"recsys.hashing gives {salt:016x}: refusing to serve keys it cannot reproduce")
            tables[name] = TableInfo(name=name, salt=salt, **t)
        feats = {f["name"]: FeatureInfo(**f) for f in manifest["features"]}
        return cls(tables=tables, features=feats, step=int(manifest.get("step", 0)),
                   source=manifest.get("source_checkpoint", ""), dense=manifest.get("dense") or {})

    # ------------------------------------------------------------------ serving

    def dense_transform(self):
        """Return the ``recsys.dense.DenseTransform`` the job's reader applied (the one
        implementation), or None when the version has no dense columns."""
        if not self.dense.get("columns"):
            return None
        return dense_transform_of(self.dense)

    def feature(self, name: str) -> FeatureInfo:
        """Return the feature ``name``; ``KeyError`` with the served ones listed otherwise."""
        try:
            return self.features[name]
        except KeyError:
            raise KeyError(f"unknown feature {name!r}; served features: {sorted(self.features)}") from None

    def keys(self, feature: FeatureInfo, ids: list) -> np.ndarray:
        """Return the int64 keys of raw ``ids`` of ``feature``, hashed as the reader hashes them.

        ``IdError`` names the first id of the wrong type (ints for int64 features, strings
        for string features; bools are not ints) or out of the int64 range.
        """
        table = self.tables[feature.table]
        if feature.kind == "int64":
            values = None
            if all(type(v) is int for v in ids):  # the common case: one pass, one conversion
                try:
                    values = np.array(ids, dtype=np.int64)
                except OverflowError:
                    pass
            if values is None:
                for i, v in enumerate(ids):
                    if type(v) is not int:
                        raise IdError(i, f"feature {feature.name!r} takes int64 ids, found {type(v).__name__} {v!r:.40}")
                    if not INT64_MIN <= v <= INT64_MAX:
                        raise IdError(i, f"feature {feature.name!r} takes int64 ids, {v} is out of range")
            keys = hashing.hash_int64(values, table.name)
        else:
            encoded = []
            for i, v in enumerate(ids):
                if type(v) is not str:
                    raise IdError(i, f"feature {feature.name!r} takes string ids, found {type(v).__name__} {v!r:.40}")
                try:
                    encoded.append(v.encode("utf-8"))
                except UnicodeEncodeError:
                    raise IdError(i, f"feature {feature.name!r}: id is not valid Unicode (a lone surrogate)") from None
            keys = hashing.hash_string_list(encoded, table.name)
        if table.num_rows is not None:
            keys = hashing.fold(keys, table.num_rows)
        return keys


def dense_settings(schema, stats: dict | None) -> dict:
    """Return what the served path needs to transform dense values as the reader did: the
    columns, the schema's dense settings and the checkpoint's statistics (JSON data)."""
    if not schema.dense:
        return {}
    return {"columns": list(schema.dense), "transform": schema.dense_transform, "buckets": schema.dense_buckets,
            "standardize_log": schema.dense_standardize_log, "fill_null": schema.dense_fill_null,
            "stats": stats}


def dense_transform_of(settings: dict, where: str = "the served version"):
    """Return the ``DenseTransform`` of ``dense_settings`` output (ValueError if unusable)."""
    from recsys.dense import DenseStats, DenseTransform
    from recsys.schema import Schema

    schema = Schema(dense=list(settings["columns"]), dense_transform=settings["transform"],
                    dense_buckets=int(settings["buckets"]), dense_standardize_log=bool(settings["standardize_log"]),
                    dense_fill_null=float(settings["fill_null"]))
    stats = settings.get("stats")
    return DenseTransform(schema, None if stats is None else DenseStats.from_json(stats, where), where)
