"""What a served version holds: its tables, the features that look them up, and how raw ids
become keys — exactly as training hashed them — and what an unseen key reads.

A ``Catalog`` is built from a checkpoint (its meta.json carries the resolved job config) and
travels inside the manifest of every published version, so a server hashes a raw id with
the same table salt, folding and kind checks as the reader did, and gives a key that was
never trained the vector ``recsys eval`` reads for it: the store's initial vector (a pure
function of seed, table and key; ``recsys.store.tables.initial``) when ``store.min_count == 1``,
zeros when admission was on (an unadmitted key reads zeros in training and evaluation).

A job trained with ``model.wide = true`` also has the wide arm's weights: one scalar per id
in a dim-1 table ``<table>.wide`` per embedding table (``recsys.store.tables.wide``). Those tables
are served like any other (``TableInfo.wide_of`` names the embedding table whose ids they
weigh); a lookup asks for them with ``arm = "wide"`` and the same feature and raw ids as
for the embeddings. Their keys are the embedding table's keys (the trainer looks both up
with one batch of keys, hashed with that table's salt), and an id never trained weighs 0
(new weights start at 0, ``init_scale = 0``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsys.features import hashing
from recsys.redisio.published import NAME
from recsys.store.tables.initial import init_vectors
from recsys.store.tables.wide import wide_store_config, wide_table

MANIFEST_FORMAT = 1
ID_KINDS = ("int64", "string")
ARMS = ("embedding", "wide")
"""What a lookup reads for a feature: its embeddings, or the wide arm's weights (``model.wide``)."""
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT = frozenset((int,))  # the exact type of an int id (a bool is not one)


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
    """``recsys.features.hashing.table_salt(name)`` when published; checked on load."""
    checksum: str = ""
    """Order-independent checksum of (key, row bytes) over the published rows."""
    wide_of: str = ""
    """A wide table (``model.wide``): the embedding table whose ids it weighs. Its keys are
    that table's keys: hashed with that table's salt (``salt`` is that table's) and folded
    alike. Empty for an embedding table."""

    @property
    def arm(self) -> str:
        """``"wide"`` for a wide table, ``"embedding"`` otherwise."""
        return "wide" if self.wide_of else "embedding"

    @property
    def hashed_as(self) -> str:
        """The table name whose salt hashes this table's keys."""
        return self.wide_of or self.name

    def defaults(self, keys: np.ndarray) -> np.ndarray:
        """Return the float32 [N, dim] vectors ``recsys eval`` reads for unseen ``keys``."""
        if self.min_count == 1 and self.init_bound > 0:  # bound 0 (the wide arm's weights): zeros
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
    wide: bool = False
    """The job trained the wide arm (``model.wide``): its weights are in the checkpoint."""

    # ------------------------------------------------------------------ building

    @classmethod
    def from_checkpoint(cls, path: str | Path, meta: dict, rows: dict[str, int],
                        tables: list[str] | None = None) -> "Catalog":
        """Return the catalog of checkpoint ``path`` (its ``meta``), with ``rows`` per table;
        ``tables`` limits it to those tables (and the features that read them). With
        ``model.wide`` the wide tables ``<table>.wide`` are tables of the checkpoint too."""
        from recsys import config as config_mod

        job = config_mod.saved_job(meta["config"], f"{path}/meta.json:config")
        wide_of = {wide_table(n): n for n in job.schema.tables} if job.model.wide else {}
        known = [*job.schema.tables, *wide_of]
        names = known if tables is None else list(tables)
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"tables {unknown} are not in the checkpoint {path}; its tables: {sorted(known)}")
        wide_cfg = wide_store_config(job.store, job.model) if wide_of else None
        infos = {}
        for name in names:
            base = wide_of.get(name, "")
            if base:  # the wide arm's weights: dim 1, new weights at 0, keyed like the base table
                spec, cfg, dim = job.schema.tables[base], wide_cfg, 1
            else:
                spec, cfg = job.schema.tables[name], job.store
                dim = spec.dim
            infos[name] = TableInfo(name=name, dim=dim, rows=int(rows.get(name, 0)), seed=cfg.seed,
                                    init_bound=float(cfg.init_bound(dim)), min_count=cfg.min_count,
                                    num_rows=spec.num_rows, salt=hashing.table_salt(base or name), wide_of=base)
        served = {t.hashed_as for t in infos.values()}
        feats = {f.name: FeatureInfo(name=f.name, table=f.table, kind=f.kind, multi_hot=f.multi_hot, pooling=f.pooling)
                 for f in job.schema.sparse if f.table in served}
        dense = dense_settings(job.schema, meta.get("dense_stats"))
        if dense:  # a checkpoint without the statistics its transforms need is refused here, not per request
            dense_transform_of(dense, f"{path}/meta.json")
        return cls(tables=infos, features=feats, step=int(meta.get("step", 0)), source=str(Path(path).resolve()),
                   dense=dense, wide=bool(job.model.wide))

    def with_tables(self, **changes: TableInfo) -> "Catalog":
        """Return a copy with some tables replaced (e.g. their row counts and checksums)."""
        return dataclasses.replace(self, tables={**self.tables, **changes})

    def to_manifest(self, **extra: Any) -> dict:
        """Return the JSON-ready manifest of this catalog plus ``extra`` fields.

        A job without the wide arm gets the manifest it got before the wide arm was served
        (no ``wide`` and no ``wide_of`` fields), which servers of that time read too."""
        out = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "source_checkpoint": self.source,
            "hashing": {"function": "recsys.features.hashing (fmix64, per-table salt)",
                        "salts": {n: f"{t.salt:016x}" for n, t in self.tables.items()}},
            "tables": {n: {k: v for k, v in dataclasses.asdict(t).items()
                           if k not in ("name", "salt") and not (k == "wide_of" and not v)}
                       for n, t in self.tables.items()},
            "features": [dataclasses.asdict(f) for f in self.features.values()],
            "dense": self.dense,
            **extra,
        }
        if self.wide:
            out["wide"] = True
        return out

    @classmethod
    def from_manifest(cls, manifest: dict, where: str) -> "Catalog":
        """Return the catalog in ``manifest`` (published by ``recsys export``), every field the
        service reads checked: ``ValueError`` naming ``where``, the field and what was expected.

        A server refuses such a manifest rather than fail later, in a request: a wrong type,
        a dim or bucket count below 1, a non-finite bound, an unknown id kind, a feature of a
        table the version lacks, dense settings the transform cannot use, or salts its
        hashing does not reproduce."""
        m = _mapping(manifest, where, "the manifest")
        if m.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{where}: manifest format {m.get('format')!r}, expected {MANIFEST_FORMAT}")
        hashing_ = _mapping(_field(m, "hashing", where), where, "hashing")
        salts = _mapping(_field(hashing_, "salts", where, "hashing"), where, "hashing.salts")
        raw_tables = _mapping(_field(m, "tables", where), where, "tables")
        if not raw_tables:
            raise ValueError(f"{where}: tables is empty, expected at least one table")
        tables = {}
        for name, t in raw_tables.items():
            tables[name] = _table_of(name, t, salts, where)
        raw_feats = _field(m, "features", where)
        if not isinstance(raw_feats, list):
            raise ValueError(f"{where}: features must be a list, found {type(raw_feats).__name__}")
        served = {t.hashed_as for t in tables.values()}
        feats = {}
        for i, f in enumerate(raw_feats):
            feat = _feature_of(i, f, where)
            if feat.table not in served:
                raise ValueError(f"{where}: features[{i}] ({feat.name!r}) reads table {feat.table!r}, which the "
                                 f"manifest does not hold (its tables: {sorted(tables)})")
            feats[feat.name] = feat
        step = _int(m.get("step", 0), where, "step", 0)
        source = m.get("source_checkpoint", "")
        if not isinstance(source, str):
            raise ValueError(f"{where}: source_checkpoint must be a string, found {type(source).__name__}")
        dense = m.get("dense") or {}
        if not isinstance(dense, dict):
            raise ValueError(f"{where}: dense must be an object, found {type(dense).__name__}")
        if dense.get("columns"):  # checked now: /v1/dense must not fail on it later
            try:
                dense_transform_of(dense, where)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise ValueError(f"{where}: dense settings unusable: {type(exc).__name__}: {exc}") from None
        wide = m.get("wide", False)
        if not isinstance(wide, bool):
            raise ValueError(f"{where}: wide must be true or false, found {wide!r:.40}")
        return cls(tables=tables, features=feats, step=step, source=source, dense=dense, wide=wide)

    # ------------------------------------------------------------------ serving

    def dense_transform(self):
        """Return the ``recsys.features.dense.DenseTransform`` the job's reader applied (the one
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

    def table(self, feature: FeatureInfo, arm: str = "embedding") -> TableInfo:
        """Return the table ``feature`` reads for ``arm`` ("embedding": its embeddings; "wide":
        the wide arm's weights, ``<table>.wide``). ``LookupError`` (the message names what
        was asked and what the version serves) when the version does not hold it."""
        if arm not in ARMS:
            raise LookupError(f"unknown arm {arm!r}; expected one of {list(ARMS)}")
        name = feature.table if arm == "embedding" else wide_table(feature.table)
        table = self.tables.get(name)
        if table is not None and table.hashed_as == feature.table:
            return table
        if arm == "wide" and not self.wide:
            raise LookupError(f"arm 'wide' of feature {feature.name!r}: the served version's model has no wide "
                              "arm (trained with model.wide = false), so it has no wide weights; it serves the "
                              f"embeddings (arm 'embedding') of features {sorted(self.features)}")
        what = "wide weights" if arm == "wide" else "embeddings"
        raise LookupError(f"arm {arm!r} of feature {feature.name!r}: its {what} (table {name!r}) are not in the "
                          f"served version; its tables: {sorted(self.tables)}")

    def keys(self, feature: FeatureInfo, ids: list, table: TableInfo | None = None) -> np.ndarray:
        """Return the int64 keys of raw ``ids`` of ``feature`` in ``table`` (default: its
        embedding table; the wide arm's table, ``table(feature, "wide")``, has the same keys),
        hashed as the reader hashes them.

        ``IdError`` names the first id of the wrong type (ints for int64 features, strings
        for string features; bools are not ints) or out of the int64 range; ``LookupError``
        a table the version does not hold (``table``).
        """
        if table is None:
            table = self.table(feature)
        if feature.kind == "int64":
            values = None
            if set(map(type, ids)) <= _INT:  # the common case: one pass in C, one conversion
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
            keys = hashing.hash_int64(values, table.hashed_as)
        else:
            encoded = []
            for i, v in enumerate(ids):
                if type(v) is not str:
                    raise IdError(i, f"feature {feature.name!r} takes string ids, found {type(v).__name__} {v!r:.40}")
                try:
                    encoded.append(v.encode("utf-8"))
                except UnicodeEncodeError:
                    raise IdError(i, f"feature {feature.name!r}: id is not valid Unicode (a lone surrogate)") from None
            keys = hashing.hash_string_list(encoded, table.hashed_as)
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
    from recsys.features.dense import DenseStats, DenseTransform
    from recsys.features.schema import Schema

    schema = Schema(dense=list(settings["columns"]), dense_transform=settings["transform"],
                    dense_buckets=int(settings["buckets"]), dense_standardize_log=bool(settings["standardize_log"]),
                    dense_fill_null=float(settings["fill_null"]))
    stats = settings.get("stats")
    return DenseTransform(schema, None if stats is None else DenseStats.from_json(stats, where), where)


# --------------------------------------------------------------------------- manifest checks

_TABLE_FIELDS = {f.name for f in dataclasses.fields(TableInfo)} - {"name", "salt"}
_FEATURE_FIELDS = {f.name for f in dataclasses.fields(FeatureInfo)}
POOLINGS = ("sum", "mean")
MAX_ROW_BYTES = 512 << 20
"""A Redis string holds at most 512 MiB: no served row (dim x 4 bytes of float32) is larger."""


def _mapping(value, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {what} must be a JSON object, found {type(value).__name__}")
    return value


def _field(d: dict, key: str, where: str, inside: str = ""):
    if key not in d:
        raise ValueError(f"{where}: {inside + '.' if inside else ''}{key} is missing")
    return d[key]


def _int(value, where: str, what: str, lo: int, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: {what} must be an integer {bound}, found {value!r:.40}")
    return value


def _table_of(name, t, salts: dict, where: str) -> TableInfo:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"{where}: table name {name!r:.60} must match {NAME.pattern}")
    what = f"tables.{name}"
    t = _mapping(t, where, what)
    unknown, missing = sorted(set(t) - _TABLE_FIELDS), sorted({"dim", "rows", "seed", "init_bound", "min_count"} - set(t))
    if unknown or missing:
        raise ValueError(f"{where}: {what}: " + (f"unknown fields {unknown}" if unknown else f"missing {missing}"))
    dim = _int(t["dim"], where, f"{what}.dim", 1, MAX_ROW_BYTES // 4)
    rows = _int(t["rows"], where, f"{what}.rows", 0)
    seed = _int(t["seed"], where, f"{what}.seed", INT64_MIN, (1 << 64) - 1)
    bound = t["init_bound"]
    if type(bound) not in (int, float) or not (bound >= 0 and bound < float("inf")):
        raise ValueError(f"{where}: {what}.init_bound must be a finite number >= 0, found {bound!r:.40}")
    min_count = _int(t["min_count"], where, f"{what}.min_count", 1)
    num_rows = t.get("num_rows")
    if num_rows is not None:
        _int(num_rows, where, f"{what}.num_rows", 1, INT64_MAX)
    checksum = t.get("checksum", "")
    if not isinstance(checksum, str):
        raise ValueError(f"{where}: {what}.checksum must be a string, found {type(checksum).__name__}")
    wide_of = t.get("wide_of", "")
    if not isinstance(wide_of, str) or (wide_of and name != wide_table(wide_of)):
        raise ValueError(f"{where}: {what}.wide_of must be '' or the embedding table whose weights {name!r} "
                         f"holds ({name!r} = '<table>.wide'), found {wide_of!r:.60}")
    salt = hashing.table_salt(wide_of or name)
    given = salts.get(name)
    try:
        same = isinstance(given, str) and int(given, 16) == salt
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"{where}: table {name!r} was hashed with salt {given!r:.40}, this server's "
                         f"recsys.features.hashing gives {salt:016x}: refusing to serve keys it cannot reproduce")
    return TableInfo(name=name, dim=dim, rows=rows, seed=seed, init_bound=float(bound), min_count=min_count,
                     num_rows=num_rows, salt=salt, checksum=checksum, wide_of=wide_of)


def _feature_of(i: int, f, where: str) -> FeatureInfo:
    what = f"features[{i}]"
    f = _mapping(f, where, what)
    unknown, missing = sorted(set(f) - _FEATURE_FIELDS), sorted({"name", "table", "kind"} - set(f))
    if unknown or missing:
        raise ValueError(f"{where}: {what}: " + (f"unknown fields {unknown}" if unknown else f"missing {missing}"))
    for key in ("name", "table"):
        if not isinstance(f[key], str) or not f[key]:
            raise ValueError(f"{where}: {what}.{key} must be a non-empty string, found {f[key]!r:.40}")
    if f["kind"] not in ID_KINDS:
        raise ValueError(f"{where}: {what}.kind must be one of {list(ID_KINDS)}, found {f['kind']!r:.40}")
    multi_hot = f.get("multi_hot", False)
    if not isinstance(multi_hot, bool):
        raise ValueError(f"{where}: {what}.multi_hot must be true or false, found {multi_hot!r:.40}")
    pooling = f.get("pooling", "sum")
    if pooling not in POOLINGS:
        raise ValueError(f"{where}: {what}.pooling must be one of {list(POOLINGS)}, found {pooling!r:.40}")
    return FeatureInfo(name=f["name"], table=f["table"], kind=f["kind"], multi_hot=multi_hot, pooling=pooling)
