"""Offline metrics on predictions: AUC, log loss, normalized entropy, calibration (numpy only).

Used by the trainer's periodic evaluation, ``recsys eval`` and the synthetic data's oracle,
so every AUC in the project is computed one way.
"""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Return the ROC AUC of ``scores`` against 0/1 ``labels``; tied scores count one half."""
    y = np.asarray(labels).ravel().astype(bool)
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.size}")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores contain NaN or inf")
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


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-12) -> float:
    """Return the mean binary cross-entropy (nats) of probabilities ``probs`` for ``labels``."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1.0 - eps)
    if y.size == 0:
        raise ValueError("log loss of an empty set")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def evaluate_predictions(labels: np.ndarray, probs: np.ndarray) -> dict:
    """Return ``rows``, ``auc``, ``log_loss``, ``normalized_entropy`` and ``calibration``.

    ``normalized_entropy`` is the log loss divided by that of always predicting the base
    rate; ``calibration`` is mean predicted CTR over observed CTR.
    """
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    out: dict = {"rows": int(y.size)}
    if y.size == 0:
        return out
    base = float(y.mean())
    ll = log_loss(y, p)
    out["log_loss"] = ll
    out["base_ctr"] = base
    out["calibration"] = float(p.mean() / base) if base > 0 else float("nan")
    if 0.0 < base < 1.0:
        out["auc"] = roc_auc(y, p)
        out["normalized_entropy"] = ll / log_loss(y, np.full_like(y, base))
    return out
