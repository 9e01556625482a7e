"""The spill tier's key index (``recsys.store.spill``): the keys a tier has in Redis, as a set.

An open-addressing set of int64 keys (linear probing; slot states 0 empty, 1 used,
2 deleted), at most half full counting deleted slots, rebuilt when it would be fuller; the
probes are numba kernels. What the tier does with it: the module doc of ``recsys.store.spill``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recsys.hashing import fmix
from recsys.store.keymap import as_keys

_INDEX_TAG = np.uint64(0x2545F4914F6CDD1D)


@njit(inline="always")
def _slot_of(table, state, k):
    """Return (slot holding k, or the slot to insert k at; whether k is there)."""
    mask = np.uint64(table.shape[0] - 1)
    j = np.int64(fmix(np.uint64(k) ^ _INDEX_TAG) & mask)
    free = np.int64(-1)
    while True:
        s = state[j]
        if s == 0:
            return (j if free < 0 else free), False
        if s == 1 and table[j] == k:
            return j, True
        if s == 2 and free < 0:
            free = j
        j = np.int64((np.uint64(j) + np.uint64(1)) & mask)


@njit(nogil=True, cache=True)
def _index_add(table, state, items):
    added = 0
    reused = 0
    for i in range(items.shape[0]):
        j, there = _slot_of(table, state, items[i])
        if there:
            continue
        if state[j] == 2:
            reused += 1
        table[j] = items[i]
        state[j] = 1
        added += 1
    return added, reused


@njit(nogil=True, cache=True)
def _index_remove(table, state, items):
    removed = 0
    for i in range(items.shape[0]):
        j, there = _slot_of(table, state, items[i])
        if there:
            state[j] = 2
            removed += 1
    return removed


@njit(nogil=True, cache=True)
def _index_contains(table, state, items, out):
    for i in range(items.shape[0]):
        _, out[i] = _slot_of(table, state, items[i])


class KeyIndex:
    """The keys a tier has in Redis: add / remove / contains on int64 arrays."""

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self._alloc(16)
        self.size = 0
        self._filled = 0  # used + deleted slots
        if keys is not None:
            self.add(keys)

    def _alloc(self, capacity: int) -> None:
        self._table = np.zeros(capacity, dtype=np.int64)
        self._state = np.zeros(capacity, dtype=np.uint8)

    def add(self, keys: np.ndarray) -> None:
        keys = as_keys(keys)
        if keys.shape[0] == 0:
            return
        if 2 * (self._filled + keys.shape[0]) > self._table.shape[0]:
            live = self.keys()
            need = 4 * (live.shape[0] + keys.shape[0])
            self._alloc(1 << max(4, (need - 1).bit_length()))
            self.size = self._filled = 0
            self.add(live)
        added, reused = _index_add(self._table, self._state, keys)
        self.size += int(added)
        self._filled += int(added) - int(reused)

    def remove(self, keys: np.ndarray) -> None:
        keys = as_keys(keys)
        if keys.shape[0]:
            self.size -= int(_index_remove(self._table, self._state, keys))

    def contains(self, keys: np.ndarray) -> np.ndarray:
        keys = as_keys(keys)
        out = np.zeros(keys.shape[0], dtype=np.bool_)
        if self.size and keys.shape[0]:
            _index_contains(self._table, self._state, keys, out)
        return out

    def keys(self) -> np.ndarray:
        return self._table[self._state == 1].copy()
