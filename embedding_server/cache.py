"""An LRU cache of served rows, bounded in bytes, in front of Redis (one per worker process).

Legend: ``U`` unique keys of a request part, ``C`` cached rows of a table, ``D`` dim.

One ``TableCache`` per (version, table): the store's own vectorized key map
(``recsys.store.tables.keymap.KeyMap``: 64-bit key → slot, exact LRU eviction, numba) over
preallocated arrays, so a request's 256 keys cost a few microseconds, not 256 dict
operations::

    KeyMap   key ─► slot          rows_CD  float32 [C, D]     found_C  bool [C]

A published version is immutable, so "absent" answers are cached too (``found`` false):
an id that was never trained costs one Redis round trip per version, not one per request.
Entries are keyed by version through the cache object itself, so a version switch can
never serve another version's row; the service drops the old version's caches when it
switches.

Reads are two-phase because a request awaits Redis in between: ``get`` copies the hits out
and touches nothing; after the fetch, ``put`` touches every key of the request (hits and
fetched) and writes their rows, synchronously, so a slot is never written by a request
that was preempted while another one reused it. Single-threaded use only (the service's
event loop).

Charged size per cached row: ``D·4`` bytes of row plus ``ENTRY_OVERHEAD``: the key map's
26 bytes a slot, its free stack's 4 (allocated, written only as deep as evictions go) and
the found flag's 1, rounded up to 32. ``CacheBudget`` splits the configured bytes over a
version's tables in proportion to their published bytes (no table gets more rows than it
has; a table of at most ``MIN_ROWS`` rows is cached whole, with room for as many absent
ids). Arrays are allocated zeroed, so untouched capacity costs no resident memory.

Live rows (``recsys serve --follow``) change while they are served, so their cache,
``LiveTableCache``, is the same map with two more columns: each entry's training step and
the clock time of the read that fetched it. An entry is a hit for ``ttl_s`` after that
read, then it is read again. Absent live rows (most keys: only the keys training touched
have one) are cached the same way. ``put`` never replaces an entry with one of an older
step (two requests' reads can finish in either order) and returns what it kept, so a
request serves the newest row this worker has seen.
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from recsys.store.tables.keymap import KeyMap, as_keys
from recsys.store.host.prefetch import ROWS_AHEAD, prefetch

ENTRY_OVERHEAD = 32
MIN_ROWS = 4096
_FLOATS_PER_LINE = 16  # float32 values in a 64-byte cache line


_SALT = np.int64(int.from_bytes(os.urandom(8), "little", signed=True))


def salted(keys: np.ndarray) -> np.ndarray:
    """Return ``keys`` as the caches' key maps hold them: XORed with a per-process random
    word. Served keys come from clients, and the hashes on their way to a key map are public
    (``recsys.features.hashing``, the map's own): unsalted, ids chosen to fill one probe run would
    slow every later lookup that lands there. XOR keeps distinct keys distinct, and every
    int64 is a valid key."""
    return np.bitwise_xor(as_keys(keys), _SALT)


@njit(nogil=True, cache=True)
def _gather_hits_kernel(slots_U, rows_CD, found_C, rows_UD, found_U):
    """Copy the cached row and found flag of every key with a slot (>= 0). Each row's cache
    lines are asked for ``ROWS_AHEAD`` keys early (a cache of 256 MiB is far beyond the CPU's
    caches, so nearly every row is a miss; ``recsys.store.host.prefetch``)."""
    n = slots_U.shape[0]
    dim = rows_CD.shape[1]
    flat = rows_CD.reshape(-1)
    for i in range(n):
        # the hint is written out in each kernel on purpose (recsys.store.host.prefetch)
        j = i + ROWS_AHEAD
        if j < n and slots_U[j] >= 0:
            base = slots_U[j] * dim
            for off in range(0, dim, _FLOATS_PER_LINE):
                prefetch(flat, base + off)
            prefetch(found_C, slots_U[j])
        s = slots_U[i]
        if s >= 0:
            for d in range(dim):
                rows_UD[i, d] = rows_CD[s, d]
            found_U[i] = found_C[s]


@njit(nogil=True, cache=True)
def _scatter_kernel(slots_U, rows_UD, found_U, rows_CD, found_C):
    """``rows_CD[slots_U] = rows_UD`` and ``found_C[slots_U] = found_U``, rows asked for
    ``ROWS_AHEAD`` keys early (as ``_gather_hits_kernel``)."""
    n = slots_U.shape[0]
    dim = rows_CD.shape[1]
    flat = rows_CD.reshape(-1)
    for i in range(n):
        j = i + ROWS_AHEAD
        if j < n:
            base = slots_U[j] * dim
            for off in range(0, dim, _FLOATS_PER_LINE):
                prefetch(flat, base + off)
            prefetch(found_C, slots_U[j])
        s = slots_U[i]
        for d in range(dim):
            rows_CD[s, d] = rows_UD[i, d]
        found_C[s] = found_U[i]


class TableCache:
    """Cached rows of one table of one version (see the module doc)."""

    @staticmethod
    def entry_bytes(dim: int) -> int:
        """Return the bytes charged per cached row of ``dim`` numbers."""
        return dim * 4 + ENTRY_OVERHEAD

    def __init__(self, capacity: int, dim: int) -> None:
        self.capacity = int(capacity)
        self.dim = dim
        self._map = KeyMap(self.capacity)
        self._rows = np.zeros((self.capacity, dim), dtype=np.float32)
        self._found = np.zeros(self.capacity, dtype=bool)
        self._step = 0

    def __len__(self) -> int:
        return len(self._map)

    @property
    def bytes(self) -> int:
        """Return the bytes charged for the rows held now."""
        return len(self._map) * self.entry_bytes(self.dim)

    def get(self, keys_U: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (hit mask, float32 [U, D] rows, found [U]) for distinct ``keys_U``; rows and
        found are valid where hit. Touches nothing (``put`` does)."""
        slots = self._map.find(salted(keys_U))
        rows = np.zeros((keys_U.shape[0], self.dim), dtype=np.float32)
        found = np.zeros(keys_U.shape[0], dtype=bool)
        _gather_hits_kernel(slots, self._rows, self._found, rows, found)
        return slots >= 0, rows, found

    def put(self, keys_U: np.ndarray, rows_UD: np.ndarray, found_U: np.ndarray) -> None:
        """Cache the rows (and found flags) of distinct ``keys_U``, the request's most recent."""
        if keys_U.shape[0] > self.capacity:  # more than fits: keep the first ones
            keys_U, rows_UD, found_U = keys_U[: self.capacity], rows_UD[: self.capacity], found_U[: self.capacity]
        self._step += 1
        slots = self._map.lookup(salted(keys_U), self._step).slots_N
        rows = np.ascontiguousarray(rows_UD, dtype=np.float32)
        _scatter_kernel(slots, rows, np.ascontiguousarray(found_U, dtype=bool), self._rows, self._found)


class LiveTableCache:
    """Cached live rows of one table, each a hit for ``ttl_s`` after its read (see the module doc).

    ``steps`` are training steps, -1 where the live namespace had no row; ``stamps`` are
    the clock times of the reads that fetched the entries."""

    STEP_BYTES = 16
    """The step and the read time, per entry."""

    @classmethod
    def entry_bytes(cls, dim: int) -> int:
        """Return the bytes charged per cached live row of ``dim`` numbers."""
        return dim * 4 + ENTRY_OVERHEAD + cls.STEP_BYTES

    def __init__(self, capacity: int, dim: int, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"a live row cache needs ttl_s > 0, found {ttl_s}")
        self.capacity = int(capacity)
        self.dim = dim
        self.ttl_s = float(ttl_s)
        self._map = KeyMap(self.capacity)
        self._rows = np.zeros((self.capacity, dim), dtype=np.float32)
        self._found = np.zeros(self.capacity, dtype=bool)
        self._steps = np.full(self.capacity, -1, dtype=np.int64)
        self._stamps = np.zeros(self.capacity, dtype=np.float64)
        self._lru = 0

    def __len__(self) -> int:
        return len(self._map)

    @property
    def bytes(self) -> int:
        """Return the bytes charged for the entries held now."""
        return len(self._map) * self.entry_bytes(self.dim)

    def get(self, keys_U: np.ndarray, now: float):
        """Return (hit mask, float32 [U, D] rows, found [U], steps [U], stamps [U]) for distinct
        ``keys_U`` at clock time ``now``: a hit is an entry read less than ``ttl_s`` before.
        The other arrays are valid where hit (elsewhere: zeros, false, -1, 0). Touches nothing."""
        n = keys_U.shape[0]
        slots = self._map.find(salted(keys_U))
        held = slots >= 0
        rows = np.zeros((n, self.dim), dtype=np.float32)
        found = np.zeros(n, dtype=bool)
        steps = np.full(n, -1, dtype=np.int64)
        stamps = np.zeros(n, dtype=np.float64)
        hit = held.copy()
        if held.any():
            s = slots[held]
            hit[held] = now - self._stamps[s] < self.ttl_s
            s = slots[hit]
            rows[hit], found[hit] = self._rows[s], self._found[s]
            steps[hit], stamps[hit] = self._steps[s], self._stamps[s]
        return hit, rows, found, steps, stamps

    def put(self, keys_U: np.ndarray, rows_UD: np.ndarray, found_U: np.ndarray, steps_U: np.ndarray,
            stamps_U: np.ndarray):
        """Cache the entries of distinct ``keys_U`` (hits and fresh reads), except where the cache
        holds a later step: then keep that entry. Return the (rows, found, steps, stamps) kept."""
        rows, found, steps, stamps = rows_UD.copy(), found_U.copy(), steps_U.copy(), stamps_U.copy()
        keys = salted(keys_U)
        slots = self._map.find(keys)
        held = slots >= 0
        if held.any():
            newer = np.zeros(keys_U.shape[0], dtype=bool)
            newer[held] = self._steps[slots[held]] > steps[held]
            if newer.any():
                s = slots[newer]
                rows[newer], found[newer], steps[newer], stamps[newer] = (self._rows[s], self._found[s],
                                                                          self._steps[s], self._stamps[s])
        k = min(keys_U.shape[0], self.capacity)  # more than fits: keep the first ones
        self._lru += 1
        slots = self._map.lookup(keys[:k], self._lru).slots_N
        self._rows[slots], self._found[slots], self._steps[slots], self._stamps[slots] = (rows[:k], found[:k],
                                                                                         steps[:k], stamps[:k])
        return rows, found, steps, stamps


class CacheBudget:
    """The caches of one version: ``max_bytes`` split over its tables (see the module doc).

    With ``ttl_s`` the caches are ``LiveTableCache``s of live rows (of the published tables
    the live namespace holds), else ``TableCache``s."""

    def __init__(self, max_bytes: int, tables: dict[str, tuple[int, int]], ttl_s: float | None = None) -> None:
        """``tables``: name -> (published rows, dim)."""
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0 (0: no cache), found {max_bytes}")
        self.max_bytes = max_bytes
        kind = TableCache if ttl_s is None else LiveTableCache
        weight = {n: rows * kind.entry_bytes(dim) for n, (rows, dim) in tables.items()}
        total = sum(weight.values())
        self.tables: dict[str, TableCache | LiveTableCache] = {}
        for name, (rows, dim) in tables.items():
            share = max_bytes * weight[name] / total if total else 0
            # a small table (hot by nature) is always cached whole, with room for absent ids
            # (a little past the budget); a large one gets its share, never more than it has
            share_rows = int(share // kind.entry_bytes(dim))
            capacity = min(max(rows, MIN_ROWS), max(share_rows, MIN_ROWS if rows <= MIN_ROWS else 0))
            capacity = capacity if max_bytes else 0
            if capacity > 0:
                self.tables[name] = TableCache(capacity, dim) if ttl_s is None else LiveTableCache(capacity, dim, ttl_s)

    def get(self, table: str):
        """Return the cache of ``table`` (None: nothing cached for it)."""
        return self.tables.get(table)

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tables.values())
