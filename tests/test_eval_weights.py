"""``recsys eval`` with sample weights (``schema.weight``): every figure weighted, checked against
scikit-learn on a checkpoint trained on weighted Parquet data; slices (1 and 2 processes), the
binned fallback, ``--compare`` (a paired bootstrap, not DeLong); weights all 1 give the
unweighted figures exactly."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from recsys.eval import metrics as M
from recsys.eval.evaluate import EvalOptions, format_tables, run_eval, slice_metrics
from weighted_data import add_weights, ones, train

DROP = ("weight_sum", "weight_column")  # what a weighted result adds to the unweighted keys


@pytest.fixture(scope="module")
def weighted(tiny_data, tmp_path_factory):
    """A checkpoint trained 12 steps with ``schema.weight = "w"`` (another kept at step 6), and
    eval splits with random weights (zeros included) and with weights all 1."""
    root = tmp_path_factory.mktemp("weighted_eval")
    train_dir = add_weights(tiny_data / "train", root / "train", seed=0)
    eval_w = add_weights(tiny_data / "eval", root / "eval_w", seed=100)
    eval_ones = add_weights(tiny_data / "eval", root / "eval_ones", weights=ones)
    run = root / "run"
    train(run, train_dir, eval_w, "schema.weight='w'", "train.max_steps=12", "train.checkpoint.every_steps=6",
          "train.checkpoint.keep_last=5")
    return SimpleNamespace(run=run, step6=run / "checkpoints" / "step-00000006", eval_w=eval_w,
                           eval_ones=eval_ones)


def _predictions(path):
    t = pq.read_table(path)
    w = t.column("weight").to_numpy().astype(np.float64) if "weight" in t.column_names else None
    return t.column("label").to_numpy().astype(np.float64), t.column("score").to_numpy().astype(np.float64), w


def _data_weights(eval_dir, row_ids):
    t = ds.dataset(eval_dir).to_table(columns=["row_id", "w"])
    by_id = dict(zip(t.column("row_id").to_pylist(), t.column("w").to_pylist()))
    return np.array([by_id[i] for i in row_ids], dtype=np.float64)


def test_weighted_eval_matches_sklearn_and_the_trainers_eval(weighted, tmp_path):
    import json

    res = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)], predictions=tmp_path / "p.parquet"))
    y, p, w = _predictions(tmp_path / "p.parquet")
    ids = pq.read_table(tmp_path / "p.parquet").column("row_id").to_pylist()
    np.testing.assert_array_equal(w, _data_weights(weighted.eval_w, ids))  # each row carries its own weight
    assert (w == 0).sum() > 100 and res["weight_column"] == "w" and res["rows"] == 2000
    assert res["auc"] == pytest.approx(roc_auc_score(y, p, sample_weight=w), abs=1e-12)
    assert res["log_loss"] == pytest.approx(sk_log_loss(y, p, sample_weight=w), rel=1e-9)
    base = (w * y).sum() / w.sum()
    assert res["ctr"] == pytest.approx(base, rel=1e-12) and res["weight_sum"] == pytest.approx(w.sum(), rel=1e-9)
    assert res["predicted_ctr"] == pytest.approx((w * p).sum() / w.sum(), rel=1e-9)
    assert res["normalized_entropy"] == pytest.approx(
        sk_log_loss(y, p, sample_weight=w) / sk_log_loss(y, np.full_like(p, base), sample_weight=w), rel=1e-9)
    # the weights matter: the unweighted AUC of the same scores is another number
    assert abs(res["auc"] - roc_auc_score(y, p)) > 1e-4
    # calibration table: weighted means per uniform bin (b/10, (b+1)/10], recomputed with masks
    for b in res["calibration_table"]:
        m = (p > b["lo"]) & (p <= b["hi"]) if b["lo"] > 0 else (p <= b["hi"])
        assert b["rows"] == m.sum() and b["weight"] == pytest.approx(w[m].sum(), rel=1e-9)
        assert b["predicted_ctr"] == pytest.approx((w * p)[m].sum() / w[m].sum(), rel=1e-9)
        assert b["observed_ctr"] == pytest.approx((w * y)[m].sum() / w[m].sum(), rel=1e-9, abs=1e-15)
    # the trainer's final evaluation of the same checkpoint on the same split (weighted too)
    logged = [json.loads(line) for line in (weighted.run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in logged if r.get("event") == "eval"][-1]
    for key in ("auc", "log_loss", "normalized_entropy", "calibration", "weight_sum"):
        assert res[key] == pytest.approx(final[key], rel=1e-6), key


def test_weighted_slices_match_sklearn_per_group(weighted, tmp_path):
    res = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)], slices=["c9"], top_k=3,
                                             predictions=tmp_path / "p.parquet"))
    y, p, w = _predictions(tmp_path / "p.parquet")
    c9 = ds.dataset(weighted.eval_w).to_table(columns=["c9"]).column("c9").to_numpy(zero_copy_only=False)
    groups = res["slices"]["c9"]
    top = [g["value"] for g in groups[:-1]]
    assert groups[-1]["value"] == "other" and sum(g["rows"] for g in groups) == 2000
    assert sum(g["weight_sum"] for g in groups) == pytest.approx(res["weight_sum"], rel=1e-9)
    for g in groups:
        m = ~np.isin(c9, top) if g["value"] == "other" else c9 == g["value"]
        assert g["rows"] == m.sum()
        assert g["auc"] == pytest.approx(roc_auc_score(y[m], p[m], sample_weight=w[m]), abs=1e-12), g["value"]
        assert g["log_loss"] == pytest.approx(sk_log_loss(y[m], p[m], sample_weight=w[m]), rel=1e-9)


@pytest.mark.multiproc
def test_weighted_slices_with_two_processes_equal_one(weighted):
    opts = dict(data=[str(weighted.eval_w)], slices=["c9", "c17"], top_k=3)
    one = run_eval(weighted.run, EvalOptions(**opts))
    two = run_eval(weighted.run, EvalOptions(**opts, nproc=2))
    assert two["nproc"] == 2 and two["weight_sum"] == pytest.approx(one["weight_sum"], rel=1e-12)
    for key in ("auc", "log_loss", "normalized_entropy", "calibration", "ece", "ctr"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    for col in opts["slices"]:
        for a, b in zip(one["slices"][col], two["slices"][col]):
            assert (a["value"], a["rows"]) == (b["value"], b["rows"])
            for key in ("auc", "log_loss", "weight_sum"):
                assert b[key] == pytest.approx(a[key], rel=1e-6), (col, a["value"], key)


def test_weights_all_one_give_exactly_the_unweighted_figures(weighted, tmp_path):
    res = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_ones)], slices=["c9"], top_k=3,
                                             compare=weighted.step6, predictions=tmp_path / "p.parquet"))
    y, p, w = _predictions(tmp_path / "p.parquet")
    assert np.all(w == 1.0) and res["weight_sum"] == 2000.0
    want = M.summarize(y, p)
    assert {k: v for k, v in res.items() if k in want} == want  # exactly, the calibration table too
    c9 = ds.dataset(weighted.eval_ones).to_table(columns=["c9"]).column("c9")
    plain = slice_metrics(y, p, c9, 3, 10)
    assert [{k: v for k, v in g.items() if k not in DROP} for g in res["slices"]["c9"]] == plain
    assert res["compare"]["auc_diff"]["method"] == "DeLong"  # the unweighted test holds
    assert res["compare"]["auc_diff"]["auc_a"] == pytest.approx(want["auc"], abs=1e-15)  # DeLong's own sum
    assert res["compare"]["delta"]["auc"] == res["compare"]["metrics"]["auc"] - want["auc"]


def test_compare_with_weights_is_a_paired_bootstrap_and_says_why(weighted):
    res = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)], compare=weighted.step6))
    d = res["compare"]["auc_diff"]
    assert d["method"].startswith("paired bootstrap") and "DeLong does not hold" in d["method"]
    assert d["auc_a"] == pytest.approx(res["auc"], abs=1e-12)
    assert d["auc_b"] == pytest.approx(res["compare"]["metrics"]["auc"], abs=1e-12)
    assert d["delta"] == pytest.approx(res["compare"]["delta"]["auc"], abs=1e-12)
    assert d["ci_low"] < d["ci_high"] and d["se"] > 0 and d["resamples"] == M.BOOTSTRAP_RESAMPLES
    assert "paired bootstrap" in format_tables(res)
    # comparing the checkpoint with itself: no difference in any resample
    same = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)], compare=weighted.run))["compare"]
    assert same["auc_diff"]["delta"] == 0 and same["auc_diff"]["se"] == 0 and same["auc_diff"]["p_value"] == 1.0


def test_weighted_binned_fallback_is_within_its_bound(weighted):
    exact = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)]))
    binned = run_eval(weighted.run, EvalOptions(data=[str(weighted.eval_w)], max_exact_rows=500))
    assert binned["auc_method"].startswith("binned") and exact["auc_method"] == "exact"
    assert abs(binned["auc"] - exact["auc"]) <= binned["auc_error_bound"]
    for key in ("log_loss", "ctr", "predicted_ctr", "normalized_entropy", "weight_sum"):
        assert binned[key] == pytest.approx(exact[key], rel=1e-9), key
    assert (binned["rows"], binned["positives"]) == (exact["rows"], exact["positives"])


# --------------------------------------------------------------------------- the metrics alone


def _scores(n: int, seed: int):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(np.float64)
    a = np.clip(0.3 * y + 0.7 * rng.random(n), 0.0, 1.0)
    b = np.clip(0.35 * y + 0.65 * rng.random(n), 0.0, 1.0)
    return rng, y, a, b


def test_streaming_and_table_with_weights_all_one_are_the_unweighted_ones_exactly():
    _, y, a, _ = _scores(5000, 0)
    plain, unit = M.StreamingMetrics(bins=1 << 12), M.StreamingMetrics(bins=1 << 12)
    for lo in range(0, 5000, 700):
        plain.add(y[lo:lo + 700], a[lo:lo + 700])
        unit.add(y[lo:lo + 700], a[lo:lo + 700], np.ones(len(y[lo:lo + 700])))
    assert unit.result() == {**plain.result(), "weight_sum": 5000.0}
    assert M.calibration_table(y, a, 10, np.ones(5000)) == M.calibration_table(y, a, 10)
    assert M.evaluate_predictions(y, a, np.ones(5000)) == {**M.evaluate_predictions(y, a), "weight_sum": 5000.0}


def test_integer_weights_equal_repeated_rows_in_the_table_and_the_stream():
    rng, y, a, _ = _scores(4000, 1)
    k = rng.integers(0, 4, y.size).astype(np.float64)
    rep = np.repeat(np.arange(y.size), k.astype(int))
    for got, want in zip(M.calibration_table(y, a, 10, k), M.calibration_table(y[rep], a[rep], 10)):
        assert got["weight"] == want["rows"]
        assert got["predicted_ctr"] == pytest.approx(want["predicted_ctr"], rel=1e-12)
        assert got["observed_ctr"] == pytest.approx(want["observed_ctr"], rel=1e-12, abs=1e-15)
    s = M.StreamingMetrics(bins=1 << 12)
    s.add(y, a, k)
    r = s.result()
    exact = M.summarize(y[rep], a[rep])
    assert abs(r["auc"] - exact["auc"]) <= r["auc_error_bound"]
    for key in ("log_loss", "ctr", "predicted_ctr", "normalized_entropy", "ece"):
        assert r[key] == pytest.approx(exact[key], rel=1e-9), key


def test_bootstrap_agrees_with_delong_where_delong_holds():
    """With unit weights both estimate the same sampling error: the bootstrap's standard error
    is within 10 % of DeLong's (1000 resamples: about 2 % noise), its interval close to his."""
    _, y, a, b = _scores(3000, 2)
    d = M.delong_auc_diff(y, a, b)
    bt = M.bootstrap_auc_diff(y, a, b, np.ones(y.size))
    assert bt["delta"] == pytest.approx(d["delta"], abs=1e-12)
    assert bt["se"] == pytest.approx(d["se"], rel=0.1)
    assert bt["ci_low"] == pytest.approx(d["ci_low"], abs=0.3 * d["se"])
    assert bt["ci_high"] == pytest.approx(d["ci_high"], abs=0.3 * d["se"])
    rng = np.random.default_rng(3)
    w = rng.exponential(1.0, y.size)
    bw = M.bootstrap_auc_diff(y, a, b, w)
    assert bw["delta"] == pytest.approx(roc_auc_score(y, b, sample_weight=w) - roc_auc_score(y, a, sample_weight=w),
                                        abs=1e-12)
    assert bw == M.bootstrap_auc_diff(y, a, b, w)  # seeded: the same call gives the same interval
    with pytest.raises(ValueError, match="2 positives and 2 negatives of weight > 0"):
        M.bootstrap_auc_diff(y, a, b, np.where(y == 1, 0.0, 1.0))
