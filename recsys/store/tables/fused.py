"""One kernel call per phase for all of a store's plain tables.

A lookup and its push do the same few steps in every table: find or insert the keys
(``reserve``), read their rows (``read``), apply the optimizer (``apply``). Done a table
at a time, each step is a handful of numpy and numba calls of a few microseconds each; over
26 tables that was ~1.3 ms a step of Python between kernels (measured at batch 4096). A
``TableGroup`` holds the arrays of every table (numba typed lists) and runs each step for
all of them in one kernel call, which calls the same per-table kernels the tables use
(``recsys.store.tables.keymap``, ``recsys.store.tables.initial``, ``recsys.store.tables.optim``), so the numbers
are the tables' own, bit for bit.

Only the common case is taken: a *plain* table (``EmbeddingTable`` itself, float32 rows,
row-wise Adagrad, no spill tier, no ``on_evict``, no admission, nothing watching its writes)
whose call needs no eviction (at least as many free slots as keys) and whose step does not
run backwards; ``apply`` takes a table only while the slots its ``reserve`` gave are still
its keys' (``KeyMap.departures`` unchanged). Every other call is left to the table's own
methods: the group returns which, and the store runs them as before. A group exists only
when every table of the store is plain (``TableGroup.of``).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.typed import List

from recsys.store.tables.initial import init_kernel
from recsys.store.tables.keymap import _CALL_ID_MAX, STEP_MAX, STEP_MIN, _commit_kernel, _delete_pending_kernel, _probe_kernel
from recsys.store.tables.optim import _rowwise_adagrad_kernel
from recsys.store.tables.table import EmbeddingTable, _fill_rows_kernel, _gather_kernel

__all__ = ["TableGroup"]


@njit(nogil=True, cache=True)
def _reserve_kernel(which, lo, hi, buckets, rec, free, caps, call_ids, n_free, fresh, keys, step1,
                    slots, pend, new_slots, n_pend, n_hit_pos, weights, states, salts, bounds, state_init):
    """For each table ``which[j]``: ``KeyMap.lookup`` of ``keys[lo[j]:hi[j]]`` at step
    ``step1[0]`` (probe, then commit), then the new keys' initial rows and state
    (``EmbeddingTable._init_rows``). A table whose new keys outnumber its free slots (an
    eviction is needed) or its capacity gets its pending entries removed again and
    ``n_pend[j] = -1``: the map is as before but for its touched marks of call ``call_ids[j]``."""
    for j in range(which.shape[0]):
        t, a, b = which[j], lo[j], hi[j]
        out, pe = slots[a:b], pend[a:b]
        n_p, _n_hit, n_hp, overflow = _probe_kernel(buckets[t], rec[t], keys[a:b], call_ids[j], caps[t], out, pe)
        if overflow or n_p > n_free[j] + caps[t] - fresh[j]:
            _delete_pending_kernel(buckets[t], rec[t], pe, n_p, caps[t])
            n_pend[j] = -1
            continue
        ns = new_slots[a : a + n_p]
        n_free[j], fresh[j] = _commit_kernel(buckets[t], rec[t], caps[t], pe, n_p, free[t], n_free[j], fresh[j],
                                             call_ids[j], step1, False, out, ns)
        init_kernel(pe[:n_p], ns, salts[t], bounds[t], weights[t])
        _fill_rows_kernel(states[t], ns, state_init)
        n_pend[j] = n_p
        n_hit_pos[j] = n_hp


@njit(nogil=True, cache=True)
def _read_kernel(which, lo, hi, weights, slots, out):
    for j in range(which.shape[0]):
        a, b = lo[j], hi[j]
        _gather_kernel(weights[which[j]], slots[a:b], out[a:b])


@njit(nogil=True, cache=True)
def _apply_kernel(which, lo, hi, weights, states, slots, grads, lr, eps, wd):
    for j in range(which.shape[0]):
        t, a, b = which[j], lo[j], hi[j]
        s = slots[a:b]
        _rowwise_adagrad_kernel(weights[t], s, states[t], s, grads[a:b], lr, eps, wd)


def _plain(table) -> bool:
    return (type(table) is EmbeddingTable and table.weights_CD.dtype == np.float32
            and table.cfg.optimizer == "rowwise_adagrad" and table.spill is None and table.on_evict is None
            and table._sketch is None and table.on_rows_written is None)


def _typed(arrays: list[np.ndarray]) -> List:
    out = List()
    for a in arrays:
        out.append(a)
    return out


class TableGroup:
    """The arrays of a store's tables, for one kernel call per phase (see module doc).
    Table ``i`` of the group is ``tables[i]``; callers name tables by that index."""

    def __init__(self, tables: list[EmbeddingTable]) -> None:
        self.tables = tables
        maps = [t._map for t in tables]
        self._buckets = _typed([m._buckets for m in maps])
        self._rec = _typed([m._rec for m in maps])
        self._free = _typed([m._free for m in maps])
        self._weights = _typed([t.weights_CD for t in tables])
        self._states = _typed([t._state["rowwise_state"] for t in tables])
        self._caps = np.array([m.capacity for m in maps], dtype=np.int64)
        self._salts = np.array([t._salt for t in tables], dtype=np.uint64)
        self._bounds = np.array([t._bound for t in tables], dtype=np.float64)
        cfg = tables[0].cfg
        self._state_init = np.float32(tables[0]._state_init["rowwise_state"])
        self._lr, self._eps, self._wd = float(cfg.lr), float(cfg.eps), float(cfg.weight_decay)

    @classmethod
    def of(cls, tables: list) -> "TableGroup | None":
        """Return a group of ``tables`` if every one is plain and they share one optimizer
        configuration, else None (every call then goes to the tables themselves)."""
        if not tables or not all(_plain(t) for t in tables):
            return None
        first = tables[0]
        if any(t.cfg is not first.cfg and (t.cfg.lr, t.cfg.eps, t.cfg.weight_decay, t.cfg.initial_accumulator)
               != (first.cfg.lr, first.cfg.eps, first.cfg.weight_decay, first.cfg.initial_accumulator)
               for t in tables):
            return None
        return cls(tables)

    def reserve(self, idx: list[int], keys: np.ndarray, base: np.ndarray, step: int, slots: np.ndarray) -> list[int]:
        """``EmbeddingTable.reserve`` of tables ``idx``, table ``i``'s unique keys being
        ``keys[base[i]:base[i+1]]``, its slots written to the same range of ``slots``;
        return the tables left to ``EmbeddingTable.reserve`` (an eviction needed, more keys
        than the capacity, a step before the map's clock or outside 32 bits, call ids about
        to wrap), in ascending order."""
        step = int(step)
        take, rest = [], []
        for i in idx:
            m = self.tables[i]._map
            ok = (m._call_id < _CALL_ID_MAX - 1 and STEP_MIN <= step <= STEP_MAX
                  and not (m._has_clock and step < m._clock))
            (take if ok else rest).append(i)
        if not take:
            return rest
        which = np.array(take, dtype=np.int64)
        lo, hi = base[which], base[which + 1]
        maps = [self.tables[i]._map for i in take]
        call_ids = np.array([m._call_id + 1 for m in maps], dtype=np.int32)
        n_free = np.array([m._n_free for m in maps], dtype=np.int64)
        fresh = np.array([m._fresh for m in maps], dtype=np.int64)
        n = keys.shape[0]
        pend = np.empty(n, dtype=np.int64)
        new_slots = np.empty(n, dtype=np.int64)
        n_pend = np.empty(len(take), dtype=np.int64)
        n_hit_pos = np.empty(len(take), dtype=np.int64)
        _reserve_kernel(which, lo, hi, self._buckets, self._rec, self._free, self._caps, call_ids, n_free, fresh,
                        keys, np.array([step], dtype=np.int64), slots, pend, new_slots, n_pend, n_hit_pos,
                        self._weights, self._states, self._salts, self._bounds, self._state_init)
        for j, i in enumerate(take):  # the map's and the table's own bookkeeping, as lookup and _touch do
            m, c = maps[j], self.tables[i]._counters
            m._call_id = int(call_ids[j])  # used, even by a call left to the table: its touched marks
            if n_pend[j] < 0:
                rest.append(i)
                continue
            m._n_free, m._fresh, m._clock, m._has_clock = int(n_free[j]), int(fresh[j]), step, True
            hits, n_miss = int(n_hit_pos[j]), int(hi[j] - lo[j] - n_hit_pos[j])
            c["hits"] += hits
            c["misses"] += n_miss
            c["admitted"] += n_miss
            c["inserts"] += int(n_pend[j])
        return sorted(rest)

    def read(self, idx: list[int], base: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
        """``EmbeddingTable.read`` of tables ``idx``: rows of ``slots[base[i]:base[i+1]]`` into
        the same range of ``out`` (float32 [*, D], C-contiguous)."""
        if idx:
            which = np.array(idx, dtype=np.int64)
            _read_kernel(which, base[which], base[which + 1], self._weights, slots, out)

    def apply(self, idx: list[int], base: np.ndarray, slots: np.ndarray, departures: list[int],
              grads: np.ndarray) -> list[int]:
        """``EmbeddingTable.apply_gradients`` of tables ``idx`` with the gradients
        ``grads[base[i]:base[i+1]]`` (float32, C-contiguous) of the keys ``reserve`` gave
        ``slots[base[i]:base[i+1]]``, for each table whose ``departures`` is still
        ``departures[i]``; return the others (their slots may be stale), in the order given."""
        take, rest = [], []
        for i in idx:
            (take if self.tables[i]._map.departures == departures[i] else rest).append(i)
        if take:
            which = np.array(take, dtype=np.int64)
            lo, hi = base[which], base[which + 1]
            _apply_kernel(which, lo, hi, self._weights, self._states, slots, grads, self._lr, self._eps, self._wd)
            for j, i in enumerate(take):
                self.tables[i]._counters["updated"] += int(hi[j] - lo[j])
        return rest
