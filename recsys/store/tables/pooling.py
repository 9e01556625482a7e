"""Pooling of batch-local rows: single-hot gathers and multi-hot (weighted) bag sums.

Legend: ``R`` rows of the batch-local table (unique keys + 1 zero row), ``D`` dim, ``B``
batch, ``F`` features, ``N`` ids of multi-hot bags.

On CPU, ``pool_forward`` / ``pool_backward`` are numba kernels over numpy arrays that
write the ``[B, F, D]`` result (and its row gradients) in one pass, in schema order. The
store hands the forward's result out as a leaf tensor and runs the backward on its worker
thread when the gradient is pushed.
Measured here: a scatter-add in numba took ~3 ms for 106k ids (D = 64, 26k rows),
against ~36 ms for torch's ``embedding`` backward and ~100 ms for ``index_add_``. On other
devices ``pool_torch`` uses torch's ``embedding`` / ``embedding_bag`` with autograd. No
input checks: hot path; the store builds the indices.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit

_scratch = threading.local()


@njit(nogil=True, cache=True)
def _pool_kernel(rows_RD, single_idx, single_cols, values, offsets, weights, has_weights, multi_cols, out_BFD):
    """out[b, single_cols[j]] = rows[single_idx[b, j]]; out[b, multi_cols[m]] = the weighted
    sum of bag m·B + b. Sample-major, so each sample's [F, D] block is written once."""
    B = out_BFD.shape[0]
    D = rows_RD.shape[1]
    for b in range(B):
        for j in range(single_cols.shape[0]):
            r = single_idx[b, j]
            c = single_cols[j]
            for d in range(D):
                out_BFD[b, c, d] = rows_RD[r, d]
        for m in range(multi_cols.shape[0]):
            c = multi_cols[m]
            bag = m * B + b
            for d in range(D):
                out_BFD[b, c, d] = 0.0
            for i in range(offsets[bag], offsets[bag + 1]):
                w = weights[i] if has_weights else np.float32(1.0)
                r = values[i]
                for d in range(D):
                    out_BFD[b, c, d] += w * rows_RD[r, d]


@njit(nogil=True, cache=True)
def _pool_grad_kernel(grad_BFD, single_idx, single_cols, values, offsets, weights, has_weights, multi_cols,
                      out_RD, use_col, masked):
    """The row gradients of ``_pool_kernel``; with ``masked``, of the columns c with
    ``use_col[c]`` only. A row's additions come in the same (sample, column) order either
    way, so the columns of a table can be done apart from the others' bit for bit."""
    B = grad_BFD.shape[0]
    D = out_RD.shape[1]
    for b in range(B):
        for j in range(single_cols.shape[0]):
            r = single_idx[b, j]
            c = single_cols[j]
            if masked and not use_col[c]:
                continue
            for d in range(D):
                out_RD[r, d] += grad_BFD[b, c, d]
        for m in range(multi_cols.shape[0]):
            c = multi_cols[m]
            if masked and not use_col[c]:
                continue
            bag = m * B + b
            for i in range(offsets[bag], offsets[bag + 1]):
                w = weights[i] if has_weights else np.float32(1.0)
                r = values[i]
                for d in range(D):
                    out_RD[r, d] += w * grad_BFD[b, c, d]


@njit(nogil=True, cache=True)
def _scatter_add_kernel(idx_N, values_ND, scale, out_RD):
    for i in range(idx_N.shape[0]):
        r = idx_N[i]
        for d in range(out_RD.shape[1]):
            out_RD[r, d] += scale * values_ND[i, d]


def scatter_add(idx_N: np.ndarray, values_ND: np.ndarray, out_RD: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Add ``scale · values_ND[i]`` into ``out_RD[idx_N[i]]`` for every i (in order); return ``out_RD``."""
    _scatter_add_kernel(idx_N, np.ascontiguousarray(values_ND, dtype=np.float32), np.float32(scale), out_RD)
    return out_RD


def pool_forward(rows_RD: np.ndarray, single_idx: np.ndarray, single_cols: np.ndarray, values: np.ndarray,
                 offsets: np.ndarray, weights: np.ndarray | None, multi_cols: np.ndarray,
                 out_BFD: np.ndarray) -> np.ndarray:
    """Fill ``out_BFD`` with pooled rows in one pass and return it: feature ``single_cols[j]``
    is ``rows_RD[single_idx[:, j]]``; feature ``multi_cols[m]`` sums (times ``weights``) the
    bags ``m·B .. m·B + B - 1`` of ``values`` / ``offsets``. Every column appears once.
    Measured here (B 4096, 26 single-hot + 2 multi-hot features, D 16): ~2x faster than a
    gather, two bag sums and a concatenation."""
    w = weights if weights is not None else np.empty(0, dtype=np.float32)
    _pool_kernel(rows_RD, single_idx, single_cols, values, offsets, w, weights is not None, multi_cols, out_BFD)
    return out_BFD


def local_copy(rows_RD: np.ndarray) -> np.ndarray:
    """Return a copy of ``rows_RD`` (float32 [R, D]) in this thread's reused scratch buffer,
    valid until the thread's next call.

    The pooling reads each row of a batch several times, in the batch's order. When another
    core wrote the rows (the store's worker gathers them), each such read fetches a line
    from that core's cache; copying them first reads them once, in order (the hardware
    prefetches it), and the pooling's reads then hit this core's caches. Measured in
    training (the bench job, B 4096, 28 features, D 16, thread CPU time of the forward
    pooling per step, two alternations): 1.17 / 1.20 ms with the copy, 1.47 / 1.49 without."""
    n = rows_RD.size
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _scratch.buf = np.empty(max(n, 1 << 16) + n // 4, dtype=np.float32)
    out = buf[:n].reshape(rows_RD.shape)
    np.copyto(out, rows_RD)
    return out


def pool_backward(grad_BFD: np.ndarray, single_idx: np.ndarray, single_cols: np.ndarray, values: np.ndarray,
                  offsets: np.ndarray, weights: np.ndarray | None, multi_cols: np.ndarray,
                  out_RD: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    """Add the row gradients of ``pool_forward`` (upstream ``grad_BFD``) into ``out_RD``.
    ``columns`` (bool [F]): only those feature columns' (calls over columns whose rows
    differ may run at once; a row's sum is the same as in one call)."""
    w = weights if weights is not None else np.empty(0, dtype=np.float32)
    use = np.ones(0, dtype=np.bool_) if columns is None else np.ascontiguousarray(columns, dtype=np.bool_)
    _pool_grad_kernel(np.ascontiguousarray(grad_BFD), single_idx, single_cols, values, offsets, w,
                      weights is not None, multi_cols, out_RD, use, columns is not None)
    return out_RD


def pool_torch(rows_RD: torch.Tensor, single_idx: torch.Tensor, single_cols: torch.Tensor, values: torch.Tensor,
               offsets: torch.Tensor, weights: torch.Tensor | None, multi_cols: torch.Tensor) -> torch.Tensor:
    """``pool_forward`` with torch kernels and autograd, on any device (row ``R - 1``, the
    zero row, gets no gradient)."""
    B, D = single_idx.shape[0], rows_RD.shape[1]
    pad = rows_RD.shape[0] - 1
    pieces, cols = [], []
    if single_cols.shape[0]:
        pieces.append(torch.nn.functional.embedding(single_idx, rows_RD, padding_idx=pad))  # [B, F_single, D]
        cols.append(single_cols)
    if multi_cols.shape[0]:
        bags = torch.nn.functional.embedding_bag(values, rows_RD, offsets, mode="sum", per_sample_weights=weights,
                                                 include_last_offset=True, padding_idx=pad)
        pieces.append(bags.view(multi_cols.shape[0], B, D).transpose(0, 1))
        cols.append(multi_cols)
    if not pieces:
        return rows_RD.new_zeros((B, 0, D))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    order = torch.cat(cols)
    if not torch.equal(order, torch.arange(order.shape[0], device=order.device)):
        out = out.index_select(1, torch.argsort(order))
    return out
