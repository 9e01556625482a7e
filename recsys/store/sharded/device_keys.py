"""The sharded store with ``store.device.key_map = "device"``: every table's keys, rows and
optimizer held by one ``DeviceSparse`` (``recsys.store.device.keymap``), no host key work.

Legend: ``B`` rows in the batch, ``F`` features, ``N`` keys of the batch, ``D`` dim, ``U``
unique keys of one table.

A training step, on the store's op sequence (``recsys.store.sharded.schedule``)::

    lookup arrives:  keys_N, lengths_FB (and id weights) ──► the device, once (pinned,
                     non_blocking, on the store's side stream: ``recsys.runtime.transfer``)
    lookup runs:     (after the push of step t - 1 was applied: staleness 0)
                     DeviceSparse.forward(keys, lengths, t) ──► pooled [B, F·D] ──► [B, F, D]
    the trainer:     model(dense, pooled) ─► loss.backward() (the gradient reaches the step's rows)
    push runs:       DeviceSparse.update(t)   (before the next lookup's forward, in order)

``DeviceSparse`` needs ``forward(t + 1)`` after ``update(t)``; the schedule runs a training
lookup only after applying every push it must see, so at staleness 0 the device sees the
calls in that order (staleness > 0 is refused: ``refusal``). An evaluation lookup
(``train=False``) touches nothing: its keys are deduplicated on the host (``index_batch``),
their rows read (``DeviceSparse.peek_rows``) and the absent keys given their initial rows,
as the host store's evaluation does (``EmbeddingTable.peek(init_missing=True)``); the
store pools them as it pools any lookup. A batch without keys (the look-ahead after the
last batch of an epoch) runs no forward: its pooled rows are zeros and its push does
nothing. Counters are read from the device when asked (the trainer: every ``log_every``
steps), with ``DeviceSparse.counters``' errors.

With ``store.device.cache_rows`` below a table's capacity the store holds a
``DeviceCachedSparse`` instead (``recsys.store.device.cached``): the same index as an
exact-LRU cache of ``cache_rows`` rows per table in front of a host ``EmbeddingTable`` of
the rest; ``prepare`` deduplicates the batch's keys per table on the host (ahead of the
step), and before each forward the host learns the step's cache misses (one blocking read),
gives the rows it holds to the device and takes the rows the cache demotes. Training,
counters and checkpoints are those of one host table of the whole capacity.

Checkpoints hold the same per-table Arrow rows as the host store's (``state_dict``,
``load_state_dict``), so either key map resumes the other's. ``KeyMapTable`` is one table's
view for the store's per-table calls (``peek``, ``pop_rows``, ``load_state_dict``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import torch

from recsys.features.schema import Schema
from recsys.runtime.transfer import Transfers, arrive
from recsys.store.config import StoreConfig
from recsys.store.tables.initial import init_vectors

__all__ = ["DeviceKeys", "DeviceLookup", "KeyMapTable", "refusal"]


def refusal(schema: Schema, cfg: StoreConfig, world_size: int, publish: bool = False) -> str | None:
    """Return why ``store.device.key_map = "device"`` cannot hold this job's tables (one
    line), or None when it can (or the key map is the host's)."""
    if cfg.device.key_map != "device":
        return None
    from recsys.store.device.cache import device_budget_rows

    why = 'store.device.key_map = "device" needs '
    if world_size != 1:
        return why + f"one process, found {world_size} (use key_map = \"host\" with several ranks)"
    if cfg.spill.url:
        return why + "no spill tier (store.spill.url is set)"
    if cfg.min_count > 1:
        return why + f"store.min_count = 1 (admission keeps host key work), found {cfg.min_count}"
    if cfg.dtype != "float32":
        return why + f"store.dtype = \"float32\", found {cfg.dtype!r}"
    if cfg.staleness:
        return why + f"store.staleness = 0 (its forward of step t follows the update of t - 1), found {cfg.staleness}"
    if publish:
        return why + "no live publishing (publish.enabled reads host rows after every push)"
    dims = sorted({spec.dim for spec in schema.tables.values()})
    if len(dims) > 1:
        return why + f"every table of one dim, found {dims}"
    if not schema.tables:
        return why + "at least one table"
    if cfg.device.cache_rows:  # tables above it: a device cache in front of a host table (cached.py)
        return None
    budget = device_budget_rows(dict(schema.tables), cfg)
    short = [name for name, spec in schema.tables.items() if budget.get(name, 0) < spec.capacity]
    if short:
        return why + (f"every table whole on the device; {len(short)} do not fit (first: {short[0]!r}): raise "
                      "store.device.memory_gb, or set store.device.cache_rows (rows per table on the device, "
                      "in front of host tables)")
    return None


@dataclasses.dataclass(slots=True)
class _Moved:
    """A training lookup's keys on their way to the device (``DeviceKeys.prepare``)."""

    kjt: object  # the host KeyedJaggedTensor (an evaluation lookup reads it instead)
    batch_size: int
    tensors: list  # keys_N, lengths_FB and the id weights (or None), on the device
    ready: object = None  # the copy's event (None: done)
    uniq: object = None  # the cached tier: each host-backed table's distinct keys (DeviceCachedSparse.dedup)
    reserved: bool = False  # its key work done ahead (``DeviceKeys.reserve``), or none to do


@dataclasses.dataclass(slots=True)
class DeviceLookup:
    """A training lookup of ``DeviceKeys``: the pooled embeddings, differentiable w.r.t. the
    step's rows (``DeviceSparse.forward``); ``push`` applies their gradients."""

    step: int
    batch_size: int
    pooled_BFD: torch.Tensor
    forwarded: bool  # False: a batch without keys (no forward, nothing to update)
    parts: list = dataclasses.field(default_factory=list)

    def pooled(self, num_features: int | None = None) -> torch.Tensor:
        """Return pooled embeddings [B, F, D] in schema feature order."""
        if num_features is not None and self.pooled_BFD.shape[1] != num_features:
            raise ValueError(f"pooled: {self.pooled_BFD.shape[1]} features, caller expected {num_features}")
        return self.pooled_BFD


class DeviceKeys:
    """Every table of a one-process store in one ``DeviceSparse`` on ``device`` (module doc).
    Not thread-safe: the store's op sequence makes every call."""

    def __init__(self, schema: Schema, cfg: StoreConfig, device: torch.device | str) -> None:
        from recsys.store.device.keymap import DeviceSparse

        self.schema, self.cfg, self.device = schema, cfg, torch.device(device)
        features = [(f.name, f.table, f.pooling) for f in schema.sparse]
        R = cfg.device.cache_rows
        self.cached = bool(R) and any(min(s.capacity, s.num_rows or s.capacity) > R for s in schema.tables.values())
        if self.cached:  # some table larger than the cache: the cached tier (recsys.store.device.cached)
            from recsys.store.device.cached import DeviceCachedSparse

            self.sparse = DeviceCachedSparse(dict(schema.tables), features, cfg, self.device)
        else:
            self.sparse = DeviceSparse(dict(schema.tables), features, cfg, self.device)
        self.F, self.dim = len(features), self.sparse.dim
        self._weighted = any(f.weighted for f in schema.sparse)
        self._single = np.array([not f.multi_hot for f in schema.sparse], dtype=bool)
        self._to_device = Transfers(self.device)
        self._bound = float(cfg.init_bound(self.dim))

    # ------------------------------------------------------------------ training

    def prepare(self, kjt) -> _Moved:
        """Start the copy of a batch's keys, lengths and id weights to the device."""
        keys = kjt.values()
        lengths = kjt.lengths()
        weights = self._id_weights(kjt)
        moved, ready = self._to_device.to_device([t for t in (keys, lengths, weights) if t is not None])
        if weights is None:
            moved.append(None)
        uniq = self.sparse.dedup(keys.numpy(), lengths.numpy()) if self.cached else None  # host work, ahead
        return _Moved(kjt, kjt.stride(), moved, ready, uniq)

    def reserve(self, moved: _Moved, step: int | None) -> None:
        """The key work of a training lookup first in line, before the pushes it must see are
        applied (the schedule's ``reserve``): with the cached tier, the host is asked for the
        step's misses now (``DeviceCachedSparse.prefetch``), while the step before runs; its
        forward (already on the device) comes first in the device's order. Nothing otherwise."""
        if self.cached and moved.uniq is not None and step is not None:
            self.sparse.prefetch(moved.uniq, step)
        moved.reserved = True

    def _id_weights(self, kjt) -> torch.Tensor | None:
        """Return the per-key weights the host store pools with: the given ones for multi-hot
        features when a feature is weighted, 1 for single-hot ones (None: no weights)."""
        given = kjt.weights_or_none()
        if given is None or not self._weighted:
            return None
        w = given.to(torch.float32).clone()
        offs = np.asarray(kjt.offset_per_key(), dtype=np.int64)
        for f in np.flatnonzero(self._single):
            w[offs[f] : offs[f + 1]] = 1.0
        return w

    def lookup(self, moved: _Moved, step: int) -> DeviceLookup:
        """Run the training forward of ``step`` on the moved batch."""
        keys, lengths, weights = moved.tensors
        B = moved.batch_size
        if keys.shape[0] == 0:  # no keys: nothing to look up or update
            zeros = torch.zeros((B, self.F, self.dim), dtype=torch.float32, device=self.device)
            return DeviceLookup(step, B, zeros.requires_grad_(True), forwarded=False)
        arrive(moved.tensors, moved.ready)  # this thread's stream waits for the copy
        if self.cached:  # the cache's key work reads the host's copy of the keys
            pooled = self.sparse.forward(keys, lengths, step, weights, uniq=moved.uniq)
        else:
            pooled = self.sparse.forward(keys, lengths, step, weights)
        return DeviceLookup(step, B, pooled.view(B, self.F, self.dim), forwarded=True)

    def push(self, lookup: DeviceLookup) -> None:
        """Apply the optimizer to the rows of ``lookup``'s step (after backward)."""
        if not lookup.forwarded:
            return
        self.sparse.update(lookup.step)

    def cancel(self, step: int) -> None:
        """Withdraw the update of ``step``'s forward (a look-ahead never trained on)."""
        self.sparse.cancel(step)

    # ------------------------------------------------------------------ reads

    def peek(self, table: str, keys: np.ndarray, init_missing: bool = False,
             found_out: np.ndarray | None = None) -> np.ndarray:
        """Return float32 [U, D] rows of ``table``'s ``keys``; changes nothing. Absent keys
        read zeros, or with ``init_missing`` their initial row (``EmbeddingTable.peek``)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        rows = self.sparse.peek_rows(table, keys)
        if found_out is None and not init_missing:
            return rows
        found = self.sparse.held(table, keys)
        if found_out is not None:
            found_out[...] = found
        if init_missing and not found.all():
            absent = ~found
            rows[absent] = init_vectors(keys[absent], self.dim, table, self.cfg.seed, self._bound)
        return rows

    def counters(self) -> dict[str, dict[str, int]]:
        """Return each table's counters (one read from the device)."""
        return self.sparse.counters()

    def state_dict(self) -> dict[str, pa.Table]:
        return self.sparse.state_dict()


class KeyMapTable:
    """One table of a ``DeviceKeys`` store, for the store's per-table calls."""

    def __init__(self, keys: DeviceKeys, name: str) -> None:
        self.keys, self.name = keys, name
        self.spec = keys.schema.tables[name]
        self.dim = keys.dim

    @property
    def spill(self):
        return None

    def peek(self, keys_U: np.ndarray, init_missing: bool = False, found_out: np.ndarray | None = None) -> np.ndarray:
        return self.keys.peek(self.name, keys_U, init_missing, found_out)

    def counters(self) -> dict[str, int]:
        return self.keys.counters()[self.name]

    def state_dict(self) -> pa.Table:
        return self.keys.state_dict()[self.name]

    def load_state_dict(self, rows: pa.Table) -> None:
        self.keys.sparse.load_state_dict({self.name: rows})

    def pop_rows(self, keys: np.ndarray) -> pa.Table:
        return self.keys.sparse.pop_rows(self.name, keys)

    def __len__(self) -> int:
        return int(self.counters()["rows"])
