"""Hash-based dedup of 64-bit keys: unique keys in first-appearance order plus the inverse.

``np.unique`` sorts (O(n log n)) and was the largest single cost of a lookup; an open-
addressing pass is O(n) and ~8x faster on a batch's keys. No validation: hot path.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recsys.hashing import _fmix


@njit(nogil=True, cache=True)
def _unique_kernel(keys, table_keys, table_slot, uniq, inverse):
    mask = table_keys.shape[0] - 1
    n_uniq = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        h = np.int64(_fmix(np.uint64(k)) & np.uint64(mask))
        while True:
            s = table_slot[h]
            if s < 0:
                table_slot[h] = n_uniq
                table_keys[h] = k
                uniq[n_uniq] = k
                inverse[i] = n_uniq
                n_uniq += 1
                break
            if table_keys[h] == k:
                inverse[i] = s
                break
            h = (h + 1) & mask
    return n_uniq


def unique_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (unique keys in first-appearance order, inverse) with ``uniq[inverse] == keys``."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    n = keys.shape[0]
    size = 1 << max(4, int(2 * n - 1).bit_length())  # load factor <= 1/2
    table_keys = np.empty(size, dtype=np.int64)
    table_slot = np.full(size, -1, dtype=np.int64)
    uniq = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    n_uniq = _unique_kernel(keys, table_keys, table_slot, uniq, inverse)
    return uniq[:n_uniq], inverse
