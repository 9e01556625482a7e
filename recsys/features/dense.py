"""Dense columns: streamed, mergeable statistics and the transforms they drive (numpy only).

One implementation for training (the reader), ``recsys eval`` (the same reader) and the
served path (``embedding_server``, which never imports torch), so a value becomes the same
model input everywhere.

**Statistics.** ``ColumnSketch`` holds, per column: rows, nulls, count, mean and variance of
the value and of ``sign(x)·log1p(|x|)`` (Chan's parallel update), min, max, and a quantile
sketch: a count per float32 value truncated to 8 mantissa bits (relative error < 2**-8,
exact for integers up to 512). Counts add, so merging sketches of shards gives exactly the
sketch of one pass; a quantile is the truncated value of numpy's ``inverted_cdf`` quantile
(tested). ``DenseStats.summary`` keeps what a transform needs (and what ``recsys inspect
--stats`` prints): that small JSON goes into the run directory and every checkpoint.

**Transforms** (``schema.dense_transform``), each column becoming one float32 of
``Batch.dense``::

    none              x                       (nulls: schema.dense_fill_null)
    signed_log1p      sign(x)·log1p(|x|)      (the default; nulls filled first)
    standardize       (t - mean(t)) / std(t), t = x, or signed_log1p(x) with
                      schema.dense_standardize_log; a constant column: std taken as 1
    quantile_buckets  bucket id in [0, N): edges are the training quantiles at i/N
                      (repeated edges merged); null: id N (a bucket of its own)
    numeric_embedding position p in [0, N] over the boundaries [min, edges..., max]:
                      bin j plus the fraction of the way through it (piecewise-linear
                      encoding: the model expands p into clamp(p - k, 0, 1), k < N);
                      null: -1 (the model's learned null vector)
    periodic          as standardize (nulls filled first); the model turns the value z
                      into a vector ReLU(Linear([sin(2π c z), cos(2π c z)])), c learned
                      (PLR: Gorishniy et al., "On Embeddings for Numerical Features in
                      Tabular Deep Learning", 2022)

The model sees the bucket id and the position as floats (exact: N is far below 2**24) and
turns them into vectors; the mapping from a value to them is here only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

TRANSFORMS = ("none", "signed_log1p", "standardize", "quantile_buckets", "numeric_embedding", "periodic")
NEEDS_STATS = ("standardize", "quantile_buckets", "numeric_embedding", "periodic")
EMBEDDED = ("quantile_buckets", "numeric_embedding", "periodic")
"""Transforms whose column becomes a vector of the interaction instead of a bottom-MLP input."""
OWN_NULL = ("quantile_buckets", "numeric_embedding")
"""Transforms that give a null its own id or vector (the reader fills their nulls with NaN)."""
STATS_VERSION = 1
SHOWN_QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)
"""Quantiles ``recsys inspect --stats`` prints."""
_SHIFT = 15
"""float32 bits >> 15 keep sign, exponent and 8 mantissa bits: the sketch's resolution."""


def signed_log1p_(x: np.ndarray) -> None:
    """x ← sign(x)·log1p(|x|) in place (numpy's float32 log1p is vectorized; a scalar loop is ~30x slower)."""
    a = np.abs(x)
    np.log1p(a, out=a)
    np.copysign(a, x, out=x)


def truncate(values: np.ndarray) -> np.ndarray:
    """Return float32 ``values`` truncated toward zero to the sketch's resolution."""
    bits = _keys(values)
    return _key_values(bits)


def _keys(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32) + np.float32(0.0)  # -0.0 → 0.0: one key for zero
    return v.view(np.int32) >> _SHIFT


def _key_values(keys: np.ndarray) -> np.ndarray:
    return (keys.astype(np.int32) << _SHIFT).view(np.float32)


# --------------------------------------------------------------------------- statistics


def _moments(x: np.ndarray) -> tuple[float, float]:
    """Return (mean, sum of squared deviations) of float64 ``x`` (non-empty)."""
    mean = float(x.mean())
    d = x - mean
    return mean, float(np.dot(d, d))


def _chan(n_a: int, mean_a: float, m2_a: float, n_b: int, mean_b: float, m2_b: float) -> tuple[float, float]:
    """Return (mean, M2) of two merged groups (Chan et al.'s parallel variance update)."""
    n = n_a + n_b
    if n_a == 0:
        return mean_b, m2_b
    if n_b == 0:
        return mean_a, m2_a
    delta = mean_b - mean_a
    return mean_a + delta * n_b / n, m2_a + m2_b + delta * delta * n_a * n_b / n


@dataclass(slots=True)
class ColumnSketch:
    """Mergeable statistics of one dense column (see the module docstring)."""

    count: int = 0
    """Non-null values."""
    nulls: int = 0
    """Null cells."""
    mean: float = 0.0
    m2: float = 0.0
    """Sum of squared deviations from the mean."""
    log_mean: float = 0.0
    """Mean of sign(x)·log1p(|x|)."""
    log_m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """Sorted sketch keys (truncated float32 bits)."""
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Values per key."""

    @classmethod
    def of(cls, values: np.ndarray, valid: np.ndarray | None = None) -> "ColumnSketch":
        """Return the sketch of ``values`` (float32 as the reader converts them; ``valid``:
        False marks a null cell, whose value is ignored)."""
        v = np.asarray(values, dtype=np.float32)
        nulls = 0
        if valid is not None:
            nulls = int(v.shape[0] - np.count_nonzero(valid))
            v = v[valid]
        s = cls(nulls=nulls)
        if v.shape[0] == 0:
            return s
        x = v.astype(np.float64)
        t = v.copy()
        signed_log1p_(t)
        s.count = int(v.shape[0])
        s.mean, s.m2 = _moments(x)
        s.log_mean, s.log_m2 = _moments(t.astype(np.float64))
        s.min, s.max = float(x.min()), float(x.max())
        s.keys, s.counts = np.unique(_keys(v), return_counts=True)
        s.counts = s.counts.astype(np.int64)
        return s

    def merge(self, other: "ColumnSketch") -> "ColumnSketch":
        """Return the sketch of both groups of values (neither is changed)."""
        mean, m2 = _chan(self.count, self.mean, self.m2, other.count, other.mean, other.m2)
        log_mean, log_m2 = _chan(self.count, self.log_mean, self.log_m2, other.count, other.log_mean, other.log_m2)
        keys, inverse = np.unique(np.concatenate([self.keys, other.keys]), return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([self.counts, other.counts]),
                             minlength=keys.shape[0]).astype(np.int64)
        return ColumnSketch(count=self.count + other.count, nulls=self.nulls + other.nulls, mean=mean, m2=m2,
                            log_mean=log_mean, log_m2=log_m2, min=min(self.min, other.min),
                            max=max(self.max, other.max), keys=keys.astype(np.int32), counts=counts)

    def std(self, log: bool = False) -> float:
        """Population standard deviation of the values (or of their signed log1p)."""
        return math.sqrt((self.log_m2 if log else self.m2) / self.count) if self.count else 0.0

    def quantiles(self, qs) -> np.ndarray:
        """Return float64 quantiles at ``qs``: the sketch value of the smallest x with
        P(X <= x) >= q (numpy's ``inverted_cdf``, truncated); q = 0 and 1 give min and max."""
        qs = np.asarray(qs, dtype=np.float64)
        if self.count == 0:
            return np.full(qs.shape, np.nan)
        values = _key_values(self.keys).astype(np.float64)
        order = np.argsort(values, kind="stable")
        cum = np.cumsum(self.counts[order])
        rank = np.maximum(1, np.ceil(qs * self.count)).astype(np.int64)
        idx = np.minimum(np.searchsorted(cum, rank, side="left"), len(cum) - 1)
        out = values[order][idx]
        out = np.clip(out, self.min, self.max)  # truncation may step below the smallest value
        out[qs <= 0.0] = self.min
        out[qs >= 1.0] = self.max
        return out

    def to_json(self) -> dict:
        """Return the sketch as plain JSON data (``from_json`` reads it back exactly)."""
        return {"count": self.count, "nulls": self.nulls, "mean": self.mean, "m2": self.m2,
                "log_mean": self.log_mean, "log_m2": self.log_m2,
                "min": self.min if self.count else None, "max": self.max if self.count else None,
                "keys": self.keys.tolist(), "counts": self.counts.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> "ColumnSketch":
        return cls(count=int(d["count"]), nulls=int(d["nulls"]), mean=float(d["mean"]), m2=float(d["m2"]),
                   log_mean=float(d["log_mean"]), log_m2=float(d["log_m2"]),
                   min=math.inf if d["min"] is None else float(d["min"]),
                   max=-math.inf if d["max"] is None else float(d["max"]),
                   keys=np.asarray(d["keys"], dtype=np.int32), counts=np.asarray(d["counts"], dtype=np.int64))


def merge_all(parts: list[dict[str, ColumnSketch]], columns: list[str]) -> dict[str, ColumnSketch]:
    """Return the per-column merge of ``parts``, folded left to right (a fixed order, so the
    floating-point result does not depend on how many ranks computed the parts)."""
    out = {c: ColumnSketch() for c in columns}
    for part in parts:
        for c in columns:
            out[c] = out[c].merge(part[c])
    return out


# --------------------------------------------------------------------------- the summary


@dataclass(kw_only=True, slots=True)
class ColumnStats:
    """What the transforms of one column need, and what ``recsys inspect --stats`` prints."""

    count: int
    """Non-null values seen."""
    nulls: int
    """Null cells seen."""
    mean: float
    std: float
    log_mean: float
    """Mean of sign(x)·log1p(|x|)."""
    log_std: float
    min: float
    max: float
    quantiles: dict[str, float]
    """``SHOWN_QUANTILES`` (keys as text, e.g. "0.5")."""
    edges: list[float]
    """Inner bucket edges: the quantiles at i/N, i = 1..N-1, repeated values merged."""

    @classmethod
    def of(cls, sketch: ColumnSketch, buckets: int) -> "ColumnStats":
        shown = sketch.quantiles(SHOWN_QUANTILES)
        inner = sketch.quantiles(np.arange(1, buckets) / buckets) if sketch.count else np.zeros(0)
        return cls(count=sketch.count, nulls=sketch.nulls, mean=sketch.mean, std=sketch.std(),
                   log_mean=sketch.log_mean, log_std=sketch.std(log=True),
                   min=sketch.min if sketch.count else math.nan, max=sketch.max if sketch.count else math.nan,
                   quantiles={str(q): float(v) for q, v in zip(SHOWN_QUANTILES, shown)},
                   edges=[float(e) for e in np.unique(inner)])


@dataclass(kw_only=True, slots=True)
class DenseStats:
    """Statistics of every dense column of a training split (the run directory's
    ``dense_stats.json`` and the checkpoint's ``meta.json["dense_stats"]``)."""

    buckets: int
    """``schema.dense_buckets`` the edges were cut for."""
    rows: int
    """Rows read."""
    row_groups: int
    """Row groups read (out of ``row_groups_total``)."""
    row_groups_total: int
    columns: dict[str, ColumnStats]

    @classmethod
    def of(cls, sketches: dict[str, ColumnSketch], buckets: int, row_groups: int, row_groups_total: int) -> "DenseStats":
        rows = next((s.count + s.nulls for s in sketches.values()), 0)
        return cls(buckets=buckets, rows=rows, row_groups=row_groups, row_groups_total=row_groups_total,
                   columns={c: ColumnStats.of(s, buckets) for c, s in sketches.items()})

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["version"] = STATS_VERSION
        for c in out["columns"].values():  # JSON has no NaN: an all-null column has no min/max
            for k in ("mean", "std", "log_mean", "log_std", "min", "max"):
                if isinstance(c[k], float) and not math.isfinite(c[k]):
                    c[k] = None
            c["quantiles"] = {q: (None if not math.isfinite(v) else v) for q, v in c["quantiles"].items()}
        return out

    @classmethod
    def from_json(cls, d: dict, where: str = "dense statistics") -> "DenseStats":
        """Return the statistics written by ``to_json``; ValueError naming ``where`` otherwise."""
        try:
            if d.get("version") != STATS_VERSION:
                raise ValueError(f"version {d.get('version')!r}, expected {STATS_VERSION}")
            nan = lambda v: math.nan if v is None else float(v)  # noqa: E731
            cols = {}
            for name, c in d["columns"].items():
                cols[name] = ColumnStats(count=int(c["count"]), nulls=int(c["nulls"]),
                                         **{k: nan(c[k]) for k in ("mean", "std", "log_mean", "log_std", "min", "max")},
                                         quantiles={q: nan(v) for q, v in c["quantiles"].items()},
                                         edges=[float(e) for e in c["edges"]])
            return cls(buckets=int(d["buckets"]), rows=int(d["rows"]), row_groups=int(d["row_groups"]),
                       row_groups_total=int(d["row_groups_total"]), columns=cols)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: not dense statistics of this recsys ({type(exc).__name__}: {exc})") from None

    def format(self) -> str:
        """Return a text table: one line per column."""
        head = ("column", "count", "nulls", "mean", "std", "min", *(f"q{q}" for q in SHOWN_QUANTILES[1:-1]), "max",
                "edges")
        rows = [head]
        g = lambda v: "-" if not math.isfinite(v) else f"{v:.4g}"  # noqa: E731
        for name, c in self.columns.items():
            rows.append((name, f"{c.count:,}", f"{c.nulls:,}", g(c.mean), g(c.std), g(c.min),
                         *(g(c.quantiles[str(q)]) for q in SHOWN_QUANTILES[1:-1]), g(c.max), str(len(c.edges))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        title = (f"dense statistics: {self.rows:,} rows from {self.row_groups} of {self.row_groups_total} row "
                 f"group(s); bucket edges cut for schema.dense_buckets = {self.buckets}")
        return "\n".join([title, *lines])


# --------------------------------------------------------------------------- transforms


class DenseTransform:
    """Applies a schema's dense transforms, column by column (see the module docstring).

    ``kinds[j]`` is column j's transform; ``fills[j]`` what the reader writes for its null
    cells before ``apply`` (NaN for the embedded kinds, whose nulls get their own id/vector).
    """

    def __init__(self, schema, stats: DenseStats | None, where: str = "") -> None:
        self.columns = list(schema.dense)
        self.kinds = [schema.transform_of(c) for c in self.columns]
        self.buckets = schema.dense_buckets
        self.standardize_log = schema.dense_standardize_log
        fill = np.float32(schema.dense_fill_null)
        self.fills = [np.float32(np.nan) if k in OWN_NULL else fill for k in self.kinds]
        self.params: list[tuple] = []
        need = [c for c, k in zip(self.columns, self.kinds) if k in NEEDS_STATS]
        if need and stats is None:
            kind = self.kinds[self.columns.index(need[0])]
            raise ValueError(f"schema.dense_transform = {kind!r} for column {need[0]!r} needs dense statistics "
                             f"of the training data{(' (' + where + ')') if where else ''}, found none: a run "
                             "computes them before its first step and saves them in every checkpoint")
        if need and stats.buckets != self.buckets and any(self.kinds[self.columns.index(c)] in OWN_NULL for c in need):
            raise ValueError(f"the dense statistics{(' of ' + where) if where else ''} cut bucket edges for "
                             f"schema.dense_buckets = {stats.buckets}, the schema asks for {self.buckets}")
        for c, kind in zip(self.columns, self.kinds):
            if kind not in NEEDS_STATS:
                self.params.append(())
                continue
            s = stats.columns.get(c)
            if s is None:
                raise ValueError(f"schema.dense_transform = {kind!r} for column {c!r}: the dense statistics"
                                 f"{(' of ' + where) if where else ''} have no column {c!r} "
                                 f"(they have {sorted(stats.columns)})")
            if kind in ("standardize", "periodic"):
                mean, std = (s.log_mean, s.log_std) if self.standardize_log else (s.mean, s.std)
                if not math.isfinite(mean):  # every value null: all cells are the fill value
                    mean, std = 0.0, 1.0
                self.params.append((mean, std if std > 0 else 1.0))
            elif kind == "quantile_buckets":
                self.params.append((np.asarray(s.edges, dtype=np.float32),))
            else:
                if s.count == 0:
                    bounds = np.zeros(1, np.float64)
                else:
                    bounds = np.unique(np.concatenate([[s.min], s.edges, [s.max]]))
                self.params.append((bounds,))

    @property
    def all_signed_log1p(self) -> bool:
        """True when every column is signed_log1p (the reader's historical path, untouched)."""
        return all(k == "signed_log1p" for k in self.kinds)

    def apply(self, j: int, x: np.ndarray) -> None:
        """Transform column ``j``'s float32 values ``x`` in place (nulls already ``fills[j]``)."""
        kind = self.kinds[j]
        if kind == "none":
            return
        if kind == "signed_log1p":
            signed_log1p_(x)
        elif kind in ("standardize", "periodic"):  # periodic: the model makes the vector
            mean, std = self.params[j]
            if self.standardize_log:
                signed_log1p_(x)
            x[...] = (x.astype(np.float64) - mean) / std
        elif kind == "quantile_buckets":
            (edges,) = self.params[j]
            ids = np.searchsorted(edges, x, side="right").astype(np.float32)
            ids[np.isnan(x)] = self.buckets
            x[...] = ids
        else:
            (bounds,) = self.params[j]
            x[...] = position(bounds, x)

    def transform(self, raw: dict[str, np.ndarray]) -> np.ndarray:
        """Return float32 [n, D]: every column of ``raw`` (float values, NaN or None for
        null) as the reader delivers it to the model. The served path's entry point."""
        cols = []
        for j, c in enumerate(self.columns):
            v = np.asarray(raw[c], dtype=np.float64)
            x = v.astype(np.float32)
            x[np.isnan(v)] = self.fills[j]
            self.apply(j, x)
            cols.append(x)
        n = cols[0].shape[0] if cols else 0
        return np.stack(cols, axis=1) if cols else np.zeros((n, 0), np.float32)


def position(bounds: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Return float32 positions of ``x`` over sorted ``bounds`` (L >= 1 values, L - 1 bins):
    bin j plus the fraction of bin j below x, clipped to [0, max(L - 1, 1)]; NaN → -1."""
    L = bounds.shape[0]
    xd = x.astype(np.float64)
    if L == 1:  # a constant column: below or at the value 0, above it 1
        pos = (xd > bounds[0]).astype(np.float64)
    else:
        j = np.clip(np.searchsorted(bounds, xd, side="right") - 1, 0, L - 2)
        lo, hi = bounds[j], bounds[j + 1]
        pos = j + np.clip((xd - lo) / (hi - lo), 0.0, 1.0)
    pos[np.isnan(xd)] = -1.0
    return pos.astype(np.float32)
