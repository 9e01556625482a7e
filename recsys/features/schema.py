"""The feature schema: label, dense columns, sparse features and the tables they look up.

A job file declares it under ``[schema]``::

    [schema]
    label = "label"
    label_kind = "binary"         # labels 0/1; "probability": soft labels in [0, 1]
    dense = ["i1", "i2"]

    [schema.tables.item]          # one embedding table
    dim = 16
    capacity = 1_000_000          # rows kept in memory before eviction
    # num_rows = 1000             # fixed-size table: keys folded to [0, num_rows)

    [[schema.sparse]]             # one sparse feature
    name = "item"
    column = "item_id"            # source column in the Parquet files
    kind = "int64"                # or "string"
    multi_hot = false             # true: an Arrow list<> column, one bag per row
    table = "item"                # features may share a table

Features that share a table share its salt, so the same raw id in two features maps to
the same key (e.g. a clicked-items history and a candidate item). No data is read here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_F32_MAX = 3.4028234663852886e38
"""The largest float32: dense values are float32, so a fill value must fit."""
DEFAULT_DENSE_TRANSFORM = "numeric_embedding"
"""``schema.dense_transform`` when a job does not set it (and for columns a per-column table
leaves out). Chosen by ``recsys bench defaults`` (docs/tuning.md, "Defaults"); the previous
default, ``signed_log1p``, is what a saved job that does not name its transform still gets
(``saved_schema_settings``)."""


@dataclass(kw_only=True, slots=True)
class TableSpec:
    """One embedding table."""

    dim: int
    """Embedding width."""
    capacity: int = 1_000_000
    """Rows kept in memory (per table, whole job) before least-recently-used eviction; one
    rank's shard of a table holds at most 2**29 - 1 (about capacity / ranks each)."""
    num_rows: int | None = None
    """If set, a fixed-size hashed table: keys are folded into ``[0, num_rows)``."""

    def __post_init__(self) -> None:
        if self.dim <= 0:
            raise ValueError(f"dim must be > 0, found {self.dim}")
        if self.capacity <= 0:
            raise ValueError(f"capacity must be > 0, found {self.capacity}")
        if self.num_rows is not None and self.num_rows <= 0:
            raise ValueError(f"num_rows must be > 0 when set, found {self.num_rows}")


@dataclass(kw_only=True, slots=True)
class FeatureSpec:
    """One sparse feature: a source column hashed into one table."""

    name: str
    """Feature name (the KeyedJaggedTensor key)."""
    column: str = ""
    """Source column; defaults to ``name``."""
    kind: Literal["int64", "string"] = "int64"
    """Raw id kind: 64-bit ints or UTF-8 strings."""
    multi_hot: bool = False
    """True for an Arrow ``list<>`` column (a bag of ids per row)."""
    table: str = ""
    """Table looked up; defaults to ``name``."""
    pooling: Literal["sum", "mean"] = "sum"
    """How a bag's embeddings are pooled."""
    weighted: bool = False
    """An id-score list: each id has a weight and the bag pools Σ weight × row (sum pooling).
    The column is a ``list<struct<id, weight>>``, or a list of ids with ``weight_column``."""
    weight_column: str = ""
    """For a weighted feature: a list<float> column parallel to ``column`` (same length per
    row) holding the weights; empty: ``column`` is a list of ``{id, weight}`` structs."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"feature name {self.name!r} is not a valid identifier")
        if self.weight_column and not self.weighted:
            raise ValueError(f"feature {self.name!r}: weight_column is set, so set weighted = true")
        if self.weighted and not self.multi_hot:
            raise ValueError(f"weighted feature {self.name!r} must be multi_hot (a list of ids with weights)")
        if self.weighted and self.pooling != "sum":
            raise ValueError(f"weighted feature {self.name!r} pools Σ weight × row: pooling must be 'sum', "
                             f"found {self.pooling!r}")
        if not self.column:
            self.column = self.name
        if not self.table:
            self.table = self.name


@dataclass(kw_only=True, slots=True)
class Schema:
    """The feature schema of a data set (see module docstring for the TOML form)."""

    label: str = "label"
    """Label column (any integer, float or boolean type; never null)."""
    label_kind: Literal["binary", "probability"] = "binary"
    """What a label value may be: ``binary``: exactly 0 or 1 (a click, a conversion);
    ``probability``: any number in [0, 1] (soft labels, e.g. a teacher's predictions; the
    loss is binary cross-entropy either way). The reader refuses any other value, naming
    the file, row group, row and value. AUC counts any label > 0 as a positive: evaluate
    on a split with 0/1 labels."""
    dense: list[str] = field(default_factory=list)
    """Dense float columns, in model input order."""
    dense_transform: str | dict[str, str] = DEFAULT_DENSE_TRANSFORM
    """How dense values become model inputs (``recsys.features.dense``), for every column, or per
    column as a table ``{column = transform}`` (key ``"*"``: the others; unlisted columns
    get the default, ``DEFAULT_DENSE_TRANSFORM``): ``none``; ``signed_log1p`` (``sign(x)·log1p(|x|)``;
    the previous default);
    ``standardize`` (zero mean, unit std over the training data); ``quantile_buckets`` (the
    value's quantile bucket, an embedding of its own); ``numeric_embedding`` (piecewise-linear
    encoding over the quantile edges, projected to an embedding); ``periodic`` (standardized,
    then an embedding of sin/cos of learned frequencies: PLR, ``model.periodic_*``). The
    last four use the dense statistics a run computes before its first step."""
    dense_buckets: int = 16
    """Quantile buckets per column (``quantile_buckets``, ``numeric_embedding``); >= 2. A
    null value gets a bucket (a learned vector) of its own."""
    dense_standardize_log: bool = False
    """``standardize`` and ``periodic`` take ``sign(x)·log1p(|x|)`` first (heavy-tailed counts)."""
    dense_stats_rows: int = 1_000_000
    """Rows the dense statistics read at most: whole row groups spread evenly over the
    training split (0: every row)."""
    dense_fill_null: float = 0.0
    """Value used for a null dense cell (before the transform); a finite float32."""
    sparse: list[FeatureSpec] = field(default_factory=list)
    """Sparse features, in KeyedJaggedTensor key order."""
    tables: dict[str, TableSpec] = field(default_factory=dict)
    """Tables by name."""
    weight: str = ""
    """Per-example weight column (any numeric type; finite, >= 0, never null): scales each
    row's loss and its share of the eval metrics (weighted AUC and log loss). Empty: all 1."""

    def __post_init__(self) -> None:
        names = [f.name for f in self.sparse]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sparse feature names must be unique, repeated: {dup}")
        dup = sorted({c for c in self.dense if self.dense.count(c) > 1})
        if dup:
            raise ValueError(f"dense columns must be unique, repeated: {dup}")
        for feat in self.sparse:
            if feat.table not in self.tables:
                raise ValueError(
                    f"sparse feature {feat.name!r} looks up table {feat.table!r}, "
                    f"which is not declared; declared tables: {sorted(self.tables)}"
                )
        unused = sorted(set(self.tables) - {f.table for f in self.sparse})
        if unused:
            raise ValueError(f"tables declared but used by no feature: {unused}")
        if self.label in self.dense or self.label in {f.column for f in self.sparse}:
            raise ValueError(f"label column {self.label!r} is also used as a feature")
        if self.label_kind not in ("binary", "probability"):
            raise ValueError(f"label_kind must be 'binary' or 'probability', found {self.label_kind!r}")
        if self.weight and (self.weight == self.label or self.weight in self.dense
                            or self.weight in {f.column for f in self.sparse}):
            raise ValueError(f"weight column {self.weight!r} is also the label or a feature")
        self._check_dense_transform()
        if isinstance(self.dense_transform, dict) and "*" not in self.dense_transform:
            # resolved, so a saved job keeps its meaning when the default changes
            self.dense_transform = {**self.dense_transform, "*": DEFAULT_DENSE_TRANSFORM}
        fill = self.dense_fill_null
        if not (math.isfinite(fill) and abs(fill) <= _F32_MAX):
            raise ValueError(
                f"dense_fill_null must be a finite number within float32 range (null dense cells "
                f"become it and reach the model), found {fill!r}"
            )

    def _check_dense_transform(self) -> None:
        from recsys.features.dense import TRANSFORMS

        spec = self.dense_transform
        items = spec.items() if isinstance(spec, dict) else [("*", spec)]
        for column, name in items:
            where = "schema.dense_transform" + ("" if not isinstance(spec, dict) else f".{column}")
            if name not in TRANSFORMS:
                raise ValueError(f"{where}: unknown transform {name!r}; expected one of {list(TRANSFORMS)}")
            if column != "*" and column not in self.dense:
                raise ValueError(f"{where}: {column!r} is not a dense column; dense columns: {self.dense}")
        if self.dense_buckets < 2:
            raise ValueError(f"dense_buckets must be >= 2 (a value's bucket among the training quantiles), "
                             f"found {self.dense_buckets}")
        if self.dense_stats_rows < 0:
            raise ValueError(f"dense_stats_rows must be >= 0 (0: every row), found {self.dense_stats_rows}")

    def transform_of(self, column: str) -> str:
        """Return the dense transform of ``column`` (``dense_transform``)."""
        spec = self.dense_transform
        if isinstance(spec, str):
            return spec
        return spec.get(column, spec.get("*", DEFAULT_DENSE_TRANSFORM))

    @property
    def needs_dense_stats(self) -> bool:
        """True when a column's transform reads the training data's dense statistics."""
        from recsys.features.dense import NEEDS_STATS

        return any(self.transform_of(c) in NEEDS_STATS for c in self.dense)

    @property
    def feature_names(self) -> list[str]:
        """Sparse feature names in KJT key order."""
        return [f.name for f in self.sparse]

    def columns(self, passthrough: list[str] = ()) -> list[str]:
        """Return the columns a reader needs, each once, in a stable order."""
        out = [self.label, *self.dense, *(f.column for f in self.sparse),
               *(f.weight_column for f in self.sparse if f.weight_column), *([self.weight] if self.weight else []),
               *passthrough]
        return list(dict.fromkeys(out))

    def feature(self, name: str) -> FeatureSpec:
        """Return the feature called ``name``."""
        for f in self.sparse:
            if f.name == name:
                return f
        raise KeyError(f"no sparse feature {name!r}; features: {self.feature_names}")

    def features_of_table(self, table: str) -> list[FeatureSpec]:
        """Return the features that look up ``table``."""
        return [f for f in self.sparse if f.table == table]

    def replace(self, **changes) -> "Schema":
        """Return a copy with fields changed (checks run again)."""
        return dataclasses.replace(self, **changes)


def saved_schema_settings(data: dict) -> dict:
    """Return a saved job's settings (a checkpoint's ``config``, as a dict) with the schema
    settings its recsys had implied: a schema saved without ``dense_transform`` (before the
    setting existed), or with a per-column table without ``"*"``, meant ``signed_log1p``
    where it named nothing. Changes ``data`` in place."""
    schema = data.get("schema")
    if isinstance(schema, dict):
        spec = schema.get("dense_transform")
        if spec is None:
            schema["dense_transform"] = "signed_log1p"
        elif isinstance(spec, dict) and "*" not in spec:
            spec["*"] = "signed_log1p"
    return data
