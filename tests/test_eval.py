"""``recsys eval``: the trainer's own eval, slices, predictions, plots, compare, errors.

Several processes (--nproc): tests/test_eval_slices_nproc.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.errors import UserError
from recsys.eval import metrics as M
from recsys.eval.evaluate import EvalOptions, run_eval


def _data(run: Path) -> Path:
    return run.parent / "data"


@pytest.fixture(scope="module")
def full(tiny_run, tmp_path_factory):
    """One evaluation with every output: slices (a string column and an int column with nulls),
    predictions, plots, and the checkpoint compared with itself."""
    out = tmp_path_factory.mktemp("eval_full")
    opts = EvalOptions(slices=["c9", "c6"], top_k=3, predictions=out / "pred.parquet", plots=out / "plots",
                       compare=tiny_run)
    return run_eval(tiny_run / "checkpoints" / "latest", opts), out


def test_cli_keeps_its_keys_and_equals_the_trainers_final_eval(tiny_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    oracle = _data(tiny_run) / "oracle.json"
    assert main(["eval", "--checkpoint", str(tiny_run), "--oracle", str(oracle), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    logged = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in logged if r.get("event") == "eval"][-1]
    assert got["step"] == final["step"]
    for key in ("rows", "log_loss", "base_ctr", "calibration", "auc", "normalized_entropy"):
        assert got[key] == pytest.approx(final[key], abs=1e-9), key
    assert got["auc_gap_to_oracle"] == pytest.approx(json.loads(oracle.read_text())["eval"]["auc"] - got["auc"])
    assert "AUC" in capsys.readouterr().out.splitlines()[-1]


def test_slices_partition_the_rows_and_agree_with_the_total(full):
    result, _ = full
    for col, groups in result["slices"].items():
        assert len(groups) == 4 and groups[-1]["value"] == "other", col
        assert sum(g["rows"] for g in groups) == result["rows"]
        assert sum(g["positives"] for g in groups) == result["positives"]
        # row-weighted means over a partition equal the mean over all rows
        for key in ("log_loss", "ctr", "predicted_ctr"):
            weighted = sum(g["rows"] * g[key] for g in groups) / result["rows"]
            assert weighted == pytest.approx(result[key], rel=1e-9), (col, key)
        sizes = [g["rows"] for g in groups[:-1]]
        assert sizes == sorted(sizes, reverse=True)


def test_slice_metrics_equal_metrics_of_the_rows_joined_independently(tiny_run, full):
    """Join the predictions file with the data by row_id and recompute one slice's metrics."""
    result, out = full
    pred = pq.read_table(out / "pred.parquet")
    data = ds.dataset(_data(tiny_run) / "eval").to_table(columns=["row_id", "label", "c6"])
    joined = pred.join(data, "row_id", right_suffix="_data")
    assert joined.num_rows == pred.num_rows == data.num_rows == result["rows"]
    np.testing.assert_array_equal(joined.column("label").to_numpy(), joined.column("label_data").to_numpy())
    for group in result["slices"]["c6"][:-1]:
        value = group["value"]
        c6 = joined.column("c6")
        mask = c6.is_null() if value is None else pa.compute.fill_null(pa.compute.equal(c6, value), False)
        mask = np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
        y = joined.column("label").to_numpy()[mask]
        p = joined.column("score").to_numpy()[mask]
        expect = M.summarize(y, p)
        assert group["rows"] == expect["rows"]
        assert group["auc"] == pytest.approx(expect["auc"], abs=1e-9)
        assert group["log_loss"] == pytest.approx(expect["log_loss"], abs=1e-6)  # scores stored as float32


def test_predictions_file_has_one_row_per_example(tiny_run, full):
    result, out = full
    pred = pq.read_table(out / "pred.parquet")
    assert pred.column_names == ["row_id", "label", "score"]
    data_ids = ds.dataset(_data(tiny_run) / "eval").to_table(columns=["row_id"]).column("row_id").to_numpy()
    assert sorted(pred.column("row_id").to_numpy().tolist()) == sorted(data_ids.tolist())
    y, p = pred.column("label").to_numpy(), pred.column("score").to_numpy()
    assert M.roc_auc(y, p) == pytest.approx(result["auc"], abs=1e-6)


def test_every_plot_is_a_real_nonblank_image(full):
    import matplotlib.image as mpimg

    result, out = full
    names = sorted(Path(p).name for p in result["plots"])
    assert names == ["calibration.png", "roc.png", "score_hist.png", "slice_auc_c6.png", "slice_auc_c9.png"]
    for path in result["plots"]:
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 400, (path, img.shape)
        assert img[..., :3].var() > 1e-4, f"{path} is blank"


def test_compare_with_itself_has_zero_delta_and_a_ci_containing_zero(full):
    result, _ = full
    cmp = result["compare"]
    assert cmp["step"] == result["step"]
    assert all(v == 0 for v in cmp["delta"].values()), cmp["delta"]
    d = cmp["auc_diff"]
    assert d["delta"] == 0 and d["ci_low"] <= 0 <= d["ci_high"]
    assert d["auc_a"] == pytest.approx(result["auc"], abs=1e-12)


def test_calibration_table_and_ece_are_reported(full):
    result, _ = full
    table = result["calibration_table"]
    assert sum(b["rows"] for b in table) == result["rows"]
    assert result["ece"] == pytest.approx(M.expected_calibration_error(table), abs=1e-15)


def test_a_missing_slice_column_is_named(tiny_run, capsys):
    assert main(["eval", "--checkpoint", str(tiny_run), "--slice", "no_such_col"]) == 2
    err = capsys.readouterr().err
    assert "no_such_col" in err and "no such column" in err


@pytest.mark.parametrize("change", ["drop_c5", "c1_as_string"])
def test_data_that_does_not_fit_the_checkpoint_names_the_column(tiny_run, tmp_path, change):
    src = sorted((_data(tiny_run) / "eval").glob("*.parquet"))[0]
    table = pq.read_table(src)
    if change == "drop_c5":
        table, col = table.drop_columns(["c5"]), "c5"
    else:
        i = table.column_names.index("c1")
        table, col = table.set_column(i, "c1", table.column("c1").cast(pa.string())), "c1"
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=rf"\b{col}\b"):
        run_eval(tiny_run, EvalOptions(data=[str(tmp_path / "bad.parquet")]))


def test_too_many_rows_fall_back_to_a_binned_auc_with_its_bound(tiny_run):
    exact = run_eval(tiny_run, EvalOptions())
    binned = run_eval(tiny_run, EvalOptions(max_exact_rows=500))
    assert binned["auc_method"].startswith("binned") and exact["auc_method"] == "exact"
    assert binned["auc_method"].endswith("more rows than 500)"), binned["auc_method"]
    assert abs(binned["auc"] - exact["auc"]) <= binned["auc_error_bound"]
    assert binned["rows"] == exact["rows"] and binned["log_loss"] == pytest.approx(exact["log_loss"], rel=1e-9)
    with pytest.raises(UserError, match="--slice needs every prediction"):
        run_eval(tiny_run, EvalOptions(max_exact_rows=500, slices=["c9"]))


def test_predictions_of_a_failed_eval_leave_the_previous_file_as_it_was(tiny_run, tmp_path):
    """A read error after rows were scored: no file with part of the rows, the one there untouched."""
    good = sorted((_data(tiny_run) / "eval").glob("*.parquet"))
    table = pq.read_table(good[0])
    labels = table.column("label").to_numpy().copy()
    labels[-1] = 7  # read last: its last row group is bad data
    bad = tmp_path / "zz-bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int8())),
                   bad, row_group_size=max(1, table.num_rows // 4))
    out = tmp_path / "pred.parquet"
    pq.write_table(pa.table({"row_id": [1], "label": pa.array([0], pa.int8()), "score": pa.array([0.5], pa.float32())}),
                   out)
    before = out.read_bytes()
    with pytest.raises(UserError, match="zz-bad.parquet: row group 3: column .label.*expected a label of 0 or 1"):
        run_eval(tiny_run, EvalOptions(data=[*map(str, good), str(bad)], predictions=out))
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred.parquet", "zz-bad.parquet"]


def test_predictions_of_an_interrupted_eval_leave_no_temporary_file(tiny_run, tmp_path, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt) while `recsys eval --predictions` streams its rows: the
    hidden temporary file, which held the rows scored so far, is removed; the file there
    before is untouched."""
    from recsys.eval import scoring

    out = tmp_path / "pred.parquet"
    pq.write_table(pa.table({"row_id": [1], "label": pa.array([0], pa.int8()), "score": pa.array([0.5], pa.float32())}),
                   out)
    before = out.read_bytes()
    real = scoring.iter_predictions
    seen: list[list[str]] = []

    def interrupted(*args, **kwargs):
        for i, batch in enumerate(real(*args, **kwargs, batch_size=256)):
            if i == 2:  # two batches written: the temporary file is there, the Ctrl-C comes now
                seen.append(sorted(p.name for p in tmp_path.iterdir()))
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(scoring, "iter_predictions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["eval", "--checkpoint", str(tiny_run), "--predictions", str(out)])
    assert len(seen) == 1 and seen[0][0].startswith(".pred.parquet.tmp-") and seen[0][1:] == ["pred.parquet"], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred.parquet"]
    assert out.read_bytes() == before
