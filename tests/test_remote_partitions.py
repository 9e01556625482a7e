"""Filesystem URIs (an in-memory filesystem behind ``memory://``, pyarrow's local one behind
``file://``) and Hive-partitioned directories selected by the job's ``data.<split>.filter``."""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.config import load_job
from recsys.io.config import ReaderConfig
from recsys.io.errors import ReadError
from recsys.io.convert import ConvertOptions, convert
from recsys.io.partitions import parse_filter, partition_values
from recsys.io.reader import ParquetReader
from recsys.features.schema import FeatureSpec, Schema, TableSpec

SCHEMA = Schema(label="label", dense=["x"], dense_transform="signed_log1p",
                sparse=[FeatureSpec(name="item")], tables={"item": TableSpec(dim=4)})
DAYS = ["2026-10-30", "2026-10-31", "2026-11-01", "2026-11-02"]


def _table(first: int, n: int) -> pa.Table:
    ids = np.arange(first, first + n)
    return pa.table({"row_id": ids, "label": ids % 2, "x": ids * 0.5, "item": ids % 13})


def _ids(cfg: ReaderConfig) -> list[int]:
    with ParquetReader(cfg, SCHEMA) as r:
        return sorted(i for b in r for i in b.extra["row_id"].tolist())


@pytest.fixture
def memory_root():
    """A unique directory in fsspec's process-wide in-memory filesystem (removed after the test)."""
    fs = fsspec.filesystem("memory")
    root = f"/t-{uuid.uuid4().hex[:8]}"
    yield fs, root
    fs.rm(root, recursive=True)


def _write_days(write, root: str) -> dict[str, list[int]]:
    rows = {}
    for d, day in enumerate(DAYS):
        for hour in (3, 7):
            first = 1000 * d + 100 * hour
            write(f"{root}/date={day}/hour={hour}/part-0.parquet", _table(first, 20))
            rows.setdefault(day, []).extend(range(first, first + 20))
    return rows


@pytest.mark.parametrize("workers", [0, 2])
def test_memory_uri_reads_every_row_once_with_partition_filter(memory_root, workers):
    fs, root = memory_root

    def write(path, table):
        with fs.open(path, "wb") as f:
            pq.write_table(table, f, row_group_size=8)

    rows = _write_days(write, root)
    cfg = ReaderConfig(paths=[f"memory://{root}"], batch_size=16, num_workers=workers, passthrough=["row_id"])
    assert _ids(cfg) == sorted(i for v in rows.values() for i in v)
    window = ReaderConfig(paths=[f"memory://{root}"], batch_size=16, num_workers=workers, passthrough=["row_id"],
                          filter="date >= '2026-11-01' and hour = 7")
    assert _ids(window) == sorted(i for d in DAYS[2:] for i in rows[d] if (i % 1000) // 100 == 7)
    with ParquetReader(window, SCHEMA) as r:
        assert r.state_dict()["units"][0][0].startswith("date=2026-11-01/hour=7/")


def test_file_uri_glob_and_filter_on_local_hive_directories(tmp_path):
    def write(path, table):
        target = tmp_path / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, target, row_group_size=8)

    rows = _write_days(write, "/data")
    (tmp_path / "data" / "_SUCCESS").write_text("")
    cases = {
        "date in ('2026-10-30', '2026-11-02')": DAYS[0::3],
        "not (date < '2026-11-02')": DAYS[3:],
        "(date = '2026-10-31' or date = '2026-11-01') and hour >= 0": DAYS[1:3],
    }
    for flt, days in cases.items():
        for paths in ([f"file://{tmp_path}/data"], [str(tmp_path / "data" / "*" / "*" / "*.parquet")]):
            cfg = ReaderConfig(paths=paths, batch_size=32, passthrough=["row_id"], filter=flt)
            assert _ids(cfg) == sorted(i for d in days for i in rows[d]), (flt, paths)


def test_filter_errors_name_what_and_where(tmp_path):
    with pytest.raises(ValueError, match=r"expected a quoted text or a number at character 9, found 'x'"):
        ReaderConfig(filter="date >= x")
    with pytest.raises(ValueError, match=r"expected '\)' at the end"):
        ReaderConfig(filter="(date = '1'")
    with pytest.raises(ValueError, match=r"cannot read '; drop' at character 12"):
        ReaderConfig(filter="date = '1' ; drop")
    pq.write_table(_table(0, 10), tmp_path / "flat.parquet")
    with pytest.raises(ReadError, match=r"flat.parquet: expected a partition directory 'date=...'.*found partitions none"):
        ParquetReader(ReaderConfig(paths=[str(tmp_path)], filter="date = '2026-11-01'"), SCHEMA)
    (tmp_path / "flat.parquet").unlink()
    (tmp_path / "date=2026-10-01").mkdir()
    pq.write_table(_table(0, 10), tmp_path / "date=2026-10-01" / "a.parquet")
    with pytest.raises(ReadError, match=r"expected at least one file whose partitions match filter .*found none of "
                                        r"1 file\(s\) \(partitions: date=2026-10-01\)"):
        ParquetReader(ReaderConfig(paths=[str(tmp_path)], filter="date >= '2026-11-01'"), SCHEMA)
    with pytest.raises(ReadError, match=r"expected a number for partition 'date'.*found '2026-10-01'"):
        ParquetReader(ReaderConfig(paths=[str(tmp_path)], filter="date > 5"), SCHEMA)


def test_partition_values_and_parse():
    assert partition_values("/a/date=2026-11-01/city=New%20York/x=1/p.parquet") == {
        "date": "2026-11-01", "city": "New York", "x": "1"}
    flt = parse_filter("date >= '2026-11-01' and city in ('New York', \"Paris\") or x <> 2")
    assert flt.keys == {"date", "city", "x"}
    assert flt.matches({"date": "2026-11-02", "city": "Paris", "x": "2"})
    assert not flt.matches({"date": "2026-10-02", "city": "Paris", "x": "2"})
    assert flt.matches({"date": "2026-10-02", "city": "Paris", "x": "3"})
    assert parse_filter("  ") is None


def test_job_file_filter_and_a_bad_one_fails_at_load(tmp_path):
    job = tmp_path / "job.toml"
    body = ("[schema]\nlabel = \"label\"\n[schema.tables.item]\ndim = 4\n[[schema.sparse]]\nname = \"item\"\n"
            "[data.train]\npaths = [\"{p}\"]\nfilter = \"{f}\"\n")
    job.write_text(body.format(p=tmp_path, f="date >= '2026-11-01'"))
    assert load_job(job).data.train.filter == "date >= '2026-11-01'"
    job.write_text(body.format(p=tmp_path, f="date >= "))
    with pytest.raises(Exception, match="expected a literal at the end"):
        load_job(job)


def test_convert_reads_a_memory_uri(memory_root, tmp_path):
    fs, root = memory_root
    with fs.open(f"{root}/in.csv", "wb") as f:
        f.write(b"label,x,item\n1,0.5,3\n0,1.5,4\n")
    report = convert([f"memory://{root}/in.csv"], tmp_path / "out", ConvertOptions(fmt="csv"), schema=SCHEMA)
    assert report["inputs"] == [f"memory://{root}/in.csv"] and report["rows"] == 2
    assert pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pydict() == {
        "label": [1, 0], "x": [0.5, 1.5], "item": [3, 4]}


def test_eval_slices_read_only_the_files_the_partition_filter_keeps(tiny_data, tmp_path):
    """A job whose eval split is a window of partitions: ``recsys eval --slice`` takes the slice
    column from the scored files only (it used to read every file and refuse the row count)."""
    import pyarrow.dataset as ds

    from recsys.eval.evaluate import EvalOptions, run_eval, slice_metrics
    from recsys.eval.metrics import summarize
    from weighted_data import train

    hive = tmp_path / "eval"
    for day, f in zip(("2026-10-31", "2026-11-01"), sorted((tiny_data / "eval").glob("*.parquet"))):
        (hive / f"date={day}").mkdir(parents=True)
        (hive / f"date={day}" / f.name).write_bytes(f.read_bytes())
    kept = ds.dataset(hive / "date=2026-11-01").to_table()
    assert 0 < kept.num_rows < ds.dataset(hive).count_rows()
    train(tmp_path / "run", tiny_data / "train", hive, "train.max_steps=3", "data.eval.filter=\"date >= '2026-11-01'\"")
    res = run_eval(tmp_path / "run", EvalOptions(slices=["c9"], top_k=2, predictions=tmp_path / "p.parquet"))
    pred = pq.read_table(tmp_path / "p.parquet")
    assert res["rows"] == kept.num_rows and pred.column("row_id").equals(kept.column("row_id"))
    y, p = pred.column("label").to_numpy(), pred.column("score").to_numpy()
    assert res["slices"]["c9"] == slice_metrics(y, p, kept.column("c9"), 2, 10)
    assert res["auc"] == summarize(y, p)["auc"]
