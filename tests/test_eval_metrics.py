"""Offline metrics against scikit-learn and against their formulas."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.calibration import calibration_curve
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from recsys.eval import metrics as M


def _data(seed: int, n: int = 5000, tied: bool = False):
    rng = np.random.default_rng(seed)
    p = rng.beta(1.0, 4.0, n)
    if tied:  # few distinct scores: most pairs are ties
        p = np.round(p, 2)
    y = (rng.random(n) < p).astype(np.float64)
    return y, np.clip(p, 1e-6, 1 - 1e-6)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_auc_and_log_loss_match_sklearn(seed, tied):
    y, p = _data(seed, tied=tied)
    assert M.roc_auc(y, p) == pytest.approx(roc_auc_score(y, p), abs=1e-9)
    assert M.log_loss(y, p) == pytest.approx(sk_log_loss(y, p), abs=1e-9)
    s = M.summarize(y, p)
    assert s["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-9) and s["auc_method"] == "exact"


def test_ne_ctr_and_calibration_follow_their_formulas():
    y, p = _data(2)
    s = M.summarize(y, p)
    base = y.mean()
    baseline = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    assert s["rows"] == y.size and s["positives"] == int(y.sum())
    assert s["ctr"] == pytest.approx(base, abs=1e-12) and s["predicted_ctr"] == pytest.approx(p.mean(), abs=1e-12)
    assert s["normalized_entropy"] == pytest.approx(sk_log_loss(y, p) / baseline, abs=1e-9)
    assert s["calibration"] == pytest.approx(p.mean() / base, abs=1e-12)


@pytest.mark.parametrize("bins", [5, 10, 20])
def test_calibration_table_matches_sklearn_and_ece_its_formula(bins):
    y, p = _data(3)
    table = M.calibration_table(y, p, bins)
    prob_true, prob_pred = calibration_curve(y, p, n_bins=bins, strategy="uniform")
    np.testing.assert_allclose([b["observed_ctr"] for b in table], prob_true, atol=1e-12)
    np.testing.assert_allclose([b["predicted_ctr"] for b in table], prob_pred, atol=1e-12)
    assert sum(b["rows"] for b in table) == y.size and sum(b["positives"] for b in table) == int(y.sum())
    # ECE from the rows directly: |mean score − mean label| per bin, weighted by the bin's share
    ids = np.minimum(np.ceil(p * bins).astype(int) - 1, bins - 1).clip(0)
    ece = sum(np.abs(p[ids == b].mean() - y[ids == b].mean()) * (ids == b).mean() for b in np.unique(ids))
    assert M.expected_calibration_error(table) == pytest.approx(ece, abs=1e-12)


def test_streaming_metrics_agree_with_exact_within_the_stated_bound():
    y, p = _data(4, n=20000)
    exact = M.summarize(y, p)
    stream = M.StreamingMetrics(bins=1000)
    for lo in range(0, y.size, 3000):
        stream.add(y[lo:lo + 3000], p[lo:lo + 3000])
    got = stream.result()
    assert got["auc_method"].startswith("binned") and got["auc_error_bound"] > 0
    assert abs(got["auc"] - exact["auc"]) <= got["auc_error_bound"]
    for key in ("rows", "positives"):
        assert got[key] == exact[key]
    for key in ("log_loss", "normalized_entropy", "calibration", "ctr", "predicted_ctr"):
        assert got[key] == pytest.approx(exact[key], rel=1e-9)


def test_binned_auc_is_exact_when_each_bin_holds_one_class():
    pos, neg = np.array([0, 3, 0, 5]), np.array([4, 0, 2, 0])
    auc, bound = M.binned_auc(pos, neg)
    y = np.r_[np.zeros(4), np.ones(3), np.zeros(2), np.ones(5)]
    s = np.r_[np.full(4, 0.1), np.full(3, 0.2), np.full(2, 0.3), np.full(5, 0.4)]
    assert bound == 0 and auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_delong_against_the_pairwise_definition():
    y, p = _data(5, n=400)
    rng = np.random.default_rng(9)
    q = np.clip(p + rng.normal(0, 0.05, p.size), 0, 1)
    got = M.delong_auc_diff(y, p, q)
    yb = y.astype(bool)
    # placement values straight from their definition (O(m·n))
    def comps(s):
        d = s[yb][:, None] - s[~yb][None, :]
        k = (d > 0) + 0.5 * (d == 0)
        return k.mean(axis=1), k.mean(axis=0)
    (a10, a01), (b10, b01) = comps(p), comps(q)
    m, n = yb.sum(), (~yb).sum()
    var = np.var(b10 - a10, ddof=1) / m + np.var(b01 - a01, ddof=1) / n
    assert got["auc_a"] == pytest.approx(roc_auc_score(y, p), abs=1e-9)
    assert got["delta"] == pytest.approx(roc_auc_score(y, q) - roc_auc_score(y, p), abs=1e-9)
    assert got["se"] == pytest.approx(np.sqrt(var), rel=1e-9)
    assert got["ci_low"] < got["delta"] < got["ci_high"]


def test_delong_of_a_scoring_with_itself_is_zero():
    y, p = _data(6, n=300)
    got = M.delong_auc_diff(y, p, p)
    assert got["delta"] == 0 and got["ci_low"] <= 0 <= got["ci_high"] and got["p_value"] == 1.0


def test_delong_p_value_of_a_clear_difference_is_small_not_zero():
    """2·Φ(−|z|) from the tail: a difference of ~11 standard errors has p ≈ 1e-29, not 0."""
    from scipy.stats import norm

    rng = np.random.default_rng(11)
    y, p = _data(7, n=4000)
    q = np.clip(p + rng.normal(0, 0.2, p.size), 1e-6, 1 - 1e-6)  # a noisier scoring of the same rows
    got = M.delong_auc_diff(y, p, q)
    z = abs(got["delta"]) / got["se"]
    assert z > 9, z  # the case this test is about
    assert 0 < got["p_value"] < 1e-16
    assert got["p_value"] == pytest.approx(2 * norm.sf(z), rel=1e-9)


def test_calibration_table_edges_are_the_round_bin_edges():
    y, p = _data(8)
    table = M.calibration_table(y, p, bins=10)
    assert [b["lo"] for b in table] == [k / 10 for k in range(len(table))]
    assert sum(b["rows"] for b in table) == y.size
