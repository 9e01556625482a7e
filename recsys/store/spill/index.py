"""The spill tier's key index (``recsys.store.spill.tier``): the keys a tier has in Redis, as a set.

An open-addressing set of int64 keys (every bit pattern is a key, so a slot's state is kept
apart, a byte: empty, deleted, or used with 7 bits of the key's hash), linear probing from
``fmix64(key ^ tag)``; the probes are numba kernels. What the tier does with it: the module doc of ``recsys.store.spill.tier``.

Two properties matter at tens of millions of keys, where the tier works every step:

- **Churn never rebuilds it.** A key is deleted by backward shift (the entries after it
  move back towards their homes), so no tombstone is ever left and the table only changes
  size when the live keys outgrow it. (Tombstones would fill the table under churn alone and
  force a rebuild of all of it, under the tier's lock, which a step that needs the tier waits
  for.)
- **Growing is spread over the calls around it** (as Redis grows its own dictionary).
  Past ``PREPARE_LOAD`` live keys a slot, a table twice as large is allocated and each
  ``add`` and ``remove`` faults in a share of it (fresh memory costs its first write, many
  times what memory the process had before costs: faulted in at once, a table of hundreds
  of MB would stall the call that first inserts into it). Once all of it is in memory it
  becomes the table inserts go to, and the old one is *drained*: each call of ``n`` keys
  also moves the entries of ``max(DRAIN_MIN, DRAIN_PER_KEY · n)`` old slots into it. Until
  the old table is drained a lookup probes both, and a deletion deletes in both (in the old
  one by marking the slot deleted, so the drain's cursor never misses an entry). A bulk
  ``add`` (a key list of at least a sixteenth of the table: the index's first build, a
  restore), or growth past ``MAX_LOAD`` before the new table was ready, rebuilds at once
  instead.

Memory: 9 bytes a slot at a load between 0.25 and 0.64: 14-36 bytes a key; while a growth
faults in and drains, the old table and the new one hold three times the slots (up to ~54
bytes a key).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from recsys.features.hashing import fmix
from recsys.store.tables.keymap import as_keys

_INDEX_TAG = np.uint64(0x2545F4914F6CDD1D)
PREPARE_LOAD = 0.5
"""Live keys per slot past which the next table (twice as many slots) is faulted in, a share
per call; once it is all in memory it becomes the table in use and the old one drains. Probes
get longer with the load (lookups, deletions and inserts alike), so a table grows well before
it is full."""
MAX_LOAD = 0.85
"""Live keys per slot past which an add rebuilds at once (growth outran the calls' shares)."""
FAULT_BYTES_PER_KEY = 128
"""Bytes of the next table faulted in per key an ``add`` or ``remove`` is given: its 2·C slots
of 9 bytes are in memory after 0.14·C keys, at a load of at most 0.64."""
FAULT_MIN_BYTES = 1 << 20
DRAIN_PER_KEY = 4
"""Old slots drained per key an ``add`` or ``remove`` is given: the old table (C slots) is
drained after C / 4 keys, while the new one (2·C slots) goes from at most 0.32 to 0.45 full,
so before the next growth. (The bounds count keys, not calls: a call's whole batch lands
before its share of the work. Batches below a sixteenth of the table, the bulk bound, keep
them: at a ninth, the two shares' rounding let the new table pass ``MAX_LOAD`` first.)"""
DRAIN_MIN = 4096
"""Old slots drained by any ``add`` or ``remove``, however few its keys."""
_MIN_SLOTS = 16
_EMPTY, _DELETED = 0, 1
_USED = 0x80
"""A used slot's state byte is ``_USED | tag``: the key's hash's top 7 bits, so a probe reads
the key only where the tag matches (1 in 128 other keys), not at every used slot it passes."""


@njit(inline="always")
def _hash(k):
    return fmix(np.uint64(k) ^ _INDEX_TAG)


@njit(inline="always")
def _tag(h):
    return np.uint8(_USED | np.int64(h >> np.uint64(57)))


@njit(inline="always")
def _probe(table, state, k):
    """Return (the slot holding ``k``, or the empty slot that ended the search; whether it
    holds ``k``; ``k``'s state byte). Passes deleted slots."""
    mask = table.shape[0] - 1
    h = _hash(k)
    tag = _tag(h)
    j = np.int64(h & np.uint64(mask))
    while True:
        s = state[j]
        if s == _EMPTY:
            return j, False, tag
        if s == tag and table[j] == k:
            return j, True, tag
        j = (j + 1) & mask


@njit(inline="always")
def _find(table, state, k):
    """Return the slot holding ``k`` in (table, state), or -1."""
    j, there, _ = _probe(table, state, k)
    return j if there else -1


@njit(inline="always")
def _insert(table, state, k):
    """Insert ``k`` into a table without deleted slots; return whether it was absent."""
    j, there, tag = _probe(table, state, k)
    if there:
        return False
    table[j] = k
    state[j] = tag
    return True


@njit(inline="always")
def _delete_at(table, state, j):
    """Delete slot ``j`` by backward shift: each later entry of the run that may move back
    to the hole (its home is not cyclically inside (hole, its slot]) fills it."""
    mask = table.shape[0] - 1
    hole = j
    k = (j + 1) & mask
    while state[k] != _EMPTY:
        h = np.int64(_hash(table[k]) & np.uint64(mask))
        if (k - h) & mask >= (k - hole) & mask:  # home at or before the hole: it moves
            table[hole] = table[k]
            state[hole] = state[k]
            hole = k
        k = (k + 1) & mask
    state[hole] = _EMPTY


@njit(nogil=True, cache=True)
def _add_kernel(table, state, old, old_state, items):
    """Add ``items`` to the new table unless present in it or in the old one; return how many
    were added."""
    added = 0
    has_old = old.shape[0] > 0
    for i in range(items.shape[0]):
        k = items[i]
        if has_old and _find(old, old_state, k) >= 0:
            continue  # the drain moves it (or already did: then the new table has it)
        if _insert(table, state, k):
            added += 1
    return added


@njit(nogil=True, cache=True)
def _remove_kernel(table, state, old, old_state, items):
    """Delete ``items`` from both tables; return how many were present."""
    removed = 0
    has_old = old.shape[0] > 0
    for i in range(items.shape[0]):
        k = items[i]
        there = False
        j = _find(table, state, k)
        if j >= 0:
            _delete_at(table, state, j)
            there = True
        if has_old:
            j = _find(old, old_state, k)
            if j >= 0:
                old_state[j] = _DELETED
                there = True
        if there:
            removed += 1
    return removed


@njit(nogil=True, cache=True)
def _contains_kernel(table, state, old, old_state, items, out):
    has_old = old.shape[0] > 0
    for i in range(items.shape[0]):
        k = items[i]
        out[i] = _find(table, state, k) >= 0 or (has_old and _find(old, old_state, k) >= 0)


@njit(nogil=True, cache=True)
def _drain_kernel(table, state, old, old_state, start, stop):
    """Insert the live entries of old slots [start, stop) into the new table; return how many
    entered it."""
    moved = 0
    for j in range(start, stop):
        if old_state[j] >= _USED and _insert(table, state, old[j]):
            moved += 1
    return moved


_NONE_KEYS = np.zeros(0, dtype=np.int64)
_NONE_STATE = np.zeros(0, dtype=np.uint8)


class KeyIndex:
    """The keys a tier has in Redis: add / remove / contains on int64 arrays (``size``: how
    many). Not thread-safe: the tier calls it under its lock."""

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self._table, self._state = self._alloc(_MIN_SLOTS)
        self._old, self._old_state = _NONE_KEYS, _NONE_STATE
        self._cursor = 0  # old slots below it are drained
        self._spare: tuple[np.ndarray, np.ndarray] | None = None  # the next table, being faulted in
        self._faulted = 0  # its slots written so far
        self.size = 0
        if keys is not None:
            self.add(keys)

    @staticmethod
    def _alloc(slots: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.uint8)

    @property
    def slots(self) -> int:
        """Slots of the tables held now: the one in use, and the old one while it drains or
        the next one while it is faulted in."""
        spare = 0 if self._spare is None else self._spare[0].shape[0]
        return self._table.shape[0] + self._old.shape[0] + spare

    @property
    def draining(self) -> bool:
        return self._old.shape[0] > 0

    @property
    def preparing(self) -> bool:
        return self._spare is not None

    def add(self, keys: np.ndarray) -> None:
        keys = as_keys(keys)
        n = keys.shape[0]
        if n == 0:
            return
        self._make_room(n)
        self.size += int(_add_kernel(self._table, self._state, self._old, self._old_state, keys))
        self._progress(n)

    def remove(self, keys: np.ndarray) -> None:
        keys = as_keys(keys)
        if keys.shape[0]:
            self.size -= int(_remove_kernel(self._table, self._state, self._old, self._old_state, keys))
            self._progress(keys.shape[0])

    def contains(self, keys: np.ndarray) -> np.ndarray:
        keys = as_keys(keys)
        out = np.zeros(keys.shape[0], dtype=np.bool_)
        if self.size and keys.shape[0]:
            _contains_kernel(self._table, self._state, self._old, self._old_state, keys, out)
        return out

    def keys(self) -> np.ndarray:
        mine = self._table[self._state >= _USED]
        if not self.draining:
            return mine.copy()
        rest = self._old[self._cursor :][self._old_state[self._cursor :] >= _USED]
        return np.concatenate([mine, rest])

    def _make_room(self, incoming: int) -> None:
        """Before an add of ``incoming`` keys: begin preparing the next table past
        ``PREPARE_LOAD``; past ``MAX_LOAD`` (or for a bulk add) rebuild at once."""
        need = self.size + incoming
        slots = self._table.shape[0]
        if need > MAX_LOAD * slots or (need > PREPARE_LOAD * slots and incoming * 16 >= slots):
            self._rebuild(need)
        elif need > PREPARE_LOAD * slots and self._spare is None and not self.draining:
            self._spare, self._faulted = self._alloc(2 * slots), 0

    def _progress(self, work: int) -> None:
        """A call's share of the background work, for ``work`` keys: fault in the next table's
        next ``max(FAULT_MIN_BYTES, FAULT_BYTES_PER_KEY · work)`` bytes, and once it is all
        there make it the table in use; drain ``max(DRAIN_MIN, DRAIN_PER_KEY · work)`` old slots."""
        if self._spare is not None:
            table, state = self._spare
            stop = min(table.shape[0], self._faulted + max(FAULT_MIN_BYTES, FAULT_BYTES_PER_KEY * work) // 9)
            table[self._faulted : stop] = 0  # fresh memory: its first write maps the page
            state[self._faulted : stop] = 0
            self._faulted = stop
            if stop == table.shape[0]:
                self._old, self._old_state, self._cursor = self._table, self._state, 0
                self._table, self._state = table, state
                self._spare = None
                return  # the drain starts with the next call
        if self.draining:
            stop = min(self._old.shape[0], self._cursor + max(DRAIN_MIN, DRAIN_PER_KEY * work))
            _drain_kernel(self._table, self._state, self._old, self._old_state, self._cursor, stop)
            self._cursor = stop
            if stop == self._old.shape[0]:
                self._old, self._old_state, self._cursor = _NONE_KEYS, _NONE_STATE, 0

    def _rebuild(self, need: int) -> None:
        """Rebuild at once into the smallest table that holds ``need`` keys within
        ``PREPARE_LOAD`` (a bulk add, or growth faster than its background work)."""
        slots = _MIN_SLOTS
        while need > PREPARE_LOAD * slots:
            slots *= 2
        live = self.keys()
        self._table, self._state = self._alloc(slots)
        self._old, self._old_state, self._cursor = _NONE_KEYS, _NONE_STATE, 0
        self._spare = None
        self.size = int(_add_kernel(self._table, self._state, self._old, self._old_state, live))
