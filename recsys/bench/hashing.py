"""``recsys bench hashing``: ids/s of our hashing on one core vs plain numpy / hashlib.

- int ids: our numba kernel vs the same function written as vectorized numpy ops (the
  obvious way without a compiler). Issue target: >= 20 M ids/s.
- string ids: our kernel over Arrow's string buffers vs ``hashlib.blake2b`` per string in
  Python (the obvious stable hash). Issue target: >= 3 M ids/s.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pyarrow as pa

from recsys.features import hashing
from recsys.bench import comparison


def _best_rate(fn, n_items: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_items / best


def _numpy_int_hash(values: np.ndarray, salt: int) -> np.ndarray:
    k = values.view(np.uint64) ^ np.uint64(salt)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xFF51AFD7ED558CCD)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xC4CEB9FE1A85EC53)
    k = k ^ (k >> np.uint64(33))
    return k.view(np.int64)


def measure(quick: bool, data=None) -> dict:
    """Return int and string hashing rates, ours vs the obvious baseline."""
    n_int = 2_000_000 if quick else 20_000_000
    n_str = 300_000 if quick else 3_000_000
    repeats = 3
    rng = np.random.default_rng(0)
    ints = rng.zipf(1.1, size=n_int).astype(np.int64)
    salt = hashing.table_salt("bench")
    hashing.hash_int64(ints[:10], salt)  # compile / load the cache outside the timing
    assert np.array_equal(hashing.hash_int64(ints[:1000], salt), _numpy_int_hash(ints[:1000], salt))
    ours_int = _best_rate(lambda: hashing.hash_int64(ints, salt), n_int, repeats)
    base_int = _best_rate(lambda: _numpy_int_hash(ints, salt), n_int, repeats)

    strs = pa.array([f"u{v:x}-{v % 97}" for v in rng.zipf(1.1, size=n_str)], pa.string())
    offsets = np.frombuffer(strs.buffers()[1], dtype=np.int32)[: len(strs) + 1]
    data_u8 = np.frombuffer(strs.buffers()[2], dtype=np.uint8)
    hashing.hash_strings(offsets[:10], data_u8, salt)
    ours_str = _best_rate(lambda: hashing.hash_strings(offsets, data_u8, salt), n_str, repeats)
    py_strs = strs.to_pylist()
    base_n = min(n_str, 300_000)

    def blake():
        for s in py_strs[:base_n]:
            hashlib.blake2b(s.encode(), digest_size=8).digest()

    base_str = _best_rate(blake, base_n, 1)
    return {
        "comparisons": [
            comparison("int ids: numba vs numpy ops", ours_int, base_int, "ids/s", target=20e6),
            comparison("string ids: numba vs hashlib per string", ours_str, base_str, "ids/s", target=3e6),
        ],
        "settings": {"int_ids": n_int, "string_ids": n_str, "repeats": repeats, "threads": 1},
    }
