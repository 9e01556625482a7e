"""A whole table on the compute device: every row and its optimizer state in device memory,
at the host table's own slots.

Legend: ``C`` the table's capacity (rows), ``D`` dim, ``U`` keys of a call.

``DeviceTable`` is what a store's GPU tier uses for a table that fits whole
(``store.device.memory_gb`` holding every capacity, or ``store.device.cache_rows`` at least the
capacity) in a one-process store without a spill tier. A ``DeviceCache`` in front of such a
table would do the host's key work *and* its own (a second key map with its own LRU), and
measured slower than no device tier at all on an H100 (BENCHMARKS.md). Here the host table
keeps only the keys::

    lookup_slots(keys_U, step)
      host.reserve ─► slots (one pass over the keys: touch, admit, evict, initialize)
                  └► rows the host initialized (new keys) ─► copied to the device at their slots
      the caller gathers rows [slots] on the device (one call over all tables: DeviceArena)
    gradient_slots(keys_U, grads_UD, step)
      host key map find (the lookup's slots as hints: usually no probe) ─► the caller's
      optimizer runs on the device rows at those slots

So the host's LRU order, admission, eviction and initial rows are exactly those of the host
store: an evicted key's slot is reused by the host and its new row overwrites the device
copy. The device copy is authoritative; the host's row arrays go stale once a row is
updated and are brought up to date (``write_back_all``) before anything reads them:
``state_dict``, ``pop_rows``, ``flush``, ``close``. Rows the host writes (``insert_rows``,
``load_state_dict``, new keys) are copied to the device as they are written.

The key work runs when the lookup reads its rows, after the pushes it must see, not ahead
of them as a host table's ``reserve`` may: tried, it measured ~40 % slower on an H100 (the
new rows' uploads then crossed while the trainer's dense step ran).

Not thread-safe: the store serializes calls.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from recsys.store.device.cache import DeviceTier, _allocate
from recsys.store.tables.keymap import as_keys, distinct
from recsys.store.tables.table import EmbeddingTable, check_push

__all__ = ["DeviceTable", "fits_whole"]


def fits_whole(host, rows: int, world_size: int) -> bool:
    """Whether ``rows`` device rows hold ``host`` whole as a ``DeviceTable`` (one process, a
    plain float32 ``EmbeddingTable`` without a spill tier or eviction callback)."""
    return (world_size == 1 and isinstance(host, EmbeddingTable) and rows >= host.capacity
            and host.spill is None and host.on_evict is None and np.dtype(host.cfg.dtype) == np.float32)


class DeviceTable(DeviceTier):
    """Every row of ``host`` on ``device``, at the host's slots (see module doc)."""

    def __init__(self, host: EmbeddingTable, device: torch.device | str, arena=None) -> None:
        """``arena``: keep the rows in ``arena``'s block for this table (at least
        ``host.capacity`` rows), as ``DeviceCache`` does."""
        if not fits_whole(host, host.capacity, 1):
            raise ValueError(f"table {host.name!r}: a DeviceTable needs a float32 host table without a spill "
                             "tier or on_evict")
        self.host = host
        self.name, self.spec, self.cfg, self.dim = host.name, host.spec, host.cfg, host.dim
        self.capacity = host.capacity
        self.rows = host.capacity
        self.device = torch.device(device)
        self.arena, self.offset = arena, 0
        if arena is None:
            self._w, self._state = _allocate(self.cfg, self.rows, self.dim, self.device)
        else:
            if arena.rows[self.name] < self.rows:
                raise ValueError(f"table {self.name!r}: the arena holds {arena.rows[self.name]} rows, "
                                 f"not the table's {self.rows}")
            self.offset = arena.offsets[self.name]
            self._w, self._state = arena.block(self.name)
        self._written: list[np.ndarray] = []
        host.on_rows_written = self._written.append
        self._host_stale = False
        self._updated = 0
        self._ignored = 0
        _, slots, _ = host._map.items()  # rows the host already holds
        if slots.shape[0]:
            self._written.append(slots)
        self._upload_written()

    @property
    def spill(self):
        return None

    @property
    def departures(self) -> int:
        """How many calls may have taken keys out of their slots (the host's)."""
        return self.host.departures

    def cached(self) -> int:
        """Return the number of rows on the device (every row of the table)."""
        return len(self.host)

    def counters(self) -> dict[str, int]:
        """Return the host's counters with the device's updates; every key found with a row
        is a device hit (``cache_hits``), every new row a ``cache_misses`` (it crosses once)."""
        out = self.host.counters()
        out["updated"] += self._updated
        out["ignored"] += self._ignored
        out.update(cache_hits=out["hits"], cache_misses=out["inserts"], cache_evictions=0, writebacks=0,
                   cached=len(self.host))
        return out

    # ------------------------------------------------------------------ reads

    def lookup_slots(self, keys_U: np.ndarray, step: int) -> np.ndarray:
        """Do the host's key work for a training lookup of the unique ``keys_U`` and return
        each key's slot (-1: not admitted), its row on the device."""
        slots = self.host.reserve(keys_U, step)  # raises with nothing changed
        self._upload_written()
        return slots

    def peek_tensor(self, keys_U: np.ndarray, init_missing: bool = False) -> torch.Tensor:
        """Return float32 [U, D] rows of ``keys_U`` on the device; changes nothing. Absent
        keys read zeros, or with ``init_missing`` their initial vector (``EmbeddingTable.peek``)."""
        keys = as_keys(keys_U)
        slots = self.host._map.find(keys)
        out = self._gather(slots)
        absent = np.flatnonzero(slots < 0)
        if init_missing and absent.shape[0]:
            rows = self.host.peek(keys[absent], init_missing=True)  # absent there too: initial vectors
            out[torch.from_numpy(absent).to(self.device)] = torch.from_numpy(rows).to(self.device)
        return out

    def peek(self, keys_U: np.ndarray, init_missing: bool = False, found_out: np.ndarray | None = None) -> np.ndarray:
        """``peek_tensor``'s rows on the host; ``found_out``: as ``EmbeddingTable.peek``."""
        keys = as_keys(keys_U)
        if found_out is not None:
            np.greater_equal(self.host._map.find(keys), 0, out=found_out)
        return self.peek_tensor(keys, init_missing).cpu().numpy()

    # ------------------------------------------------------------------ updates

    def gradient_slots(self, keys_U: np.ndarray, grads_UD: torch.Tensor, step: int,
                       slots_hint: np.ndarray | None = None, hint_departures: int | None = None,
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Return (positions in ``keys_U`` of the keys with a row, their slots) for the
        caller's device update; keys without one (evicted since, not admitted) are ignored
        and counted. ``slots_hint`` / ``hint_departures``: as ``EmbeddingTable.apply_gradients``."""
        keys = as_keys(keys_U)
        check_push(self.name, self.dim, keys, tuple(grads_UD.shape), step, self.host._map.clock)
        slots = self.host._map.find(keys, slots_hint, hint_departures)
        sel = np.flatnonzero(slots >= 0)
        self._updated += sel.shape[0]
        self._ignored += keys.shape[0] - sel.shape[0]
        if sel.shape[0]:
            self._host_stale = True
        return sel, slots[sel]

    # ------------------------------------------------------------------ rows in and out

    def write_back_all(self) -> int:
        """Copy every row the device updated since the last call into the host's arrays;
        return how many rows the host holds then (0 when it was up to date)."""
        if not self._host_stale:
            return 0
        _, slots, _ = self.host._map.items()
        idx = torch.from_numpy(slots).to(self.device)
        self.host.weights_CD[slots] = self._w.index_select(0, idx).cpu().numpy()
        for name, t in self._state.items():
            self.host._state[name][slots] = t.index_select(0, idx).cpu().numpy()
        self._host_stale = False
        return int(slots.shape[0])

    def insert_rows(self, rows: pa.Table) -> None:
        """Put rows into the table exactly (``EmbeddingTable.insert_rows``), on the device too."""
        self.host.insert_rows(rows)
        self._upload_written()

    def pop_rows(self, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` and return them, the device's values."""
        self.write_back_all()
        return self.host.pop_rows(keys)

    # ------------------------------------------------------------------ internals

    def _upload_written(self) -> None:
        """Copy the rows the host wrote since the last call (new keys' initial rows,
        inserted rows) to the device at their slots."""
        if not self._written:
            return
        slots = distinct(np.concatenate(self._written))
        self._written.clear()
        idx = torch.from_numpy(slots).to(self.device)
        self._w.index_copy_(0, idx, torch.from_numpy(self.host.weights_CD[slots]).to(self.device))
        for name, t in self._state.items():
            t.index_copy_(0, idx, torch.from_numpy(self.host._state[name][slots]).to(self.device))
