"""The device cache: a table's hot rows, with their optimizer state, on the compute device.

Legend: ``R`` cached rows (``store.device.cache_rows``), ``D`` dim, ``U`` keys of a call.

``DeviceCache`` sits in front of an ``EmbeddingTable`` (the host tier, which may spill to
Redis) and offers the same interface (lookup / peek / apply_gradients / state_dict /
load_state_dict / insert_rows / pop_rows / counters / flush / close)::

    lookup(keys_U, step)
      cache KeyMap.find ─► hits: rows on the device
                        └► misses: host.lookup_rows ─► host row + state (host may fetch
                                   from spill or initialize) ─► copied to the device
      host.lookup_rows touches *every* key of the call, so the host's LRU order is exactly
      what it would be without the cache; cache misses evict the cache's LRU rows, and
      dirty ones are written back (row + state + last_seen) to the host first.
    apply_gradients(keys_U, grads_UD, step)
      cached keys: the optimizer in torch on the device (the formulas of
      ``recsys.store.tables.optim``, float32 math); other keys: the host's optimizer.

Write-back: while a row is cached its device copy is authoritative and the host's copy may
be stale (it is marked dirty once updated). A dirty row is written back when the cache
evicts it, before ``pop_rows`` takes it, and on ``flush`` / ``state_dict`` / ``close``
(which write back every dirty row and keep the rows cached, now clean).

Devices: the cache lives on the ``device`` given (``torch.device``); nothing moves to a GPU
implicitly. Rows cross between host and device only on a cache miss (host → device) and a
write-back (device → host). ``lookup`` returns host numpy rows (the table interface the
sharded store's CPU all_to_all uses); ``lookup_tensor`` / ``peek_tensor`` return them on the
device, and ``apply_gradients`` takes gradients on the device too: a one-process store whose
tables are all device caches gathers, pools and updates its cached rows on the device (the
GPU tier; ``ShardedEmbeddingStore._read_on_device``). The suite runs this code on the CPU
device; the ``cuda``-marked tests run it on a GPU with ``device="cuda:N"``.

Counters (merged with the host's): ``cache_hits`` / ``cache_misses`` (keys with a row
found / not found in the cache), ``cache_evictions``, ``writebacks`` (rows written back),
and ``updated`` counts device and host updates together.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from recsys.store.tables import optim
from recsys.store.tables.keymap import KeyMap, as_keys, distinct
from recsys.store.tables.rowblock import RowBlock
from recsys.store.tables.table import CapacityError, EmbeddingTable, check_push

__all__ = ["DeviceArena", "DeviceCache", "DeviceTier", "device_budget_rows", "CACHE_COUNTERS", "apply_update_torch"]

CACHE_COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "writebacks")
_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                 np.dtype(np.int64): torch.int64}


class DeviceTier:
    """What the device tiers over a host ``EmbeddingTable`` share (``DeviceCache``,
    ``recsys.store.device.table.DeviceTable``): ``host``, the device rows ``_w``, and a
    ``write_back_all`` that brings the host's rows up to date before anything reads them."""

    host: EmbeddingTable
    device: torch.device
    cfg: object
    _w: torch.Tensor
    _state: dict[str, torch.Tensor]

    def write_back_all(self) -> int:
        raise NotImplementedError

    def lookup_slots(self, keys_U: np.ndarray, step: int) -> np.ndarray:
        """Do a training lookup's key work; return each key's device slot (-1: no row)."""
        raise NotImplementedError

    def gradient_slots(self, keys_U: np.ndarray, grads_UD: torch.Tensor, step: int,
                       slots_hint: np.ndarray | None = None, hint_departures: int | None = None,
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Return (positions in ``keys_U`` of the keys updated on the device, their slots)."""
        raise NotImplementedError

    def insert_rows(self, rows: pa.Table) -> None:
        raise NotImplementedError

    def lookup_tensor(self, keys_U: np.ndarray, step: int) -> torch.Tensor:
        """Return float32 [U, D] rows on the device (zeros for keys without a row)."""
        return self._gather(self.lookup_slots(keys_U, step))

    def apply_gradients(self, keys_U: np.ndarray, grads_UD, step: int, slots_hint: np.ndarray | None = None,
                        hint_departures: int | None = None) -> None:
        """Apply the sparse optimizer to the rows of the unique keys ``keys_U`` (as
        ``EmbeddingTable``): on the device for the rows there (``gradient_slots``)."""
        grads = torch.as_tensor(grads_UD, dtype=torch.float32)  # host or device: a device's stay there
        sel, slots = self.gradient_slots(keys_U, grads, step, slots_hint, hint_departures)
        if sel.shape[0]:
            if sel.shape[0] < grads.shape[0]:
                grads = grads.index_select(0, torch.from_numpy(sel).to(grads.device))
            _update_rows(self.cfg, self._w, self._state, slots, grads.to(self.device))

    def __len__(self) -> int:
        """Return the number of rows of the table (held by the host, cached rows included)."""
        return len(self.host)

    def lookup(self, keys_U: np.ndarray, step: int, out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 [U, D] host rows of the unique keys ``keys_U`` (as ``EmbeddingTable``)."""
        rows = self.lookup_tensor(keys_U, step).cpu().numpy()
        if out is None:
            return rows
        out[...] = rows
        return out

    def flush(self) -> None:
        """Write the device's rows back to the host, then flush the host's spill writes."""
        self.write_back_all()
        self.host.flush()

    def close(self) -> None:
        """Write the device's rows back, then close the host (its spill tier)."""
        self.write_back_all()
        self.host.close()

    def state_dict(self) -> pa.Table:
        """Return every row (``EmbeddingTable.state_dict``), the device's values."""
        self.write_back_all()
        return self.host.state_dict()

    def load_state_dict(self, rows: pa.Table) -> None:
        """Merge ``rows`` into the table (``insert_rows``)."""
        self.insert_rows(rows)

    def admission_state(self) -> dict | None:
        """Return the host's admission sketch state."""
        return self.host.admission_state()

    def load_admission_state(self, state: dict | None) -> None:
        """Restore the host's admission sketch state."""
        self.host.load_admission_state(state)

    def _gather(self, slots: np.ndarray) -> torch.Tensor:
        """Return float32 copies of the device rows ``slots`` (zeros where a slot is -1)."""
        absent = slots < 0
        idx = torch.from_numpy(np.where(absent, 0, slots)).to(self.device)
        out = self._w.index_select(0, idx).float()
        if absent.any():
            out[torch.from_numpy(absent).to(self.device)] = 0.0
        return out


class DeviceCache(DeviceTier):
    """A write-back LRU cache of up to ``rows`` rows of ``host`` on ``device`` (see module doc).

    Not thread-safe: the store serializes calls.
    """

    def __init__(self, host: EmbeddingTable, rows: int, device: torch.device | str,
                 arena: "DeviceArena | None" = None) -> None:
        """``arena``: keep the rows and state in ``arena``'s block for this table (one array
        for every table of a store, so a step's gathers and updates are one call each)."""
        if rows <= 0:
            raise ValueError(f"table {host.name!r}: device cache rows must be > 0, found {rows}")
        self.host = host
        self.name, self.spec, self.cfg, self.dim = host.name, host.spec, host.cfg, host.dim
        self.capacity = host.capacity
        self.rows = int(rows)
        self.device = torch.device(device)
        self._map = KeyMap(self.rows)
        self._np_dtype = np.dtype(self.cfg.dtype)
        self._columns = optim.state_columns(self.cfg.optimizer)
        self.arena, self.offset = arena, 0
        if arena is None:
            self._w, self._state = _allocate(self.cfg, self.rows, self.dim, self.device)
        else:
            self.offset = arena.offsets[self.name]
            if arena.rows[self.name] != self.rows:
                raise ValueError(f"table {self.name!r}: the arena holds {arena.rows[self.name]} rows, not {self.rows}")
            self._w, self._state = arena.block(self.name)
        self._dirty = np.zeros(self.rows, dtype=bool)
        self._counters = dict.fromkeys(CACHE_COUNTERS, 0)
        self._updated = 0

    @property
    def spill(self):
        """Return the host's spill tier (None without one)."""
        return self.host.spill

    def prefetch(self, keys_U: np.ndarray) -> int:
        """Have the host's spill tier read ahead the rows of ``keys_U`` the host does not hold
        (``EmbeddingTable.prefetch``; keys cached here are read only if the host spilled them,
        and a read not asked for is dropped at the host's next fetch)."""
        return self.host.prefetch(keys_U)

    def cached(self) -> int:
        """Return the number of rows cached on the device."""
        return len(self._map)

    def counters(self) -> dict[str, int]:
        """Return the host's counters with the cache's (``updated`` includes device updates)."""
        out = self.host.counters()
        out["updated"] += self._updated
        out.update(self._counters)
        out["cached"] = len(self._map)
        return out

    # ------------------------------------------------------------------ reads

    def lookup_slots(self, keys_U: np.ndarray, step: int) -> np.ndarray:
        """Do ``lookup_tensor``'s work but the gather: return each key's cache slot (-1: the
        key has no row, e.g. not yet admitted), its row on the device from now on."""
        keys = as_keys(keys_U)
        step = int(step)
        if keys.shape[0] > self.rows and (touched := distinct(keys).shape[0]) > self.rows:
            raise CapacityError(self.name, step, touched, self.rows, holder="its device cache",
                                fix="store.device.cache_rows (or store.device.memory_gb)")
        clock = self._map.clock
        if clock is not None and step < clock:
            raise ValueError(f"table {self.name!r}: lookup step {step} is before the previous lookup's step {clock}")
        miss = self._map.find(keys) < 0
        has_row, block = self.host.lookup_rows(keys, step, miss)  # raises with nothing changed
        upd = self._map.lookup(keys[has_row], step)
        c = self._counters
        c["cache_hits"] += upd.hits
        c["cache_misses"] += int(has_row.sum()) - upd.hits
        wb = None
        k = upd.evicted_keys_K.shape[0]
        if k:
            c["cache_evictions"] += k
            ev_slots = upd.evicted_slots_K
            dirty = self._dirty[ev_slots]
            if dirty.any():  # copied out before the new rows overwrite the slots
                wb = self._block(upd.evicted_keys_K[dirty], ev_slots[dirty], upd.evicted_steps_K[dirty])
        if upd.new_keys_M.shape[0]:
            order = np.argsort(block.keys, kind="stable")
            pos = order[np.searchsorted(block.keys, upd.new_keys_M, sorter=order)]
            self._load(upd.new_slots_M, block.take(pos))
            self._dirty[upd.new_slots_M] = False
        slots = np.full(keys.shape[0], -1, dtype=np.int64)
        slots[has_row] = upd.slots_N
        if wb is not None:  # last: the cache is consistent even if the host raises (rows kept there)
            c["writebacks"] += wb.num_rows
            self.host.write_back(wb)
        return slots

    def peek(self, keys_U: np.ndarray, init_missing: bool = False, found_out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 [U, D] rows of ``keys_U``, cached ones from the device; changes
        nothing. ``found_out``: as ``EmbeddingTable.peek``."""
        keys = as_keys(keys_U)
        slots = self._map.find(keys)
        cached = slots >= 0
        out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        if cached.any():
            out[cached] = self._gather(slots[cached]).cpu().numpy()
        if found_out is not None:
            found_out[cached] = True
        if not cached.all():
            host_found = None if found_out is None else np.empty(int((~cached).sum()), dtype=bool)
            out[~cached] = self.host.peek(keys[~cached], init_missing=init_missing, found_out=host_found)
            if found_out is not None:
                found_out[~cached] = host_found
        return out

    def peek_tensor(self, keys_U: np.ndarray, init_missing: bool = False) -> torch.Tensor:
        """Return ``peek``'s float32 [U, D] rows on the device: cached rows gathered there,
        the others read from the host and copied over. Changes nothing."""
        keys = as_keys(keys_U)
        slots = self._map.find(keys)
        out = self._gather(slots)  # zeros where not cached
        rest = np.flatnonzero(slots < 0)
        if rest.shape[0]:
            host_rows = self.host.peek(keys[rest], init_missing=init_missing)
            out[torch.from_numpy(rest).to(self.device)] = torch.from_numpy(host_rows).to(self.device)
        return out

    # ------------------------------------------------------------------ updates

    @property
    def departures(self) -> int:
        """How many calls may have taken keys out of their cache slots (``KeyMap.departures``)."""
        return self._map.departures

    def gradient_slots(self, keys_U: np.ndarray, grads_UD: torch.Tensor, step: int,
                       slots_hint: np.ndarray | None = None, hint_departures: int | None = None,
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Do ``apply_gradients``'s work but the device update: apply the host's optimizer to
        the keys not cached; return (positions in ``keys_U`` of the cached keys, their
        slots), which the caller updates on the device (marked dirty here). ``slots_hint``
        / ``hint_departures``: ``lookup_slots``'s slots and ``departures`` after it."""
        keys = as_keys(keys_U)
        check_push(self.name, self.dim, keys, tuple(grads_UD.shape), step, self._map.clock)
        slots = self._map.find(keys, slots_hint, hint_departures)
        cached = slots >= 0
        sel = np.flatnonzero(cached)
        self._dirty[slots[sel]] = True
        self._updated += sel.shape[0]
        if sel.shape[0] < keys.shape[0]:
            rest = np.flatnonzero(~cached)
            host_grads = grads_UD.index_select(0, torch.from_numpy(rest).to(grads_UD.device)).cpu().numpy()
            self.host.apply_gradients(keys[rest], host_grads, step)
        return sel, slots[sel]

    # ------------------------------------------------------------------ rows in and out

    def write_back_all(self) -> int:
        """Write every dirty cached row back to the host (rows stay cached); return how many."""
        keys, slots, steps = self._map.items()
        dirty = self._dirty[slots]
        if not dirty.any():
            return 0
        wb = self._block(keys[dirty], slots[dirty], steps[dirty])
        self.host.write_back(wb)
        self._dirty[slots[dirty]] = False
        self._counters["writebacks"] += wb.num_rows
        return wb.num_rows

    def insert_rows(self, rows: pa.Table) -> None:
        """Put rows into the host exactly; cached copies of their keys are dropped (stale)."""
        if isinstance(rows, pa.Table) and "key" in rows.column_names:
            self._drop(rows.column("key").to_numpy())
        self.host.insert_rows(rows)

    def pop_rows(self, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` (written back first if dirty) and return them."""
        keys = as_keys(keys)
        slots = self._map.find(keys)
        dirty = (slots >= 0) & self._dirty[np.maximum(slots, 0)]
        if dirty.any():
            sel = distinct(slots[dirty])
            self.host.write_back(self._block(self._map.slot_key[sel], sel, self._map.steps_of(sel)))
            self._counters["writebacks"] += sel.shape[0]
        self._drop(keys)
        return self.host.pop_rows(keys)

    # ------------------------------------------------------------------ internals

    def _drop(self, keys: np.ndarray) -> None:
        """Forget cached copies of ``keys`` without writing them back."""
        slots = self._map.remove(as_keys(keys))
        self._dirty[slots[slots >= 0]] = False

    def _block(self, keys: np.ndarray, slots: np.ndarray, steps: np.ndarray) -> RowBlock:
        """Return host copies of the cached rows in ``slots``."""
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)
        emb = self._w.index_select(0, idx).cpu().numpy()
        states = {name: t.index_select(0, idx).cpu().numpy() for name, t in self._state.items()}
        return RowBlock(np.ascontiguousarray(keys, dtype=np.int64), emb, states,
                        np.ascontiguousarray(steps, dtype=np.int64))

    def _load(self, slots: np.ndarray, block: RowBlock) -> None:
        """Copy host rows ``block`` into the cache's ``slots``."""
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)
        self._w.index_copy_(0, idx, torch.from_numpy(np.ascontiguousarray(block.emb)).to(self.device, self._w.dtype))
        for name, t in self._state.items():
            t.index_copy_(0, idx, torch.from_numpy(np.ascontiguousarray(block.states[name])).to(self.device))


def device_budget_rows(specs: dict, cfg) -> dict[str, int]:
    """Return the device cache rows of each table (its shard's ``TableSpec``) under
    ``cfg.device.memory_gb``: every table's capacity when all fit, else the budget shared in
    proportion to capacity (at least 1 row each). Empty without a budget."""
    if not cfg.device.memory_gb or not specs:
        return {}
    itemsize = np.dtype(cfg.dtype).itemsize
    budget = cfg.device.memory_gb * 2**30
    rows: dict[str, int] = {}
    per_row = {}
    for name, spec in specs.items():
        state = sum((spec.dim if c.per_dim else 1) * np.dtype(c.dtype).itemsize
                    for c in optim.state_columns(cfg.optimizer))
        per_row[name] = spec.dim * itemsize + state
    need = sum(spec.capacity * per_row[name] for name, spec in specs.items())
    share = min(1.0, budget / need)
    for name, spec in specs.items():
        rows[name] = max(1, min(spec.capacity, int(spec.capacity * share)))
    return rows


class DeviceArena:
    """The device rows and optimizer state of every table of a store, one array each (a
    block of ``rows[name]`` rows per table, in the order given) plus one zero row at the end
    (``zero_row``) that is never updated: a step gathers all its rows, and updates them, with
    one call each over all tables instead of one per table."""

    def __init__(self, cfg, rows: dict[str, int], dim: int, device: torch.device | str) -> None:
        self.cfg, self.rows, self.device = cfg, dict(rows), torch.device(device)
        self.offsets, total = {}, 0
        for name, n in self.rows.items():
            self.offsets[name] = total
            total += int(n)
        self.zero_row = total
        self.w, self.state = _allocate(cfg, total + 1, dim, self.device)

    def block(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return views of table ``name``'s rows and state."""
        a, b = self.offsets[name], self.offsets[name] + self.rows[name]
        return self.w[a:b], {k: t[a:b] for k, t in self.state.items()}

    def gather(self, rows_N: np.ndarray) -> torch.Tensor:
        """Return float32 [N, D] copies of the arena's rows ``rows_N`` (one call)."""
        return self.w.index_select(0, torch.from_numpy(rows_N).to(self.device)).float()

    def update(self, rows_N: np.ndarray, grads_ND: torch.Tensor) -> None:
        """Apply the optimizer to the arena's distinct rows ``rows_N`` (one call)."""
        _update_rows(self.cfg, self.w, self.state, rows_N, grads_ND.to(self.device))


def _allocate(cfg, rows: int, dim: int, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    w = torch.zeros((rows, dim), dtype=_TORCH_DTYPES[np.dtype(cfg.dtype)], device=device)
    state = {c.name: torch.zeros((rows, dim) if c.per_dim else (rows,), dtype=_TORCH_DTYPES[np.dtype(c.dtype)],
                                 device=device)
             for c in optim.state_columns(cfg.optimizer)}
    return w, state


def _update_rows(cfg, w_all: torch.Tensor, state_all: dict[str, torch.Tensor], rows: np.ndarray,
                 g: torch.Tensor) -> None:
    """Apply ``cfg.optimizer`` to the distinct ``rows`` of ``w_all`` and their state, in place."""
    idx = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(w_all.device)
    w = w_all.index_select(0, idx).float()
    state = {name: t.index_select(0, idx) for name, t in state_all.items()}
    apply_update_torch(cfg, w, state, g)
    w_all.index_copy_(0, idx, w.to(w_all.dtype))
    for name, t in state_all.items():
        t.index_copy_(0, idx, state[name])


# --------------------------------------------------------------------------- torch optimizers


def apply_update_torch(cfg, w: torch.Tensor, state: dict[str, torch.Tensor], g: torch.Tensor) -> None:
    """Apply ``cfg.optimizer`` in place to float32 rows ``w`` [U, D] and their ``state`` rows,
    one gradient row each, with ``recsys.store.tables.optim``'s formulas (float32 math, per-row
    scalars formed in float64). Results agree with the numba kernels to float rounding
    (row-wise Adagrad sums ``g'^2`` in another order)."""
    f32 = torch.float32
    lr, eps, wd = _f32(cfg.lr), _f32(cfg.eps), _f32(cfg.weight_decay)
    gd = g + wd * w if cfg.weight_decay else g
    opt = cfg.optimizer
    if opt == "rowwise_adagrad":
        st = state["rowwise_state"] + (gd * gd).sum(dim=1) * _f32(1.0 / w.shape[1])
        state["rowwise_state"].copy_(st)
        mult = lr / (torch.sqrt(st) + eps)
        w.sub_(mult.unsqueeze(1) * gd)
    elif opt == "adagrad":
        st = state["state_sum"] + gd * gd
        state["state_sum"].copy_(st)
        w.sub_(lr * (gd / (torch.sqrt(st) + eps)))
    elif opt == "adam":
        t = state["adam_step"] + 1
        state["adam_step"].copy_(t)
        td = t.to(torch.float64)
        step_size = (float(cfg.lr) / (1.0 - torch.pow(float(cfg.beta1), td))).to(f32).unsqueeze(1)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(float(cfg.beta2), td)).to(f32).unsqueeze(1)
        b1, b2 = _f32(cfg.beta1), _f32(cfg.beta2)
        m = b1 * state["exp_avg"] + _f32(1.0 - cfg.beta1) * gd
        v = b2 * state["exp_avg_sq"] + (_f32(1.0 - cfg.beta2) * gd) * gd
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        w.sub_(step_size * (m / (torch.sqrt(v) / bc2_sqrt + eps)))
    elif opt == "sgd":
        w.sub_(lr * gd)
    else:
        raise ValueError(f"unknown optimizer {opt!r}")


def _f32(x: float) -> float:
    """Return ``x`` rounded to float32 (as a Python float: torch keeps float32 tensors float32)."""
    return float(np.float32(x)) if math.isfinite(x) else x
