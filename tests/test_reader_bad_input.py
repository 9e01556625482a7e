"""Bad input: every case stops with a ReadError naming file, row group, column and what was
expected; with ``on_bad_file = "skip"`` the bad file or row group is counted and skipped."""

from __future__ import annotations

import logging
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.io.reader import ParquetReader, ReadError
from reader_data import ids_of, make_schema, write_dataset


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("bad") / "good", files=2, row_groups=2)


@pytest.fixture
def dirty(good, tmp_path):
    """A copy of the good data set, into which a test writes one bad file (bad.parquet)."""
    root = tmp_path / "data"
    shutil.copytree(good.root, root)
    return root


def good_table(good, n=30, first_id=10_000):
    """A valid table of the test schema (row ids outside the good set)."""
    table = pq.read_table(good.files[0]).slice(0, n)
    return table.set_column(table.schema.get_field_index("row_id"), "row_id",
                            pa.array(range(first_id, first_id + n), pa.int64()))


def with_column(table, name, array):
    return table.set_column(table.schema.get_field_index(name), name, array)


def cfg(good, root, **kw):
    kw.setdefault("shuffle", False)
    return good.config(paths=[str(root)], **kw)


def read(good, root, **kw):
    with ParquetReader(cfg(good, root, **kw), make_schema()) as r:
        return list(r), dict(r.stats)


def expect_error(good, root, *patterns, **kw):
    """Assert reading fails with a ReadError whose message holds every pattern; return it."""
    with pytest.raises(ReadError) as info:
        read(good, root, **kw)
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in {msg!r}"
    return info.value


def expect_skipped(good, root, caplog, *, files=0, row_groups=0, rows=0, also=(), **kw):
    """Read with on_bad_file="skip": the good rows (plus ``also``) come once, skips are counted."""
    with caplog.at_level(logging.WARNING, logger="recsys.io.reader"):
        batches, stats = read(good, root, on_bad_file="skip", **kw)
    assert sorted(ids_of(batches)) == sorted(good.row_ids + list(also))
    assert (stats["skipped_files"], stats["skipped_row_groups"], stats["skipped_rows"]) == (files, row_groups, rows)
    assert "bad.parquet" in caplog.text
    return stats


# --------------------------------------------------------------------------- schema (eager)


SCHEMA_CASES = {
    "missing column": (
        lambda t: t.drop_columns(["cat"]),
        [r"bad\.parquet", r"column 'cat'", r"expected a string or binary column for single-hot string feature 'cat'",
         r"found no such column \(columns: row_id, label"],
    ),
    "string where int64 expected": (
        lambda t: with_column(t, "item_id", pa.array([str(i) for i in range(len(t))])),
        [r"bad\.parquet", r"column 'item_id'", r"expected an integer column for single-hot int64 feature 'item'",
         r"found string"],
    ),
    "dense column is a string": (
        lambda t: with_column(t, "d2", pa.array(["1.5"] * len(t))),
        [r"bad\.parquet", r"column 'd2'", r"expected a numeric \(integer, float or boolean\) dense column", r"found string"],
    ),
    "multi-hot column is not a list": (
        lambda t: with_column(t, "hist", pa.array(range(len(t)), pa.int64())),
        [r"bad\.parquet", r"column 'hist'", r"expected a list<int64> column for multi-hot feature 'hist'",
         r"found int64 \(not a list; set multi_hot = false"],
    ),
    "single-hot column is a list": (
        lambda t: with_column(t, "item_id", pa.array([[i] for i in range(len(t))], pa.list_(pa.int64()))),
        [r"bad\.parquet", r"column 'item_id'", r"expected an integer column",
         r"found list<.*int64> \(a list column; set multi_hot = true"],
    ),
    "list of the wrong element type": (
        lambda t: with_column(t, "tags", pa.array([[1.5]] * len(t), pa.list_(pa.float64()))),
        [r"bad\.parquet", r"column 'tags'", r"expected a list<string> column", r"wrong element type"],
    ),
}


@pytest.mark.parametrize("case", list(SCHEMA_CASES))
def test_schema_errors_are_caught_when_the_reader_is_built(good, dirty, case, caplog):
    change, patterns = SCHEMA_CASES[case]
    pq.write_table(change(good_table(good)), dirty / "bad.parquet")
    with pytest.raises(ReadError) as info:
        ParquetReader(cfg(good, dirty), make_schema())  # eager: no batch requested
    for p in patterns:
        assert re.search(p, str(info.value)), f"{p!r} not in {str(info.value)!r}"
    assert info.value.file.endswith("bad.parquet")
    expect_skipped(good, dirty, caplog, files=1)


# --------------------------------------------------------------------------- files


def test_garbage_file(good, dirty, caplog):
    (dirty / "bad.parquet").write_bytes(np.random.default_rng(0).bytes(5000))
    expect_error(good, dirty, r"bad\.parquet", r"expected a Parquet file with a valid footer",
                 r"found a corrupt, truncated or non-Parquet file")
    expect_skipped(good, dirty, caplog, files=1)


def test_truncated_file(good, dirty, caplog):
    blob = good.files[0].read_bytes()
    (dirty / "bad.parquet").write_bytes(blob[: len(blob) // 2])
    expect_error(good, dirty, r"bad\.parquet", r"expected a Parquet file with a valid footer",
                 r"corrupt, truncated")
    expect_skipped(good, dirty, caplog, files=1)


def test_zero_byte_file(good, dirty, caplog):
    (dirty / "bad.parquet").write_bytes(b"")
    expect_error(good, dirty, r"bad\.parquet", r"expected a Parquet file", r"found an empty file \(0 bytes\)")
    expect_skipped(good, dirty, caplog, files=1)


def test_file_with_zero_rows(good, dirty, caplog):
    pq.write_table(good_table(good).slice(0, 0), dirty / "bad.parquet")
    expect_error(good, dirty, r"bad\.parquet", r"expected a file with rows", r"found an empty file \(1 row group\(s\) with 0 rows\)")
    expect_skipped(good, dirty, caplog, files=1)


def test_file_with_zero_row_groups(good, dirty, caplog):
    with pq.ParquetWriter(dirty / "bad.parquet", good_table(good).schema):
        pass
    expect_error(good, dirty, r"bad\.parquet", r"found an empty file \(0 row groups\)")
    expect_skipped(good, dirty, caplog, files=1)


def test_empty_row_group(good, dirty, caplog):
    table = good_table(good)
    with pq.ParquetWriter(dirty / "bad.parquet", table.schema) as w:
        w.write_table(table.slice(0, 10))
        w.write_table(table.slice(0, 0))
        w.write_table(table.slice(10, 10))
    err = expect_error(good, dirty, r"bad\.parquet: row group 1: expected a row group with rows",
                       r"found an empty row group \(0 rows\)")
    assert err.row_group == 1
    # skipped: the empty row group only; the file's other row groups are read
    with caplog.at_level(logging.WARNING, logger="recsys.io.reader"):
        batches, stats = read(good, dirty, on_bad_file="skip")
    assert sorted(ids_of(batches)) == sorted(good.row_ids + list(range(10_000, 10_020)))
    assert stats["skipped_row_groups"] == 1 and stats["skipped_files"] == 0
    assert "bad.parquet" in caplog.text


def test_corrupt_column_chunk_is_named(good, dirty, caplog):
    """Footer intact, one column chunk overwritten: found when that row group is read."""
    table = good_table(good)
    path = dirty / "bad.parquet"
    with pq.ParquetWriter(path, table.schema, compression="zstd") as w:
        w.write_table(table.slice(0, 15))
        w.write_table(table.slice(15, 15))
    col = pq.ParquetFile(path).metadata.row_group(1).column(table.schema.get_field_index("d2"))
    start = col.dictionary_page_offset or col.data_page_offset
    blob = bytearray(path.read_bytes())
    blob[start : start + col.total_compressed_size] = np.random.default_rng(1).bytes(col.total_compressed_size)
    path.write_bytes(bytes(blob))
    ParquetReader(cfg(good, dirty), make_schema()).close()  # the footer is fine
    err = expect_error(good, dirty, r"bad\.parquet: row group 1: column 'd2': expected a readable row group, found ")
    assert (err.row_group, err.column) == (1, "d2")
    expect_skipped(good, dirty, caplog, row_groups=1, rows=15, also=range(10_000, 10_015))


# --------------------------------------------------------------------------- data (when read)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_dense_value_names_the_row(good, dirty, bad, caplog):
    table = good_table(good)
    d1 = table.column("d1").to_pylist()
    d1[7] = bad
    with pq.ParquetWriter(dirty / "bad.parquet", table.schema) as w:
        w.write_table(table.slice(0, 5))
        w.write_table(with_column(table, "d1", pa.array(d1, pa.float32())).slice(5))
    err = expect_error(
        good, dirty, r"bad\.parquet: row group 1: column 'd1': row 2: expected a finite number or null",
        rf"found {re.escape(repr(bad))} \(row 7 of the file\)",
    )
    assert (err.row_group, err.column, err.row) == (1, "d1", 2)
    stats = expect_skipped(good, dirty, caplog, row_groups=1, rows=25, also=range(10_000, 10_005))
    assert stats["rows"] == len(good.rows) + 5


def test_null_label(good, dirty, caplog):
    table = good_table(good)
    labels = table.column("label").to_pylist()
    labels[3] = None
    pq.write_table(with_column(table, "label", pa.array(labels, pa.int8())), dirty / "bad.parquet")
    expect_error(good, dirty, r"bad\.parquet: row group 0: column 'label': row 3: expected a finite, non-null label",
                 r"found null")
    expect_skipped(good, dirty, caplog, row_groups=1, rows=30)


@pytest.mark.multiproc
def test_error_in_a_worker_surfaces_with_the_same_message(good, dirty):
    table = good_table(good)
    pq.write_table(with_column(table, "d1", pa.array([float("nan")] * 30, pa.float32())), dirty / "bad.parquet")
    thread = expect_error(good, dirty, r"bad\.parquet: row group 0: column 'd1': row 0")
    worker = expect_error(good, dirty, r"bad\.parquet: row group 0: column 'd1': row 0", num_workers=2)
    assert str(worker) == str(thread)
    assert type(worker) is ReadError and worker.row == 0


@pytest.mark.multiproc
def test_skip_in_a_worker_is_counted_and_resumable(good, dirty, caplog):
    table = good_table(good)
    pq.write_table(with_column(table, "d1", pa.array([float("nan")] * 30, pa.float32())), dirty / "bad.parquet")
    stats = expect_skipped(good, dirty, caplog, row_groups=1, rows=30, num_workers=2, batch_size=8)
    assert stats["rows"] == len(good.rows)
    with ParquetReader(cfg(good, dirty, on_bad_file="skip"), make_schema()) as r:
        list(r)
        state = r.state_dict()
    assert state["skipped"] == ["bad.parquet#0"]


def test_missing_path_and_empty_glob(good, tmp_path):
    with pytest.raises(ReadError, match=r"no_such_dir: expected an existing file or directory, found no such path"):
        ParquetReader(good.config(paths=[str(tmp_path / "no_such_dir")]), make_schema())
    with pytest.raises(ReadError, match=r"expected a glob matching at least one file, found no match"):
        ParquetReader(good.config(paths=[str(tmp_path / "*.parquet")]), make_schema())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReadError, match=r"expected a directory holding data files"):
        ParquetReader(good.config(paths=[str(tmp_path / "empty")]), make_schema())
