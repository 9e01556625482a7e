"""A vectorized 64-bit key → slot map with exact LRU eviction, and the admission sketch.

Legend: ``N`` keys in one call (may repeat), ``M`` new keys of a call, ``K`` keys evicted by
a call, ``C`` capacity (slots), ``NB`` hash buckets (2.5·C + 1), ``P`` the
eviction candidate pool.

Keys are int64 arrays holding uint64 bit patterns (``recsys.features.hashing``): every value,
0 and negative ones included, is a valid key, so occupancy is marked separately, never by
a sentinel key. Layout::

    buckets_NB   uint32 [NB]     one word per bucket: 0xFFFFFFFF empty, else a 30-bit code
                                 and 2 tag bits (the key's hash's low bits); code < C: the
                                 key's slot; C + j: new key #j of the running call (pending)
    rec_C2       int64 [C, 2]    per slot, side by side: its key (``slot_key``, a view) and
                                 a *meta* word: the step of its last access ("last_seen",
                                 ``steps_of``) in the high 32 bits (signed), and in the low
                                 32 bits the id of the last call that touched it: 0 a free
                                 slot, 1 a call the map has forgotten (ids wrap), >= 2 a call
    free_C       int32 [C]       stack of slots freed by evictions and ``remove`` (first
                                 ``n_free`` entries); slots from ``fresh`` on were never held

Slots are handed out from the free stack first, then the next fresh one. The free stack's
memory is never written until a slot is freed, so only its used depth (about one call's
evictions, in training) is ever backed by memory.

A bucket holds no key: a probe whose tag matches reads the slot's key (a pending entry's
from the call's list). Tags spare that read for 3 of 4 other keys it passes; the probe asks
for the slot's line a few keys ahead (``SLOTS_AHEAD``), once the home bucket it asked for
earlier has arrived, and the touch of the slot's step then writes the line just read.

Open addressing with linear probing from ``(fmix64(key ^ _MAP_TAG) >> 32) · NB >> 32`` (the
hash's top bits scaled to NB, so NB need not be a power of two); deletion is
backward-shift (no tombstones, so probe lengths never degrade). At most 50 % of the
buckets hold keys during a call (held and pending ones), 40 % in a full map, so probes stay
short; a call's new keys enter as *pending* entries during the call, which lets one pass
deduplicate repeated keys.

Eviction policy (exact, and what the tests' reference model implements):

- ``lookup(keys, step)`` requires ``step`` >= the step of every earlier ``lookup``; every
  distinct key of the call is *touched*: its last-access step becomes ``step``.
- If the call brings ``M`` keys that are not present and only ``F < M`` slots are free,
  exactly ``M - F`` present keys are evicted: the smallest by ``(last-access step, key as
  uint64)`` among the keys *not touched by this call*. Ties therefore never depend on slot
  layout, so a table restored from a checkpoint evicts exactly what the original would.
- If the call's distinct keys exceed the capacity, ``ValueError`` is raised and the map
  is unchanged.
- ``assign`` (rows put back by the spill tier or a checkpoint) follows the same rule with
  the call's keys protected, but sets each key's last-access step to the given value.

Finding the smallest keys is amortized: a scan of all slots collects a *pool* of the ``P``
oldest keys with last access < the scanning call's step (``P`` = max(needed, C/8)), sorted
by (step, key), and later calls take their victims from its front, passing over entries
touched since (their step changed) or freed; a call reads only the entries it takes or
passes over, never the whole pool. This is exact:
every key outside the pool is newer than every valid pool entry, because keys outside it
were newer at scan time, and touches and inserts only happen at steps >= the scan step.
``assign`` may insert rows of any age: one older than the scan step drops the pool. When no
key older than the current step remains, victims are chosen by an exact, uncached selection.

Costs: 26 bytes per slot (buckets 10, key and meta 16), plus the free stack's used depth
(what earlier layouts cost: docs/benchmarks-history.md, "Figures from module
docstrings"). A lookup is one probe per input key (repeats included), plus for its new keys a
second probe, and per evicted key a backward-shift deletion, which reads the key of each entry
it moves past (to find that entry's home); a pool scan (a selection and a sort of P entries)
reads the slot array once per ~C/8 evictions. Keys are not validated beyond dtype
and shape (hot path).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

# The numba-callable murmur3 finalizer of THE hashing module (one definition of the mixer).
from recsys.features.hashing import fmix
from recsys.store.host import pages
from recsys.store.host.prefetch import KEYS_AHEAD, prefetch

__all__ = ["KeyMap", "MapUpdate", "FrequencySketch", "as_keys", "distinct", "has_repeats",
           "merge_sketch_states"]

_CODE_BITS = 30
_CODE_MASK = (1 << _CODE_BITS) - 1
_TAG_FIELD = 0xFFFFFFFF & ~_CODE_MASK
_TAG_BITS = np.uint64(0xFFFFFFFF >> _CODE_BITS)
_EMPTY = 0xFFFFFFFF
SLOTS_AHEAD = KEYS_AHEAD // 2
"""How many keys ahead the probe reads a home bucket (asked for ``KEYS_AHEAD`` keys ahead)
and asks for the slot it names, so the key check finds that slot's line cached."""
_RING = 1 << KEYS_AHEAD.bit_length()  # a power of two above KEYS_AHEAD
_MAP_TAG = np.uint64(0x2545F4914F6CDD1D)
_SKETCH_TAG = np.uint64(0x94D049BB133111EB)
_INT64_MIN = np.iinfo(np.int64).min
_CALL_ID_MAX = np.iinfo(np.int32).max
_CALL_FIELD = np.int64(0xFFFFFFFF)
"""The low half of a slot's meta word: the id of the last call that touched it."""
_STEP_FIELD = np.int64(-(1 << 32))
"""The high half of a slot's meta word: its last-access step, signed."""
_FREE_CALL = 0
"""A free slot's call field (fresh memory reads as free)."""
_OLD_CALL = 1
"""A held slot's call field once the map has forgotten the call that touched it."""
STEP_MIN, STEP_MAX = -(2**31), 2**31 - 1
"""The steps a map can store (32 bits of the meta word)."""
BUCKETS_PER_SLOT = 2.5
"""Hash buckets per slot (> 2: see ``KeyMap.__init__``). A full map's probes then read 1.33
buckets for a held key and 1.9 for an absent one (linear probing at 40 % load); fewer buckets
make a lookup dearer, more make it cheaper, at 2 bytes a slot per 0.5 (the trade-off as
measured: docs/benchmarks-history.md, "Figures from module docstrings")."""
MAX_CAPACITY = 2**29 - 1
"""Slots one map holds at most: a bucket's 30-bit code names any of them or of a call's pending
keys (codes below 2·C, short of the empty word's), and the buckets (``BUCKETS_PER_SLOT`` a
slot) number below 2**32 for the home bucket's scaling."""


class MapUpdate(NamedTuple):
    """What a ``lookup`` or ``assign`` did: slots of the keys, new keys, evicted keys."""

    slots_N: np.ndarray
    """Slot of each input key (int64)."""
    new_keys_M: np.ndarray
    """Keys that were not present, in first-appearance order."""
    new_slots_M: np.ndarray
    """Slots given to ``new_keys_M``."""
    evicted_keys_K: np.ndarray
    """Keys evicted to make room (a set: in no particular order)."""
    evicted_slots_K: np.ndarray
    """Slots they held (now held by new keys: read their rows before overwriting them)."""
    evicted_steps_K: np.ndarray
    """Their last-access steps."""
    hits: int
    """Input positions whose key was present before the call."""


# --------------------------------------------------------------------------- kernels


@njit(inline="always")
def _hash(key):
    """Return the map's 64-bit hash of ``key``."""
    return fmix(np.uint64(key) ^ _MAP_TAG)


@njit(inline="always")
def _home_of(hv, nb_u):
    """Return the home bucket of hash ``hv`` among ``nb_u`` (< 2**32) buckets: the hash's top
    32 bits scaled to the bucket count (a multiply and a shift, for any count)."""
    return np.int64(((hv >> np.uint64(32)) * nb_u) >> np.uint64(32))


@njit(inline="always")
def _tag_of(hv):
    """Return the bucket word's tag bits for hash ``hv`` (its low bits, in place)."""
    return np.int64(hv & _TAG_BITS) << _CODE_BITS


@njit(inline="always")
def _home(key, nb_u):
    return _home_of(_hash(key), nb_u)


@njit(inline="always")
def _next(h, nb):
    """Return the bucket after ``h`` (linear probing, wrapping at ``nb``)."""
    h += 1
    return h if h < nb else np.int64(0)


@njit(inline="always")
def _code_key(rec, pend_keys, capacity, code):
    """Return the key of a bucket's code: a held slot's, or a pending entry's."""
    return rec[code, 0] if code < capacity else pend_keys[code - capacity]


@njit(inline="always")
def _bucket_of(buckets, rec, key, nb, nb_u, capacity):
    """Return the bucket holding ``key`` in a slot (-1: absent; pending entries are skipped)."""
    return _bucket_at(buckets, rec, key, _hash(key), nb, nb_u, capacity)


@njit(inline="always")
def _bucket_at(buckets, rec, key, hv, nb, nb_u, capacity):
    """``_bucket_of`` for a key whose hash ``hv`` is known."""
    h = _home_of(hv, nb_u)
    tag = _tag_of(hv)
    while True:
        word = np.int64(buckets[h])
        if word == _EMPTY:
            return np.int64(-1)
        if (word & _TAG_FIELD) == tag:
            code = word & _CODE_MASK
            if code < capacity and rec[code, 0] == key:
                return h
        h = _next(h, nb)


@njit(inline="always")
def _slot_of(buckets, rec, key, nb, nb_u, capacity):
    """Return the slot of ``key`` (-1: absent)."""
    b = _bucket_of(buckets, rec, key, nb, nb_u, capacity)
    return np.int64(-1) if b < 0 else np.int64(buckets[b]) & _CODE_MASK


# The read-ahead of the probe and of ``find``. Each kernel allocates its ring of hashes
# itself: a helper that allocated and returned it made both kernels markedly slower.
@njit(inline="always")
def _ask_home(buckets, hashes, keys, j, nb_u):
    """Hash key ``j`` into the ring ``hashes`` (position mod ``_RING``) and ask for its home
    bucket's line (``KEYS_AHEAD`` keys before its probe)."""
    hv = _hash(keys[j])
    hashes[j & (_RING - 1)] = hv
    prefetch(buckets, _home_of(hv, nb_u))


@njit(inline="always")
def _ask_slot(buckets, rec, hashes, j, nb_u, capacity):
    """Ask for the line of the slot that key ``j``'s home bucket names (the bucket, asked for
    earlier, is cached by now); return that slot (-1: none)."""
    word = np.int64(buckets[_home_of(hashes[j & (_RING - 1)], nb_u)])
    if word != _EMPTY and (word & _CODE_MASK) < capacity:
        prefetch(rec, word & _CODE_MASK)
        return word & _CODE_MASK
    return np.int64(-1)


@njit(nogil=True, cache=True)
def _find_kernel(buckets, rec, capacity, keys, out):
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    n = keys.shape[0]
    hashes = np.empty(_RING, dtype=np.uint64)  # of the keys KEYS_AHEAD on, by position mod _RING
    for i in range(min(KEYS_AHEAD, n)):
        _ask_home(buckets, hashes, keys, i, nb_u)
    for i in range(n):
        if i + KEYS_AHEAD < n:
            _ask_home(buckets, hashes, keys, i + KEYS_AHEAD, nb_u)
        if i + SLOTS_AHEAD < n:
            _ask_slot(buckets, rec, hashes, i + SLOTS_AHEAD, nb_u, capacity)
        b = _bucket_at(buckets, rec, keys[i], hashes[i & (_RING - 1)], nb, nb_u, capacity)
        out[i] = -1 if b < 0 else np.int64(buckets[b]) & _CODE_MASK


@njit(nogil=True, cache=True)
def _find_hinted_kernel(buckets, rec, capacity, keys, hints, out):
    """``_find_kernel`` that first tries each key's hinted slot (one read instead of a probe)."""
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    for i in range(keys.shape[0]):
        s = hints[i]
        if s >= 0 and (rec[s, 1] & _CALL_FIELD) != _FREE_CALL and rec[s, 0] == keys[i]:
            out[i] = s
        else:
            out[i] = _slot_of(buckets, rec, keys[i], nb, nb_u, capacity)


@njit(nogil=True, cache=True)
def _probe_kernel(buckets, rec, keys, call_id, capacity, out, pend_keys):
    """Resolve present keys, enter absent ones as pending; return (pending, distinct hits,
    hit positions, overflow). Stops early on overflow (the caller removes the pending)."""
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    n_pend = 0
    n_hit = 0
    n_hit_pos = 0
    n = keys.shape[0]
    hashes = np.empty(_RING, dtype=np.uint64)  # of the keys KEYS_AHEAD on, by position mod _RING
    for i in range(min(KEYS_AHEAD, n)):
        _ask_home(buckets, hashes, keys, i, nb_u)
    for i in range(n):
        if i + KEYS_AHEAD < n:
            _ask_home(buckets, hashes, keys, i + KEYS_AHEAD, nb_u)
        if i + SLOTS_AHEAD < n:
            _ask_slot(buckets, rec, hashes, i + SLOTS_AHEAD, nb_u, capacity)
        key = keys[i]
        hv = hashes[i & (_RING - 1)]
        h = _home_of(hv, nb_u)
        tag = _tag_of(hv)
        n_probe = 0
        while True:
            word = np.int64(buckets[h])
            if word == _EMPTY:
                if n_hit + n_pend >= capacity:
                    return n_pend, n_hit, n_hit_pos, True
                buckets[h] = tag | (capacity + n_pend)
                pend_keys[n_pend] = key
                out[i] = -2 - n_pend
                n_pend += 1
                break
            if (word & _TAG_FIELD) == tag:
                code = word & _CODE_MASK
                if code < capacity:
                    if rec[code, 0] == key:
                        out[i] = code
                        n_hit_pos += 1
                        meta = rec[code, 1]
                        if (meta & _CALL_FIELD) != call_id:
                            rec[code, 1] = (meta & _STEP_FIELD) | call_id
                            n_hit += 1
                            if n_hit + n_pend > capacity:
                                return n_pend, n_hit, n_hit_pos, True
                        break
                elif pend_keys[code - capacity] == key:
                    out[i] = -2 - (code - capacity)
                    break
            h = _next(h, nb)
            n_probe += 1
            if n_probe >= nb:  # every bucket is taken: only possible past capacity
                return n_pend, n_hit, n_hit_pos, True
    return n_pend, n_hit, n_hit_pos, False


@njit(nogil=True)
def _delete_at(buckets, rec, pend_keys, capacity, i):
    """Empty bucket ``i`` by backward-shift deletion."""
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    j = i
    while True:
        j = _next(j, nb)
        word = np.int64(buckets[j])
        if word == _EMPTY:
            break
        k = _home(_code_key(rec, pend_keys, capacity, word & _CODE_MASK), nb_u)
        # the entry at j may fill the hole at i unless its home lies cyclically in (i, j]
        if i <= j:
            stays = i < k <= j
        else:
            stays = k > i or k <= j
        if not stays:
            buckets[i] = buckets[j]
            i = j
    buckets[i] = _EMPTY


@njit(nogil=True)
def _delete_code(buckets, rec, pend_keys, capacity, key, code):
    """Remove the entry of ``key`` whose code is ``code`` (present)."""
    nb = np.int64(buckets.shape[0])
    hv = _hash(key)
    h = _home_of(hv, np.uint64(nb))
    want = _tag_of(hv) | code
    while np.int64(buckets[h]) != want:
        h = _next(h, nb)
    _delete_at(buckets, rec, pend_keys, capacity, h)


@njit(nogil=True, cache=True)
def _delete_pending_kernel(buckets, rec, pend_keys, n, capacity):
    for j in range(n):
        _delete_code(buckets, rec, pend_keys, capacity, pend_keys[j], capacity + j)


@njit(nogil=True, cache=True)
def _commit_kernel(buckets, rec, capacity, pend_keys, n_pend, free, n_free, fresh, call_id,
                   steps, per_key_step, out, new_slots):
    """Give pending keys free slots (the free stack's first, then fresh ones), then set every
    input key's slot and last-access step; return (free stack depth, first fresh slot)."""
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    for j in range(n_pend):
        if n_free > 0:
            n_free -= 1
            s = np.int64(free[n_free])
        else:
            s = fresh
            fresh += 1
        key = pend_keys[j]
        hv = _hash(key)
        h = _home_of(hv, nb_u)
        tag = _tag_of(hv)
        want = tag | (capacity + j)
        while np.int64(buckets[h]) != want:
            h = _next(h, nb)
        buckets[h] = tag | s
        rec[s, 0] = key
        rec[s, 1] = call_id
        new_slots[j] = s
    step = steps[0]
    for i in range(out.shape[0]):
        c = out[i]
        if c <= -2:
            c = new_slots[-2 - c]
            out[i] = c
        rec[c, 1] = ((steps[i] if per_key_step else step) << 32) | (rec[c, 1] & _CALL_FIELD)
    return n_free, fresh


@njit(nogil=True, cache=True)
def _evict_kernel(buckets, rec, capacity, pend_keys, victims, free, n_free,
                  out_keys, out_steps, out_slots, n_out):
    nb_u = np.uint64(buckets.shape[0])
    n = victims.shape[0]
    for t in range(n):
        if t + KEYS_AHEAD < n:
            prefetch(rec, victims[t + KEYS_AHEAD])
        if t + SLOTS_AHEAD < n:  # its slot is cached by now: ask for the key's home bucket
            prefetch(buckets, _home(rec[victims[t + SLOTS_AHEAD], 0], nb_u))
        s = victims[t]
        key = rec[s, 0]
        out_keys[n_out] = key
        out_steps[n_out] = rec[s, 1] >> 32
        out_slots[n_out] = s
        n_out += 1
        _delete_code(buckets, rec, pend_keys, capacity, key, s)
        rec[s, 1] &= _STEP_FIELD  # free; its key and step stay readable until reused
        free[n_free] = s
        n_free += 1
    return n_free, n_out


@njit(nogil=True, cache=True)
def _remove_kernel(buckets, rec, capacity, keys, free, n_free, out):
    nb = np.int64(buckets.shape[0])
    nb_u = np.uint64(nb)
    no_pending = np.empty(0, dtype=np.int64)
    for i in range(keys.shape[0]):
        b = _bucket_of(buckets, rec, keys[i], nb, nb_u, capacity)
        if b < 0:
            out[i] = -1
            continue
        code = np.int64(buckets[b]) & _CODE_MASK
        out[i] = code
        _delete_at(buckets, rec, no_pending, capacity, b)
        rec[code, 1] &= _STEP_FIELD  # free; its key and step stay readable until reused
        free[n_free] = code
        n_free += 1
    return n_free


@njit(nogil=True, cache=True)
def _candidates_kernel(rec, n_slots, call_id, limited, step_limit):
    """Return the held slots below ``n_slots`` not touched by this call (with step <
    step_limit if limited)."""
    n = 0
    for s in range(n_slots):
        if _candidate(rec[s, 1], call_id, limited, step_limit):
            n += 1
    out = np.empty(n, dtype=np.int64)
    n = 0
    for s in range(n_slots):
        if _candidate(rec[s, 1], call_id, limited, step_limit):
            out[n] = s
            n += 1
    return out


@njit(inline="always")
def _candidate(meta, call_id, limited, step_limit):
    call = meta & _CALL_FIELD
    return call != _FREE_CALL and call != call_id and (not limited or (meta >> 32) < step_limit)


@njit(nogil=True, cache=True)
def _pool_take_kernel(pool_slots, pool_steps, pos, want, rec, call_id, out):
    """Walk the pool, sorted by (step, key), from ``pos``: put its first ``want`` entries that
    are still valid (held, untouched since the scan, not in this call) into ``out``; return
    (how many, the position after the last entry read). An entry passed over never becomes
    valid again: a touch or an insert writes a step >= the scan's limit, above its old one."""
    n = 0
    while pos < pool_slots.shape[0] and n < want:
        s = pool_slots[pos]
        meta = rec[s, 1]
        call = meta & _CALL_FIELD
        if call != _FREE_CALL and (meta >> 32) == pool_steps[pos] and call != call_id:
            out[n] = s
            n += 1
        pos += 1
    return n, pos


# --------------------------------------------------------------------------- the map


def commit_pages(zeroed: np.ndarray, page: int = 4096) -> None:
    """Write a zero byte every ``page`` bytes of the all-zero array ``zeroed``, so the kernel
    backs all of it with memory now rather than at the first write of each page (a read
    would not: untouched pages of ``np.zeros`` read as the shared zero page)."""
    flat = zeroed.reshape(-1).view(np.uint8)  # a view: C-contiguous, as every array here
    flat[::page] = 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


class KeyMap:
    """Return slots for 64-bit keys, inserting absent keys and evicting LRU keys (see module doc)."""

    def __init__(self, capacity: int, *, pool_fraction: float = 0.125, huge_pages: bool = False) -> None:
        """``huge_pages``: the buckets and per-slot arrays on 2 MiB pages (``recsys.store.host.pages``)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, found {capacity}")
        if capacity > MAX_CAPACITY:
            raise ValueError(f"capacity must be <= {MAX_CAPACITY} slots per map, found {capacity}")
        self.capacity = int(capacity)
        # > 2·C: during a call, C held keys plus up to C pending ones still leave an empty
        # bucket, which every probe and backward shift needs to stop (any count will do: the
        # home bucket is scaled, not masked)
        self._buckets = pages.zeros(int(BUCKETS_PER_SLOT * self.capacity) + 1, np.uint32, huge_pages)
        self._buckets[:] = _EMPTY
        # (key, meta word) of each slot side by side: a probe's key check, its touch and
        # the step's write read one cache line
        self._rec = pages.zeros((self.capacity, 2), np.int64, huge_pages)
        self.slot_key = self._rec[:, 0]
        """Key held by each slot (a view)."""
        # freed slots, reused first (last freed, first reused); written only as slots are
        # freed, so untouched pages stay unbacked
        self._free = pages.zeros(self.capacity, np.int32, huge_pages)
        self._n_free = 0
        self._fresh = 0  # slots from here on were never held: handed out in ascending order
        self.departures = 0
        """How many calls may have taken keys out of their slots (evictions, ``remove``). While
        it is unchanged, every key still holds the slot it had: inserts only take free slots."""
        self._call_id = _OLD_CALL  # the first call's id is the next one
        self._clock = 0
        self._has_clock = False
        self._pool_target = max(1, int(self.capacity * pool_fraction))
        self._drop_pool()

    def commit_pages(self) -> None:
        """Back the per-slot array with memory now (see ``store.host.prefault``); the
        buckets are written in full at construction already, and the free stack is
        backed as it fills."""
        commit_pages(self._rec)

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Return the number of keys held."""
        return self._fresh - self._n_free

    def _n_open(self) -> int:
        """Return the number of free slots (freed ones and never-held ones)."""
        return self._n_free + self.capacity - self._fresh

    def steps_of(self, slots: np.ndarray) -> np.ndarray:
        """Return the last-access step (int64) of each of ``slots`` (held slots)."""
        return self._rec[slots, 1] >> 32

    @property
    def clock(self) -> int | None:
        """Return the step of the latest ``lookup`` (None before the first)."""
        return self._clock if self._has_clock else None

    def find(self, keys_N: np.ndarray, hints_N: np.ndarray | None = None,
             hints_departures: int | None = None) -> np.ndarray:
        """Return the slot of each key, -1 where absent; touches nothing.

        ``hints_N``: a slot each key probably still holds (say, from its lookup; -1: none),
        checked first: a right hint saves the hash probe, a wrong one costs one read.
        ``hints_departures``: ``departures`` when the hints were this map's slots of these
        keys; if no key left its slot since and every key had one, the hints are returned
        as they are, unread (the caller's own array when it is already int64 and contiguous)."""
        keys = as_keys(keys_N)
        if hints_N is not None:
            hints = np.ascontiguousarray(hints_N, dtype=np.int64)
            if hints.shape != keys.shape:
                raise ValueError(f"find: {keys.shape[0]} keys but hints of shape {hints.shape}")
            if hints_departures == self.departures and (hints.shape[0] == 0 or hints.min() >= 0):
                return hints
        out = np.empty(keys.shape[0], dtype=np.int64)
        if hints_N is None:
            _find_kernel(self._buckets, self._rec, self.capacity, keys, out)
        else:
            _find_hinted_kernel(self._buckets, self._rec, self.capacity, keys, hints, out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (keys, slots, last-access steps) of every held key, in slot order."""
        slots = np.flatnonzero(self._rec[: self._fresh, 1] & _CALL_FIELD).astype(np.int64)
        return self.slot_key[slots], slots, self.steps_of(slots)

    # ------------------------------------------------------------------ updates

    def lookup(self, keys_N: np.ndarray, step: int) -> MapUpdate:
        """Return the slots of ``keys_N`` at ``step``, inserting absent keys (LRU eviction).

        ``step`` may not be below an earlier lookup's (the clock belongs to this object: a
        map rebuilt from a checkpoint starts without one). Repeated keys are fine."""
        step = int(step)
        _check_steps(step, step, "lookup")
        if self._has_clock and step < self._clock:
            raise ValueError(
                f"lookup step {step} is before the previous lookup's step {int(self._clock)}; "
                "steps must not decrease"
            )
        update = self._place(as_keys(keys_N), np.array([step], dtype=np.int64), False, step)
        self._clock = step
        self._has_clock = True
        return update

    def assign(self, keys_N: np.ndarray, steps_N: np.ndarray) -> MapUpdate:
        """Return the slots of ``keys_N`` (inserted if absent) with last-access ``steps_N``."""
        keys = as_keys(keys_N)
        steps = np.ascontiguousarray(steps_N, dtype=np.int64)
        if steps.shape != keys.shape:
            raise ValueError(f"assign needs one step per key: {keys.shape[0]} keys, steps shape {steps.shape}")
        if keys.shape[0] == 0:
            return self._place(keys, np.zeros(1, dtype=np.int64), False, None)
        oldest = int(steps.min())
        _check_steps(oldest, int(steps.max()), "assign")
        if oldest < self._pool_limit:
            self._drop_pool()  # rows older than the pool's scan arrive: its order no longer holds
        limit = min(oldest, int(self._clock)) if self._has_clock else None
        return self._place(keys, steps, True, limit)

    def remove(self, keys_N: np.ndarray) -> np.ndarray:
        """Remove keys; return the slot each held (-1 where absent). Slots become free; their
        keys and steps stay readable (``slot_key``, ``steps_of``) until a new key takes them."""
        keys = as_keys(keys_N)
        out = np.empty(keys.shape[0], dtype=np.int64)
        self.departures += 1
        self._n_free = int(
            _remove_kernel(self._buckets, self._rec, self.capacity, keys, self._free, self._n_free, out)
        )
        return out

    # ------------------------------------------------------------------ internals

    def _place(self, keys: np.ndarray, steps: np.ndarray, per_key: bool, limit: int | None) -> MapUpdate:
        """Place ``keys``; victims older than ``limit`` may come from the pool (None: exact scan)."""
        if self._call_id == _CALL_ID_MAX:  # the int32 call ids wrap: forget every earlier call
            meta = self._rec[: self._fresh, 1]
            held = (meta & _CALL_FIELD) != _FREE_CALL
            meta[held] = (meta[held] & _STEP_FIELD) | _OLD_CALL
            self._call_id = _OLD_CALL
        self._call_id += 1
        call_id = self._call_id
        n = keys.shape[0]
        out = np.empty(n, dtype=np.int64)
        pend = np.empty(min(n, self.capacity), dtype=np.int64)
        n_pend, n_hit, n_hit_pos, overflow = _probe_kernel(
            self._buckets, self._rec, keys, call_id, self.capacity, out, pend
        )
        if overflow:
            _delete_pending_kernel(self._buckets, self._rec, pend, n_pend, self.capacity)
            distinct_keys = distinct(keys).shape[0]
            raise ValueError(
                f"a call touches {distinct_keys} distinct keys but the map holds at most {self.capacity}; "
                "raise the table's capacity or send smaller batches"
            )
        need = n_pend - self._n_open()
        ev_keys = np.empty(max(need, 0), dtype=np.int64)
        ev_steps = np.empty(max(need, 0), dtype=np.int64)
        ev_slots = np.empty(max(need, 0), dtype=np.int64)
        if need > 0:
            got = self._evict(need, limit, call_id, pend, ev_keys, ev_steps, ev_slots)
            if got != need:  # cannot happen: the probe counted the call's distinct keys
                raise RuntimeError(f"internal error: evicted {got} keys, needed {need}")
        new_slots = np.empty(n_pend, dtype=np.int64)
        n_free, fresh = _commit_kernel(
            self._buckets, self._rec, self.capacity, pend, n_pend, self._free, self._n_free, self._fresh,
            call_id, steps, per_key, out, new_slots,
        )
        self._n_free, self._fresh = int(n_free), int(fresh)
        return MapUpdate(out, pend[:n_pend].copy(), new_slots, ev_keys, ev_slots, ev_steps, int(n_hit_pos))

    def _evict(self, need: int, limit: int | None, call_id: int, pend, ev_keys, ev_steps, ev_slots) -> int:
        """Evict ``need`` keys by the policy; return how many were evicted.

        Pool entries are only valid while every write since its scan had a step >= the
        scan's ``limit``; lookups guarantee it, ``assign`` drops the pool otherwise. ``pend``:
        the call's pending keys (backward shifts read the keys of the entries they move)."""
        got = 0
        while got < need and limit is not None:
            if self._pool_pos == self._pool_slots.shape[0] and not self._refill_pool(need - got, limit, call_id):
                break
            victims = np.empty(need - got, dtype=np.int64)
            n, self._pool_pos = _pool_take_kernel(
                self._pool_slots, self._pool_steps, self._pool_pos, need - got, self._rec, call_id, victims,
            )
            # in slot order, as a selection from the slot-ordered scan gave them: the free
            # stack, so the slots new keys get, stay what they always were
            got = self._evict_slots(np.sort(victims[:n]), got, pend, ev_keys, ev_steps, ev_slots)
        if got < need:
            # No key older than this step is left (or rows of any age were assigned): pick
            # exactly, among all keys this call did not touch.
            cand = _candidates_kernel(self._rec, self._fresh, call_id, False, 0)
            chosen = self._oldest(cand, need - got)
            got = self._evict_slots(cand if chosen is None else cand[chosen], got, pend, ev_keys, ev_steps, ev_slots)
        return got

    def _evict_slots(self, victims: np.ndarray, got: int, pend, ev_keys, ev_steps, ev_slots) -> int:
        self.departures += 1
        self._n_free, got = _evict_kernel(
            self._buckets, self._rec, self.capacity, pend, np.ascontiguousarray(victims),
            self._free, self._n_free, ev_keys, ev_steps, ev_slots, got,
        )
        self._n_free = int(self._n_free)
        return int(got)

    def _refill_pool(self, need: int, limit: int, call_id: int) -> bool:
        self._drop_pool()
        cand = _candidates_kernel(self._rec, self._fresh, call_id, True, limit)
        if cand.shape[0] == 0:
            return False
        chosen = self._oldest(cand, max(need, self._pool_target))
        pool = cand if chosen is None else cand[chosen]
        steps = self.steps_of(pool)
        order = np.lexsort((self.slot_key[pool].view(np.uint64), steps))  # by (step, key as uint64)
        self._pool_slots = np.ascontiguousarray(pool[order])
        self._pool_steps = np.ascontiguousarray(steps[order])
        self._pool_pos = 0
        self._pool_limit = limit
        return True

    def _oldest(self, cand: np.ndarray, m: int) -> np.ndarray | None:
        """Return a mask of the ``m`` entries of ``cand`` with the smallest (step, key as
        uint64), or None when that is all of them. Selection, not sorting: O(len(cand))."""
        if cand.shape[0] <= m:
            return None
        steps = self.steps_of(cand)
        threshold = np.partition(steps, m - 1)[m - 1]
        mask = steps < threshold
        rest = m - int(np.count_nonzero(mask))  # >= 1 by the choice of threshold
        tied = np.flatnonzero(steps == threshold)
        if rest < tied.shape[0]:
            tied_keys = self.slot_key[cand[tied]].view(np.uint64)
            tied = tied[np.argpartition(tied_keys, rest - 1)[:rest]]
        mask[tied] = True
        return mask

    def _drop_pool(self) -> None:
        self._pool_slots = np.empty(0, dtype=np.int64)
        self._pool_steps = np.empty(0, dtype=np.int64)
        self._pool_pos = 0  # entries before it are used up
        self._pool_limit = _INT64_MIN


def _check_steps(lo: int, hi: int, what: str) -> None:
    if lo < STEP_MIN or hi > STEP_MAX:
        bad = lo if lo < STEP_MIN else hi
        raise ValueError(f"{what}: step {bad} is outside [{STEP_MIN}, {STEP_MAX}], the steps a key map stores "
                         "(32 bits)")


def as_keys(keys) -> np.ndarray:
    """Return ``keys`` as a contiguous 1-D int64 array (uint64 input is reinterpreted)."""
    keys = np.ascontiguousarray(keys)
    if keys.ndim != 1:
        raise ValueError(f"keys must be a 1-D array, found shape {keys.shape}")
    if keys.dtype == np.uint64:
        return keys.view(np.int64)
    if keys.dtype != np.int64:
        if keys.dtype.kind not in "iu" and keys.shape[0] > 0:
            raise TypeError(f"keys must be int64 (uint64 bit patterns), found dtype {keys.dtype}")
        keys = keys.astype(np.int64)
    return keys


def distinct(values: np.ndarray) -> np.ndarray:
    """Return the distinct values of a 1-D array, sorted: one sort and one pass.

    Not ``np.unique(values)``: numpy 2.4 (the one installed) finds distinct values by
    hashing, many times slower than one sort on random 64-bit keys (the figures:
    docs/benchmarks-history.md, "Figures from module docstrings")."""
    values = np.sort(np.asarray(values).reshape(-1))
    if values.shape[0] < 2:
        return values
    keep = np.empty(values.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def has_repeats(values: np.ndarray) -> bool:
    """Return whether a 1-D array holds some value twice: one pass when it is strictly
    increasing (rows a ``state_dict`` wrote), a sort otherwise."""
    values = np.asarray(values).reshape(-1)
    if values.shape[0] < 2 or bool((values[1:] > values[:-1]).all()):
        return False
    values = np.sort(values)
    return bool((values[1:] == values[:-1]).any())


# --------------------------------------------------------------------------- admission


@njit(nogil=True, cache=True)
def _sketch_kernel(cells, keys, cap, commit, out):
    """Per key: estimated count after one more sighting; with ``commit``, record it.

    Count-min with conservative update: a sighting raises only the key's smallest cells,
    so estimates overshoot less. Returns the number of sightings recorded."""
    depth = cells.shape[0]
    mask_u = np.uint64(cells.shape[1] - 1)
    for i in range(keys.shape[0]):
        h = fmix(np.uint64(keys[i]) ^ _SKETCH_TAG)
        h1 = h & np.uint64(0xFFFFFFFF)
        h2 = (h >> np.uint64(32)) | np.uint64(1)
        est = np.int64(255)
        for r in range(depth):
            c = np.int64(cells[r, np.int64((h1 + np.uint64(r) * h2) & mask_u)])
            if c < est:
                est = c
        new = min(est + 1, cap)
        out[i] = new
        if commit:
            for r in range(depth):
                idx = np.int64((h1 + np.uint64(r) * h2) & mask_u)
                if cells[r, idx] < new:
                    cells[r, idx] = new
    return keys.shape[0] if commit else 0


class FrequencySketch:
    """Return approximate sighting counts of keys in bounded memory (count-min, aging).

    ``depth`` rows of ``width`` saturating uint8 counters (capped at ``cap``), conservative
    update. Estimates never undercount within an aging period: a key is admitted no later
    than its ``cap``-th sighting, possibly earlier when it shares every cell with other keys
    (probability ~ (load / width)^depth). Aging: after ``10 · width`` recorded sightings,
    every counter is halved (TinyLFU's reset), so counts reflect recent traffic and a long
    run cannot saturate the sketch.
    """

    def __init__(self, width: int, cap: int, depth: int = 4) -> None:
        if not 1 <= cap <= 255:
            raise ValueError(f"cap must be in [1, 255], found {cap}")
        self.width = _next_pow2(max(int(width), 64))
        self.cap = int(cap)
        self.cells = np.zeros((depth, self.width), dtype=np.uint8)
        self.recorded = 0
        self.reset_every = 10 * self.width

    def estimate_next(self, keys_N: np.ndarray) -> np.ndarray:
        """Return each key's count if it were seen once more now (nothing recorded)."""
        keys = as_keys(keys_N)
        out = np.empty(keys.shape[0], dtype=np.int64)
        _sketch_kernel(self.cells, keys, self.cap, False, out)
        return out

    def add(self, keys_N: np.ndarray) -> np.ndarray:
        """Record one sighting per key; return each key's count after its sighting."""
        keys = as_keys(keys_N)
        out = np.empty(keys.shape[0], dtype=np.int64)
        self.recorded += int(_sketch_kernel(self.cells, keys, self.cap, True, out))
        if self.recorded >= self.reset_every:
            self.cells >>= 1
            self.recorded = 0
        return out

    def state(self) -> dict[str, np.ndarray | int]:
        """Return the sketch's state (cells and the aging counter), copied."""
        return {"cells": self.cells.copy(), "recorded": self.recorded}

    def load_state(self, state: dict) -> None:
        """Restore ``state()`` output of a sketch of the same shape (e.g. the same shard)."""
        cells = np.asarray(state["cells"], dtype=np.uint8)
        if cells.shape != self.cells.shape:
            raise ValueError(f"sketch state has shape {cells.shape}, this sketch {self.cells.shape}")
        self.cells[...] = cells
        self.recorded = int(state["recorded"])


def merge_sketch_states(states: list[dict], width: int, cap: int) -> dict:
    """Return one ``FrequencySketch`` state of ``width`` columns that never undercounts any
    key of the sketches in ``states`` (e.g. the shards of a table saved at another world size).

    Each cell is the sum of the cells that hash to it, saturated at ``cap``: a key's cells
    in every input are at least its count there (count-min with conservative update keeps
    that), so their sum is at least its count in any one input. Widths are powers of two
    and a key's column is its hash modulo the width, so a wider input folds (column j
    collects every j' with j' mod width = j) and a narrower one repeats (column j reads
    j mod its width). The aging counter starts over (the next halving comes a full period
    later, which only keeps counts longer). ``step`` / ``step_keys``: the latest step of
    the inputs and the union of their keys at that step (``EmbeddingTable.admission_state``).
    Overcounts: each key also sees the other inputs' counts in its cells, like a hash
    collision, so a key may be admitted before its ``cap``-th sighting, never after.
    """
    if not states:
        raise ValueError("merge_sketch_states: no states")
    width = int(width)
    if width <= 0 or width & (width - 1):
        raise ValueError(f"merge_sketch_states: width must be a power of two, found {width}")
    depth = np.asarray(states[0]["cells"]).shape[0]
    out = np.zeros((depth, width), dtype=np.int64)
    for s in states:
        cells = np.asarray(s["cells"], dtype=np.int64)
        d, w = cells.shape
        if d != depth or w <= 0 or w & (w - 1):
            raise ValueError(f"merge_sketch_states: a sketch of shape {cells.shape}, expected ({depth}, 2^k)")
        if w == width:
            out += cells
        elif w > width:
            out += cells.reshape(depth, w // width, width).sum(axis=1)
        else:
            out += np.tile(cells, (1, width // w))
    step = max(int(s.get("step", -1)) for s in states)
    at_step = [np.asarray(s.get("step_keys", ()), dtype=np.int64) for s in states if int(s.get("step", -1)) == step]
    keys = distinct(np.concatenate(at_step)) if at_step else np.empty(0, dtype=np.int64)
    return {"cells": np.minimum(out, int(cap)).astype(np.uint8), "recorded": 0, "step": step,
            "step_keys": keys if step >= 0 else keys[:0]}
