"""Sparse optimizers applied in place to exactly the rows a batch touched (numba kernels).

Legend: ``U`` rows updated in one call, ``D`` dim, ``R`` rows of the arrays updated (the
table's capacity, or ``U`` for a gathered copy).

Each kernel reads row ``w_idx[i]`` of the weights and row ``s_idx[i]`` of the optimizer
state for gradient row ``i``; a negative index skips the row. The two index arrays are the
same slots for a float32 table updated in place; a float16 table gathers its rows into a
float32 copy first (``w_idx = arange(U)``), so the math is always float32 (per-row scalars
formed in float64, then rounded), and the state is always stored in float32.

Weight decay is L2, coupled, as in ``torch.optim`` (Adagrad, Adam, SGD):
``g' = g + weight_decay * w``, and ``g'`` replaces ``g`` everywhere below (state and step).
It acts only on touched rows: an untouched row neither decays nor advances its state
(lazy, the sparse semantics). (fbgemm-gpu-cpu 1.8.0's CPU row-wise Adagrad ignores its
``weight_decay`` altogether, so without decay the two agree exactly, with it only ours decays.)

- ``rowwise_adagrad`` (fbgemm ``EXACT_ROWWISE_ADAGRAD``): one float per row,
  ``s += mean_d(g'^2)``; ``w -= lr * g' / (sqrt(s) + eps)``.
- ``adagrad`` (``torch.optim.Adagrad``, lr_decay 0): elementwise ``s += g'^2``;
  ``w -= lr * g' / (sqrt(s) + eps)``.
- ``adam`` (``torch.optim.Adam``, lazy): per-row step count ``t += 1``;
  ``m = b1 m + (1-b1) g'``; ``v = b2 v + (1-b2) g'^2``;
  ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. A row's ``t`` counts
  the updates *that row* received, so each row follows exactly the trajectory torch's Adam
  would give it as a parameter of its own stepped only when the row is touched.
- ``sgd``: ``w -= lr * g'``.

A repeated index in one call is applied once per occurrence, in order (callers pass unique
keys; the store sums a key's gradients before calling).

Measured here (2 shared cores, U = 20k random rows of a 1M × 64 table): in place by slot,
numba is 1.2–1.4× faster than numpy on gathered rows for row-wise Adagrad (both bound by
the random row traffic) and ~2.4× for Adam (numpy needs a gather, ~8 [U, D] temporaries
and a scatter per state array).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from recsys.store.config import StoreConfig
from recsys.store.host.prefetch import ROWS_AHEAD, prefetch

__all__ = ["StateColumn", "state_columns", "initial_state_value", "apply_update"]


@dataclass(frozen=True, slots=True)
class StateColumn:
    """One optimizer state array of a table: its name, whether it is [D] per row, its type."""

    name: str
    """Column name in ``state_dict()`` tables."""
    per_dim: bool
    """True: shape [capacity, D]; False: one value per row, shape [capacity]."""
    dtype: type
    """numpy dtype of the array (float32 or int64)."""


_COLUMNS = {
    "rowwise_adagrad": (StateColumn("rowwise_state", False, np.float32),),
    "adagrad": (StateColumn("state_sum", True, np.float32),),
    "adam": (
        StateColumn("exp_avg", True, np.float32),
        StateColumn("exp_avg_sq", True, np.float32),
        StateColumn("adam_step", False, np.int64),
    ),
    "sgd": (),
}


def state_columns(optimizer: str) -> tuple[StateColumn, ...]:
    """Return the state arrays ``optimizer`` keeps per row."""
    try:
        return _COLUMNS[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(_COLUMNS)}") from None


def initial_state_value(cfg: StoreConfig, column: StateColumn) -> float:
    """Return the value a new row's ``column`` starts from."""
    if column.name in ("rowwise_state", "state_sum"):
        return cfg.initial_accumulator
    return 0


# --------------------------------------------------------------------------- kernels


# Element math is float32, as in torch and fbgemm (and ~1.5x faster than float64 here);
# per-row scalars (bias corrections, Adam step size) are formed in float64, then rounded.
# Scalars are cast to float32 first: numba would promote float32 * float64 to float64.


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _row_sum_sq(g, i, w, r, wd32):
    """Return Σ_d (g[i, d] + wd · w[r, d])², summed in any order (SIMD lanes): the only
    reassociated sum of the optimizers; ~4x faster than a strict left-to-right loop here."""
    acc = np.float32(0.0)
    for d in range(g.shape[1]):
        gd = g[i, d] + wd32 * w[r, d]
        acc += gd * gd
    return acc


@njit(nogil=True, cache=True)
def _rowwise_adagrad_kernel(w, w_idx, state, s_idx, g, lr, eps, wd):
    D = g.shape[1]
    lr32, eps32, wd32, inv_d = np.float32(lr), np.float32(eps), np.float32(wd), np.float32(1.0 / D)
    n = g.shape[0]
    for i in range(n):
        # the hint is written out in each kernel on purpose (recsys.store.host.prefetch)
        j = i + ROWS_AHEAD
        if j < n:
            rj, sj = w_idx[j], s_idx[j]
            if rj >= 0 and sj >= 0:
                prefetch(w, rj)
                prefetch(state, sj)
        r = w_idx[i]
        s = s_idx[i]
        if r < 0 or s < 0:
            continue
        st = state[s] + _row_sum_sq(g, i, w, r, wd32) * inv_d
        state[s] = st
        mult = lr32 / (np.sqrt(st) + eps32)
        for d in range(D):
            w[r, d] = w[r, d] - mult * (g[i, d] + wd32 * w[r, d])


@njit(nogil=True, cache=True)
def _adagrad_kernel(w, w_idx, state, s_idx, g, lr, eps, wd):
    D = g.shape[1]
    lr32, eps32, wd32 = np.float32(lr), np.float32(eps), np.float32(wd)
    n = g.shape[0]
    for i in range(n):
        j = i + ROWS_AHEAD
        if j < n:
            rj, sj = w_idx[j], s_idx[j]
            if rj >= 0 and sj >= 0:
                prefetch(w, rj)
                prefetch(state, sj)
        r = w_idx[i]
        s = s_idx[i]
        if r < 0 or s < 0:
            continue
        for d in range(D):
            gd = g[i, d] + wd32 * w[r, d]
            st = state[s, d] + gd * gd
            state[s, d] = st
            w[r, d] = w[r, d] - lr32 * (gd / (np.sqrt(st) + eps32))


@njit(nogil=True, cache=True)
def _adam_kernel(w, w_idx, m, v, t, s_idx, g, lr, beta1, beta2, eps, wd):
    D = g.shape[1]
    b1, b2, eps32, wd32 = np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(wd)
    one_b1, one_b2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    n = g.shape[0]
    for i in range(n):
        j = i + ROWS_AHEAD
        if j < n:
            rj, sj = w_idx[j], s_idx[j]
            if rj >= 0 and sj >= 0:
                prefetch(w, rj)
                prefetch(m, sj)
                prefetch(v, sj)
                prefetch(t, sj)
        r = w_idx[i]
        s = s_idx[i]
        if r < 0 or s < 0:
            continue
        step = t[s] + 1
        t[s] = step
        step_size = np.float32(lr / (1.0 - beta1**step))
        bc2_sqrt = np.float32(np.sqrt(1.0 - beta2**step))
        for d in range(D):
            gd = g[i, d] + wd32 * w[r, d]
            md = b1 * m[s, d] + one_b1 * gd
            vd = b2 * v[s, d] + one_b2 * gd * gd
            m[s, d] = md
            v[s, d] = vd
            w[r, d] = w[r, d] - step_size * (md / (np.sqrt(vd) / bc2_sqrt + eps32))


@njit(nogil=True, cache=True)
def _sgd_kernel(w, w_idx, g, lr, wd):
    D = g.shape[1]
    lr32, wd32 = np.float32(lr), np.float32(wd)
    n = g.shape[0]
    for i in range(n):
        j = i + ROWS_AHEAD
        if j < n and w_idx[j] >= 0:
            prefetch(w, w_idx[j])
        r = w_idx[i]
        if r < 0:
            continue
        for d in range(D):
            w[r, d] = w[r, d] - lr32 * (g[i, d] + wd32 * w[r, d])


# --------------------------------------------------------------------------- dispatch


def apply_update(
    cfg: StoreConfig,
    weights_RD: np.ndarray,
    w_idx_U: np.ndarray,
    state: dict[str, np.ndarray],
    s_idx_U: np.ndarray,
    grads_UD: np.ndarray,
) -> None:
    """Apply ``cfg.optimizer`` in place to rows ``w_idx_U`` of float32 ``weights_RD`` and rows
    ``s_idx_U`` of the ``state`` arrays (named as ``state_columns``), one gradient row each."""
    if weights_RD.dtype != np.float32 or grads_UD.dtype != np.float32:
        raise TypeError(f"weights and grads must be float32, found {weights_RD.dtype} and {grads_UD.dtype}")
    lr, eps, wd = float(cfg.lr), float(cfg.eps), float(cfg.weight_decay)
    opt = cfg.optimizer
    if opt == "rowwise_adagrad":
        _rowwise_adagrad_kernel(weights_RD, w_idx_U, state["rowwise_state"], s_idx_U, grads_UD, lr, eps, wd)
    elif opt == "adagrad":
        _adagrad_kernel(weights_RD, w_idx_U, state["state_sum"], s_idx_U, grads_UD, lr, eps, wd)
    elif opt == "adam":
        _adam_kernel(
            weights_RD, w_idx_U, state["exp_avg"], state["exp_avg_sq"], state["adam_step"], s_idx_U,
            grads_UD, lr, float(cfg.beta1), float(cfg.beta2), eps, wd,
        )
    elif opt == "sgd":
        _sgd_kernel(weights_RD, w_idx_U, grads_UD, lr, wd)
    else:
        raise ValueError(f"unknown optimizer {opt!r}")
