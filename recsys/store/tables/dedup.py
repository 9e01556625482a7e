"""Hash-based dedup of 64-bit keys: unique keys in first-appearance order plus the inverse.

The one dedup of keys with their inverse: a batch's keys (``index_batch``), an owner's
received blocks (``unique_blocks``), a live push's touched keys and a served request's ids
(``unique_inverse``). Not ``np.unique``: it returns the keys sorted, in several array passes;
one open-addressing pass is O(n) (the figures that chose it: docs/benchmarks-history.md,
"Figures from module docstrings"). ``index_batch`` does every table of a batch in one
call, with a hash table sized to each table's ids (so it stays in cache). The unique keys
come in the order they first appear whatever the hash, so the salt ``unique_inverse`` hashes
with never changes a result. No validation beyond ``as_keys`` in ``unique_inverse``; none in
the batch kernels (hot path).
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from recsys.features.hashing import fmix
from recsys.store.tables.keymap import as_keys

_SALT = np.uint64(int.from_bytes(os.urandom(8), "little"))
"""Salts ``unique_inverse``'s hash per process: served ids come from clients, and both hashes
on their way here are public, so ids chosen to share one probe run would otherwise cost
quadratic time. The batch kernels hash unsalted (salt 0)."""


@njit(inline="always")
def _dedup(h_row, mask, key, uniq, n, salt=np.uint64(0)):
    """Return (row of ``key``, rows so far): ``key``'s row in ``uniq`` if ``h_row`` (open
    addressing, -1 = empty, ``mask`` = its size - 1, home bucket from the hash of
    ``key ^ salt``) has it, else ``n`` after adding it."""
    h = np.int64(fmix(np.uint64(key) ^ salt) & mask)
    while True:
        r = h_row[h]
        if r < 0:
            h_row[h] = n
            uniq[n] = key
            return n, n + 1
        if uniq[r] == key:
            return r, n
        h = (h + np.int64(1)) & np.int64(mask)


def _table_size(n: int) -> int:
    return 1 << max(4, int(2 * n - 1).bit_length())  # load factor <= 1/2


@njit(nogil=True, cache=True)
def _unique_kernel(keys, h_row, uniq, inverse, salt):
    mask = np.uint64(h_row.shape[0] - 1)
    n = 0
    for i in range(keys.shape[0]):
        inverse[i], n = _dedup(h_row, mask, keys[i], uniq, n, salt)
    return n


def unique_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (the distinct ``keys`` in the order they first appear, each key's index among
    them), int64 both, with ``uniq[inverse] == keys``: ``np.unique(keys, return_inverse=True)``
    but in first-appearance order, not sorted. ``keys``: 1-D, int64 or uint64 bit patterns
    (``as_keys``). One compiled pass with a hash table at most half full, salted per process
    (``_SALT``)."""
    keys = as_keys(keys)
    n = keys.shape[0]
    h_row = np.full(_table_size(n), -1, dtype=np.int64)
    uniq = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    n_uniq = _unique_kernel(keys, h_row, uniq, inverse, _SALT)
    return uniq[:n_uniq], inverse


@njit(nogil=True, cache=True)
def _index_batch_kernel(values, feat_off, lengths_FB, tf_ptr, tf_idx, single_col, multi_dst,
                        uniq, table_base, single_idx, multi_values, h_row):
    """Dedup every table's ids and write each id's batch-local row (see ``index_batch``).

    Returns -1, or the first single-hot feature with a sample holding more than one id."""
    B = lengths_FB.shape[1]
    n = 0
    for t in range(tf_ptr.shape[0] - 1):
        table_base[t] = n
        ids = 0
        for j in range(tf_ptr[t], tf_ptr[t + 1]):
            ids += feat_off[tf_idx[j] + 1] - feat_off[tf_idx[j]]
        size = 16
        while size < 2 * ids:
            size *= 2
        h_row[:size] = -1
        mask = np.uint64(size - 1)
        for j in range(tf_ptr[t], tf_ptr[t + 1]):
            f = tf_idx[j]
            col = single_col[f]
            if col >= 0:
                pos = feat_off[f]
                for b in range(B):
                    length = lengths_FB[f, b]
                    if length > 1:
                        return f
                    if length == 0:
                        single_idx[b, col] = -1
                    else:
                        single_idx[b, col], n = _dedup(h_row, mask, values[pos], uniq, n)
                        pos += 1
            else:
                dst = multi_dst[f] - feat_off[f]
                for i in range(feat_off[f], feat_off[f + 1]):
                    multi_values[dst + i], n = _dedup(h_row, mask, values[i], uniq, n)
    table_base[tf_ptr.shape[0] - 1] = n
    # empty single-hot slots point at the zero row after every table's rows
    for b in range(single_idx.shape[0]):
        for c in range(single_idx.shape[1]):
            if single_idx[b, c] < 0:
                single_idx[b, c] = n
    return -1


def index_batch(values: np.ndarray, feat_off: np.ndarray, lengths_FB: np.ndarray, tf_ptr: np.ndarray,
                tf_idx: np.ndarray, single_col: np.ndarray, multi_dst: np.ndarray, n_multi_values: int,
                names: list[str] | None = None):
    """Return (uniq, table_base [T+1], single_idx [B, F_single], multi_values) of one batch.

    ``values``: every id of the batch, feature-major (a KJT's values), feature f at
    ``feat_off[f] .. feat_off[f+1]`` with per-sample ``lengths_FB[f]``. Table t's
    features are ``tf_idx[tf_ptr[t] : tf_ptr[t+1]]``. Each table's distinct ids go to
    ``uniq[table_base[t] : table_base[t+1]]`` in first-appearance order (its features in
    the given order); an id's row is its index in ``uniq``. Single-hot feature f fills
    column ``single_col[f]`` of ``single_idx`` (row ``table_base[T]``, the zero row, where
    a sample has no id); multi-hot feature f (``single_col[f] < 0``) writes its ids' rows
    at ``multi_values[multi_dst[f] ..]``. One pass, one hash table for all tables.
    Raises ``ValueError`` naming the feature (``names[f]``) if a single-hot feature holds
    more than one id in a sample.
    """
    keys = np.ascontiguousarray(values, dtype=np.int64)
    n = keys.shape[0]
    h_row = np.empty(_table_size(n), dtype=np.int64)  # reset per table, up to its ids
    uniq = np.empty(n, dtype=np.int64)
    table_base = np.empty(tf_ptr.shape[0], dtype=np.int64)
    B = lengths_FB.shape[1]
    n_single = int((single_col >= 0).sum())
    single_idx = np.empty((B, n_single), dtype=np.int64)
    multi_values = np.empty(n_multi_values, dtype=np.int64)
    bad = _index_batch_kernel(keys, feat_off, lengths_FB, tf_ptr, tf_idx, single_col, multi_dst,
                              uniq, table_base, single_idx, multi_values, h_row)
    if bad >= 0:
        name = names[bad] if names is not None else f"#{bad}"
        raise ValueError(f"feature {name!r} is single-hot but a sample of the batch holds more than one id")
    return uniq[: table_base[-1]], table_base, single_idx, multi_values


@njit(nogil=True, cache=True)
def block_starts(counts_WT):
    """Return where each block of a message laid out in [W, T] blocks, rank-major, starts."""
    W, T = counts_WT.shape
    start = np.empty((W, T), dtype=np.int64)
    pos = 0
    for r in range(W):
        for t in range(T):
            start[r, t] = pos
            pos += counts_WT[r, t]
    return start


@njit(nogil=True, cache=True)
def _unique_blocks_kernel(keys, counts_WT, h_row, uniq, table_base, inverse):
    W, T = counts_WT.shape
    start = block_starts(counts_WT)  # each (rank, table) block's first key
    n = 0
    for t in range(T):
        table_base[t] = n
        ids = 0
        for r in range(W):
            ids += counts_WT[r, t]
        size = 16
        while size < 2 * ids:
            size *= 2
        h_row[:size] = -1
        mask = np.uint64(size - 1)
        for r in range(W):
            for i in range(start[r, t], start[r, t] + counts_WT[r, t]):
                inverse[i], n = _dedup(h_row, mask, keys[i], uniq, n)
    table_base[T] = n


def unique_blocks(keys: np.ndarray, counts_WT: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deduplicate each table's keys across the blocks of ``keys``; return (uniq, table_base
    [T+1], inverse) with ``uniq[inverse] == keys``.

    ``keys`` is laid out in [W, T] blocks, rank-major (what an all-to-all brings each owner:
    rank r's keys of table t at block (r, t), ``counts_WT[r, t]`` long). Table t's distinct
    keys go to ``uniq[table_base[t] : table_base[t+1]]`` in first-appearance order over the
    blocks (r = 0, 1, ...): what ``unique_inverse`` of the concatenation of its blocks gives,
    for every table in one pass."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    counts = np.ascontiguousarray(counts_WT, dtype=np.int64)
    n = keys.shape[0]
    per_table = counts.sum(axis=0)
    h_row = np.empty(_table_size(int(per_table.max()) if per_table.shape[0] else 0), dtype=np.int64)
    uniq = np.empty(n, dtype=np.int64)
    table_base = np.empty(counts.shape[1] + 1, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    _unique_blocks_kernel(keys, counts, h_row, uniq, table_base, inverse)
    return uniq[: table_base[-1]], table_base, inverse
