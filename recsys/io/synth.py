"""Synthetic CTR data with a known ground-truth model, so every AUC has a ceiling to aim at.

``generate(preset, out)`` writes a Criteo-like data set::

    out/train/part-00000.parquet ...   zstd, fixed-size row groups, several files per split
    out/eval/part-00000.parquet ...
    out/oracle.json                    what the best possible model scores (see below)

Columns: ``row_id`` int64 (unique across train and eval), ``label`` int8, ``i1``..``i13``
float32 heavy-tailed dense values (some nulls, never NaN/inf), ``c1``..``c26`` categorical
ids drawn from Zipf laws (``recsys.io.zipf``; int64, or 8-hex-digit strings for ``c3 c9
c16 c22``; a null is an empty bag), ``m1`` list<int64> and ``m2`` list<string> multi-hot
bags (some empty, a few null). A Zipf rank maps to its raw id through a per-(seed, feature)
bijection, so ids look arbitrary rather than ``1..n``.

The hidden model::

    logit = bias + Σ_c effect_c(id)                      one scalar per categorical id
                 + Σ_pairs scale·u_f(id_f)·v_g(id_g)      rank-4 interactions, small features
                 + Σ_bags mean(effect_m(id) for id in bag)
                 + Σ_j w_j·z_j + 0.25·cos(1.2·z_8)         z = sign(x)·log1p(|x|), null → 0
    label ~ Bernoulli(sigmoid(logit))

Per-id effects and latent vectors are functions of (seed, feature, id) computed on the fly
by hashing (no tables: cardinalities reach millions). The effect of the id at Zipf rank
``r`` (1-based) is scaled by ``min(1, (r0/r)^2)`` where ``r0`` is the rank expected about
``LEARNABLE_COUNT`` times in ``REFERENCE_ROWS`` rows (the small preset's train split), so
the signal sits on ids frequent enough to be learned in one epoch and a good model gets
close to the oracle; rare ids are mostly noise, as in real logs. ``bias`` is solved on a
pilot sample so the click rate is about ``TARGET_CTR``.

Determinism: rows are generated in chunks of ``GEN_CHUNK_ROWS`` rows, chunk ``k`` of a split
from an RNG seeded by ``(seed, split, k)``. Files and row groups only cut that stream, so
``row_group_size`` and ``rows_per_file`` change the layout, never the rows; the same seed
gives byte-identical files.

``oracle.json`` keys: ``generator``, ``version``, ``preset``, ``seed``, ``row_group_size``,
``rows_per_file``, ``target_ctr``, ``bias``, ``train`` and ``eval`` (each ``rows``,
``files``, ``row_id_start``, ``base_ctr``, ``log_loss`` of the true probabilities; ``eval``
also ``auc`` of the true probabilities, ``constant_log_loss`` of predicting its base rate
and ``normalized_entropy`` = log_loss / constant_log_loss), and ``features`` (the
generating parameters of each column, for reference).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.eval.metrics import log_loss, roc_auc
from recsys.features.hashing import hash_int64, table_salt
from recsys.io.parquet_out import SplitWriter as _SplitWriter
from recsys.io.zipf import zipf_norm, zipf_ranks

__all__ = [
    "Preset",
    "PRESETS",
    "generate",
    "roc_auc",
    "log_loss",
    "signed_log1p",
    "GENERATOR_VERSION",
]

GENERATOR_VERSION = 1
"""Bumped whenever the same (preset, seed) would produce different data."""
TARGET_CTR = 0.17
"""Click rate the bias is solved for."""
GEN_CHUNK_ROWS = 65_536
"""Rows per RNG chunk. Part of the data definition: changing it changes the rows."""
REFERENCE_ROWS = 1_800_000
"""Training rows the effect shrinkage is tuned for (the small preset's train split)."""
LEARNABLE_COUNT = 3000.0
"""Expected occurrences in REFERENCE_ROWS above which an id keeps its full effect."""
SHRINK_POWER = 2.0
"""Effects of rarer ids shrink as (r0 / r) ** SHRINK_POWER."""
LATENT_RANK = 4
"""Width of the latent vectors of pairwise interactions."""

_SPLITS = {"train": 0, "eval": 1}
_CALIBRATION_STREAM = 2
_CALIBRATION_ROWS = 32_768
_INT_ID_BITS = 40  # int ids live in [0, 2**40): plausible-looking, positive
_STR_ID_BITS = 32  # string ids are 8 hex digits


# --------------------------------------------------------------------------- presets


@dataclass(kw_only=True, slots=True, frozen=True)
class Preset:
    """Size and layout of a generated data set (the hidden model is the same for all)."""

    name: str
    train_rows: int
    eval_rows: int
    rows_per_file: int
    """Rows per Parquet file (the last file of a split holds the remainder)."""
    row_group_size: int
    """Rows per row group (the last row group of a file holds the remainder)."""
    max_cardinality: int | None = None
    """Caps every feature's cardinality (small data sets cannot show millions of ids)."""
    description: str = ""

    def __post_init__(self) -> None:
        for key in ("train_rows", "eval_rows", "rows_per_file", "row_group_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"preset {self.name!r}: {key} must be > 0, found {getattr(self, key)}")
        if self.max_cardinality is not None and self.max_cardinality < 2:
            raise ValueError(f"preset {self.name!r}: max_cardinality must be >= 2")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny",
            train_rows=6_000,
            eval_rows=2_000,
            rows_per_file=1_500,
            row_group_size=512,
            max_cardinality=10_000,
            description="unit and smoke tests: 4 train files, 12 train row groups, < 2 s",
        ),
        Preset(
            name="small",
            train_rows=1_800_000,
            eval_rows=200_000,
            rows_per_file=131_072,
            row_group_size=65_536,
            description="one-epoch convergence checks against the oracle AUC (about a minute)",
        ),
        Preset(
            name="large",
            train_rows=20_000_000,
            eval_rows=1_000_000,
            rows_per_file=524_288,
            row_group_size=65_536,
            description="throughput and out-of-core runs; streamed to disk chunk by chunk",
        ),
    )
}


# --------------------------------------------------------------------------- the hidden model


@dataclass(kw_only=True, slots=True, frozen=True)
class _Cat:
    name: str
    cardinality: int
    exponent: float
    """Zipf exponent of the id distribution."""
    effect: float
    """Standard deviation of the logit effect of a frequent id."""
    kind: Literal["int64", "string"] = "int64"
    null_fraction: float = 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class _Bag(_Cat):
    mean_length: float = 5.0
    max_length: int = 20
    empty_fraction: float = 0.04
    """Extra empty (non-null) lists on top of the zero-length draws."""


@dataclass(kw_only=True, slots=True, frozen=True)
class _Dense:
    name: str
    mu: float
    sigma: float
    """Values are lognormal(mu, sigma), floored when ``integer``, then shifted."""
    integer: bool = True
    shift: float = 0.0
    null_fraction: float = 0.0
    weight: float = 0.0
    """Logit weight on sign(x)·log1p(|x|)."""


# Cardinalities spread from a handful to millions, roughly like Criteo's.
_CATS: tuple[_Cat, ...] = (
    _Cat(name="c1", cardinality=1_500, exponent=1.20, effect=0.35),
    _Cat(name="c2", cardinality=600, exponent=1.20, effect=0.45),
    _Cat(name="c3", cardinality=2_000_000, exponent=1.20, effect=0.54, kind="string", null_fraction=0.03),
    _Cat(name="c4", cardinality=1_000_000, exponent=1.20, effect=0.42, null_fraction=0.02),
    _Cat(name="c5", cardinality=300, exponent=1.15, effect=0.30),
    _Cat(name="c6", cardinality=24, exponent=1.05, effect=0.40, null_fraction=0.05),
    _Cat(name="c7", cardinality=12_000, exponent=1.25, effect=0.30),
    _Cat(name="c8", cardinality=640, exponent=1.15, effect=0.20),
    _Cat(name="c9", cardinality=8, exponent=1.10, effect=0.24, kind="string"),
    _Cat(name="c10", cardinality=90_000, exponent=1.25, effect=0.30, null_fraction=0.01),
    _Cat(name="c11", cardinality=5_700, exponent=1.25, effect=0.25),
    _Cat(name="c12", cardinality=4_000_000, exponent=1.18, effect=0.48, null_fraction=0.04),
    _Cat(name="c13", cardinality=3_200, exponent=1.25, effect=0.20),
    _Cat(name="c14", cardinality=27, exponent=1.10, effect=0.32),
    _Cat(name="c15", cardinality=15_000, exponent=1.30, effect=0.15),
    _Cat(name="c16", cardinality=1_500_000, exponent=1.20, effect=0.42, kind="string", null_fraction=0.03),
    _Cat(name="c17", cardinality=10, exponent=1.30, effect=0.40),
    _Cat(name="c18", cardinality=5_600, exponent=1.30, effect=0.15),
    _Cat(name="c19", cardinality=2_200, exponent=1.30, effect=0.10, null_fraction=0.04),
    _Cat(name="c20", cardinality=4, exponent=1.30, effect=0.32, null_fraction=0.04),
    _Cat(name="c21", cardinality=3_000_000, exponent=1.20, effect=0.36, null_fraction=0.03),
    _Cat(name="c22", cardinality=18, exponent=1.20, effect=0.24, kind="string", null_fraction=0.05),
    _Cat(name="c23", cardinality=15, exponent=1.10, effect=0.32),
    _Cat(name="c24", cardinality=280_000, exponent=1.25, effect=0.25, null_fraction=0.02),
    _Cat(name="c25", cardinality=100, exponent=1.25, effect=0.16, null_fraction=0.04),
    _Cat(name="c26", cardinality=140_000, exponent=1.30, effect=0.05, null_fraction=0.02),
)

_BAGS: tuple[_Bag, ...] = (
    _Bag(name="m1", cardinality=200_000, exponent=1.15, effect=1.0, null_fraction=0.02),
    _Bag(name="m2", cardinality=50_000, exponent=1.20, effect=0.8, kind="string", null_fraction=0.02),
)

# Low-rank interactions only between low-cardinality features, whose ids are all frequent.
_PAIRS: tuple[tuple[str, str, float], ...] = (
    ("c5", "c6", 0.12),
    ("c9", "c14", 0.10),
    ("c17", "c23", 0.10),
    ("c20", "c22", 0.10),
    ("c2", "c25", 0.10),
)

_DENSE: tuple[_Dense, ...] = (
    _Dense(name="i1", mu=0.5, sigma=1.2, null_fraction=0.04, weight=0.24),
    _Dense(name="i2", mu=1.0, sigma=1.5, shift=-2.0, weight=-0.16),
    _Dense(name="i3", mu=1.5, sigma=1.0, null_fraction=0.03, weight=0.32),
    _Dense(name="i4", mu=1.2, sigma=0.9, null_fraction=0.02, weight=0.00),
    _Dense(name="i5", mu=8.0, sigma=2.0, integer=False, null_fraction=0.02, weight=0.13),
    _Dense(name="i6", mu=3.0, sigma=1.8, null_fraction=0.02, weight=-0.19),
    _Dense(name="i7", mu=1.5, sigma=1.4, null_fraction=0.05, weight=0.29),
    _Dense(name="i8", mu=2.5, sigma=1.0, weight=0.00),
    _Dense(name="i9", mu=4.0, sigma=1.5, null_fraction=0.03, weight=0.16),
    _Dense(name="i10", mu=-0.5, sigma=0.8, null_fraction=0.04, weight=0.40),
    _Dense(name="i11", mu=1.0, sigma=1.0, null_fraction=0.02, weight=-0.24),
    _Dense(name="i12", mu=-1.5, sigma=1.5, null_fraction=0.06, weight=0.32),
    _Dense(name="i13", mu=1.5, sigma=1.2, null_fraction=0.03, weight=0.08),
)
_NONLINEAR_DENSE = 7  # index of i8: logit += 0.25·cos(1.2·z)

DENSE_COLUMNS: tuple[str, ...] = tuple(d.name for d in _DENSE)
CATEGORICAL_COLUMNS: tuple[str, ...] = tuple(c.name for c in _CATS)
MULTI_HOT_COLUMNS: tuple[str, ...] = tuple(b.name for b in _BAGS)


# --------------------------------------------------------------------------- numeric helpers


def signed_log1p(x: np.ndarray) -> np.ndarray:
    """Return ``sign(x)·log1p(|x|)`` (the schema's default dense transform)."""
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.log1p(np.abs(x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Return the logistic function of ``x``."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def _salt(seed: int, *parts: object) -> int:
    """Return a 64-bit salt naming one random function of the hidden model (seed, feature, role)."""
    # the prefix is part of every data set's definition (the generator's first name), not a module path
    return table_salt("recsys.synth/" + "/".join(str(x) for x in (seed, *parts)))


def _normals(ranks: np.ndarray, salt: int) -> np.ndarray:
    """Return one standard normal per rank, a fixed function of (rank, salt)."""
    h = hash_int64(ranks, salt).view(np.uint64)
    # Box-Muller on the two 32-bit halves of the hash; +0.5 keeps u1 away from 0.
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _scramble(ranks: np.ndarray, bits: int, salt: int) -> np.ndarray:
    """Return raw ids for 0-based ``ranks``: a bijection of ``[0, 2**bits)`` keyed by ``salt``."""
    mask = np.uint64((1 << bits) - 1)
    half = np.uint64(bits // 2)
    x = (ranks.astype(np.uint64) + np.uint64(salt & ((1 << bits) - 1))) & mask
    # Each step (odd multiply mod 2**bits, xor with own right shift) is invertible.
    for mult in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB):
        x = (x * np.uint64(mult)) & mask
        x ^= x >> half
    return x


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex_strings(ids: np.ndarray, valid: np.ndarray | None, width: int = 8) -> pa.Array:
    """Return a string array of ``width`` lowercase hex digits per id (null where not ``valid``)."""
    n = ids.shape[0]
    shifts = np.arange(4 * width - 4, -1, -4, dtype=np.uint64)
    digits = _HEX[((ids.astype(np.uint64)[:, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]
    offsets = np.arange(0, width * n + 1, width, dtype=np.int32)
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(digits))]
    null_count = 0
    if valid is not None and not valid.all():
        buffers[0] = pa.py_buffer(np.packbits(valid, bitorder="little"))
        null_count = int(n - valid.sum())
    return pa.Array.from_buffers(pa.string(), n, buffers, null_count=null_count)


# --------------------------------------------------------------------------- the plan


@dataclass(kw_only=True, slots=True)
class _Column:
    """A categorical or bag feature resolved for one (preset, seed)."""

    spec: _Cat
    cardinality: int
    """After the preset's cap."""
    r0: float
    """Ranks (1-based) above r0 get shrunk effects."""
    id_salt: int
    effect_salt: int


@dataclass(kw_only=True, slots=True)
class _Plan:
    """Everything fixed for one (preset, seed): resolved columns, salts and the bias."""

    seed: int
    columns: dict[str, _Column]
    latent_salts: dict[tuple[str, str, str, int], int]
    bias: float = 0.0


def _make_plan(preset: Preset, seed: int) -> _Plan:
    """Return the hidden model and column layout of ``preset`` for ``seed``."""
    columns = {}
    for spec in (*_CATS, *_BAGS):
        card = spec.cardinality
        if preset.max_cardinality is not None:
            card = min(card, preset.max_cardinality)
        # r0 depends on the uncapped law, so the hidden model is the same in every preset.
        # A bag element moves the logit by effect/length, so an occurrence in a bag of L
        # carries 1/L² of the information of a single-hot one: L·N elements, each worth 1/L².
        occurrences = REFERENCE_ROWS / (spec.mean_length if isinstance(spec, _Bag) else 1.0)
        z = zipf_norm(spec.cardinality, spec.exponent)
        r0 = (occurrences / (z * LEARNABLE_COUNT)) ** (1.0 / spec.exponent)
        columns[spec.name] = _Column(
            spec=spec,
            cardinality=card,
            r0=r0,
            id_salt=_salt(seed, spec.name, "id"),
            effect_salt=_salt(seed, spec.name, "effect"),
        )
    latent = {
        (f, g, side, k): _salt(seed, f, g, side, k)
        for f, g, _ in _PAIRS
        for side in ("u", "v")
        for k in range(LATENT_RANK)
    }
    plan = _Plan(seed=seed, columns=columns, latent_salts=latent)
    plan.bias = _solve_bias(plan)
    return plan


def _solve_bias(plan: _Plan) -> float:
    """Return the bias giving a mean click probability of TARGET_CTR on a pilot sample."""
    rng = np.random.default_rng([GENERATOR_VERSION, plan.seed, _CALIBRATION_STREAM, 0])
    logit = _sample(plan, rng, _CALIBRATION_ROWS)["logit"]
    lo, hi = -20.0, 20.0
    for _ in range(60):  # bisection: the mean is increasing in the bias
        mid = 0.5 * (lo + hi)
        if _sigmoid(logit + mid).mean() < TARGET_CTR:
            lo = mid
        else:
            hi = mid
    return round(0.5 * (lo + hi), 6)


# --------------------------------------------------------------------------- sampling


def _shrink(col: _Column, ranks: np.ndarray) -> np.ndarray:
    """Return the factor scaling the effects of 0-based ``ranks``: 1 in the head, → 0 in the tail."""
    return np.minimum(1.0, (col.r0 / (ranks + 1.0)) ** SHRINK_POWER)


def _effects(col: _Column, ranks: np.ndarray) -> np.ndarray:
    """Return the logit effect of each id (given by its 0-based Zipf rank) of feature ``col``."""
    return col.spec.effect * _shrink(col, ranks) * _normals(ranks, col.effect_salt)


def _sample(plan: _Plan, rng: np.random.Generator, n: int) -> dict:
    """Return the raw draws of ``n`` rows and their logit without the bias (draw order is fixed).

    ``parts`` splits the logit by term (diagnostics: how much each term carries).
    """
    parts = {k: np.zeros(n) for k in ("dense", "dense_nonlinear", "cats", "pairs", "bags")}
    out: dict = {"parts": parts}

    dense = {}
    for j, d in enumerate(_DENSE):
        x = np.exp(d.mu + d.sigma * rng.standard_normal(n))
        if d.integer:
            x = np.floor(x)
        x = (x + d.shift).astype(np.float32)  # the truth uses exactly the value a reader sees
        valid = rng.random(n) >= d.null_fraction
        z = np.where(valid, signed_log1p(x), 0.0)  # a null is read as 0, whose transform is 0
        parts["dense"] += d.weight * z
        if j == _NONLINEAR_DENSE:
            parts["dense_nonlinear"] += 0.25 * np.cos(1.2 * z)
        dense[d.name] = (x, valid)
    out["dense"] = dense

    cats = {}
    for spec in _CATS:
        col = plan.columns[spec.name]
        ranks = zipf_ranks(rng, n, col.cardinality, spec.exponent)
        valid = rng.random(n) >= spec.null_fraction
        parts["cats"] += np.where(valid, _effects(col, ranks), 0.0)
        cats[spec.name] = (ranks, valid)
    out["cats"] = cats

    for f, g, scale in _PAIRS:
        cf, cg = plan.columns[f], plan.columns[g]
        (rf, vf), (rg, vg) = cats[f], cats[g]
        dot = np.zeros(n)
        for k in range(LATENT_RANK):
            dot += _normals(rf, plan.latent_salts[f, g, "u", k]) * _normals(rg, plan.latent_salts[f, g, "v", k])
        shrink = _shrink(cf, rf) * _shrink(cg, rg)
        # Σ of LATENT_RANK products of independent normals has std sqrt(LATENT_RANK).
        parts["pairs"] += np.where(vf & vg, scale / math.sqrt(LATENT_RANK) * shrink * dot, 0.0)

    bags = {}
    for spec in _BAGS:
        col = plan.columns[spec.name]
        # Negative binomial lengths (a Poisson with a gamma rate): over-dispersed like histories.
        lengths = rng.poisson(rng.gamma(2.0, spec.mean_length / 2.0, n))
        lengths = np.minimum(lengths, spec.max_length)
        lengths[rng.random(n) < spec.empty_fraction] = 0
        valid = rng.random(n) >= spec.null_fraction
        lengths[~valid] = 0
        total = int(lengths.sum())
        ranks = zipf_ranks(rng, total, col.cardinality, spec.exponent)
        rows = np.repeat(np.arange(n), lengths)
        sums = np.bincount(rows, weights=_effects(col, ranks), minlength=n)
        parts["bags"] += sums / np.maximum(lengths, 1)
        bags[spec.name] = (lengths, ranks, valid)
    out["bags"] = bags

    out["logit"] = sum(parts.values())
    return out


def _make_chunk(plan: _Plan, split: str, chunk: int, row_start: int, n: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Return (table, true click probabilities, labels) of one chunk of a split."""
    rng = np.random.default_rng([GENERATOR_VERSION, plan.seed, _SPLITS[split], chunk])
    draws = _sample(plan, rng, n)
    prob = _sigmoid(plan.bias + draws["logit"])
    labels = (rng.random(n) < prob).astype(np.int8)

    arrays: dict[str, pa.Array] = {
        "row_id": pa.array(np.arange(row_start, row_start + n, dtype=np.int64)),
        "label": pa.array(labels),
    }
    for name, (x, valid) in draws["dense"].items():
        arrays[name] = pa.array(x, mask=~valid)
    for name, (ranks, valid) in draws["cats"].items():
        arrays[name] = _id_array(plan.columns[name], ranks, valid)
    for name, (lengths, ranks, valid) in draws["bags"].items():
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = _id_array(plan.columns[name], ranks, None)
        arrays[name] = pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(~valid))
    return pa.table(arrays), prob, labels


def _id_array(col: _Column, ranks: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    """Return the Arrow array of raw ids (int64 or hex strings) of 0-based ``ranks``."""
    if col.spec.kind == "string":
        return _hex_strings(_scramble(ranks, _STR_ID_BITS, col.id_salt), valid)
    ids = _scramble(ranks, _INT_ID_BITS, col.id_salt).view(np.int64)
    return pa.array(ids, mask=None if valid is None else ~valid)


# --------------------------------------------------------------------------- writing


def _write_split(
    plan: _Plan, split: str, directory: Path, rows: int, row_start: int, rows_per_file: int, row_group_size: int, progress
) -> dict:
    """Write one split; return its oracle stats (and, for eval, keep probabilities for the AUC)."""
    directory.mkdir(parents=True, exist_ok=True)
    # Stale parts of an earlier, larger run would silently join this split.
    for old in (*directory.glob("part-*.parquet"), *directory.glob("part-*.parquet.tmp")):
        old.unlink()
    writer = _SplitWriter(directory, rows_per_file, row_group_size, progress)
    clicks = 0
    loss_sum = 0.0
    probs, labels = [], []
    for chunk in range(-(-rows // GEN_CHUNK_ROWS)):
        start = chunk * GEN_CHUNK_ROWS
        n = min(GEN_CHUNK_ROWS, rows - start)
        table, p, y = _make_chunk(plan, split, chunk, row_start + start, n)
        writer.add(table)
        clicks += int(y.sum())
        loss_sum += log_loss(y, p) * n
        if split == "eval":
            probs.append(p)
            labels.append(y)
    writer.finish()
    stats = {
        "rows": rows,
        "files": writer.files,
        "row_id_start": row_start,
        "base_ctr": clicks / rows,
        "log_loss": loss_sum / rows,
    }
    if split == "eval":
        p, y = np.concatenate(probs), np.concatenate(labels)
        base = stats["base_ctr"]
        both = 0 < clicks < rows  # else AUC and NE are undefined (JSON null)
        stats["auc"] = roc_auc(y, p) if both else None
        stats["constant_log_loss"] = log_loss(y, np.full(rows, base))
        stats["normalized_entropy"] = stats["log_loss"] / stats["constant_log_loss"] if both else None
    return stats


def generate(
    preset: "str | Preset",
    out: str | os.PathLike,
    seed: int = 0,
    row_group_size: int | None = None,
    rows_per_file: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Return the oracle dict after writing out/train/*.parquet, out/eval/*.parquet and out/oracle.json.

    ``row_group_size`` and ``rows_per_file`` override the preset's layout; they never
    change the rows themselves. ``progress`` receives one line per file written.
    """
    if isinstance(preset, Preset):  # a custom size (benchmarks); the hidden model is the same
        p = preset
    elif preset in PRESETS:
        p = PRESETS[preset]
    else:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, found {seed!r}")
    row_group_size = p.row_group_size if row_group_size is None else row_group_size
    rows_per_file = p.rows_per_file if rows_per_file is None else rows_per_file
    for key, value in (("row_group_size", row_group_size), ("rows_per_file", rows_per_file)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{key} must be a positive int, found {value!r}")
    seed, row_group_size, rows_per_file = int(seed), int(row_group_size), int(rows_per_file)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    oracle_path = out / "oracle.json"
    # Written last: its presence means the data set is complete.
    oracle_path.unlink(missing_ok=True)

    plan = _make_plan(p, seed)
    if progress is not None:
        progress(f"preset {p.name}: {p.train_rows:,} train + {p.eval_rows:,} eval rows, seed {seed}, bias {plan.bias}")
    oracle = {
        "generator": "recsys.synth",  # the data format's generator name, as every written oracle.json has it
        "version": GENERATOR_VERSION,
        "preset": p.name,
        "seed": seed,
        "row_group_size": row_group_size,
        "rows_per_file": rows_per_file,
        "target_ctr": TARGET_CTR,
        "bias": plan.bias,
    }
    oracle["train"] = _write_split(plan, "train", out / "train", p.train_rows, 0, rows_per_file, row_group_size, progress)
    oracle["eval"] = _write_split(
        plan, "eval", out / "eval", p.eval_rows, p.train_rows, rows_per_file, row_group_size, progress
    )
    oracle["features"] = _describe(plan)

    tmp = oracle_path.with_name("oracle.json.tmp")
    tmp.write_text(json.dumps(oracle, indent=2) + "\n")
    os.replace(tmp, oracle_path)
    if progress is not None:
        e = oracle["eval"]
        auc, ne = (("n/a" if v is None else f"{v:.4f}") for v in (e["auc"], e["normalized_entropy"]))
        progress(f"oracle eval AUC {auc}, log loss {e['log_loss']:.4f}, NE {ne}")
    return oracle


def write_criteo_tsv(out: str | os.PathLike, preset: "str | Preset" = "tiny", seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Write the synthetic data in the Criteo click logs' layout; return the oracle dict.

    ``out/train.txt.gz`` and ``out/eval.txt.gz``: one row per line, tab-separated, no header:
    the label, ``i1``..``i13`` (integers; ``i5`` keeps its fraction), ``c1``..``c26`` as hex
    strings (the int64 ids as 10 hex digits: they have 40 bits), empty fields for nulls. The
    multi-hot ``m1``/``m2`` have no place in the layout and are left out, so the oracle in
    ``out/oracle.json`` (which knows them) is a ceiling no model of these files reaches.
    """
    import shutil

    import pyarrow.csv as pa_csv

    out = Path(out)
    work = out / ".parquet"
    oracle = generate(preset, work, seed=seed, progress=progress)
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    for split in ("train", "eval"):
        path = out / f"{split}.txt.gz"
        tmp = path.with_name(path.name + ".tmp")
        with pa.CompressedOutputStream(str(tmp), "gzip") as sink:
            for f in sorted((work / split).glob("part-*.parquet")):
                for batch in pq.ParquetFile(f).iter_batches(GEN_CHUNK_ROWS):
                    pa_csv.write_csv(_criteo_layout(batch), sink, options)
        os.replace(tmp, path)
        if progress is not None:
            progress(f"wrote {path} ({oracle[split]['rows']:,} rows)")
    shutil.rmtree(work)
    oracle["layout"] = "criteo tsv (label, i1..i13, c1..c26; m1, m2 left out)"
    tmp = out / "oracle.json.tmp"
    tmp.write_text(json.dumps(oracle, indent=2) + "\n")
    os.replace(tmp, out / "oracle.json")
    return oracle


def _criteo_layout(batch: pa.RecordBatch) -> pa.Table:
    """Return one batch of the synthetic columns as the Criteo layout's 40 columns."""
    cols = {"label": batch.column("label")}
    for d in _DENSE:
        x = batch.column(d.name)
        cols[d.name] = x.cast(pa.int64()) if d.integer else x
    for spec in _CATS:
        ids = batch.column(spec.name)
        if pa.types.is_integer(ids.type):
            valid = ids.is_valid().to_numpy(zero_copy_only=False)
            ids = _hex_strings(ids.fill_null(0).to_numpy().view(np.uint64), valid, width=_INT_ID_BITS // 4)
        cols[spec.name] = ids
    return pa.table(cols)


def _describe(plan: _Plan) -> dict:
    """Return the generating parameters of every column (reference only; ids' effects stay hidden)."""
    out: dict = {}
    for d in _DENSE:
        out[d.name] = {
            "type": "float32",
            "distribution": f"{'floor(' if d.integer else '('}lognormal({d.mu}, {d.sigma})){d.shift:+g}",
            "null_fraction": d.null_fraction,
            "weight": d.weight,
        }
    for name, col in plan.columns.items():
        s = col.spec
        entry = {
            "type": f"list<{s.kind}>" if isinstance(s, _Bag) else s.kind,
            "cardinality": col.cardinality,
            "zipf_exponent": s.exponent,
            "null_fraction": s.null_fraction,
            "effect_std": s.effect,
            "full_effect_ranks": int(col.r0),
        }
        if isinstance(s, _Bag):
            entry["mean_length"] = s.mean_length
            entry["max_length"] = s.max_length
            entry["empty_fraction"] = s.empty_fraction
        out[name] = entry
    out["interactions"] = [{"features": [f, g], "rank": LATENT_RANK, "std": scale} for f, g, scale in _PAIRS]
    return out
