"""One shard's embedding table: rows, optimizer state and LRU bookkeeping in flat arrays.

Legend: ``C`` capacity (slots), ``D`` dim, ``U`` unique keys of a call, ``M`` keys new to
the table in a call, ``K`` keys evicted by a call, ``N`` rows of an Arrow table.

Layout (every array preallocated at construction, indexed by slot)::

                slot:   0     1     2    ...  C-1
    KeyMap         key  k0    k1    -         k9       64-bit key -> slot, LRU by step
             last_seen  12    15    -         15       (the map's meta words)
    weights_CD          [ row 0 ][ row 1 ][ free ] ... [ row C-1 ]    float32 or float16
    optimizer state     rowwise_adagrad: rowwise_state_C        float32
                        adagrad:         state_sum_CD           float32
                        adam:            exp_avg_CD, exp_avg_sq_CD float32, adam_step_C int64
                        sgd:             (none)
    admission           FrequencySketch [4, W] uint8, W = pow2 >= max(2C, 4096)
                        (8-16 bytes per slot; only when min_count > 1)

    lookup(keys_U, step)                 apply_gradients(keys_U, grads_UD, step)
      keys ─► KeyMap ─► slots ─► gather     keys ─► KeyMap.find ─► slots ─► optimizer
              │ new key: init row            (absent / rejected keys: ignored, counted)
              └ full: evict LRU rows ─► on_evict(rows as Arrow)

A new key's initial vector depends only on (seed, table name, key) (``recsys.store.tables.initial``),
so every shard, insertion order, capacity and world size starts a key identically.

Admission (``min_count > 1``): sightings of keys that have no row are counted in a
count-min sketch (``keymap.FrequencySketch``), chosen over an exact bounded counting map
because one-off ids — the very keys admission exists to keep out — can outnumber the
capacity within one batch; a sketch's memory is fixed and it never undercounts, so a key
is admitted no later than its ``min_count``-th sighting (earlier only on a full hash
collision, ~(keys per aging period / width)^4). A key is admitted on the lookup that brings
its ``min_count``-th sighting and gets its row then. Before that, lookups return zeros and
gradients for it are ignored. The sketch ages (halves) every ``10·W`` sightings and is
not part of ``state_dict``: carry it with ``admission_state`` / ``load_admission_state``
(the store saves it with every checkpoint). A training lookup redone for the same step —
the look-ahead lookup a resumed run redoes, or one withdrawn and redone
(``arm_admission_replay``) — counts each key's sighting of that step once.

Spill tier (``spill``, a ``recsys.store.spill.tier.SpillTier``; built from ``cfg.spill.url``
unless given): evicted rows go to it with their optimizer state and last_seen, and a
lookup's misses are asked of it before anything is initialized::

    lookup(keys_U, step)
      KeyMap.find ─► misses ─► spill.fetch (in-memory buffer, then MGET) ─► found / not found
      one KeyMap.lookup of every admitted key (the whole call's keys protected from eviction)
        new slots: found rows copied back exactly, the others initialized; every key's
        last_seen becomes ``step``; evicted rows ─► spill.put (async)
      spill.restored(found keys): their Redis copies are kept, stale and never read while
        the rows are in memory, overwritten when they are evicted again (with
        ``spill.delete_restored``: deleted, an async UNLINK each)

A spilled key found in the tier is admitted whatever the sketch says (it had a row).
``apply_gradients`` brings back spilled rows of its keys the same way (with their own
last_seen), so a row evicted between its lookup and its push still gets its gradient.
``peek`` reads spilled rows without moving them. ``state_dict`` holds the spilled rows
too (after a flush of pending writes); ``insert_rows`` takes more rows than the capacity
(the oldest are written to the spill tier at once: ``SpillTier.write_rows``). A spill error
(``SpillError``) leaves the table as it was before the call; a key that might be in Redis is
never initialized instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
from numba import njit

from recsys.errors import UserError
from recsys.features.schema import TableSpec
from recsys.store.tables import optim
from recsys.store.host import pages
from recsys.store.config import StoreConfig
from recsys.store.tables.float16 import f16_lut, gather_f16_kernel, scatter_f16_kernel, to_float32
from recsys.store.tables.initial import init_kernel as _init_kernel
from recsys.store.tables.initial import init_salt, init_vectors
from recsys.store.tables.keymap import MAX_CAPACITY, FrequencySketch, KeyMap, as_keys, commit_pages, distinct, has_repeats
from recsys.store.host.prefetch import ROWS_AHEAD, prefetch
from recsys.store.tables.rowblock import RowBlock, fixed_list, int64_column, matrix_column, vector_column

__all__ = ["EmbeddingTable", "CapacityError", "init_vectors", "COUNTERS", "arrow_schema"]


class CapacityError(UserError):
    """A call brings more distinct ids than a table (or its device cache) holds: the job's
    capacity or batch size is at fault, not the code, so commands print this one line
    (``UserError``) and exit 2. The table is unchanged. ``holder``: what holds the rows
    (default: the table; a store of several processes names this process's shard), ``fix``:
    the setting to raise (default: the table's capacity)."""

    def __init__(self, table: str, step: int, distinct_ids: int, capacity: int, *,
                 holder: str = "", fix: str = "") -> None:
        self.table, self.step, self.distinct_ids, self.capacity = table, int(step), int(distinct_ids), int(capacity)
        self.holder = holder or "the table"
        self.fix = fix or f"schema.tables.{table.removesuffix('.wide')}.capacity"
        super().__init__(
            f"table {table!r}: the batch of step {self.step} has {self.distinct_ids} distinct ids, more than the "
            f"{self.capacity} rows {self.holder} holds; raise {self.fix} to at least the distinct ids of one batch "
            "or lower data.train.batch_size")


_SPILL_ROWS_PER_WRITE = 1 << 20
"""``insert_rows``: rows beyond the capacity copied out and written to the spill tier per piece."""

COUNTERS = (
    "hits",  # looked-up keys that had a row
    "misses",  # looked-up keys that had none
    "inserts",  # rows created (initialized) by lookups
    "admitted",  # misses given a row (every miss when min_count = 1)
    "rejected",  # misses not admitted yet (read the zero vector)
    "evictions",  # rows evicted to make room
    "updated",  # rows changed by apply_gradients
    "ignored",  # gradient rows ignored: key without a row (never admitted, evicted, popped)
    "rows_in",  # rows put in by insert_rows / load_state_dict
    "rows_out",  # rows taken out by pop_rows
)


# --------------------------------------------------------------------------- initial rows


@njit(nogil=True, cache=True)
def _fill_rows_kernel(arr, rows, value):
    for i in range(rows.shape[0]):
        arr[rows[i]] = value


@njit(nogil=True, cache=True)
def _gather_kernel(w, rows, out):
    """``out[i] = w[rows[i]]``, zeros where ``rows[i] < 0``. Rows are asked for a few ahead
    (``prefetch`` asks to write: in training the push updates the same rows next)."""
    n = rows.shape[0]
    for i in range(n):
        # the hint is written out in each kernel on purpose (recsys.store.host.prefetch)
        j = i + ROWS_AHEAD
        if j < n and rows[j] >= 0:
            prefetch(w, rows[j])
        r = rows[i]
        if r < 0:
            out[i, :] = 0.0
        else:
            for d in range(out.shape[1]):
                out[i, d] = w[r, d]


def check_push(name: str, dim: int, keys: np.ndarray, grads_shape: tuple, step: int, clock: int | None) -> None:
    """Raise ``ValueError`` unless the gradients fit the keys and their step was looked up."""
    if grads_shape != (keys.shape[0], dim):
        raise ValueError(f"table {name!r}: grads must have shape ({keys.shape[0]}, {dim}), found {grads_shape}")
    if clock is None or int(step) > clock:
        raise ValueError(
            f"table {name!r}: gradients of step {step} arrive before its lookup (latest lookup step: {clock})"
        )


def arrow_schema(name: str, dim: int, cfg: StoreConfig) -> pa.Schema:
    """Return the Arrow schema of table ``name``'s rows (``EmbeddingTable.state_dict``)."""
    emb_type = pa.float32() if np.dtype(cfg.dtype) == np.float32 else pa.float16()
    fields = [pa.field("key", pa.int64(), nullable=False),
              pa.field("embedding", pa.list_(emb_type, dim), nullable=False)]
    for c in optim.state_columns(cfg.optimizer):
        t = pa.from_numpy_dtype(c.dtype)
        fields.append(pa.field(c.name, pa.list_(t, dim) if c.per_dim else t, nullable=False))
    fields.append(pa.field("last_seen", pa.int64(), nullable=False))
    meta = {"recsys.table": name, "recsys.optimizer": cfg.optimizer,
            "recsys.dim": str(dim), "recsys.dtype": cfg.dtype}
    return pa.schema(fields, metadata=meta)


# --------------------------------------------------------------------------- the table


class EmbeddingTable:
    """One shard's rows of table ``name``: lookup with insertion, sparse updates, Arrow I/O.

    ``on_evict`` receives the rows an LRU eviction removes (``state_dict`` columns), after
    the table is consistent again; without it (and without a spill tier) evicted rows are
    dropped. ``spill``: the spill tier ("auto": one built from ``cfg.spill.url`` when set;
    None: none). Not thread-safe: the store serializes calls.
    """

    def __init__(
        self,
        name: str,
        spec: TableSpec,
        cfg: StoreConfig,
        *,
        on_evict: Callable[[pa.Table], None] | None = None,
        spill="auto",
    ) -> None:
        self.name = name
        self.spec = spec
        self.cfg = cfg
        self.dim = spec.dim
        # a fixed-size table's keys are already folded into [0, num_rows) (recsys.features.hashing.fold)
        self.capacity = spec.capacity if spec.num_rows is None else min(spec.capacity, spec.num_rows)
        self.on_evict = on_evict
        if self.capacity > MAX_CAPACITY:
            raise ValueError(f"table {name!r}: {self.capacity} rows in one shard, above the {MAX_CAPACITY} a shard holds; "
                             "lower the table's capacity or train on more ranks (each holds capacity / ranks)")
        self._map = KeyMap(self.capacity, huge_pages=cfg.host.huge_pages)
        self._np_dtype = np.dtype(cfg.dtype)
        self.weights_CD = pages.zeros((self.capacity, self.dim), self._np_dtype, cfg.host.huge_pages)
        self._w16 = self.weights_CD.view(np.uint16) if self._np_dtype == np.float16 else None
        self._columns = optim.state_columns(cfg.optimizer)
        self._state = {
            c.name: pages.zeros((self.capacity, self.dim) if c.per_dim else self.capacity, c.dtype, cfg.host.huge_pages)
            for c in self._columns
        }
        self._state_init = {c.name: optim.initial_state_value(cfg, c) for c in self._columns}
        if cfg.host.prefault:
            for arr in (self.weights_CD, *self._state.values()):
                commit_pages(arr)
            self._map.commit_pages()
        self._sketch = (
            FrequencySketch(max(2 * self.capacity, 4096), cap=cfg.min_count) if cfg.min_count > 1 else None
        )
        self._sighted_step = -1  # the step of the latest training lookup that ran admission
        self._sighted_keys = np.empty(0, dtype=np.int64)  # sightings recorded at that step (sorted)
        self._replay: tuple[int, np.ndarray] | None = None  # (step, keys) already counted
        self._salt = np.uint64(init_salt(name, cfg.seed))
        self._bound = float(cfg.init_bound(self.dim))
        self._counters = dict.fromkeys(COUNTERS, 0)
        self.schema = self._arrow_schema()
        if isinstance(spill, str):
            if spill != "auto":
                raise ValueError(f"spill must be a SpillTier, None or 'auto', found {spill!r}")
            spill = None
            if cfg.spill.url:
                from recsys.store.spill.tier import SpillTier  # redis is only needed with a spill tier

                spill = SpillTier(name, self.dim, cfg)
        self.spill = spill
        self.on_rows_written: Callable[[np.ndarray], None] | None = None
        """Called with the slots of every row this table writes (new keys' initial rows,
        inserted or restored rows): a ``DeviceTable`` copies them to its device."""

    # ------------------------------------------------------------------ reads

    def __len__(self) -> int:
        """Return the number of rows held."""
        return len(self._map)

    def counters(self) -> dict[str, int]:
        """Return the event counters (see ``COUNTERS``) and ``rows``, the rows held now."""
        out = {**self._counters, "rows": len(self._map)}
        if self.spill is not None:
            out.update(self.spill.counters())
        return out

    def peek(self, keys_U: np.ndarray, init_missing: bool = False, found_out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 [U, D] rows of ``keys_U``; changes nothing.

        Absent keys read zeros, or with ``init_missing`` the initial vector they would get
        if inserted now (what training would have fed the model for a new key).
        ``found_out`` (bool [U]), if given, is set to whether each key has a row (held or spilled).
        """
        keys = as_keys(keys_U)
        slots = self._map.find(keys)
        rows = self._gather(slots)
        absent = slots < 0
        if self.spill is not None and absent.any():
            self.spill.check()
            where = np.flatnonzero(absent)
            found, block = self.spill.fetch(keys[where], count=False)
            if block.num_rows:
                rows[where[found]] = _as_float32(block.emb)
                absent[where[found]] = False
        if found_out is not None:
            np.logical_not(absent, out=found_out)
        if init_missing and absent.any():
            rows[absent] = init_vectors(keys[absent], self.dim, self.name, self.cfg.seed, self._bound)
        return rows

    def lookup(self, keys_U: np.ndarray, step: int, out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 [U, D] rows of the unique keys ``keys_U`` at training ``step``
        (written into ``out``, a C-contiguous float32 [U, D] array, when given).

        Absent keys are admitted (see module doc) and initialized, evicting least-recently
        used rows if the table is full; keys not admitted read zeros. ``step`` must not be
        below an earlier lookup's. Raises ``CapacityError`` (table unchanged) if the call's
        keys cannot all fit. Uniqueness is the caller's promise (not checked: hot path).
        """
        slots = self._touch(as_keys(keys_U), int(step))
        return self._gather(slots, out)

    @property
    def reserves_early(self) -> bool:
        """Whether ``reserve`` may run before pushes of earlier steps are applied: true
        without a spill tier, ``on_evict`` and admission (``min_count`` > 1). Then a row
        evicted before its pending push is dropped exactly as if evicted after it (the push
        only counts it ``ignored``, not ``updated``); with a spill tier or ``on_evict`` the
        evicted row's copy would miss the push, and with admission a key admitted early
        would get the row an earlier push must not find (that push would update it)."""
        return self.spill is None and self.on_evict is None and self._sketch is None

    def reserve(self, keys_U: np.ndarray, step: int) -> np.ndarray:
        """Do ``lookup``'s key work (touch, admit, evict, initialize new rows) and return the
        slots (-1: not admitted) for ``read``; the rows are not read yet."""
        return self._touch(as_keys(keys_U), int(step))

    def prefetch(self, keys_U: np.ndarray) -> int:
        """Have the spill tier read ahead the spilled rows of ``keys_U`` (``SpillTier.prefetch``:
        the misses a coming ``lookup`` or ``reserve`` of these keys will restore); return how
        many rows it read. Changes no row and no key; with no spill tier, does nothing. May run
        before pushes of earlier steps are applied: a push changes only rows this table holds.

        Only the keys this table does not hold are passed on: the tier reads every key its
        index has and its buffer does not, and a row held here may have a copy there (kept by
        ``SpillTier.restored``), stale and not to be read."""
        if self.spill is None:
            return 0
        keys = as_keys(keys_U)
        return self.spill.prefetch(keys[self._map.find(keys) < 0])

    @property
    def departures(self) -> int:
        """How many calls may have taken keys out of their slots so far (``KeyMap.departures``)."""
        return self._map.departures

    def read(self, slots_U: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Return the float32 rows of ``reserve``'s slots as they are now (zeros for -1).
        Valid until the next call that inserts or evicts (``reserve``, ``lookup``...)."""
        return self._gather(slots_U, out)

    def lookup_rows(self, keys_U: np.ndarray, step: int, want_U: np.ndarray) -> tuple[np.ndarray, RowBlock]:
        """``lookup`` that returns, instead of float32 rows, which keys have a row (bool [U])
        and the full rows (``RowBlock``) of the keys with a row where ``want_U`` is true."""
        keys = as_keys(keys_U)
        slots = self._touch(keys, int(step))
        has_row = slots >= 0
        sel = np.flatnonzero(has_row & np.asarray(want_U, dtype=bool))
        return has_row, self._block(keys[sel], slots[sel], self._map.steps_of(slots[sel]))

    def _touch(self, keys: np.ndarray, step: int) -> np.ndarray:
        """Touch ``keys`` at ``step``, admitting, restoring (spill) or initializing misses;
        return their slots (-1: not admitted)."""
        spill = self.spill
        fetched = None
        if spill is not None:
            spill.check()
        if self._sketch is None and spill is None:
            self._check_capacity(keys, step)
            upd = self._map.lookup(keys, step)
            slots = upd.slots_N
            n_miss = keys.shape[0] - upd.hits
            n_admit = n_miss
        else:
            found = self._map.find(keys)
            miss = found < 0
            miss_keys = keys[miss]
            in_spill = np.zeros(miss_keys.shape[0], dtype=bool)
            if spill is not None and miss_keys.shape[0]:
                self._check_call(keys, step)  # no Redis round trip for a call that cannot succeed
                in_spill, fetched = spill.fetch(miss_keys)  # read-only: a raise changes nothing
            if self._sketch is None:
                admit = np.ones(miss_keys.shape[0], dtype=bool)
            else:
                counted = self._replayed(miss_keys, step)  # rejected at this step before: again
                admit = in_spill | (~counted & (self._sketch.estimate_next(miss_keys) >= self.cfg.min_count))
            take = ~miss
            take[miss] = admit
            self._check_capacity(keys[take], step)  # raises before anything is recorded
            upd = self._map.lookup(keys[take], step)
            if self._sketch is not None:
                self._record_sightings(miss_keys[~in_spill & ~counted], step)  # a spilled key had a row
            slots = np.full(keys.shape[0], -1, dtype=np.int64)
            slots[take] = upd.slots_N
            n_miss = miss_keys.shape[0]
            n_admit = int(admit.sum())
        evicted = self._take_evicted(upd)
        new_keys, new_slots = upd.new_keys_M, upd.new_slots_M
        if fetched is not None and fetched.num_rows:
            pos = _positions(fetched.keys, new_keys)  # every fetched key is new
            restored = np.zeros(new_keys.shape[0], dtype=bool)
            restored[pos] = True
            self._write_rows(new_slots[pos], fetched)
            new_keys, new_slots = new_keys[~restored], new_slots[~restored]
        self._init_rows(new_keys, new_slots)
        c = self._counters
        c["hits"] += keys.shape[0] - n_miss
        c["misses"] += n_miss
        c["admitted"] += n_admit
        c["rejected"] += n_miss - n_admit
        c["inserts"] += new_slots.shape[0]
        if fetched is not None and fetched.num_rows:
            spill.restored(fetched.keys)
        self._emit(evicted)
        return slots

    def _check_call(self, keys: np.ndarray, step: int) -> None:
        """Raise the errors ``KeyMap.lookup`` would raise for this call, changing nothing."""
        clock = self._map.clock
        if clock is not None and step < clock:
            raise ValueError(
                f"lookup step {step} is before the previous lookup's step {int(clock)}; steps must not decrease"
            )
        if self._sketch is None:
            self._check_capacity(keys, step)

    def _check_capacity(self, keys: np.ndarray, step: int) -> None:
        """Raise ``CapacityError`` if the call's distinct keys outnumber the slots (the map
        would raise a ``ValueError`` naming no table); a comparison of two ints when they fit."""
        if keys.shape[0] > self.capacity and (touched := distinct(keys).shape[0]) > self.capacity:
            raise CapacityError(self.name, step, touched, self.capacity)

    # ------------------------------------------------------------------ updates

    def apply_gradients(self, keys_U: np.ndarray, grads_UD: np.ndarray, step: int,
                        slots_hint: np.ndarray | None = None, hint_departures: int | None = None) -> None:
        """Apply the sparse optimizer to the rows of ``keys_U`` with gradients ``grads_UD``.

        Keys without a row (not admitted, evicted, popped) are ignored and counted.
        ``step`` is the step whose lookup produced the rows: it may not be later than the
        latest lookup (pushes may lag lookups, never lead them). ``slots_hint``: the slots
        ``reserve`` gave these keys (checked, so a stale hint is harmless; saves probes);
        ``hint_departures``: ``departures`` right after that ``reserve`` (no key left its
        slot since: the hints are used unchecked).
        """
        keys = as_keys(keys_U)
        grads = np.ascontiguousarray(grads_UD, dtype=np.float32)
        check_push(self.name, self.dim, keys, tuple(grads.shape), step, self._map.clock)
        if self.spill is not None:
            self.spill.check()
        slots = self._map.find(keys, slots_hint, hint_departures)
        if self.spill is not None and (slots < 0).any():
            slots = self._restore_for_update(keys, slots)
        n_ignored = int((slots < 0).sum())
        self._counters["ignored"] += n_ignored
        self._counters["updated"] += keys.shape[0] - n_ignored
        if self._np_dtype == np.float32:
            optim.apply_update(self.cfg, self.weights_CD, slots, self._state, slots, grads)
        else:  # float32 math on a gathered copy, rounded back to float16
            w32 = self._gather(slots)
            optim.apply_update(self.cfg, w32, np.arange(slots.shape[0]), self._state, slots, grads)
            scatter_f16_kernel(w32.view(np.uint32), self._w16, slots)

    # ------------------------------------------------------------------ rows in and out

    def state_dict(self) -> pa.Table:
        """Return every row as an Arrow table sorted by key (signed int64 order).

        Columns: ``key`` int64, ``embedding`` fixed_size_list<float32|float16>[D], the
        optimizer's state columns (``optim.state_columns``), ``last_seen`` int64.
        """
        keys, slots, steps = self._map.items()
        if self.spill is not None:
            self.spill.check()
            block = self._block(keys, slots, steps)
            # flushes pending writes first; a row held here has no copy there or a stale one
            spilled = self.spill.rows(skip=lambda k: self._map.find(k) >= 0)
            block = RowBlock.concat([block, spilled])
            return self._block_table(block.take(np.argsort(block.keys)))
        order = np.argsort(keys)  # distinct keys: any sort gives the one order (quicksort: 2x a stable one)
        return self._rows_table(keys[order], slots[order], steps[order])

    def load_state_dict(self, rows: pa.Table) -> None:
        """Merge ``rows`` (any subset of a ``state_dict``) into the table; see ``insert_rows``."""
        self.insert_rows(rows)

    def pop_rows(self, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` and return them (absent keys are skipped).

        Only rows held in memory move; spilled rows stay in the spill tier, whose keys do
        not depend on the shard (their new owner finds them on its next miss). A copy the
        tier kept of a moved row (``SpillTier.restored``) is deleted: it is older than the row."""
        keys = as_keys(keys)
        if self.spill is not None:
            # deleted before the rows leave (a raise keeps them here), and at once: a new
            # owner's write of the same Redis key must land after this UNLINK, not before
            held = keys[self._map.find(keys) >= 0]
            if held.shape[0]:
                self.spill.forget(held)
                self.spill.flush()
        slots = self._map.remove(keys)
        live = slots >= 0
        slots = slots[live]
        out = self._rows_table(keys[live], slots, self._map.steps_of(slots))
        self._counters["rows_out"] += out.num_rows
        return out

    def insert_rows(self, rows: pa.Table) -> None:
        """Put rows back exactly (embedding, optimizer state, last_seen), replacing present keys.

        Rows of a float32 table load into a float16 one (rounded) and vice versa. If the
        table is full, least-recently-used rows not in ``rows`` are evicted (``on_evict``).
        With a spill tier, ``rows`` may exceed the capacity: ordered by last_seen, then key,
        the newest ``capacity`` go in as above and the others are written to the spill tier
        directly (not counted as evictions), replacing copies held here or spilled.
        """
        keys, emb, states, last_seen = self._read_rows(rows)
        if self.spill is not None:
            self.spill.check()
        block = RowBlock(keys, emb, states, last_seen)
        over = keys.shape[0] - self.capacity
        if over <= 0:
            self._insert_block(block)
        else:  # (only with a spill tier: ``_read_rows``)
            # The oldest rows go straight to Redis, as inserting all of them a capacity at a
            # time would have left them (each block evicting the one before), without the
            # key map's work and the buffer's value a row in between.
            order = np.lexsort((keys.view(np.uint64), last_seen))
            for start in range(0, over, _SPILL_ROWS_PER_WRITE):
                self.spill.write_rows(block.take(order[start : min(start + _SPILL_ROWS_PER_WRITE, over)]))
            self._map.remove(keys[order[:over]])  # a copy held here was older: the spilled one counts
            self._insert_block(block.take(order[over:]))
        self._counters["rows_in"] += keys.shape[0]

    def write_back(self, block: RowBlock) -> None:
        """Overwrite rows with ``block`` (a cache's newer copies), keeping their LRU place.

        Keys without a row here are inserted with their last_seen (evicting LRU rows if
        full). Nothing is counted as ``rows_in``."""
        slots = self._map.find(block.keys)
        present = slots >= 0
        if present.any():
            self._write_rows(slots[present], block.take(present) if not present.all() else block)
        if not present.all():
            self._insert_block(block.take(~present))

    def flush(self) -> None:
        """Wait until the spill tier's pending writes are in Redis (no-op without one)."""
        if self.spill is not None:
            self.spill.flush()

    def close(self) -> None:
        """Flush and close the spill tier (no-op without one). Raises ``SpillError`` if rows
        could not be written (they stay in this process's memory)."""
        if self.spill is not None:
            self.spill.close()

    # ------------------------------------------------------------------ admission state

    def admission_state(self) -> dict | None:
        """Return the admission state (None when ``min_count`` is 1): the sketch (``cells``
        [depth, width] uint8, ``recorded``), ``step``, the step of the latest training
        lookup that ran admission (-1: none), and ``step_keys``, the keys whose sightings it
        recorded (sorted int64), so a redone lookup of that step does not count them twice."""
        if self._sketch is None:
            return None
        return {**self._sketch.state(), "step": int(self._sighted_step), "step_keys": self._sighted_keys.copy()}

    def load_admission_state(self, state: dict | None) -> None:
        """Restore ``admission_state()`` of a table with the same sketch shape (same capacity,
        or ``keymap.merge_sketch_states`` of other shapes). A resumed run then calls
        ``arm_admission_replay(state["step"])``: the look-ahead lookup it redoes was counted."""
        if (state is None) != (self._sketch is None):
            raise ValueError(
                f"table {self.name!r}: admission state {'missing' if state is None else 'given'} "
                f"but min_count is {self.cfg.min_count}"
            )
        if state is not None:
            self._sketch.load_state(state)
            step = int(state.get("step", -1))
            keys = distinct(as_keys(np.asarray(state.get("step_keys", np.empty(0)), dtype=np.int64)))
            self._sighted_step, self._sighted_keys = (step, keys) if step >= 0 else (-1, keys[:0])
            self._replay = None

    def arm_admission_replay(self, step: int) -> None:
        """The training lookup of ``step`` will be redone: it was withdrawn
        (``ShardedEmbeddingStore.cancel``), or it is the look-ahead lookup of a checkpoint a
        run resumes from (after ``load_admission_state``). If it ran admission here, the
        redone lookup of ``step`` counts none of the sightings it counted again and rejects
        those keys when they have no row (they were rejected then: an admitted key keeps its
        row, in memory or spilled), so the redo changes nothing."""
        if self._sketch is not None and self._sighted_step == int(step):
            self._replay = (int(step), self._sighted_keys.copy())

    def _replayed(self, miss_keys: np.ndarray, step: int) -> np.ndarray:
        """Return which of ``miss_keys`` had their sighting at ``step`` counted already."""
        r = self._replay
        if r is None or r[0] != step or r[1].shape[0] == 0 or miss_keys.shape[0] == 0:
            return np.zeros(miss_keys.shape[0], dtype=bool)
        return np.isin(miss_keys, r[1])

    def _record_sightings(self, keys: np.ndarray, step: int) -> None:
        """Count one sighting of each of ``keys`` (distinct) at training ``step``."""
        if self._replay is not None and step > self._replay[0]:
            self._replay = None
        if keys.shape[0]:
            self._sketch.add(keys)
        if step != self._sighted_step:
            self._sighted_step = step
            self._sighted_keys = np.sort(keys)
        elif keys.shape[0]:
            self._sighted_keys = np.union1d(self._sighted_keys, keys)

    # ------------------------------------------------------------------ internals

    def _init_rows(self, keys_M: np.ndarray, slots_M: np.ndarray) -> None:
        if slots_M.shape[0] == 0:
            return
        if self._np_dtype == np.float32:  # in place: a [M, D] fancy assignment costs 3x more
            _init_kernel(keys_M, slots_M, self._salt, self._bound, self.weights_CD)
        else:
            w32 = init_vectors(keys_M, self.dim, self.name, self.cfg.seed, self._bound)
            scatter_f16_kernel(w32.view(np.uint32), self._w16, slots_M)
        for name, arr in self._state.items():
            _fill_rows_kernel(arr, slots_M, arr.dtype.type(self._state_init[name]))
        if self.on_rows_written is not None:
            self.on_rows_written(slots_M)

    def _gather(self, slots_U: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 rows of ``slots_U`` (in ``out`` if given), zeros where a slot is -1."""
        if out is None:
            out = np.empty((slots_U.shape[0], self.dim), dtype=np.float32)
        if self._w16 is not None:
            gather_f16_kernel(self._w16, slots_U, f16_lut(), out.view(np.uint32))
        else:
            _gather_kernel(self.weights_CD, np.ascontiguousarray(slots_U, dtype=np.int64), out)
        return out

    def _take_evicted(self, upd) -> RowBlock | None:
        k = upd.evicted_keys_K.shape[0]
        if k == 0:
            return None
        self._counters["evictions"] += k
        if self.on_evict is None and self.spill is None:
            return None
        # copy before new rows overwrite the slots
        return self._block(upd.evicted_keys_K, upd.evicted_slots_K, upd.evicted_steps_K)

    def _emit(self, evicted: RowBlock | None) -> None:
        if evicted is None:
            return
        if self.spill is not None:
            self.spill.put(evicted)  # holds the rows even when it raises
        if self.on_evict is not None:
            self.on_evict(self._block_table(evicted))

    def _insert_block(self, block: RowBlock) -> None:
        """Put ``block`` (at most ``capacity`` distinct keys) in with its last_seen steps."""
        upd = self._map.assign(block.keys, block.last_seen)
        evicted = self._take_evicted(upd)
        self._write_rows(upd.slots_N, block)
        if self.spill is not None and upd.new_keys_M.shape[0]:
            self.spill.restored(upd.new_keys_M)  # a spilled copy of these keys is now stale
        self._emit(evicted)

    def _write_rows(self, slots: np.ndarray, block: RowBlock) -> None:
        """Write ``block``'s embeddings and optimizer state into ``slots``."""
        emb = block.emb
        if self._w16 is not None and emb.dtype == np.float32:
            scatter_f16_kernel(np.ascontiguousarray(emb).view(np.uint32), self._w16, slots)
        else:
            self.weights_CD[slots] = emb
        for name, values in block.states.items():
            self._state[name][slots] = values
        if self.on_rows_written is not None:
            self.on_rows_written(slots)

    def _restore_for_update(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Bring back spilled rows of gradient keys (their last_seen kept); return new slots."""
        absent = slots < 0
        found, block = self.spill.fetch(keys[absent])
        if block.num_rows == 0:
            return slots
        present = ~absent
        all_keys = np.concatenate([keys[present], block.keys])
        all_steps = np.concatenate([self._map.steps_of(slots[present]), block.last_seen])
        upd = self._map.assign(all_keys, all_steps)  # protects the present keys too
        evicted = self._take_evicted(upd)
        self._write_rows(upd.slots_N[present.sum():], block)
        self.spill.restored(block.keys)
        self._emit(evicted)
        return self._map.find(keys)

    def _block(self, keys_N: np.ndarray, slots_N: np.ndarray, steps_N: np.ndarray) -> RowBlock:
        """Return a copy of the rows in ``slots_N``."""
        return RowBlock(
            np.ascontiguousarray(keys_N, dtype=np.int64),
            self.weights_CD[slots_N],
            {c.name: self._state[c.name][slots_N] for c in self._columns},
            np.ascontiguousarray(steps_N, dtype=np.int64),
        )

    def _block_table(self, block: RowBlock) -> pa.Table:
        cols = [pa.array(block.keys), fixed_list(block.emb, self.dim)]
        for c in self._columns:
            values = block.states[c.name]
            cols.append(fixed_list(values, self.dim) if c.per_dim else pa.array(values))
        cols.append(pa.array(block.last_seen))
        return pa.Table.from_arrays(cols, schema=self.schema)

    def _arrow_schema(self) -> pa.Schema:
        return arrow_schema(self.name, self.dim, self.cfg)

    def _rows_table(self, keys_N: np.ndarray, slots_N: np.ndarray, steps_N: np.ndarray) -> pa.Table:
        return self._block_table(self._block(keys_N, slots_N, steps_N))

    def _read_rows(self, rows: pa.Table):
        """Return (keys, embeddings, {state column: values}, last_seen) of ``rows``, checked."""
        where = f"table {self.name!r}: rows to load"
        if not isinstance(rows, pa.Table):
            raise TypeError(f"{where}: expected a pyarrow.Table, found {type(rows).__name__}")
        expected = self.schema.names
        if sorted(rows.column_names) != sorted(expected):
            raise ValueError(
                f"{where}: columns {rows.column_names} do not match this table's "
                f"({self.cfg.optimizer}, dim {self.dim}): expected {expected}"
            )
        keys = int64_column(rows, "key", where)
        if has_repeats(keys):
            raise ValueError(f"{where}: column 'key' repeats keys")
        last_seen = int64_column(rows, "last_seen", where)
        emb = matrix_column(rows, "embedding", self.dim, where, (np.float32, np.float16))
        states = {}
        for c in self._columns:
            if c.per_dim:
                states[c.name] = matrix_column(rows, c.name, self.dim, where, (c.dtype,))
            else:
                states[c.name] = vector_column(rows, c.name, where, c.dtype)
        if keys.shape[0] > self.capacity and self.spill is None:
            raise ValueError(f"{where}: {keys.shape[0]} rows exceed the capacity {self.capacity}")
        return keys, emb, states, last_seen


def _positions(needles: np.ndarray, haystack: np.ndarray) -> np.ndarray:
    """Return the index in ``haystack`` (distinct keys) of each of ``needles`` (all present)."""
    order = np.argsort(haystack, kind="stable")
    return order[np.searchsorted(haystack, needles, sorter=order)]


def _as_float32(values: np.ndarray) -> np.ndarray:
    """Return float16 or float32 rows as float32 (float16 through ``recsys.store.tables.float16``'s kernel)."""
    return to_float32(values) if values.dtype == np.float16 else np.asarray(values, dtype=np.float32)
