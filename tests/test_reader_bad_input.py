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
from reader_data import ids_of, kjt_rows, make_schema, write_dataset


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


def read_clean(good, root, **kw):
    """Read in both modes: every good row once, no error, nothing counted as skipped; return stats."""
    for mode in ("error", "skip"):
        batches, stats = read(good, root, on_bad_file=mode, **kw)
        assert sorted(ids_of(batches)) == good.row_ids
        assert (stats["skipped_files"], stats["skipped_row_groups"], stats["skipped_rows"]) == (0, 0, 0)
    return stats


def test_file_with_zero_rows_has_nothing_to_read(good, dirty):
    """A valid file without rows (an empty partition, as Spark writes them) loses nothing: counted, read past."""
    pq.write_table(good_table(good).slice(0, 0), dirty / "bad.parquet")
    stats = read_clean(good, dirty)
    assert (stats["empty_files"], stats["empty_row_groups"], stats["files"]) == (1, 0, 3)


def test_file_with_zero_row_groups_has_nothing_to_read(good, dirty):
    with pq.ParquetWriter(dirty / "bad.parquet", good_table(good).schema):
        pass
    assert pq.ParquetFile(dirty / "bad.parquet").metadata.num_row_groups == 0
    stats = read_clean(good, dirty)
    assert stats["empty_files"] == 1


def test_empty_row_group_is_read_past(good, dirty):
    table = good_table(good)
    with pq.ParquetWriter(dirty / "bad.parquet", table.schema) as w:
        w.write_table(table.slice(0, 10))
        w.write_table(table.slice(0, 0))
        w.write_table(table.slice(10, 10))
    assert pq.ParquetFile(dirty / "bad.parquet").metadata.row_group(1).num_rows == 0
    for mode in ("error", "skip"):
        batches, stats = read(good, dirty, on_bad_file=mode)
        assert sorted(ids_of(batches)) == sorted(good.row_ids + list(range(10_000, 10_020)))
        assert (stats["empty_row_groups"], stats["empty_files"], stats["skipped_row_groups"]) == (1, 0, 0)
    with ParquetReader(cfg(good, dirty), make_schema()) as r:  # not a unit: not in the resume state
        assert not any(k.startswith("bad.parquet#1") for k, _ in r.state_dict()["units"])


def test_no_rows_at_all_is_an_error(good, tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    pq.write_table(good_table(good).slice(0, 0), root / "a.parquet")
    pq.write_table(good_table(good).slice(0, 0), root / "b.parquet")
    for mode in ("error", "skip"):
        with pytest.raises(ReadError, match=r"empty/: expected at least one row to read, found 2 file\(s\): 2 without rows$"):
            ParquetReader(cfg(good, root, on_bad_file=mode), make_schema())
    (root / "c.parquet").write_bytes(b"junk")  # with skip, a bad file counts among them
    with pytest.raises(ReadError, match=r"expected at least one row to read, found 3 file\(s\): 2 without rows, 1 bad "
                                        r"\(.*c\.parquet: expected a Parquet file"):
        ParquetReader(cfg(good, root, on_bad_file="skip"), make_schema())


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
    labels[3] = labels[9] = None
    pq.write_table(with_column(table, "label", pa.array(labels, pa.int8())), dirty / "bad.parquet")
    expect_error(good, dirty, r"bad\.parquet: row group 0: column 'label': row 3: expected a label of 0 or 1",
                 r"found null \(row 3 of the file; 2 bad rows in the row group\)$")
    expect_skipped(good, dirty, caplog, row_groups=1, rows=30)


def write_labels(good, dirty, values, arrow_type):
    """Write bad.parquet: 2 row groups of 5 and 25 rows, ``values`` as the labels of the second."""
    table = good_table(good)
    labels = [0, 1, 1, 0, 1] + list(values) + [0] * (25 - len(values))
    array = pa.array([float(v) for v in labels]).cast(arrow_type, safe=False) if pa.types.is_boolean(arrow_type) \
        or pa.types.is_float16(arrow_type) else pa.array(labels, arrow_type)
    table = with_column(table, "label", array)
    with pq.ParquetWriter(dirty / "bad.parquet", table.schema) as w:
        w.write_table(table.slice(0, 5))
        w.write_table(table.slice(5))


BAD_BINARY_LABELS = {  # (labels of row group 1, type) -> what the message shows
    "two": ([1, 0, 2, 2], pa.int64(), "2"),
    "minus one": ([0, -1], pa.int8(), "-1"),
    "a half": ([0.0, 1.0, 0.5], pa.float64(), "0.5"),
    "nearly one": ([0.0, 1.0, 0.99999994], pa.float32(), "0.99999994"),
    "nan": ([float("nan")], pa.float32(), "nan"),
    "inf": ([0.0, float("inf")], pa.float64(), "inf"),
}


@pytest.mark.parametrize("case", list(BAD_BINARY_LABELS))
def test_binary_labels_must_be_0_or_1(good, dirty, case, caplog):
    values, arrow_type, shown = BAD_BINARY_LABELS[case]
    write_labels(good, dirty, values, arrow_type)
    row = next(i for i, v in enumerate(values) if not (v == 0 or v == 1))
    count = sum(1 for v in values if not (v == 0 or v == 1))
    err = expect_error(
        good, dirty,
        rf"^.*bad\.parquet: row group 1: column 'label': row {row}: expected a label of 0 or 1 "
        r"\(schema.label_kind = 'binary'; set it to 'probability' for soft labels in \[0, 1\]\), "
        rf"found {re.escape(shown)} \(row {5 + row} of the file" + (f"; {count} bad rows in the row group" if count > 1 else "")
        + r"\)$",
    )
    assert (err.row_group, err.column, err.row) == (1, "label", row)
    expect_skipped(good, dirty, caplog, row_groups=1, rows=25, also=range(10_000, 10_005))


def test_the_first_bad_label_of_the_row_group_is_named(good, dirty):
    """Nulls and bad values together: the message names the first in row order, and counts both."""
    write_labels(good, dirty, [0, 1, None, 0.5, None], pa.float64())
    expect_error(good, dirty, r"bad\.parquet: row group 1: column 'label': row 2: expected a label of 0 or 1 .*"
                              r"found null \(row 7 of the file; 3 bad rows in the row group\)$")
    write_labels(good, dirty, [0.5, 1, None], pa.float32())
    expect_error(good, dirty, r"row group 1: column 'label': row 0: .*found 0.5 \(row 5 of the file; 2 bad rows")


def test_labels_of_any_numeric_or_boolean_type_that_are_0_or_1(good, dirty):
    for arrow_type, values in [(pa.bool_(), [True, False]), (pa.float16(), [1.0, 0.0]), (pa.uint64(), [1, 0]),
                               (pa.float64(), [1.0, -0.0])]:
        write_labels(good, dirty, values, arrow_type)
        batches, _ = read(good, dirty)
        got = {rid: lab for b in batches for rid, lab in zip(b.extra["row_id"].tolist(), b.labels.tolist())}
        assert [got[10_005 + i] for i in range(len(values))] == [1.0, 0.0], arrow_type


def test_probability_labels_take_0_to_1_and_nothing_else(good, dirty):
    schema = make_schema(label_kind="probability")
    write_labels(good, dirty, [0.25, 1.0, 0.0, 0.7], pa.float64())
    with ParquetReader(cfg(good, dirty), schema) as r:
        batches = list(r)
    got = {rid: lab for b in batches for rid, lab in zip(b.extra["row_id"].tolist(), b.labels.tolist())}
    assert [got[10_005 + i] for i in range(4)] == pytest.approx([0.25, 1.0, 0.0, 0.7])
    for values, shown in [([0.5, 1.5], "1.5"), ([-0.1], "-0.1"), ([float("nan")], "nan"), ([2], "2.0")]:
        write_labels(good, dirty, values, pa.float64())
        with pytest.raises(ReadError) as info, ParquetReader(cfg(good, dirty), schema) as r:
            list(r)
        msg = str(info.value)
        assert re.search(r"bad\.parquet: row group 1: column 'label': row \d: expected a label in \[0, 1\] "
                         rf"\(schema.label_kind = 'probability'\), found {re.escape(shown)} \(row \d of the file\)$", msg), msg


@pytest.mark.parametrize("fill", ["nan", "inf", "-inf", "1e39"])
def test_non_finite_dense_fill_is_refused_in_the_job_file(tmp_path, fill):
    from recsys.config import ConfigError, load_job
    from recsys.features.schema import Schema

    with pytest.raises(ValueError, match=r"dense_fill_null must be a finite number within float32 range"):
        Schema(dense_fill_null=float(fill))
    job = tmp_path / "job.toml"
    job.write_text(f'name = "j"\n[schema]\nlabel = "y"\ndense_fill_null = {fill}\n')
    with pytest.raises(ConfigError, match=rf"schema: dense_fill_null must be a finite number within float32 range "
                                          rf"\(null dense cells become it and reach the model\), found {re.escape(repr(float(fill)))}$"):
        load_job(job)
    with pytest.raises(ConfigError, match=r"schema.label_kind: expected one of \['binary', 'probability'\], found 'soft'"):
        load_job(job, ["schema.dense_fill_null=0", "schema.label_kind=soft"])
    assert load_job(job, ["schema.dense_fill_null=-1.5"]).schema.dense_fill_null == -1.5


def test_dense_fill_reaches_the_batch(good, dirty):
    """Nulls become dense_fill_null (then the transform); an all-null column too."""
    table = good_table(good)
    d1 = [None] * 30
    table = with_column(with_column(table, "d1", pa.array(d1, pa.float32())), "d3", pa.nulls(30))
    pq.write_table(table, dirty / "bad.parquet")
    with ParquetReader(cfg(good, dirty), make_schema(dense_fill_null=-3.0, dense_transform="none")) as r:
        rows = {rid: d for b in r for rid, d in zip(b.extra["row_id"].tolist(), b.dense.tolist())}
    assert all(rows[i][0] == -3.0 and rows[i][2] == -3.0 for i in range(10_000, 10_030))
    assert all(np.isfinite(v).all() for v in rows.values())


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


# --------------------------------------------------------------------------- ids


def bad_utf8_strings(values: list[bytes | None], large: bool = False) -> pa.Array:
    """Return a string array holding ``values`` as they are (Arrow does not check UTF-8 here)."""
    offsets, data, valid = [0], b"", []
    for v in values:
        data += v or b""
        offsets.append(len(data))
        valid.append(v is not None)
    otype = np.int64 if large else np.int32
    bitmap = pa.py_buffer(np.packbits(np.array(valid), bitorder="little").tobytes())
    return pa.Array.from_buffers(pa.large_string() if large else pa.string(), len(values),
                                 [bitmap, pa.py_buffer(np.array(offsets, otype).tobytes()), pa.py_buffer(data)],
                                 null_count=valid.count(False))


def test_empty_string_is_an_id_and_null_is_none(good, dirty):
    """'' is an id like any other (its own key, a bag of one); null is no id (an empty bag)."""
    from recsys.features import hashing

    table = good_table(good, n=4)
    table = with_column(table, "cat", pa.array(["", None, "x", ""]))
    table = with_column(table, "tags", pa.array([[""], ["", "y"], [], None], pa.list_(pa.string())))
    pq.write_table(table, dirty / "bad.parquet")
    schema = make_schema()
    with ParquetReader(cfg(good, dirty), schema) as r:
        rows = {rid: bags for b in r for rid, bags in zip(b.extra["row_id"].tolist(), kjt_rows(b))}
    empty = hashing.hash_string_reference([""], "tags")[0]
    assert [rows[10_000 + i]["tags"] for i in range(4)] == [[empty], [empty, *hashing.hash_string_reference(["y"], "tags")], [], []]
    cat = [(k & (2**64 - 1)) % 97 for k in hashing.hash_string_reference(["", "x"], "cat")]  # a fixed-size table folds
    assert [rows[10_000 + i]["cat"] for i in range(4)] == [[cat[0]], [], [cat[1]], [cat[0]]]


def test_non_utf8_text_in_a_string_column_is_refused_by_row(good, dirty, caplog):
    table = good_table(good)
    cats = [f"c{i}".encode() for i in range(30)]
    cats[6] = cats[9] = b"caf\xe9"  # Latin-1 written as text
    tags = [[b"ok"]] * 30
    tags[8] = [b"fine", b"\xff\xfe"]
    pq.write_table(with_column(table, "cat", bad_utf8_strings(cats)), dirty / "bad.parquet")
    err = expect_error(good, dirty, r"bad\.parquet: row group 0: column 'cat': row 6: expected UTF-8 text \(the column's "
                                    r"type is string; keep raw bytes in a binary column\), found b'caf\\xe9' \(not UTF-8\) "
                                    r"\(row 6 of the file; 2 bad rows in the row group\)$")
    assert (err.column, err.row) == ("cat", 6)
    expect_skipped(good, dirty, caplog, row_groups=1, rows=30)
    offsets = pa.array(np.cumsum([0] + [len(bag) for bag in tags]), pa.int32())
    flat = [b for bag in tags for b in bag]
    pq.write_table(with_column(table, "tags", pa.ListArray.from_arrays(offsets, bad_utf8_strings(flat))),
                   dirty / "bad.parquet")
    expect_error(good, dirty, r"bad\.parquet: row group 0: column 'tags': row 8: expected UTF-8 text",
                 r"found b'\\xff\\xfe' \(not UTF-8\) in the list \(row 8 of the file\)$")


def test_binary_ids_are_hashed_as_bytes(good, dirty):
    from recsys.features import hashing

    table = good_table(good, n=3)
    table = with_column(table, "cat", pa.array([b"caf\xe9", b"", b"x"], pa.binary()))
    pq.write_table(table, dirty / "bad.parquet")
    with ParquetReader(cfg(good, dirty), make_schema()) as r:
        rows = {rid: bags["cat"] for b in r for rid, bags in zip(b.extra["row_id"].tolist(), kjt_rows(b))}
    keys = [(k & (2**64 - 1)) % 97 for k in hashing.hash_string_reference([b"caf\xe9", b"", b"x"], "cat")]
    assert [rows[10_000 + i] for i in range(3)] == [[k] for k in keys]


def test_converter_ignores_bad_bytes_under_nulls():
    """What Arrow holds under a null (a null string, or a null list's covered values) is no id."""
    from recsys.features import hashing
    from recsys.io.decode import UnitConverter

    conv = UnitConverter(make_schema(dense=[]), [])
    cat = pa.Array.from_buffers(pa.string(), 3, [pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes()),
                                                 pa.py_buffer(np.array([0, 1, 2, 3], np.int32).tobytes()),
                                                 pa.py_buffer(b"a\xffb")], null_count=1)
    tags = pa.ListArray.from_arrays(pa.array([0, 1, 2, 2], pa.int32()), bad_utf8_strings([b"t", b"\xfe"]),
                                    mask=pa.array([False, True, False]))
    table = pa.table({"label": pa.array([0, 1, 0], pa.int8()), "item_id": pa.array([1, 2, 3]),
                      "hist": pa.array([[1], [], None], pa.list_(pa.int64())), "cat": cat, "tags": tags})
    for variant in (cat, cat.dictionary_encode(), pa.chunked_array([cat.slice(0, 1), cat.slice(1)])):
        unit = conv.convert(table.set_column(3, "cat", variant), "mem", 0, 0)
        assert unit.single_len[1].tolist() == [1, 0, 1]  # conv.single: item, cat; conv.multi: hist, tags
        assert np.diff(unit.multi_offs[1]).tolist() == [1, 0, 0]
        assert unit.multi_vals[-1] == hashing.hash_string_reference(["t"], "tags")[0]
    with pytest.raises(ReadError, match=r"^mem: row group 0: column 'cat': row 1: expected UTF-8 text.*found b'\\xff'"):
        conv.convert(table.set_column(3, "cat", bad_utf8_strings([b"a", b"\xff", None]).dictionary_encode()), "mem", 0, 0)
    with pytest.raises(ReadError, match=r"^mem: row group 0: column 'cat': row 2: expected UTF-8 text"):
        conv.convert(table.set_column(3, "cat", bad_utf8_strings([b"a", None, b"\xff"], large=True)), "mem", 0, 0)


def test_a_row_group_whose_string_ids_are_all_null(good, dirty):
    """Read as a dictionary, such a column has an empty dictionary: every row has no id (this was an
    IndexError in the reader until the fuzz test found it)."""
    table = good_table(good, n=5)
    table = with_column(table, "cat", pa.nulls(5, pa.string()))
    table = with_column(table, "tags", pa.array([None, [], None, [None], None], pa.list_(pa.string())))
    pq.write_table(table, dirty / "bad.parquet")
    with ParquetReader(cfg(good, dirty), make_schema()) as r:
        rows = {rid: bags for b in r for rid, bags in zip(b.extra["row_id"].tolist(), kjt_rows(b))}
    assert [(rows[10_000 + i]["cat"], rows[10_000 + i]["tags"]) for i in range(5)] == [([], [])] * 5
    assert len(rows) == len(good.rows) + 5


def test_extreme_and_negative_int_ids_are_ids(good, dirty):
    """Every int64 is an id (its own key: the hash is a bijection); uint64 ids beyond int64 are refused."""
    from recsys.features import hashing

    extremes = [-(2**63), 2**63 - 1, -1, 0, 1, -(2**62)]
    table = good_table(good, n=6)
    table = with_column(table, "item_id", pa.array(extremes, pa.int64()))
    table = with_column(table, "hist", pa.array([[v, -v - 1] for v in extremes], pa.list_(pa.int64())))
    pq.write_table(table, dirty / "bad.parquet")
    with ParquetReader(cfg(good, dirty), make_schema()) as r:
        rows = {rid: bags for b in r for rid, bags in zip(b.extra["row_id"].tolist(), kjt_rows(b))}
    got = [rows[10_000 + i]["item"][0] for i in range(6)]
    assert got == hashing.hash_int64_reference(extremes, "item") and len(set(got)) == 6
    assert [rows[10_000 + i]["hist"] for i in range(6)] == [hashing.hash_int64_reference([v, -v - 1], "item") for v in extremes]
    table = good_table(good, n=4)
    ok = pa.array([0, 2**63 - 1, 7, None], pa.uint64())  # within int64: the same keys as int64
    pq.write_table(with_column(table, "item_id", ok), dirty / "bad.parquet")
    with ParquetReader(cfg(good, dirty), make_schema()) as r:
        rows = {rid: bags for b in r for rid, bags in zip(b.extra["row_id"].tolist(), kjt_rows(b))}
    assert [rows[10_000 + i]["item"] for i in range(4)] == [[k] for k in hashing.hash_int64_reference([0, 2**63 - 1, 7], "item")] + [[]]
    big = pa.array([0, 2**63, 2**64 - 1, None], pa.uint64())
    pq.write_table(with_column(table, "item_id", big), dirty / "bad.parquet")
    expect_error(good, dirty, r"bad\.parquet: row group 0: column 'item_id': row 1: expected ids within int64 \(the "
                              r"service takes int64 ids; an unsigned id above 2\*\*63-1 has none\), found 9223372036854775808 "
                              r"\(row 1 of the file; 2 bad rows in the row group\)$")
    pq.write_table(with_column(table, "hist", pa.array([[1], None, [2, 2**64 - 1], []], pa.list_(pa.uint64()))),
                   dirty / "bad.parquet")
    expect_error(good, dirty, r"column 'hist': row 2: expected ids within int64.*found 18446744073709551615 in the list")


def test_repeated_column_names_are_named(good, dirty, caplog):
    table = good_table(good)
    table = table.append_column("d2", table.column("d1"))
    assert table.column_names.count("d2") == 2
    pq.write_table(table, dirty / "bad.parquet")
    with pytest.raises(ReadError, match=r"bad\.parquet: column 'd2': expected one column of that name, found 2 columns named 'd2'$"):
        ParquetReader(cfg(good, dirty), make_schema())
    expect_skipped(good, dirty, caplog, files=1)
    from recsys.io.reader import describe

    assert "bad.parquet: 2 columns of that name" in describe([str(dirty)], make_schema())


def test_arrow_messages_end_up_on_one_line(good, dirty):
    """A footer Arrow cannot parse: its multi-line message is folded into the one-line error."""
    (dirty / "bad.parquet").write_bytes(b"PAR1" + b"\x00" * 100 + (50).to_bytes(4, "little") + b"PAR1")
    err = expect_error(good, dirty, r"bad\.parquet: expected a Parquet file with a valid footer")
    assert "\n" not in str(err)


# --------------------------------------------------------------------------- files changing under the reader


def later_file(good, dirty, name="zz.parquet"):
    """Write a good 2-row-group file that sorts after the data set's files (read last)."""
    table = good_table(good)
    with pq.ParquetWriter(dirty / name, table.schema) as w:
        w.write_table(table.slice(0, 12))
        w.write_table(table.slice(12))
    return dirty / name


def read_changing(good, dirty, change, **kw):
    """Read the first batch, ``change()`` the files, read the rest; return (ids, stats)."""
    with ParquetReader(cfg(good, dirty, batch_size=8, prefetch=1, **kw), make_schema()) as r:
        it = iter(r)
        ids = ids_of([next(it)])
        change()
        ids += ids_of(it)
        return ids, dict(r.stats)


@pytest.mark.parametrize("how", ["deleted", "truncated", "replaced by garbage", "column dropped", "row group lost"])
def test_a_file_changing_mid_epoch_is_named_with_its_row_group(good, dirty, how, caplog):
    path = later_file(good, dirty)
    blob = path.read_bytes()
    change = {
        "deleted": lambda: path.unlink(),
        "truncated": lambda: path.write_bytes(blob[: len(blob) // 2]),
        "replaced by garbage": lambda: path.write_bytes(np.random.default_rng(0).bytes(len(blob))),
        "column dropped": lambda: pq.write_table(pq.read_table(path).drop_columns(["cat"]), path),
        "row group lost": lambda: pq.write_table(pq.read_table(path), path),  # same rows, one row group
    }[how]
    found = {
        "deleted": r"expected an existing file \(it was listed when the reader was built\), found no such file "
                   r"\(deleted or moved\)$",
        "truncated": r"expected a Parquet file with a valid footer, found a corrupt, truncated",
        "replaced by garbage": r"expected a Parquet file with a valid footer",
        "column dropped": r"column 'cat': expected a string or binary column .*found no such column",
        "row group lost": r"",
    }[how]
    with pytest.raises(ReadError) as info:
        read_changing(good, dirty, change)
    msg = str(info.value)
    if how == "row group lost":  # row group 0 now holds all 30 rows, row group 1 is gone
        assert re.search(r"zz\.parquet: row group 0: expected 12 rows \(as its footer said when the reader was "
                         r"built\), found 30 rows \(file changed\?\)$", msg), msg
    else:
        assert re.search(r"zz\.parquet: row group 0: " + found, msg), msg
        assert info.value.row_group == 0
    if how == "row group lost":
        return
    # skipped: every row group of the file counted, every other row read once
    path.unlink(missing_ok=True)
    later_file(good, dirty)
    with caplog.at_level(logging.WARNING, logger="recsys.io.reader"):
        ids, stats = read_changing(good, dirty, change, on_bad_file="skip")
    assert sorted(ids) == good.row_ids
    assert (stats["skipped_row_groups"], stats["skipped_rows"], stats["skipped_files"]) == (2, 30, 0)
    assert "zz.parquet: row group 1" in caplog.text


def test_page_checksums_catch_flipped_bytes(good, dirty, caplog):
    """Without checksums a flipped byte in an uncompressed page is a wrong value no reader can see;
    with pages written with checksums the reader verifies them and names the row group and column."""
    table = good_table(good)
    path = dirty / "bad.parquet"
    with pq.ParquetWriter(path, table.schema, compression="none", use_dictionary=False,
                          write_page_checksum=True) as w:
        w.write_table(table.slice(0, 15))
        w.write_table(table.slice(15, 15))
    col = pq.ParquetFile(path).metadata.row_group(1).column(table.schema.get_field_index("d2"))
    blob = bytearray(path.read_bytes())
    blob[col.data_page_offset + col.total_compressed_size - 3] ^= 0x40  # in the last value's bytes
    path.write_bytes(bytes(blob))
    assert pq.read_table(path).column("d2")[29].as_py() != table.column("d2")[29].as_py()  # silently wrong unverified
    err = expect_error(good, dirty, r"bad\.parquet: row group 1: column 'd2': expected a readable row group, found "
                                    r".*CRC checksum verification failed")
    assert (err.row_group, err.column) == (1, "d2")
    expect_skipped(good, dirty, caplog, row_groups=1, rows=15, also=range(10_000, 10_015))
