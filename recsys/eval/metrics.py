"""Offline metrics on predictions: AUC, log loss, NE, calibration and its table, ECE, DeLong (numpy only).

Used by the trainer's periodic evaluation, ``recsys eval`` and the synthetic data's oracle,
so every AUC in the project is computed one way.
"""

from __future__ import annotations

import math

import numpy as np


def _sample_weights(weights, n: int) -> np.ndarray:
    """Return ``weights`` as float64 [n], checked: finite and >= 0."""
    w = np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != (n,):
        raise ValueError(f"sample weights and labels differ in length: {w.size} vs {n}")
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError("sample weights must be finite and >= 0")
    return w


def _nontrivial(weights, n: int) -> np.ndarray | None:
    """Return ``weights`` checked (``_sample_weights``), or None when absent or all exactly 1:
    then every figure takes the unweighted path and equals the unweighted one bit for bit."""
    if weights is None:
        return None
    w = _sample_weights(weights, n)
    return None if bool(np.all(w == 1.0)) else w


def roc_auc(labels: np.ndarray, scores: np.ndarray, sample_weight: np.ndarray | None = None) -> float:
    """Return the ROC AUC of ``scores`` against 0/1 ``labels``; tied scores count one half.

    With ``sample_weight``: the weighted share of (positive, negative) pairs ordered right,
    a pair counting the product of its weights (the area under the weighted ROC curve).
    """
    y = np.asarray(labels).ravel().astype(bool)
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.size}")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores contain NaN or inf")
    if sample_weight is not None:
        return _weighted_auc(y, s, _sample_weights(sample_weight, y.size))
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes; found {n_pos} positives and {n_neg} negatives")
    order = np.argsort(s, kind="stable")
    s_sorted = s[order]
    # Mann-Whitney U with midranks: a tie group occupying 1-based ranks a..b gets (a+b)/2.
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s.size]
    ranks = np.repeat((starts + 1 + ends) / 2.0, ends - starts)
    pos_rank_sum = float(ranks[y[order]].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _weighted_auc(y: np.ndarray, s: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(s, kind="stable")
    s_sorted, y_sorted, w_sorted = s[order], y[order], w[order]
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    pos = np.add.reduceat(np.where(y_sorted, w_sorted, 0.0), starts)  # per group of tied scores
    neg = np.add.reduceat(np.where(y_sorted, 0.0, w_sorted), starts)
    P, N = float(pos.sum()), float(neg.sum())
    if P == 0 or N == 0:
        raise ValueError(f"AUC needs both classes with weight > 0; found weights {P} (positives) and {N} (negatives)")
    neg_below = np.cumsum(neg) - neg
    return float((pos * (neg_below + 0.5 * neg)).sum() / (P * N))


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-12,
             sample_weight: np.ndarray | None = None) -> float:
    """Return the mean binary cross-entropy (nats) of probabilities ``probs`` for ``labels``
    (weighted by ``sample_weight`` when given)."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1.0 - eps)
    if y.size == 0:
        raise ValueError("log loss of an empty set")
    losses = y * np.log(p) + (1.0 - y) * np.log1p(-p)
    if sample_weight is None:
        return float(-np.mean(losses))
    w = _sample_weights(sample_weight, y.size)
    if w.sum() == 0:
        raise ValueError("log loss with every sample weight 0")
    return float(-np.average(losses, weights=w))


def evaluate_predictions(labels: np.ndarray, probs: np.ndarray, weights: np.ndarray | None = None) -> dict:
    """Return ``rows``, ``auc``, ``log_loss``, ``normalized_entropy`` and ``calibration``.

    ``normalized_entropy`` is the log loss divided by that of always predicting the base
    rate; ``calibration`` is mean predicted CTR over observed CTR. With ``weights`` (the
    job's ``schema.weight``) every figure is weighted: a row counts its weight, in the base
    rate and the means as in the AUC's pairs; ``weight_sum`` is added.
    """
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    out: dict = {"rows": int(y.size)}
    if y.size == 0:
        return out
    if weights is not None:
        w = _sample_weights(weights, y.size)
        out["weight_sum"] = float(w.sum())
        if w.sum() == 0:
            return out
    w = _nontrivial(weights, y.size)
    base = float(np.average(y, weights=w))
    ll = log_loss(y, p, sample_weight=w)
    out["log_loss"] = ll
    out["base_ctr"] = base
    out["calibration"] = float(np.average(p, weights=w) / base) if base > 0 else float("nan")
    if 0.0 < base < 1.0:
        out["auc"] = roc_auc(y, p, sample_weight=w)
        out["normalized_entropy"] = ll / log_loss(y, np.full_like(y, base), sample_weight=w)
    return out


# --------------------------------------------------------------------------- the full report

MAX_EXACT_ROWS = 50_000_000
"""Rows up to which ``recsys eval`` keeps every (label, score) in memory and computes the AUC
exactly. The exact AUC sorts the scores: about 40 bytes per row at its peak (float64 scores,
int64 order, float64 midranks, labels), so 50M rows need about 2 GB. Beyond it the AUC comes
from a score histogram (``binned_auc``) and its error bound is reported with it."""

HISTOGRAM_BINS = 1 << 20
"""Uniform score bins in [0, 1] of the fallback histogram."""


def calibration_table(labels: np.ndarray, probs: np.ndarray, bins: int = 10,
                      weights: np.ndarray | None = None) -> list[dict]:
    """Return predicted vs observed CTR per uniform score bin of [0, 1] (empty bins left out).

    Bin ``b`` holds scores in ``(b/bins, (b+1)/bins]`` (the first also holds 0): the same
    edges and assignment as scikit-learn's ``calibration_curve(strategy="uniform")``. Each
    entry: ``lo``, ``hi``, ``rows``, ``positives``, ``predicted_ctr`` (mean score) and
    ``observed_ctr`` (mean label). With ``weights`` (not all 1) the means are weighted, each
    entry adds its ``weight`` and a bin whose rows all weigh 0 is left out.
    """
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    w = _nontrivial(weights, y.size)
    edges = np.linspace(0.0, 1.0, bins + 1)
    ids = np.searchsorted(edges[1:-1], p)
    count = lambda v=None: np.bincount(ids, weights=v, minlength=bins)  # noqa: E731
    if w is None:
        return _table(edges, count(), count(y), count(p))
    return _table(edges, count(), count(y), count(p * w), count(y * w), count(w))


def _table(edges, rows, positives, score_sums, label_sums=None, weight_sums=None) -> list[dict]:
    """Calibration bins from per-bin sums; ``label_sums``/``weight_sums`` (Σ w·y, Σ w) make the
    means weighted (``score_sums`` is then Σ w·p)."""
    weighted = weight_sums is not None
    denom = weight_sums if weighted else rows
    out = []
    for b in np.flatnonzero(denom):
        n = int(rows[b])
        # edges as written (0.3, not linspace's 0.30000000000000004); rows were binned by the exact edges
        entry = {"lo": round(float(edges[b]), 12), "hi": round(float(edges[b + 1]), 12), "rows": n,
                 "positives": int(round(positives[b])),
                 "predicted_ctr": float(score_sums[b] / denom[b]),
                 "observed_ctr": float((label_sums if weighted else positives)[b] / denom[b])}
        if weighted:
            entry["weight"] = float(weight_sums[b])
        out.append(entry)
    return out


def expected_calibration_error(table: list[dict]) -> float:
    """Return Σ_b (rows_b / rows) · |predicted_ctr_b − observed_ctr_b| over a calibration table
    (shares of ``weight`` instead of rows when the table is weighted)."""
    share = [b.get("weight", b["rows"]) for b in table]
    total = sum(share)
    return float(sum(s / total * abs(b["predicted_ctr"] - b["observed_ctr"]) for s, b in zip(share, table)))


def binned_auc(pos_counts: np.ndarray, neg_counts: np.ndarray) -> tuple[float, float]:
    """Return (AUC, error bound) from positives and negatives per score bin (ascending bins).

    Pairs in different bins are ordered exactly; a pair within one bin counts one half
    (as a tie), whereas the exact AUC counts it 0, ½ or 1. So
    ``|AUC − exact AUC| ≤ Σ_b pos_b · neg_b / (2 · P · N)``, the bound returned. With sample
    weights, pass the weight of the positives and negatives per bin: a pair counts the
    product of its weights, and the same bound holds for the weighted AUC.
    """
    pos = np.asarray(pos_counts, dtype=np.float64)
    neg = np.asarray(neg_counts, dtype=np.float64)
    P, N = pos.sum(), neg.sum()
    if P == 0 or N == 0:
        raise ValueError(f"AUC needs both classes; found {P:g} positives and {N:g} negatives (by weight)")
    neg_below = np.cumsum(neg) - neg
    auc = float((pos * (neg_below + 0.5 * neg)).sum() / (P * N))
    return auc, float((pos * neg).sum() / (2 * P * N))


def summarize(labels: np.ndarray, probs: np.ndarray, calibration_bins: int = 10,
              weights: np.ndarray | None = None) -> dict:
    """Return every metric of ``recsys eval`` for one set of rows (exact AUC).

    ``evaluate_predictions``'s keys (``rows``, ``log_loss``, ``base_ctr``, ``calibration``,
    ``auc``, ``normalized_entropy``) plus ``positives``, ``ctr`` (= ``base_ctr``),
    ``predicted_ctr``, ``auc_method`` (``exact``), ``ece`` and ``calibration_table``. With
    ``weights`` (the job's ``schema.weight``) every rate, mean and the AUC are weighted as in
    ``evaluate_predictions``; ``rows`` and ``positives`` stay counts, ``weight_sum`` is added.
    """
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    out = evaluate_predictions(y, p, weights)
    out["positives"] = int(y.sum())
    if "base_ctr" not in out:  # no rows, or every weight 0
        return out
    w = _nontrivial(weights, y.size)
    out["ctr"] = out["base_ctr"]
    out["predicted_ctr"] = float(p.mean()) if w is None else float(np.average(p, weights=w))
    if "auc" in out:
        out["auc_method"] = "exact"
    table = calibration_table(y, p, calibration_bins, w)
    out["ece"] = expected_calibration_error(table)
    out["calibration_table"] = table
    return out


def _log_likelihoods(y: np.ndarray, p: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    p = np.clip(p, eps, 1.0 - eps)
    return y * np.log(p) + (1.0 - y) * np.log1p(-p)


class StreamingMetrics:
    """Metrics of rows seen batch by batch, for more rows than fit in memory.

    Log loss, CTR, calibration and its table are exact; the AUC comes from a histogram of
    ``HISTOGRAM_BINS`` uniform score bins with the error bound of ``binned_auc``. Batches
    with sample weights make every figure weighted, as ``summarize`` does.
    """

    def __init__(self, bins: int = HISTOGRAM_BINS, exact_rows: int = MAX_EXACT_ROWS) -> None:
        self.bins = bins
        self.exact_rows = exact_rows  # the limit passed, named in ``auc_method``
        self.rows = np.zeros(bins, dtype=np.int64)
        self.positives = np.zeros(bins, dtype=np.int64)
        self.pos = np.zeros(bins, dtype=np.float64)  # weight of the positives (their count without weights)
        self.neg = np.zeros(bins, dtype=np.float64)
        self.score_sum = np.zeros(bins, dtype=np.float64)  # Σ w·p
        self.loss_sum = 0.0  # Σ w·(−log likelihood)
        self.weighted = False  # weights were given (``weight_sum`` is reported)
        self.nontrivial = False  # some weight was not 1 (the calibration table is weighted)

    def add(self, labels: np.ndarray, probs: np.ndarray, weights: np.ndarray | None = None) -> None:
        y = np.asarray(labels, dtype=np.float64).ravel()
        p = np.asarray(probs, dtype=np.float64).ravel()
        self.weighted |= weights is not None
        w = _nontrivial(weights, y.size)
        self.nontrivial |= w is not None
        ids = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        count = lambda v=None: np.bincount(ids, weights=v, minlength=self.bins)  # noqa: E731
        self.rows += count()
        self.positives += np.rint(count(y)).astype(np.int64)
        self.pos += count(y if w is None else y * w)
        self.neg += count(1.0 - y if w is None else (1.0 - y) * w)
        self.score_sum += count(p if w is None else p * w)
        if y.size:
            self.loss_sum += log_loss(y, p) * y.size if w is None else float(-(w * _log_likelihoods(y, p)).sum())

    def result(self, calibration_bins: int = 10) -> dict:
        n, P = int(self.rows.sum()), int(self.positives.sum())
        out: dict = {"rows": n, "positives": P}
        W, Wpos = float(self.pos.sum() + self.neg.sum()), float(self.pos.sum())
        if self.weighted:
            out["weight_sum"] = W
        if n == 0 or W == 0:
            return out
        base = Wpos / W
        ll = self.loss_sum / W
        out.update(log_loss=ll, base_ctr=base, ctr=base, predicted_ctr=float(self.score_sum.sum() / W),
                   calibration=float(self.score_sum.sum() / W / base) if base > 0 else float("nan"))
        if 0 < Wpos < W:
            out["auc"], out["auc_error_bound"] = binned_auc(self.pos, self.neg)
            out["auc_method"] = f"binned ({self.bins:,} uniform score bins; more rows than {self.exact_rows:,})"
            out["normalized_entropy"] = ll / float(-(base * np.log(base) + (1 - base) * np.log1p(-base)))
        # the calibration bins are unions of histogram bins (histogram bin i lies in [i/bins, (i+1)/bins))
        group = np.minimum(np.arange(self.bins) * calibration_bins // self.bins, calibration_bins - 1)
        agg = lambda a: np.bincount(group, weights=a, minlength=calibration_bins)  # noqa: E731
        edges = np.linspace(0.0, 1.0, calibration_bins + 1)
        sums = (agg(self.rows.astype(np.float64)), agg(self.positives.astype(np.float64)), agg(self.score_sum))
        table = _table(edges, *sums, agg(self.pos), agg(self.pos + self.neg)) if self.nontrivial else _table(edges, *sums)
        out["ece"] = expected_calibration_error(table)
        out["calibration_table"] = table
        return out


def delong_auc_diff(labels: np.ndarray, scores_a: np.ndarray, scores_b: np.ndarray, alpha: float = 0.05) -> dict:
    """Return the AUCs of two scorings of the same rows, their difference B − A and its DeLong CI.

    DeLong, DeLong & Clarke-Pearson (1988): each positive's and each negative's placement
    values give the covariance of the two (paired) AUC estimates; the difference is
    asymptotically normal with variance ``var_a + var_b − 2 cov_ab``. Returns ``auc_a``,
    ``auc_b``, ``delta``, ``se``, ``ci_low``, ``ci_high`` (level ``1 − alpha``), ``p_value``
    (two-sided, of delta = 0).
    """
    from statistics import NormalDist

    y = np.asarray(labels).ravel().astype(bool)
    m, n = int(y.sum()), int((~y).sum())
    if m < 2 or n < 2:
        raise ValueError(f"DeLong needs at least 2 positives and 2 negatives; found {m} and {n}")
    v10, v01, aucs = [], [], []
    for s in (scores_a, scores_b):
        s = np.asarray(s, dtype=np.float64).ravel()
        r_all, r_pos, r_neg = _midranks(s), _midranks(s[y]), _midranks(s[~y])
        # positive i: share of negatives below it (ties ½); negative j: share of positives above it
        v10.append((r_all[y] - r_pos) / n)
        v01.append(1.0 - (r_all[~y] - r_neg) / m)
        aucs.append(float(v10[-1].mean()))
    s10, s01 = np.cov(np.vstack(v10)), np.cov(np.vstack(v01))
    var = (s10[0, 0] + s10[1, 1] - 2 * s10[0, 1]) / m + (s01[0, 0] + s01[1, 1] - 2 * s01[0, 1]) / n
    se = float(np.sqrt(max(var, 0.0)))
    delta = aucs[1] - aucs[0]
    z = NormalDist().inv_cdf(1 - alpha / 2)
    # two-sided p = 2·Φ(−|z|) = erfc(|z|/√2): exact in the tail (1 − cdf rounds below ~1e-16 to 0)
    p_value = math.erfc(abs(delta) / se / math.sqrt(2)) if se > 0 else (1.0 if delta == 0 else 0.0)
    return {"auc_a": aucs[0], "auc_b": aucs[1], "delta": delta, "se": se, "ci_low": delta - z * se,
            "ci_high": delta + z * se, "level": 1 - alpha, "p_value": float(p_value), "method": "DeLong"}


def _midranks(s: np.ndarray) -> np.ndarray:
    """Return 1-based ranks of ``s`` with ties given their mean rank, in the input order."""
    order = np.argsort(s, kind="stable")
    s_sorted = s[order]
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s.size]
    out = np.empty(s.size, dtype=np.float64)
    out[order] = np.repeat((starts + 1 + ends) / 2.0, ends - starts)
    return out


BOOTSTRAP_RESAMPLES = 1000
"""Resamples of ``bootstrap_auc_diff`` (``recsys eval --compare`` on weighted rows)."""


def bootstrap_auc_diff(labels: np.ndarray, scores_a: np.ndarray, scores_b: np.ndarray, weights: np.ndarray,
                       resamples: int = BOOTSTRAP_RESAMPLES, alpha: float = 0.05, seed: int = 0) -> dict:
    """Return the weighted AUCs of two scorings of the same rows, B − A and a paired bootstrap CI.

    DeLong's variance is that of unweighted U-statistics over independent rows; a weighted
    AUC is a ratio of weighted pair sums whose variance depends on what the weights are
    (frequencies, importance or survey weights), and no DeLong form covers them all. Here the
    rows themselves are resampled (with replacement, ``resamples`` times, ``seed`` fixed so a
    result repeats), each keeping its weight and both scores: the spread of B − A over the
    resamples estimates its sampling error when the rows are independent draws. ``ci_low`` and
    ``ci_high`` are the percentile interval; ``p_value`` is two-sided from ``delta / se`` with
    ``se`` the resamples' standard deviation (the normal approximation pROC's bootstrap test
    uses). Same keys as ``delong_auc_diff`` plus ``resamples``.
    """
    y = np.asarray(labels).ravel().astype(bool)
    w = _sample_weights(weights, y.size)
    if resamples < 2:
        raise ValueError(f"the bootstrap needs at least 2 resamples, found {resamples}")
    if (w[y] > 0).sum() < 2 or (w[~y] > 0).sum() < 2:
        raise ValueError(f"the bootstrap needs at least 2 positives and 2 negatives of weight > 0; found "
                         f"{int((w[y] > 0).sum())} and {int((w[~y] > 0).sum())}")
    # each scoring is sorted once; a resample only changes the weights (w × times drawn), O(rows)
    sorted_by = []
    for s in (scores_a, scores_b):
        s = np.asarray(s, dtype=np.float64).ravel()
        order = np.argsort(s, kind="stable")
        ss = s[order]
        sorted_by.append((order, y[order], np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])))

    def auc(k: int, v: np.ndarray) -> float:
        order, ys, starts = sorted_by[k]
        vs = v[order]
        pos = np.add.reduceat(np.where(ys, vs, 0.0), starts)
        neg = np.add.reduceat(np.where(ys, 0.0, vs), starts)
        P, N = pos.sum(), neg.sum()
        return float((pos * (np.cumsum(neg) - 0.5 * neg)).sum() / (P * N)) if P > 0 and N > 0 else float("nan")

    aucs = [auc(0, w), auc(1, w)]
    rng = np.random.default_rng(seed)
    n = y.size
    deltas = np.empty(resamples)
    for r in range(resamples):
        v = w * np.bincount(rng.integers(0, n, n), minlength=n)
        deltas[r] = auc(1, v) - auc(0, v)
    deltas = deltas[np.isfinite(deltas)]  # a resample without a positive or negative of weight > 0
    delta = aucs[1] - aucs[0]
    se = float(deltas.std(ddof=1)) if deltas.size > 1 else 0.0
    lo, hi = np.quantile(deltas, [alpha / 2, 1 - alpha / 2]) if deltas.size else (delta, delta)
    p_value = math.erfc(abs(delta) / se / math.sqrt(2)) if se > 0 else (1.0 if delta == 0 else 0.0)
    return {"auc_a": aucs[0], "auc_b": aucs[1], "delta": delta, "se": se, "ci_low": float(lo),
            "ci_high": float(hi), "level": 1 - alpha, "p_value": float(p_value), "resamples": int(deltas.size),
            "method": f"paired bootstrap, {int(deltas.size)} resamples of the weighted rows; "
                      "DeLong does not hold for weighted AUCs"}
