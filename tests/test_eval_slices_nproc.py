"""``recsys eval --slice COL --nproc N``: any slice column (strings, nulls) gives the groups and
metrics of one process; the id join behind it; its errors (no id column, repeated or null ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.errors import UserError
from recsys.eval.evaluate import EvalOptions, RowIndex, run_eval

COUNTRIES = np.array(["de", "fr", "us", "br", "in", "jp", "ng"])


def _eval_table(run: Path) -> pa.Table:
    return ds.dataset(run.parent / "data" / "eval").to_table()


def _write_split(table: pa.Table, out: Path, files: int = 3, row_group_size: int = 300) -> Path:
    """Write ``table`` as ``files`` Parquet files of several row groups each; return the directory."""
    out.mkdir(parents=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for i in range(files):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]), out / f"part-{i:05d}.parquet",
                       row_group_size=row_group_size)
    return out


@pytest.fixture(scope="module")
def sliced_data(tiny_run, tmp_path_factory) -> Path:
    """The tiny eval split in 3 files of 300-row groups, plus a string column with nulls
    (``country``; null is the most frequent value) and a boolean column with nulls (``active``)."""
    table = _eval_table(tiny_run)
    rng = np.random.default_rng(7)
    n = table.num_rows
    country = COUNTRIES[rng.integers(0, len(COUNTRIES), n)].astype(object)
    country[rng.random(n) < 0.3] = None
    active = rng.random(n) < 0.4
    active_mask = rng.random(n) < 0.1
    table = table.append_column("country", pa.array(country, pa.string()))
    table = table.append_column("active", pa.array(active, pa.bool_(), mask=active_mask))
    return _write_split(table, tmp_path_factory.mktemp("sliced") / "eval")


# Scores are float32 and a row's score may differ by one ulp when it is scored in another batch
# (the ranks' batches hold other rows), so metrics agree to about 1e-9 relative; counts exactly.
REL = 1e-6


def _same_slices(one: dict, two: dict) -> None:
    assert list(two["slices"]) == list(one["slices"])
    for col, groups in one["slices"].items():
        got = two["slices"][col]
        assert [g["value"] for g in got] == [g["value"] for g in groups], col
        for a, b in zip(groups, got):
            for key in ("rows", "positives"):
                assert b[key] == a[key], (col, a["value"], key)
            for key in ("auc", "log_loss", "normalized_entropy", "calibration", "ctr", "predicted_ctr", "ece"):
                assert b[key] == pytest.approx(a[key], rel=REL, abs=1e-12), (col, a["value"], key)


@pytest.mark.multiproc
def test_string_and_null_slices_with_two_processes_equal_one(tiny_run, sliced_data, tmp_path):
    opts = dict(data=[str(sliced_data)], slices=["c9", "country", "active", "c17"], top_k=3)
    one = run_eval(tiny_run, EvalOptions(**opts, predictions=tmp_path / "p1.parquet"))
    two = run_eval(tiny_run, EvalOptions(**opts, nproc=2, predictions=tmp_path / "p2.parquet"))
    assert two["nproc"] == 2 and one["rows"] == two["rows"] == 2000
    assert (two["rows"], two["positives"]) == (one["rows"], one["positives"])
    for key in ("auc", "log_loss", "normalized_entropy", "calibration", "ece", "ctr"):
        assert two[key] == pytest.approx(one[key], rel=REL, abs=1e-12), key
    # the null string is a group of its own (the largest), and a null boolean too
    assert one["slices"]["country"][0]["value"] is None
    assert None in [g["value"] for g in one["slices"]["active"]]
    _same_slices(one, two)
    for col in one["slices"]:
        assert sum(g["rows"] for g in two["slices"][col]) == one["rows"], col
    # the rows themselves: same ids, labels and scores, whatever order the ranks read them in
    p1 = pq.read_table(tmp_path / "p1.parquet").sort_by("row_id")
    p2 = pq.read_table(tmp_path / "p2.parquet").sort_by("row_id")
    assert p2.column("row_id").equals(p1.column("row_id"))
    assert p2.column("label").equals(p1.column("label"))
    np.testing.assert_allclose(p2.column("score").to_numpy(), p1.column("score").to_numpy(), atol=1e-6)


@pytest.mark.multiproc
def test_without_an_id_column_numeric_slices_are_carried_by_the_processes(tiny_run, tmp_path):
    data = _write_split(_eval_table(tiny_run).drop_columns(["row_id"]), tmp_path / "eval", files=2)
    opts = dict(data=[str(data)], slices=["c17"], top_k=4)
    one = run_eval(tiny_run, EvalOptions(**opts))
    two = run_eval(tiny_run, EvalOptions(**opts, nproc=2))
    assert len(one["slices"]["c17"]) == 5
    _same_slices(one, two)


@pytest.mark.multiproc
def test_bad_data_in_one_ranks_share_is_that_ranks_one_line_error(tiny_run, tmp_path):
    """The rank reading the bad row stops every rank in step; its error is shown, not a peer's
    lost connection."""
    table = _eval_table(tiny_run)
    labels = table.column("label").to_numpy().copy()
    labels[1100] = 2
    table = table.set_column(table.column_names.index("label"), "label", pa.array(labels, pa.int8()))
    data = _write_split(table, tmp_path / "eval", files=2)
    with pytest.raises(UserError) as exc:
        run_eval(tiny_run, EvalOptions(data=[str(data)], nproc=2))
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1, msg
    assert msg.startswith("--nproc 2: rank ") and "part-00001.parquet: row group 0: column 'label'" in msg, msg
    assert "found 2" in msg and "another rank" not in msg


# --------------------------------------------------------------------------- errors (before any scoring)


@pytest.mark.parametrize("column, reason", [("c9", "the column is string"), ("c6", "the column has nulls")])
def test_without_an_id_column_a_column_the_processes_cannot_carry_is_refused(tiny_run, tmp_path, column, reason):
    table = _eval_table(tiny_run).drop_columns(["row_id"])
    data = _write_split(table, tmp_path / "eval", files=2)  # 1000 rows each
    with pytest.raises(UserError) as exc:
        run_eval(tiny_run, EvalOptions(data=[str(data)], slices=[column], nproc=2))
    msg = str(exc.value)
    assert msg.startswith(f"--slice {column} with --nproc 2: {reason}"), msg
    assert "no id column" in msg and "['row_id']" in msg and "use --nproc 1" in msg
    if column == "c6":  # the synthetic c6 has nulls; the first one is named
        first = int(np.flatnonzero(table.column("c6").is_null().to_numpy(zero_copy_only=False))[0])
        assert f"(first in {data / f'part-{first // 1000:05d}.parquet'} row {first % 1000})" in msg, msg


def test_repeated_ids_are_refused_naming_both_rows(tiny_run, tmp_path):
    table = _eval_table(tiny_run)
    data = _write_split(pa.concat_tables([table.slice(0, 700), table.slice(500, 900)]), tmp_path / "eval", files=2)
    rid = table.column("row_id")[500].as_py()
    with pytest.raises(UserError) as exc:
        run_eval(tiny_run, EvalOptions(data=[str(data)], slices=["c9"], nproc=2))
    msg = str(exc.value)
    assert f"row_id={rid} is in {data / 'part-00000.parquet'} row 500 and in {data / 'part-00000.parquet'} row 700" \
        in msg, msg
    assert "(200 repeated in all)" in msg and "use --nproc 1" in msg


def test_a_null_id_is_refused_naming_its_row(tiny_run, tmp_path):
    table = _eval_table(tiny_run)
    ids = table.column("row_id").to_pylist()
    ids[1500] = None
    table = table.set_column(table.column_names.index("row_id"), "row_id", pa.array(ids, pa.int64()))
    data = _write_split(table, tmp_path / "eval", files=2)
    with pytest.raises(UserError, match=r"part-00001\.parquet row 500: the id column row_id is null"):
        run_eval(tiny_run, EvalOptions(data=[str(data)], slices=["c9"], nproc=2))


def test_the_cli_prints_the_error_on_one_line(tiny_run, tmp_path, capsys):
    data = _write_split(_eval_table(tiny_run).drop_columns(["row_id"]), tmp_path / "eval", files=1)
    assert main(["eval", "--checkpoint", str(tiny_run), "--data", str(data), "--slice", "c3", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--slice c3 with --nproc 2" in err and "use --nproc 1" in err


# --------------------------------------------------------------------------- the join itself


def _index(table: pa.Table, id_cols: list[str]) -> RowIndex:
    starts = np.array([0, table.num_rows])
    return RowIndex(table, starts, [type("F", (), {"display": "mem"})()], id_cols, "test")


def test_row_index_joins_on_several_id_columns_like_a_dictionary():
    rng = np.random.default_rng(3)
    n = 5000
    # two id columns, neither unique alone, unique together; an int32 and a float one
    user = rng.integers(0, 400, n).astype(np.int32)
    item = rng.integers(0, 300, n).astype(np.float64)
    keys = np.unique(np.stack([user, item], axis=1), axis=0)
    user, item = keys[:, 0].astype(np.int32), keys[:, 1]
    perm = rng.permutation(len(keys))
    user, item = user[perm], item[perm]
    value = pa.array([None if i % 11 == 0 else f"v{i % 17}" for i in range(len(keys))], pa.string())
    table = pa.table({"user": user, "item": item, "value": value})
    index = _index(table, ["user", "item"])
    # the scored rows: a shuffled subset, ids as the reader carries them (int64, float64)
    pick = rng.permutation(len(keys))[: len(keys) // 2]
    ids = {"user": user[pick].astype(np.int64), "item": item[pick]}
    expect = {(int(u), float(i)): v for u, i, v in zip(user, item, value.to_pylist())}
    got = index.columns(["value"], ids)["value"].to_pylist()
    assert got == [expect[(int(u), float(i))] for u, i in zip(ids["user"], ids["item"])]
    np.testing.assert_array_equal(index.locate(ids), pick)


def test_row_index_names_an_id_it_does_not_hold():
    table = pa.table({"row_id": np.arange(10, 20), "v": np.arange(10)})
    index = _index(table, ["row_id"])
    np.testing.assert_array_equal(index.locate({"row_id": np.array([19, 10])}), [9, 0])
    with pytest.raises(UserError, match=r"test: 2 scored row\(s\) have ids the data files do not hold \(first: "
                                        r"row_id=9\)"):
        index.locate({"row_id": np.array([12, 9, 20])})


def test_reading_slice_columns_names_a_file_without_one(tmp_path):
    from recsys.eval.evaluate import data_columns, read_data

    pq.write_table(pa.table({"row_id": [1, 2], "country": ["de", None]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"row_id": [3]}), tmp_path / "b.parquet")
    files, _ = data_columns([str(tmp_path / "a.parquet")])
    table, starts = read_data(files, ["country", "country", "row_id"])  # a repeated --slice is read once
    assert table.column_names == ["country", "row_id"] and starts.tolist() == [0, 2]
    files, _ = data_columns([str(tmp_path)])
    with pytest.raises(UserError, match=r"b\.parquet: cannot read column\(s\) country, row_id"):
        read_data(files, ["country", "row_id"])
