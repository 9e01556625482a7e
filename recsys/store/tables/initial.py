"""The initial vector of a new key: a pure function of (seed, table name, key). No torch.

Element ``d`` of a key's initial row is ``a · ((2·(h_d >> 40) + 1) / 2^24 - 1)`` with
``h_d = fmix64(base + (d+1)·φ)``, ``base = fmix64(key ^ table_salt(name) ^ fmix64(seed ^ tag))``
and φ the golden-ratio constant. Every shard, insertion order, capacity and world size
therefore starts a key identically, and the lookup service can give a key it never saw
exactly the vector ``recsys eval`` reads for it, without the store.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recsys.features import hashing
from recsys.features.hashing import fmix

__all__ = ["init_salt", "init_vectors", "init_kernel"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_INIT_TAG = 0xD6E8FEB86659FD93
_MASK = (1 << 64) - 1


@njit(nogil=True, cache=True)
def init_kernel(keys, rows, salt, bound, out):
    """Write the initial vector of ``keys[i]`` into ``out[rows[i]]`` (float32)."""
    D = out.shape[1]
    for i in range(keys.shape[0]):
        base = fmix(np.uint64(keys[i]) ^ salt)
        r = rows[i]
        for d in range(D):
            h = fmix(base + np.uint64(d + 1) * _GOLDEN)
            k = np.float64(h >> np.uint64(40))  # 24 uniform bits
            out[r, d] = np.float32(bound * ((2.0 * k + 1.0) * (1.0 / 16777216.0) - 1.0))


def init_salt(table: str, seed: int) -> int:
    """Return the 64-bit salt of initial vectors for ``table`` under ``seed``."""
    return hashing.table_salt(table) ^ hashing.fmix64((seed & _MASK) ^ _INIT_TAG)


def init_vectors(keys_M: np.ndarray, dim: int, table: str, seed: int, bound: float) -> np.ndarray:
    """Return the initial float32 [M, dim] rows of ``keys_M``, each ~ U(-bound, bound)."""
    keys = np.ascontiguousarray(keys_M)
    if keys.dtype == np.uint64:
        keys = keys.view(np.int64)
    elif keys.dtype != np.int64:
        keys = keys.astype(np.int64)
    out = np.empty((keys.shape[0], dim), dtype=np.float32)
    init_kernel(keys, np.arange(keys.shape[0]), np.uint64(init_salt(table, seed)), float(bound), out)
    return out
