"""Dense statistics and transforms (recsys.features.dense): numpy references, hand computations,
merges, bad settings; the model's dense embeddings and DeepFM's FM term."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomli_w

from recsys.features.dense import (ColumnSketch, ColumnStats, DenseStats, DenseTransform, merge_all, position,
                          signed_log1p_, truncate)
from recsys.features.schema import Schema

QS = [0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]


def _column(case: str, n: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return (float32 values, valid mask) of a test column."""
    rng = np.random.default_rng(seed)
    if case == "normal":
        x = rng.normal(3.0, 2.0, n)
    elif case == "heavy":  # Pareto counts with a few huge values, and negatives
        x = (rng.pareto(0.8, n) * 10) * rng.choice([-1, 1, 1, 1], n)
    elif case == "counts":  # small integers, as in click logs
        x = rng.poisson(2.5, n).astype(np.float64)
    elif case == "constant":
        x = np.full(n, 7.25)
    elif case == "all_null":
        x = rng.normal(size=n)
    else:
        raise AssertionError(case)
    valid = rng.random(n) > 0.1
    if case == "all_null":
        valid[:] = False
    return x.astype(np.float32), valid


@pytest.mark.parametrize("case", ["normal", "heavy", "counts", "constant", "all_null"])
def test_sketch_matches_numpy(case):
    x, valid = _column(case)
    s = ColumnSketch.of(x, valid)
    v = x[valid]
    assert (s.count, s.nulls) == (int(valid.sum()), int((~valid).sum()))
    if case == "all_null":
        assert s.count == 0 and np.isnan(s.quantiles(QS)).all()
        return
    v64 = v.astype(np.float64)
    assert s.mean == pytest.approx(np.mean(v64), rel=1e-12, abs=1e-12)
    assert s.std() == pytest.approx(np.std(v64), rel=1e-9, abs=1e-12)
    logs = np.copysign(np.log1p(np.abs(v)), v).astype(np.float64)
    assert s.log_mean == pytest.approx(np.mean(logs), rel=1e-12, abs=1e-12)
    assert s.std(log=True) == pytest.approx(np.std(logs), rel=1e-9, abs=1e-12)
    assert (s.min, s.max) == (float(v.min()), float(v.max()))
    got = s.quantiles(QS)
    want = np.quantile(v64, QS, method="inverted_cdf")
    # the sketch keeps 8 mantissa bits: within 2**-8 of numpy, and exactly numpy's value truncated
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=0)
    exact = np.clip(truncate(want.astype(np.float32)).astype(np.float64), v64.min(), v64.max())
    exact[0], exact[-1] = v64.min(), v64.max()
    np.testing.assert_array_equal(got, exact)


def test_truncation_keeps_small_integers_and_rounds_toward_zero():
    ints = np.arange(-512, 513, dtype=np.float32)
    np.testing.assert_array_equal(truncate(ints), ints)
    x = np.array([1.0 + 2**-9, -(1.0 + 2**-9), 3.1415927, -0.0], dtype=np.float32)
    t = truncate(x)
    assert t[0] == 1.0 and t[1] == -1.0 and 3.125 <= t[2] < 3.1415927 and t[3] == 0.0
    assert np.all(np.abs(t) <= np.abs(x))


@pytest.mark.parametrize("case", ["normal", "heavy", "counts"])
def test_merge_of_shards_equals_one_pass(case):
    x, valid = _column(case, n=6000, seed=3)
    whole = ColumnSketch.of(x, valid)
    rng = np.random.default_rng(1)
    cuts = np.sort(rng.choice(np.arange(1, x.shape[0]), size=7, replace=False))
    shards = [ColumnSketch.of(a, m) for a, m in zip(np.split(x, cuts), np.split(valid, cuts))]
    shards.insert(3, ColumnSketch())  # a rank with no rows
    left = merge_all([{"c": s} for s in shards], ["c"])["c"]
    tree = shards[0].merge(shards[1]).merge(shards[2].merge(shards[3])).merge(
        shards[4].merge(shards[5]).merge(shards[6].merge(shards[7].merge(shards[8]))))
    for merged in (left, tree):
        assert (merged.count, merged.nulls, merged.min, merged.max) == (whole.count, whole.nulls, whole.min, whole.max)
        np.testing.assert_array_equal(merged.keys, whole.keys)
        np.testing.assert_array_equal(merged.counts, whole.counts)
        np.testing.assert_array_equal(merged.quantiles(QS), whole.quantiles(QS))
        for a, b in ((merged.mean, whole.mean), (merged.std(), whole.std()), (merged.log_mean, whole.log_mean),
                     (merged.std(log=True), whole.std(log=True))):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12)
    again = ColumnSketch.from_json(left.to_json())
    assert again.to_json() == left.to_json()


def _write_split(root, rows_per_group=(300, 500, 200, 400), seed=0):
    """Write a two-file split with nulls and a heavy tail; return its directory."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f, groups in enumerate([rows_per_group[:2], rows_per_group[2:]]):
        tables = []
        for n in groups:
            a = rng.normal(size=n)
            b = rng.pareto(1.0, n) * 100
            tables.append(pa.table({
                "label": pa.array(rng.integers(0, 2, n), pa.int8()),
                "a": pa.array(a, mask=rng.random(n) < 0.2),
                "b": pa.array(b.astype(np.float32)),
                "k": pa.array(rng.integers(0, 50, n)),
            }))
        with pq.ParquetWriter(root / f"part-{f}.parquet", tables[0].schema) as w:
            for t in tables:
                w.write_table(t)
    return root


def _schema(**kw) -> Schema:
    from recsys.features.schema import FeatureSpec, TableSpec

    return Schema(dense=["a", "b"], sparse=[FeatureSpec(name="k")], tables={"k": TableSpec(dim=4)}, **kw)


def test_statistics_pass_is_the_same_for_any_number_of_ranks(tmp_path):
    from recsys.io import dense_stats
    from recsys.io.config import ReaderConfig

    data = _write_split(tmp_path / "d")
    cfg = ReaderConfig(paths=[str(data)])
    schema = _schema(dense_buckets=8)
    one = dense_stats.compute(cfg, schema)
    for world in (2, 3):
        shares = [dense_stats.unit_sketches(cfg, schema, r, world)[0] for r in range(world)]
        many = dense_stats.compute(cfg, schema, 0, world, gather=lambda mine, shares=shares: shares)
        assert many.to_json() == one.to_json()
    # against numpy over every row read (nulls excluded)
    table = pq.read_table(data)
    for c in ("a", "b"):
        v = table.column(c).to_numpy(zero_copy_only=False).astype(np.float32)
        v = v[~np.isnan(v)].astype(np.float64)
        s = one.columns[c]
        assert s.count == v.size and s.nulls == table.num_rows - v.size
        assert s.mean == pytest.approx(v.mean(), rel=1e-12) and s.std == pytest.approx(v.std(), rel=1e-9)
        want = np.quantile(v, np.arange(1, 8) / 8, method="inverted_cdf")
        np.testing.assert_allclose(s.edges, np.unique(want), rtol=2.0**-8)
    assert one.rows == table.num_rows and one.row_groups == one.row_groups_total == 4
    assert DenseStats.from_json(one.to_json()).to_json() == one.to_json()
    # a sample: whole row groups, evenly spread, about dense_stats_rows rows
    sampled = dense_stats.compute(cfg, _schema(dense_buckets=8, dense_stats_rows=600))
    assert sampled.row_groups == 2 and sampled.rows == 300 + 400


def _stats(**cols) -> DenseStats:
    out = {}
    for name, c in cols.items():
        base = dict(count=10, nulls=0, mean=0.0, std=1.0, log_mean=0.0, log_std=1.0, min=0.0, max=1.0,
                    quantiles={}, edges=[])
        base.update(c)
        out[name] = ColumnStats(**base)
    return DenseStats(buckets=4, rows=10, row_groups=1, row_groups_total=1, columns=out)


def _transform(kinds: dict, stats=None, **kw) -> DenseTransform:
    schema = Schema(dense=list(kinds), dense_transform=kinds, dense_buckets=4, **kw)
    return DenseTransform(schema, stats)


def test_transforms_against_hand_computation():
    nan = np.nan
    raw = {
        "n": [1.5, -2.0, nan],
        "l": [0.0, math.e - 1, nan],
        "s": [1.0, 2.0, nan],
        "q": [0.0, 1.0, nan],
        "p": [0.5, 7.5, nan],
    }
    stats = _stats(s=dict(mean=2.0, std=0.5), q=dict(edges=[1.0, 5.0, 10.0]), p=dict(min=0.0, max=10.0, edges=[1.0, 5.0]))
    t = _transform({"n": "none", "l": "signed_log1p", "s": "standardize", "q": "quantile_buckets",
                    "p": "numeric_embedding"}, stats, dense_fill_null=-1.0)
    out = t.transform(raw)
    assert out.dtype == np.float32 and out.shape == (3, 5)
    np.testing.assert_allclose(out[:, 0], [1.5, -2.0, -1.0])               # null → fill
    np.testing.assert_allclose(out[:, 1], [0.0, 1.0, -math.log(2)], rtol=1e-6)  # fill, then the log
    np.testing.assert_allclose(out[:, 2], [-2.0, 0.0, -6.0])               # (x - 2) / 0.5, null = fill -1
    np.testing.assert_array_equal(out[:, 3], [0, 1, 4])                    # the null bucket is N = 4
    np.testing.assert_allclose(out[:, 4], [0.5, 2.5, -1.0])                # bounds [0, 1, 5, 10]


def test_quantile_buckets_and_positions_by_hand():
    edges = np.array([1.0, 5.0, 10.0], np.float32)
    t = _transform({"q": "quantile_buckets"}, _stats(q=dict(edges=edges.tolist())))
    x = np.array([-3, 0, 1, 3, 5, 7, 10, 100, np.nan], np.float32)
    t.apply(0, x)
    np.testing.assert_array_equal(x, [0, 0, 1, 1, 2, 2, 3, 3, 4])
    bounds = np.array([0.0, 1.0, 5.0, 10.0])
    x = np.array([-1, 0, 0.5, 1, 3, 5, 7.5, 10, 20, np.nan], np.float32)
    np.testing.assert_allclose(position(bounds, x), [0, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3, -1])
    # a constant column: one boundary; below or at it 0, above 1
    np.testing.assert_array_equal(position(np.array([4.0]), np.array([3, 4, 5], np.float32)), [0, 0, 1])


def test_standardize_after_log_and_a_constant_column():
    t = _transform({"s": "standardize"}, _stats(s=dict(log_mean=1.0, log_std=2.0, mean=9.0, std=0.0)),
                   dense_standardize_log=True)
    x = np.array([math.e - 1, 0.0], np.float32)
    t.apply(0, x)
    np.testing.assert_allclose(x, [0.0, -0.5], rtol=1e-6)
    t = _transform({"s": "standardize"}, _stats(s=dict(mean=9.0, std=0.0)))  # constant: std taken as 1
    x = np.array([9.0, 10.0], np.float32)
    t.apply(0, x)
    np.testing.assert_array_equal(x, [0.0, 1.0])


def test_periodic_is_standardize_with_a_vector_in_the_model():
    """``periodic``: the float is the standardized value (nulls: the fill value first, as
    ``standardize``); the bucket count is not involved and no null gets NaN."""
    stats = _stats(p=dict(mean=2.0, std=0.5, log_mean=1.0, log_std=2.0), s=dict(mean=2.0, std=0.5, log_mean=1.0,
                                                                                log_std=2.0))
    raw = {"p": [1.0, 2.0, np.nan, math.e - 1], "s": [1.0, 2.0, np.nan, math.e - 1]}
    for log in (False, True):
        t = _transform({"p": "periodic", "s": "standardize"}, stats, dense_fill_null=-1.0, dense_standardize_log=log)
        out = t.transform(raw)
        np.testing.assert_array_equal(out[:, 0], out[:, 1])
        assert np.isfinite(out).all()
    np.testing.assert_allclose(t.transform({"p": [math.e - 1], "s": [0.0]})[0, 0], 0.0, atol=1e-6)
    # statistics cut for another bucket count still serve a periodic column (no edges used)
    t = DenseTransform(Schema(dense=["p"], dense_transform="periodic", dense_buckets=8), stats)
    np.testing.assert_allclose(t.transform({"p": [3.0]})[0], [2.0])
    with pytest.raises(ValueError, match=r"'periodic' for column 'p' needs dense statistics"):
        DenseTransform(Schema(dense=["p"], dense_transform="periodic"), None)


def test_default_transform_is_numeric_embedding_and_saved_jobs_keep_theirs():
    from recsys.config import dumps, from_dict, JobConfig, saved_job

    assert Schema(dense=["a", "b"]).transform_of("a") == "numeric_embedding"
    with pytest.raises(ValueError, match=r"'numeric_embedding' for column 'a' needs dense statistics"):
        DenseTransform(Schema(dense=["a", "b"]), None)
    # a per-column table's unlisted columns get the default, written into the schema so a
    # saved job keeps its meaning if the default changes again
    s = Schema(dense=["a", "b"], dense_transform={"a": "none"})
    assert s.dense_transform == {"a": "none", "*": "numeric_embedding"} and s.transform_of("b") == "numeric_embedding"
    # a job saved by an older recsys names no transform, or a table without "*": signed_log1p then
    old = {"name": "old", "schema": {"dense": ["a", "b"]}}
    assert saved_job(tomli_w.dumps(old), "meta").schema.transform_of("a") == "signed_log1p"
    old["schema"]["dense_transform"] = {"a": "none"}
    job = saved_job(tomli_w.dumps(old), "meta")
    assert job.schema.transform_of("a") == "none" and job.schema.transform_of("b") == "signed_log1p"
    # a job saved now names its transform and loads back unchanged
    now = from_dict(JobConfig, {"name": "now", "schema": {"dense": ["a"]}})
    assert saved_job(dumps(now), "meta").schema.dense_transform == "numeric_embedding"


def test_signed_log1p_is_the_historical_reader_path():
    schema = Schema(dense=["a", "b"], dense_transform="signed_log1p")
    t = DenseTransform(schema, None)
    assert t.all_signed_log1p and t.kinds == ["signed_log1p", "signed_log1p"]
    out = t.transform({"a": [3.0, np.nan], "b": [-1e30, 0.0]})
    want = np.array([[3.0, -1e30], [0.0, 0.0]], np.float32)
    signed_log1p_(want)
    np.testing.assert_array_equal(out, want)


def test_bad_settings_get_clear_errors():
    with pytest.raises(ValueError, match=r"schema.dense_transform: unknown transform 'log'; expected one of"):
        Schema(dense=["a"], dense_transform="log")
    with pytest.raises(ValueError, match=r"schema.dense_transform.b: 'b' is not a dense column"):
        Schema(dense=["a"], dense_transform={"b": "none"})
    with pytest.raises(ValueError, match=r"dense_buckets must be >= 2.*found 1"):
        Schema(dense=["a"], dense_buckets=1)
    with pytest.raises(ValueError, match=r"'standardize' for column 'a' needs dense statistics.*found none"):
        DenseTransform(Schema(dense=["a"], dense_transform="standardize"), None)
    with pytest.raises(ValueError, match=r"cut bucket edges for schema.dense_buckets = 4, the schema asks for 8"):
        DenseTransform(Schema(dense=["q"], dense_transform="quantile_buckets", dense_buckets=8),
                       _stats(q=dict(edges=[1.0])))
    with pytest.raises(ValueError, match=r"have no column 'x'"):
        DenseTransform(Schema(dense=["x"], dense_transform="standardize", dense_buckets=4), _stats(q={}))
    with pytest.raises(ValueError, match=r"not dense statistics of this recsys"):
        DenseStats.from_json({"version": 1, "columns": {"a": {}}})


def test_job_file_takes_a_transform_per_column_or_for_all(tmp_path):
    from recsys.config import ConfigError, load_job

    job = tmp_path / "job.toml"
    job.write_text('[schema]\ndense = ["a", "b", "c"]\ndense_transform = {a = "quantile_buckets", "*" = "none"}\n')
    schema = load_job(job).schema
    assert [schema.transform_of(c) for c in "abc"] == ["quantile_buckets", "none", "none"]
    assert schema.needs_dense_stats
    assert load_job(job, ["schema.dense_transform='standardize'"]).schema.transform_of("b") == "standardize"
    assert not load_job(job, ["schema.dense_transform='none'"]).schema.needs_dense_stats
    with pytest.raises(ConfigError, match=r"unknown transform 'zscore'"):
        load_job(job, ["schema.dense_transform='zscore'"])


def test_inspect_prints_the_statistics(tmp_path, capsys):
    from recsys.cli import main

    data = _write_split(tmp_path / "d")
    job = tmp_path / "job.toml"
    job.write_text(f'[schema]\ndense = ["a", "b"]\ndense_buckets = 4\n[schema.tables.k]\ndim = 4\n'
                   f'[[schema.sparse]]\nname = "k"\n[data.train]\npaths = ["{data}"]\n')
    assert main(["inspect", "--config", str(job), "--stats"]) == 0
    out = capsys.readouterr().out
    assert "dense statistics: 1,400 rows from 4 of 4 row group(s)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("a "))
    v = pq.read_table(data).column("a").to_numpy(zero_copy_only=False)
    assert f"{int((~np.isnan(v)).sum()):,}" in line.split()
    assert main(["inspect", str(data), "--stats"]) == 2
    assert "inspect --stats: give --config" in capsys.readouterr().err
