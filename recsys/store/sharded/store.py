"""The sharded embedding store: rows owned by rank, batch-local lookups, bounded-stale pushes.

Legend: ``B`` rows in the batch, ``F`` features, ``T`` tables, ``U`` unique keys of one
table in the batch, ``D`` table dim, ``W`` world size, ``R`` keys a rank receives.

One training step, seen from rank r (W = 2)::

    batch KJT ──► _prepare: index_batch → every table's keys_U (first appearance), the
                     │      pooling indices (single_idx, bags); owner = owner_of(key, W)
                     ▼
    _reserve:  all_to_all(keys) ──► owner: table.reserve(unique received keys) → slots
                     │              (touch, insert, evict, init: no row values read)
                     ▼   ...the pushes this lookup must see are applied here...
    _read:     all_to_all(rows) ◄── owner: table.read(slots)
                     │
    rows_all [ΣU + 1, D] ──► Lookup.pooled(): one kernel ──► pooled [B, F, D] (a leaf)
                                                   ...model, loss, backward...
    push: pooled.grad ──► pool_backward ──► row grads ──► all_to_all(grads)
                     ──► owner: sum over requesters / W ──► sparse optimizer (slot hints)

No ``[num_rows, D]`` gradient ever exists: only the batch's unique rows move.

Staleness (deterministic, not racy): with ``staleness = s`` the lookup of step t sees the
pushes of steps ``<= t - s - 1`` and *none* of steps ``t - s .. t - 1``, whatever the
timing. All store mutations run in one sequence (on a worker thread when ``threaded``,
else in the caller), identical on every rank, on the store's own process group, so
collectives never interleave with DDP's. ``s = 0`` is synchronous training. The part of
a lookup that needs only its batch (dedup of every table's keys in one pass, pooling
indices, owners) runs when the lookup arrives at the worker; its key work (touch,
insert, evict) once it is first in line; only the row reads wait for the pushes the
lookup must see. Pooling runs in ``Lookup.pooled``, its backward on the worker in the push.

Costs: one all_to_all for keys, one for rows and one for gradients per step (all tables
in one message each), plus one for the per-table counts.

The store owns two parts with their own state: its schedule (``self.schedule``, the order of
lookups and pushes on the worker thread: ``recsys.store.sharded.schedule``), to which it
hands its work as functions, and, with W > 1, its exchange (``self.exchange``, the
all-to-alls between ranks and their counters: ``recsys.store.sharded.exchange``), to which
it hands what an owner does with the keys and gradients it receives. Elsewhere: a lookup's
types and its pooling (``recsys.store.sharded.lookup``); the per-table work spread over threads
(``recsys.store.sharded.lanes``); the device tiers and their budget (``recsys.store.device.cache``,
``recsys.store.device.table``); the contracts (``recsys.store.protocols``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.features import hashing
from recsys.runtime.local_exchange import LocalExchange
from recsys.features.schema import Schema, TableSpec
from recsys.store.config import StoreConfig
from recsys.store.tables.dedup import index_batch
from recsys.store.sharded.exchange import RankExchange, route
from recsys.store.tables.fused import TableGroup
from recsys.store.sharded.schedule import StoreSchedule, StoreWork
from recsys.store.host.malloc import keep_freed_memory
from recsys.store.sharded.lanes import Board, Lanes, raise_first
from recsys.store.sharded.lookup import Lookup, _Failed, _Prepared, _TablePart
from recsys.runtime.transfer import Transfers

log = logging.getLogger(__name__)
ADMISSION_FORMAT = 1




class ShardedEmbeddingStore:
    """Return-by-lookup store of every table's rows, sharded over a process group by owner.

    ``group=None`` with no initialized process group means one process owning every row.

    ``run_dir`` / ``job_name``: the training run this store belongs to. With a spill tier
    (``cfg.spill.url``) it spills to the run's namespace (``cfg.spill.namespace``, or when
    empty one derived from the run directory and job: ``SpillConfig.namespace_for``),
    claims it (``<namespace>:owner``; another run's namespace is refused with ``SpillError``
    unless ``cfg.spill.takeover``) and deletes this shard's rows in it: the rows of a run
    are those of the checkpoint it resumes from (``load_state_dict``), or none. With
    ``restoring`` the caller loads a checkpoint (``load_state_dict``) before any other call:
    the start then only finds this shard's rows (one SCAN), and the load deletes those the
    checkpoint lacks and rewrites the others, instead of all of them being deleted first
    (until the load, the spill tiers refuse to read them). A store
    with a configured namespace and no run deletes its rows at start too; one with neither
    spills to temporary namespaces (deleted by ``close``). A ``SpillError`` of a store with
    a run directory also names the latest complete checkpoint, which is intact.
    """

    def __init__(
        self,
        schema: Schema,
        cfg: StoreConfig,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        threaded: bool = False,
        table_factory: Callable[[str, TableSpec, StoreConfig], object] | None = None,
        run_dir: str | os.PathLike | None = None,
        job_name: str = "job",
        restoring: bool = False,
        local_exchange: bool = True,
        collective_timeout_s: float = 300.0,
    ) -> None:
        if cfg.host.keep_freed_memory:
            keep_freed_memory()
        self.schema = schema
        self.run_dir = None if run_dir is None else Path(os.path.abspath(run_dir))
        if cfg.spill.url and self.run_dir is not None:
            spill = dataclasses.replace(cfg.spill, namespace=cfg.spill.namespace_for(self.run_dir, job_name))
            cfg = dataclasses.replace(cfg, spill=spill)
        self.cfg = cfg
        self.device = torch.device(device)
        if group is None and dist.is_available() and dist.is_initialized():
            # A group of our own: store collectives may run on a worker thread while the
            # trainer's DDP collectives run on the main thread.
            group = dist.new_group(backend="gloo")
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # ranks of one host exchange through shared memory (recsys.runtime.local_exchange), others by gloo
        local = (LocalExchange.open(group, collective_timeout_s)
                 if local_exchange and self.world_size > 1 else None)
        self.exchange = RankExchange(group, self.world_size, self.rank, local) if self.world_size > 1 else None
        self.table_names = list(schema.tables)
        self._keys = None  # store.device.key_map = "device": every table in one DeviceSparse
        if cfg.device.key_map == "device":
            from recsys.errors import UserError
            from recsys.store.sharded.device_keys import refusal

            why = refusal(schema, cfg, self.world_size)
            if why is None and table_factory is not None:
                why = 'store.device.key_map = "device" holds its own tables (a table factory was given)'
            if why is not None:
                raise UserError(why)
        from recsys.store.device.cache import device_budget_rows

        budget_rows = device_budget_rows(
            {name: self._shard_spec(spec) for name, spec in schema.tables.items()}, cfg)
        self._arena = None  # every table's device cache in one array (recsys.store.device.cache.DeviceArena)
        # each table's device cache rows (0: none), from device.cache_rows or the budget
        self._cache_rows = {name: cfg.device.cache_rows or budget_rows.get(name, 0)
                            for name in schema.tables}
        if cfg.device.key_map == "device":
            from recsys.store.sharded.device_keys import DeviceKeys, KeyMapTable

            self._keys = DeviceKeys(schema, cfg, self.device)
            self._cache_rows = {name: 0 for name in schema.tables}
        cache_rows = self._cache_rows
        if self._keys is None and table_factory is None and cache_rows and all(cache_rows.values()):
            from recsys.store.device.cache import DeviceArena

            dims = {spec.dim for spec in schema.tables.values()}
            if len(dims) == 1:  # else the check below raises
                self._arena = DeviceArena(cfg, cache_rows, dims.pop(), self.device)
        self.tables = {
            name: (KeyMapTable(self._keys, name) if self._keys is not None
                   else self._make_table(table_factory, name, self._shard_spec(spec), cfg))
            for name, spec in schema.tables.items()
        }
        try:
            self._start_spill(job_name, restoring)
        except BaseException as exc:
            for table in self.tables.values():
                spill = getattr(table, "spill", None)
                if spill is not None:
                    spill.abandon()
            raise self._explain(exc) from None
        self._features_of = {
            t: [i for i, f in enumerate(schema.sparse) if f.table == t] for t in self.table_names
        }
        self._mean = np.array([f.pooling == "mean" for f in schema.sparse])
        self._weighted = np.array([f.weighted for f in schema.sparse], dtype=bool)
        dims = {spec.dim for spec in schema.tables.values()}
        if len(dims) > 1:
            raise ValueError(f"the store keeps one embedding dim across tables, found {sorted(dims)}")
        self.dim = dims.pop() if dims else 0
        self._single_features = [i for i, f in enumerate(schema.sparse) if not f.multi_hot]
        self._multi_features = [i for i, f in enumerate(schema.sparse) if f.multi_hot]
        # the batch indexing kernel's view of the schema: features per table (CSR), columns
        self._tf_idx = np.array([f for t in self.table_names for f in self._features_of[t]], dtype=np.int64)
        self._tf_ptr = np.cumsum([0] + [len(self._features_of[t]) for t in self.table_names]).astype(np.int64)
        self._single_col = np.full(len(schema.sparse), -1, dtype=np.int64)
        self._single_col[self._single_features] = np.arange(len(self._single_features))
        self._table_columns = {t: np.isin(np.arange(len(schema.sparse)), self._features_of[t]) for t in self.table_names}
        # per-table work on several threads: plain host tables only (a spill tier's Redis
        # client and a device cache stay on the worker thread)
        plain = (table_factory is None and self._keys is None and not cfg.spill.url
                 and not any(self._cache_rows.values()))
        lanes = (cfg.host.threads or torch.get_num_threads()) if plain and self.device.type == "cpu" else 1
        self._board = Board() if threaded and cfg.host.waiter_helps and plain and self.device.type == "cpu" else None
        self._lanes = Lanes(lanes, self._board)
        # every table plain (float32 host rows, row-wise Adagrad, nothing else attached):
        # training's per-table steps run as one kernel call for all tables
        self._group = TableGroup.of([self.tables[t] for t in self.table_names])
        # rows gathered where they live: every table a device cache, one process (the GPU tier)
        self._device_rows = self.world_size == 1 and bool(self.tables) and all(
            hasattr(t, "lookup_tensor") for t in self.tables.values())
        self._to_device = Transfers(self.device)  # the worker's copies of a lookup's rows and indices
        self._to_host = Transfers(self.device)  # the caller's copies of a push's row gradients
        self._single_cols_t = torch.tensor(self._single_features, dtype=torch.int64, device=self.device)
        self._multi_cols_t = torch.tensor(self._multi_features, dtype=torch.int64, device=self.device)
        self.publisher = None  # recsys.train.live_push.LivePublisher: told of every applied push
        self.schedule = StoreSchedule(
            StoreWork(prepare=self._prepare_for, reserve=self._reserve, lookup=self._do_lookup, push=self._do_push,
                      explain=self._explain),
            cfg.staleness, threaded, self._board)

    @property
    def staleness(self) -> int:
        """Pushes of the last ``staleness`` steps a training lookup does not see (the contract above)."""
        return self.schedule.staleness

    @property
    def visibility(self) -> list[tuple[int, int]]:
        """(push step, the first lookup step that saw it), for every push applied so far."""
        return self.schedule.visibility

    def _make_table(self, table_factory, name: str, spec: TableSpec, cfg: StoreConfig):
        """Return one table's tiers: ``table_factory``'s table (default: an ``EmbeddingTable``
        spilling to ``cfg.spill.url`` if set, listing only this rank's keys), wrapped in a
        ``DeviceCache`` on ``self.device`` when it has cache rows (``device.cache_rows`` or the budget),
        or held whole there as a ``DeviceTable`` when those rows hold it (``fits_whole``)."""
        if table_factory is not None:
            table = table_factory(name, spec, cfg)
        else:
            from recsys.store.tables.table import EmbeddingTable

            spill = None
            if cfg.spill.url:
                from recsys.store.spill.tier import SpillTier

                owns = None
                if self.world_size > 1:
                    world, rank = self.world_size, self.rank
                    owns = lambda keys: hashing.owner_of(keys, world) == rank  # noqa: E731
                spill = SpillTier(name, spec.dim, cfg, owns=owns)
            table = EmbeddingTable(name, spec, cfg, spill=spill)
        rows = self._cache_rows[name]
        if rows > 0:
            from recsys.store.device.cache import DeviceCache
            from recsys.store.device.table import DeviceTable, fits_whole

            if fits_whole(table, rows, self.world_size):  # the whole table on the device
                return DeviceTable(table, self.device, arena=self._arena)
            table = DeviceCache(table, rows, self.device, arena=self._arena)
        return table

    def _spill_tiers(self) -> list:
        return [t.spill for t in self.tables.values() if getattr(t, "spill", None) is not None]

    def _start_spill(self, job_name: str, restoring: bool) -> None:
        """Claim the run's spill namespace and delete this shard's rows in it, or with
        ``restoring`` find them for ``load_state_dict`` (see the class doc)."""
        tiers = self._spill_tiers()
        if not tiers or tiers[0].temporary:
            return
        from recsys.store.spill.tier import clear_tables, find_leftovers

        if self.run_dir is not None:
            taken = tiers[0].claim({"run_dir": str(self.run_dir), "job": job_name}, takeover=self.cfg.spill.takeover)
            if taken is not None:
                log.warning("spill namespace %r taken over from %s (store.spill.takeover)", tiers[0].namespace, taken)
        if restoring:
            n = find_leftovers(tiers)
            if n:
                log.info("found %d spilled rows this shard left in namespace %r: the restore rewrites or deletes them",
                         n, tiers[0].namespace)
            return
        n = clear_tables(tiers)
        if n:
            log.info("deleted %d spilled rows this shard left in namespace %r", n, tiers[0].namespace)

    def _explain(self, exc: BaseException) -> BaseException:
        """Return ``exc``; for a ``CapacityError`` of a table sharded over several processes,
        the same error naming this rank's shard (its capacity is a share of the job's); for a
        ``SpillError`` of a store with a run directory, the same error naming the run's latest
        complete checkpoint (intact: it holds every row)."""
        table_mod = sys.modules.get("recsys.store.tables.table")
        if (table_mod is not None and isinstance(exc, table_mod.CapacityError) and self.world_size > 1
                and exc.holder == "the table" and exc.table in self.schema.tables):
            full = self.schema.tables[exc.table].capacity
            out = table_mod.CapacityError(
                exc.table, exc.step, exc.distinct_ids, exc.capacity, fix=exc.fix,
                holder=f"rank {self.rank}'s shard of the table (capacity {full} over {self.world_size} ranks)")
            out.__cause__ = exc
            return out
        spill_mod = sys.modules.get("recsys.store.spill.tier")
        if (spill_mod is None or not isinstance(exc, spill_mod.SpillError) or self.run_dir is None
                or getattr(exc, "explained", False)):
            return exc
        from recsys.checkpoint import read as checkpoint_files

        try:
            latest = checkpoint_files.latest(self.run_dir / "checkpoints")
            step = checkpoint_files.load_meta(latest)["step"] if latest is not None else None
        except Exception:  # noqa: BLE001 - the note is best effort; the error stands
            latest = step = None
        if latest is not None:
            note = (f"The latest complete checkpoint, {latest} (step {step}), is intact and holds every spilled "
                    f"row: once Redis is back, train again with --run-dir {self.run_dir} to resume from it.")
        else:
            note = f"No checkpoint of the run {self.run_dir} was written yet: once Redis is back, the run starts over."
        out = spill_mod.SpillError(f"{str(exc).rstrip('.')}. {note}", transient=exc.transient)
        out.explained = True
        out.__cause__ = exc
        return out

    def _shard_spec(self, spec: TableSpec) -> TableSpec:
        """Return the spec of this rank's shard: its share of the capacity plus hashing slack.

        Ownership is by hash, so a shard's share of any key set fluctuates around 1/W (by
        about sqrt(n/W)); 4 standard deviations of slack keep a table sized for its whole
        vocabulary from evicting just because it is sharded. One shard holds all rows.
        """
        if self.world_size == 1:
            return spec
        share = spec.capacity / self.world_size
        per_shard = min(spec.capacity, math.ceil(share + 4 * math.sqrt(share) + 8))
        return dataclasses.replace(spec, capacity=per_shard)

    # ------------------------------------------------------------------ public API

    def lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool = True) -> Lookup:
        """Return the batch's rows per table; ``train`` promises a ``push`` (or ``cancel``).

        An evaluation lookup (``train=False``) reads the rows as they are now: it applies
        no queued push and inserts nothing.
        """
        if train:
            self.schedule.check_pushes_before(step)
        return self.submit_lookup(kjt, step, train).result()

    def submit_lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool = True) -> Future:
        """Return a future of ``lookup``. Threaded, it runs once the pushes it must see arrive.

        The ids must be on the host (``Batch.to`` leaves them there): the store hashes them
        to slots on the CPU whatever its ``device``."""
        device = kjt.values().device
        if device.type != "cpu":
            raise ValueError(f"store lookup: the batch's sparse ids are on {device}; the store reads ids on the "
                             "host (keep the KeyedJaggedTensor on the CPU: Batch.to moves only the dense side)")
        return self.schedule.submit_lookup(kjt, step, train)

    def push(self, lookup: Lookup) -> None:
        """Queue the row gradients of ``lookup`` (after backward) for their owners."""
        if self._keys is not None:  # the rows' gradients are on their leaf: DeviceKeys.push
            self.schedule.push(lookup.step, lambda: (lookup, None, None, None))
            return

        def gradients() -> tuple:
            g = lookup.rows_all.grad
            ready = None
            if g is None or g.device.type == "cpu":
                g_rows = None if g is None else g.detach().to(torch.float32)
            elif self._device_rows:  # the optimizer runs where the rows are
                g_rows = g.detach()
            else:  # to the host rows: copied on a side stream; the worker waits for it, not this thread
                (g_rows,), ready = self._to_host.to_host([g.detach().to(torch.float32)])
            leaf = lookup.pooled_leaf
            g_pooled = None if leaf is None or leaf.grad is None else leaf.grad.detach()
            return lookup, g_rows, g_pooled, ready

        self.schedule.push(lookup.step, gradients)

    def cancel(self, lookup: Lookup) -> None:
        """Withdraw the push a training lookup promised (e.g. a look-ahead never trained on).

        With admission (``min_count > 1``), a lookup of the same step made later counts the
        sightings this one counted once in all (``EmbeddingTable.arm_admission_replay``)."""
        self.schedule.cancel(lookup.step)
        if self._keys is not None and lookup.step is not None:  # the device counted its rows ahead
            step, keys = lookup.step, self._keys
            self.schedule.submit_call(lambda: keys.cancel(step))
        if self.cfg.min_count > 1 and lookup.step is not None:
            step = lookup.step

            def arm() -> None:
                for table in self.tables.values():
                    host = getattr(table, "host", table)  # a DeviceCache's host table
                    arm_replay = getattr(host, "arm_admission_replay", None)
                    if arm_replay is not None:
                        arm_replay(step)

            self.schedule.submit_call(arm)

    def flush(self, through_step: int | None = None) -> None:
        """Apply every queued push of steps ``<= through_step`` (all when None) now."""
        self.schedule.flush(through_step)

    def close(self) -> None:
        """Stop the worker thread; queued pushes are applied first. Then close every table:
        device caches write back, spill tiers flush (the first failure is raised after all
        tables were closed)."""
        self.schedule.stop()
        failure = self.schedule.failure
        if failure is not None:
            # the failure was raised to the caller already; the checkpoint holds the truth,
            # so buffered spill writes are dropped instead of waited for
            for spill in self._spill_tiers():
                spill.abandon()
        errors: list[BaseException] = []
        try:
            if failure is None:
                self.schedule.apply_remaining()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the tables closed
            errors.append(exc)
        self._lanes.close()
        if self.exchange is not None:
            self.exchange.close()
        for table in self.tables.values():
            close = getattr(table, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
        if errors and failure is None:
            raise self._explain(errors[0])
        for exc in errors:
            log.warning("closing the store after an earlier failure: %s", exc)

    def attach_publisher(self, make: Callable) -> None:
        """Attach ``make(read_rows)``'s live publisher (``recsys.train.live_push``): told of
        every applied push on the store's op sequence; ``read_rows(table, keys) -> (found,
        rows)`` reads this shard's current rows there and changes nothing."""
        if self._keys is not None:
            from recsys.errors import UserError
            from recsys.store.sharded.device_keys import refusal

            raise UserError(refusal(self.schema, self.cfg, self.world_size, publish=True))
        def read_rows(table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            found = np.empty(keys.shape[0], dtype=bool)
            rows = self.tables[table].peek(keys, found_out=found)
            return found, rows

        self.publisher = make(read_rows)

    def finish_publisher(self, step: int) -> bool:
        """Write the publisher's last snapshot (on the op sequence, after every queued push)."""
        if self.publisher is None:
            return True
        return self.schedule.call(lambda: self.publisher.finish(step))

    def peek_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return this shard's float32 rows of ``keys`` in ``table`` (zeros where absent)."""
        return self.schedule.call(lambda: self.tables[table].peek(np.asarray(keys, dtype=np.int64)))

    def comm_stats(self) -> dict[str, dict]:
        """Return this rank's all-to-alls so far, per kind (``counts``, ``keys``, ``rows``,
        ``grads``): calls, seconds inside the call (the transfer and any wait for the other
        ranks to arrive) and bytes sent to / received from other ranks; ``{}`` with W = 1."""
        return {} if self.exchange is None else self.exchange.stats()

    def counters(self) -> dict[str, dict[str, int]]:
        """Return this shard's counters per table."""
        if self._keys is not None:  # one read from the device, on the op sequence
            return self.schedule.call(self._keys.counters)
        return {name: table.counters() for name, table in self.tables.items()}

    def state_dict(self) -> dict[str, pa.Table]:
        """Return this shard's rows per table (``flush`` first for a consistent snapshot)."""
        state: dict[str, pa.Table] = {}
        self.write_state(state.__setitem__)
        return state

    def write_state(self, each: Callable[[str, pa.Table], None]) -> None:
        """Call ``each(name, rows)`` per table with ``state_dict``'s rows, all in one call on
        the store's worker (the same snapshot), one table's copy of the rows alive at a time:
        a checkpoint's peak memory is the store plus its largest table, not twice the store."""
        def write() -> None:
            if self._keys is not None:  # every table's rows in one read of the device index
                for name, rows in self._keys.state_dict().items():
                    each(name, rows)
                return
            for name, table in self.tables.items():
                rows = table.state_dict()
                each(name, rows)
                del rows

        self.schedule.call(write)

    def load_state_dict(self, state: dict[str, pa.Table], admission: dict | None = None) -> None:
        """Load rows saved at any world size: this rank keeps the rows it owns.

        The saved rows are the whole truth: rows this shard spilled to Redis earlier (say,
        after the checkpoint was taken) are deleted first unless the checkpoint has their
        keys, whose rows then replace them (written to Redis again, or loaded into memory,
        where a copy kept in Redis is never read and the next eviction overwrites it), so
        none comes back stale.
        ``admission``: ``admission_state_dict()["admission"]`` of the same checkpoint (see there).
        """
        unknown = sorted(set(state) - set(self.tables))
        if unknown:
            raise ValueError(f"state has tables {unknown}; the schema declares {self.table_names}")
        def load() -> None:
            tiers = {name: getattr(table, "spill", None) for name, table in self.tables.items()}
            for name, tier in tiers.items():
                if tier is not None and name not in state and tier.holds_leftovers:
                    tier.retain(np.zeros(0, dtype=np.int64))  # a table the checkpoint lacks: none of them
            for name in state:  # one table's saved rows in memory at a time (``SavedTables`` reads on access)
                rows = state[name]
                keys = rows.column("key").to_numpy()
                mine = hashing.owner_of(keys, self.world_size) == self.rank
                if not mine.all():
                    rows, keys = rows.filter(pa.array(mine)), keys[mine]
                if tiers[name] is not None:
                    # spilled rows the checkpoint lacks go; the others are written again or
                    # loaded into memory (whose restore deletes the spilled copy) as the table loads
                    tiers[name].retain(keys)
                self.tables[name].load_state_dict(rows)
                del rows, keys, mine
            if admission is not None and self.cfg.min_count > 1:
                self._load_admission(admission)

        self.schedule.call(load)

    def admission_state_dict(self) -> dict:
        """Return ``{"admission": ...}``, every shard's admission state (``min_count > 1``),
        for the checkpoint's dense state (tensors and plain data: ``torch.load(weights_only)``
        reads it); ``{}`` on ranks other than 0 and without admission. Collective.

        ``admission``: ``format``, ``world_size``, ``min_count`` and per table ``cells``
        uint8 [world, depth, width], ``recorded`` and ``step`` int64 [world], ``step_keys``
        (one int64 tensor per rank): ``EmbeddingTable.admission_state`` of every shard.
        ``load_state_dict(..., admission=...)`` restores it: at the same world size (and
        table capacity and min_count) each rank takes its own shard's state, exactly; else
        every rank takes the saturating sum of all shards' sketches folded to its width
        (``keymap.merge_sketch_states``), which never undercounts a key: a key is admitted
        no later than after a run that was never resized, possibly earlier.
        """
        if self.cfg.min_count <= 1:
            return {}

        def gather() -> list[dict] | None:
            mine = {}
            for name, table in self.tables.items():
                state = table.admission_state() if hasattr(table, "admission_state") else None
                if state is not None:
                    mine[name] = state
            if self.world_size == 1:
                return [mine]
            shards = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, shards, group=self.group, group_dst=0)
            return shards

        shards = self.schedule.call(gather)
        if self.rank != 0:
            return {}
        tables = {}
        for name in shards[0]:
            per = [s[name] for s in shards]
            tables[name] = {
                "cells": torch.from_numpy(np.stack([np.asarray(p["cells"], dtype=np.uint8) for p in per])),
                "recorded": torch.tensor([int(p["recorded"]) for p in per], dtype=torch.int64),
                "step": torch.tensor([int(p["step"]) for p in per], dtype=torch.int64),
                "step_keys": [torch.from_numpy(np.asarray(p["step_keys"], dtype=np.int64)) for p in per],
            }
        return {"admission": {"format": ADMISSION_FORMAT, "world_size": self.world_size,
                              "min_count": self.cfg.min_count, "tables": tables}}

    def _load_admission(self, payload: dict) -> None:
        """Restore ``admission_state_dict()["admission"]`` (see there) into this shard's tables."""
        from recsys.store.tables.keymap import merge_sketch_states

        if int(payload.get("format", 0)) != ADMISSION_FORMAT:
            raise ValueError(f"admission state of format {payload.get('format')}, this store reads {ADMISSION_FORMAT}")
        saved_world = int(payload["world_size"])
        exact_config = saved_world == self.world_size and int(payload["min_count"]) == self.cfg.min_count
        for name, entry in payload["tables"].items():
            table = self.tables.get(name)
            current = table.admission_state() if table is not None and hasattr(table, "admission_state") else None
            if current is None:
                continue
            cells = entry["cells"].numpy()
            states = [{"cells": cells[r], "recorded": int(entry["recorded"][r]), "step": int(entry["step"][r]),
                       "step_keys": entry["step_keys"][r].numpy()} for r in range(cells.shape[0])]
            if exact_config and cells.shape[1:] == current["cells"].shape:
                state = states[self.rank]
            else:
                state = merge_sketch_states(states, current["cells"].shape[1], self.cfg.min_count)
            table.load_admission_state(state)
            # the resumed run redoes the checkpoint's look-ahead lookup: its sightings counted
            host = getattr(table, "host", table)  # a DeviceCache's host table
            if hasattr(host, "arm_admission_replay"):
                host.arm_admission_replay(int(state["step"]))

    # ------------------------------------------------------------------ the work

    def _prepare_for(self, kjt: KeyedJaggedTensor, train: bool):
        """The schedule's ``prepare``: ``_prepare``, or with the device key map a training
        lookup's keys on their way to the device (``DeviceKeys.prepare``)."""
        if self._keys is not None and train:
            return self._keys.prepare(kjt)
        return self._prepare(kjt)

    def _prepare(self, kjt: KeyedJaggedTensor) -> _Prepared:
        """Return the batch's own part of a lookup: each table's unique keys, the pooling
        indices and (W > 1) the owner of each key. Reads no table: it may run before the
        pushes the lookup must see are applied."""
        B = kjt.stride()
        F = len(self.schema.sparse)
        lengths_FB = kjt.lengths().numpy().astype(np.int64, copy=False).reshape(F, B)
        values = kjt.values().numpy()
        offs = np.asarray(kjt.offset_per_key(), dtype=np.int64)
        multi = self._multi_features
        multi_dst = np.full(F, -1, dtype=np.int64)
        n_multi_values = 0
        for f in multi:
            multi_dst[f] = n_multi_values
            n_multi_values += int(offs[f + 1] - offs[f])
        uniq, base, single_idx, multi_values = index_batch(
            values, offs, lengths_FB, self._tf_ptr, self._tf_idx, self._single_col, multi_dst, n_multi_values,
            self.schema.feature_names)
        parts = [_TablePart(t, uniq[base[i] : base[i + 1]], int(base[i])) for i, t in enumerate(self.table_names)]
        route_plan = route(uniq, base, self.world_size) if self.world_size > 1 else None
        weights = None
        if multi:
            lens = lengths_FB[multi].reshape(-1)
            multi_offsets = np.zeros(lens.shape[0] + 1, dtype=np.int64)
            np.cumsum(lens, out=multi_offsets[1:])
            w = None
            if self._mean[multi].any():
                per_bag = np.ones((len(multi), B), dtype=np.float32)
                for j, f in enumerate(multi):
                    if self._mean[f]:
                        per_bag[j] = 1.0 / np.maximum(lengths_FB[f], 1)
                w = np.repeat(per_bag.reshape(-1), lens)
            id_weights = kjt.weights_or_none()
            if id_weights is not None and self._weighted.any():  # id-score lists: Σ weight × row
                kw = id_weights.numpy()
                given = np.concatenate([kw[offs[f] : offs[f + 1]] for f in multi]).astype(np.float32, copy=False)
                w = given if w is None else w * given
            if w is not None:
                weights = torch.from_numpy(w)
        else:
            multi_offsets = np.zeros(1, dtype=np.int64)
        # host tensors: ``_read`` moves them to the device with the rows
        return _Prepared(B, parts, int(base[-1]), torch.from_numpy(single_idx), torch.from_numpy(multi_values),
                         torch.from_numpy(multi_offsets), weights, route=route_plan,
                         owned=(uniq, base) if self.world_size == 1 else None)

    def _do_lookup(self, batch: KeyedJaggedTensor | _Prepared | _Failed, step: int | None, train: bool) -> Lookup:
        if isinstance(batch, _Failed):
            raise batch.exc
        if self._keys is not None and train:
            return self._keys.lookup(batch if not isinstance(batch, KeyedJaggedTensor) else self._keys.prepare(batch),
                                     step)
        prep = batch if isinstance(batch, _Prepared) else self._prepare(batch)
        if not prep.reserved:
            self._reserve(prep, step, train)
        return self._read(prep, step, train)

    def _reserve(self, prep: _Prepared, step: int | None, train: bool, early: bool = False) -> None:
        """The key work of a lookup: send keys to their owners (W > 1) and, for tables that
        allow it (``EmbeddingTable.reserves_early``), touch / insert / evict now.

        The worker runs this for the lookup first in line, possibly before the pushes it
        must see are applied: only row values depend on pushes (``_read``). Exact for
        such tables: their rows with a pending push can only leave (evicted: dropped in
        either order), never appear (every key gets its row at its own lookup).

        ``early`` (the worker, before the pushes this lookup must see): tables with a spill
        tier read ahead the spilled rows of their misses (``EmbeddingTable.prefetch``), so
        that the Redis round trips overlap the step's dense work instead of the lookup wait.
        """
        if self._keys is not None and train:  # the device key map's own (DeviceKeys.reserve)
            self._keys.reserve(prep, step)
            return
        if self.world_size > 1:
            prep.comm = self.exchange.send_keys(prep)
        if train:
            def served(p: _TablePart) -> np.ndarray:
                return p.keys_U if self.world_size == 1 else p.served_U

            def reserve(p: _TablePart) -> None:
                table = self.tables[p.name]
                p.slots = table.reserve(served(p), step)
                p.departures = table.departures

            def prefetch(p: _TablePart) -> None:
                self.tables[p.name].prefetch(served(p))

            if self._group is not None:  # every table plain (it reserves early)
                self._reserve_grouped(prep, step, reserve)
            else:
                todo = [p for p in prep.parts
                        if len(served(p)) and getattr(self.tables[p.name], "reserves_early", False)]
                self._lanes.each(todo, [len(served(p)) for p in todo], reserve)
            if early:  # the misses' spilled rows, read while the pushes are awaited
                ahead = [p for p in prep.parts
                         if len(served(p)) and getattr(self.tables[p.name], "spill", None) is not None
                         and hasattr(self.tables[p.name], "prefetch")
                         and not getattr(self.tables[p.name], "reserves_early", False)]
                self._lanes.each(ahead, [len(served(p)) for p in ahead], prefetch)
        prep.reserved = True

    def _by_group(self, idx: list[int], costs: list[float], fused: Callable[[list[int]], list[int]],
                  one: Callable[[int], None], before: Callable[[list[int]], None] | None = None) -> None:
        """Run one phase over tables ``idx`` (ascending) with the ``TableGroup``: the tables
        split into up to one group per lane, balanced by ``costs``; per group ``before(group)``,
        then ``fused(group)`` (one kernel call; it returns the tables it left) and ``one(i)``
        for each table left, in order. The error raised is that of the first failing table
        in ``idx`` order (a group stops at its first), as a loop over the tables would raise."""
        if not idx:
            return
        groups = [[idx[k] for k in g] for g in self._lanes.split(costs)]
        failed: list[tuple[int, BaseException]] = []

        def run(group: list[int]) -> None:
            if before is not None:
                before(group)
            for i in fused(group):
                try:
                    one(i)
                except Exception as exc:  # noqa: BLE001 - raised below, in table order
                    failed.append((i, exc))
                    return

        cost = dict(zip(idx, costs))
        self._lanes.each(groups, [sum(cost[i] for i in g) for g in groups], run)
        raise_first(failed)

    def _reserve_grouped(self, prep: _Prepared, step: int, reserve: Callable[[_TablePart], None]) -> None:
        """``_reserve``'s key work through the ``TableGroup``: ``prep.fused`` lists the tables
        it did (their slots in ``prep.slots``, at the owned keys' places); the others
        (an eviction needed...) were reserved by their tables."""
        keys, base = prep.owned
        prep.slots = np.empty(keys.shape[0], dtype=np.int64)
        idx = [i for i in range(len(prep.parts)) if base[i + 1] > base[i]]
        done: list[int] = []

        def fused(group: list[int]) -> list[int]:
            rest = self._group.reserve(group, keys, base, step, prep.slots)
            for i in sorted(set(group) - set(rest)):
                p = prep.parts[i]
                p.slots = prep.slots[base[i] : base[i + 1]]
                p.departures = self.tables[p.name].departures
                done.append(i)
            return rest

        self._by_group(idx, [int(base[i + 1] - base[i]) for i in idx], fused, lambda i: reserve(prep.parts[i]))
        prep.fused = sorted(done)

    def _read_grouped(self, prep: _Prepared, out: np.ndarray, serve: Callable[[int], None]) -> None:
        """Read every table's rows of the owned keys into ``out`` (at their places): the fused
        tables' through the ``TableGroup``, the others by ``serve(i)``."""
        base = prep.owned[1]
        idx = [i for i in range(len(prep.parts)) if base[i + 1] > base[i]]
        fused = set(prep.fused)

        def read(group: list[int]) -> list[int]:
            self._group.read([i for i in group if i in fused], base, prep.slots, out)
            return [i for i in group if i not in fused]

        self._by_group(idx, [int(base[i + 1] - base[i]) for i in idx], read, serve)

    def _apply_grouped(self, lookup: Lookup, grads: np.ndarray, apply: Callable[[int], None],
                       before: Callable[[list[int]], None] | None = None) -> None:
        """Apply every table's gradients (``grads`` at the owned keys' places): the fused
        tables' through the ``TableGroup`` while their slots hold, the others by ``apply(i)``."""
        base = lookup.owned_base
        idx = [i for i in range(len(lookup.parts)) if base[i + 1] > base[i]]
        fused = set(lookup.fused)
        departures = [p.departures for p in lookup.parts]

        def update(group: list[int]) -> list[int]:
            rest = self._group.apply([i for i in group if i in fused], base, lookup.fused_slots, departures, grads)
            return sorted(rest + [i for i in group if i not in fused])

        self._by_group(idx, [int(base[i + 1] - base[i]) for i in idx], update, apply, before)

    def _fused_kwargs(self, prep: _Prepared) -> dict:
        if prep.fused is None:
            return {}
        return {"fused": prep.fused, "fused_slots": prep.slots, "owned_base": prep.owned[1]}

    def _read(self, prep: _Prepared, step: int | None, train: bool) -> Lookup:
        """Return the lookup's rows as they are now (after the pushes it must see)."""
        parts, n = prep.parts, prep.num_rows
        index = [prep.single_idx, prep.multi_values, prep.multi_offsets, prep.multi_weights]
        if self._device_rows:
            return self._read_on_device(prep, index, step, train)
        # every row is written: by its table, or (W > 1) by the exchange; the last is the zero row
        if self.device.type == "cpu":
            rows_np = np.empty((n + 1, self.dim), dtype=np.float32)
        else:  # pinned: the copy to the device runs on a side stream (recsys.runtime.transfer)
            rows_host = torch.empty((n + 1, self.dim), dtype=torch.float32, pin_memory=self.device.type == "cuda")
            rows_np = rows_host.numpy()
        rows_np[n] = 0.0
        if self.world_size == 1:
            def serve(p: _TablePart) -> None:
                self._serve(p, p.keys_U, step, train, rows_np[p.base : p.base + len(p.keys_U)])

            if prep.fused is not None:
                self._read_grouped(prep, rows_np, lambda i: serve(parts[i]))
            else:
                todo = [p for p in parts if len(p.keys_U)]
                self._lanes.each(todo, [len(p.keys_U) for p in todo], serve)
        else:
            self.exchange.fetch_rows(prep, rows_np, lambda served: self._serve_owned(prep, step, train, served))
        ready = None
        if self.device.type == "cpu":
            rows_all = torch.from_numpy(rows_np)
        else:  # the rows and the pooling indices cross together, once
            moved, ready = self._to_device.to_device([rows_host] + [t for t in index if t is not None])
            rows_all, index = moved[0], moved[1:] + [None] * (index[3] is None)
        return Lookup(step, prep.batch_size, parts, rows_all.requires_grad_(train), index[0], self._single_cols_t,
                      index[1], index[2], index[3], self._multi_cols_t, **prep.comm, **self._fused_kwargs(prep),
                      ready=ready)

    def _read_on_device(self, prep: _Prepared, index: list, step: int | None, train: bool) -> Lookup:
        """``_read`` for device-resident rows (one process, every table a ``DeviceCache`` on a
        GPU): the rows are gathered on the device; only the pooling indices cross."""
        n, arena = prep.num_rows, self._arena
        if train and arena is not None:  # the tables' key work, then one gather over all of them
            rows = np.full(n + 1, arena.zero_row, dtype=np.int64)
            for p in prep.parts:
                if len(p.keys_U):
                    table = self.tables[p.name]
                    p.slots = slots = table.lookup_slots(p.keys_U, step)
                    p.departures = table.departures  # the push's hints (_update_arena)
                    rows[p.base : p.base + len(p.keys_U)] = np.where(slots >= 0, arena.offsets[p.name] + slots,
                                                                     arena.zero_row)
            rows_all = arena.gather(rows)
        else:
            rows_all = torch.empty((n + 1, self.dim), dtype=torch.float32, device=self.device)
            rows_all[n] = 0.0
            for p in prep.parts:
                if len(p.keys_U):
                    rows_all[p.base : p.base + len(p.keys_U)] = self._serve_tensor(p, step, train)
        moved, ready = self._to_device.to_device([t for t in index if t is not None])
        index = moved + [None] * (index[3] is None)
        return Lookup(step, prep.batch_size, prep.parts, rows_all.requires_grad_(train), index[0], self._single_cols_t,
                      index[1], index[2], index[3], self._multi_cols_t, ready=ready)

    def _serve_owned(self, prep: _Prepared, step: int | None, train: bool, served: np.ndarray) -> None:
        """Fill ``served`` [S, D] (table-major) with this rank's rows of the keys other ranks
        asked for (``RankExchange.fetch_rows``' owner side)."""
        base = prep.comm["served_base"]

        def serve(i: int) -> None:
            p = prep.parts[i]
            self._serve(p, p.served_U, step, train, served[base[i] : base[i + 1]])

        if prep.fused is not None:
            self._read_grouped(prep, served, serve)
        else:
            todo = [i for i, p in enumerate(prep.parts) if len(p.served_U)]
            self._lanes.each(todo, [len(prep.parts[i].served_U) for i in todo], serve)

    def _apply_owned(self, lookup: Lookup, summed: np.ndarray) -> None:
        """Apply ``summed`` [S, D] (table-major), the gradients of this rank's owned keys summed
        over the requesters (``RankExchange.send_grads``' owner side)."""
        parts, base = lookup.parts, lookup.served_base

        def apply_served(i: int) -> None:
            p = parts[i]
            self._apply(p, p.served_U, summed[base[i] : base[i + 1]], lookup.step)

        if lookup.fused is not None:
            self._apply_grouped(lookup, summed, apply_served)
        else:
            todo = [i for i, p in enumerate(parts) if len(p.served_U)]
            self._lanes.each(todo, [len(parts[i].served_U) for i in todo], apply_served)

    def _serve_tensor(self, part: _TablePart, step: int | None, train: bool) -> torch.Tensor:
        """Return the float32 [U, D] rows of ``part``'s keys on the device (a ``DeviceCache``)."""
        t = self.tables[part.name]
        if train:
            return t.lookup_tensor(part.keys_U, step)
        return t.peek_tensor(part.keys_U, init_missing=self.cfg.min_count == 1)

    def _serve(self, part: _TablePart, keys_U: np.ndarray, step: int | None, train: bool,
               out: np.ndarray | None = None) -> np.ndarray:
        """Return this shard's float32 rows of the unique ``keys_U`` of ``part``'s table
        (owner side), written into ``out`` when given."""
        t = self.tables[part.name]
        if part.slots is not None:
            return t.read(part.slots, out)
        if train:
            return t.lookup(keys_U, step, out=out)
        rows = t.peek(keys_U, init_missing=self.cfg.min_count == 1)
        if out is None:
            return rows
        out[...] = rows
        return out

    def _do_push(self, lookup: Lookup, g_rows: torch.Tensor | None, g_pooled: torch.Tensor | None,
                 ready=None) -> None:
        """Turn the gradients of ``rows_all`` and of ``pooled_leaf`` into row gradients and
        apply them at the owners (``ready``: the event after which ``g_rows`` holds them)."""
        if self._keys is not None:
            self._keys.push(lookup)
            return
        if ready is not None:
            ready.synchronize()
        if g_rows is None:
            grads = np.zeros(tuple(lookup.rows_all.shape), dtype=np.float32)
        elif g_rows.device.type != "cpu":  # device-resident rows: their device caches apply it there
            grads = g_rows
        else:
            grads = np.array(g_rows.numpy(), dtype=np.float32)  # ours to add into
        parts = lookup.parts
        # a table's share of the pooling backward: its ids' rows (its feature columns) plus
        # a weight per key of its update
        costs = [len(p.keys_U) + 0.25 * lookup.batch_size * len(self._features_of[p.name]) for p in parts]

        def pool_backward(group: list[_TablePart]) -> None:
            if g_pooled is not None:
                columns = None
                if len(group) < len(parts):
                    columns = np.logical_or.reduce([self._table_columns[p.name] for p in group])
                lookup.pool_backward(g_pooled.numpy(), grads, columns)

        if self.world_size == 1 and self._arena is not None:
            pool_backward(parts)
            self._update_arena(parts, torch.as_tensor(grads), lookup.step)
        elif self.world_size == 1:
            def apply(p: _TablePart) -> None:
                if len(p.keys_U):
                    self._apply(p, p.keys_U, grads[p.base : p.base + len(p.keys_U)], lookup.step)

            if lookup.fused is not None:
                self._apply_grouped(lookup, grads, lambda i: apply(parts[i]),
                                    before=lambda group: pool_backward([parts[i] for i in group]))
            else:
                self._lanes.each(parts, costs, apply, before=pool_backward)
        if self.world_size == 1:
            if self.publisher is not None:  # rows now reflect lookup.step + 1 optimizer steps (the trainer's count)
                self.publisher.after_push(lookup.step + 1, [(p.name, p.keys_U) for p in lookup.parts])
            return
        self._lanes.each(parts, costs, lambda p: None, before=pool_backward)
        self.exchange.send_grads(lookup, grads, lambda summed: self._apply_owned(lookup, summed))
        if self.publisher is not None:  # this rank's owned keys the push updated; as above
            self.publisher.after_push(lookup.step + 1, [(p.name, p.served_U) for p in lookup.parts
                                                        if p.served_U is not None])

    def _update_arena(self, parts: list[_TablePart], grads: torch.Tensor, step: int) -> None:
        """Apply a push to the device caches of one arena: each table's key work (and the
        host optimizer of keys no longer cached), then one update over all tables' rows."""
        arena, rows, positions = self._arena, [], []
        for p in parts:
            if len(p.keys_U):
                sel, slots = self.tables[p.name].gradient_slots(p.keys_U, grads[p.base : p.base + len(p.keys_U)], step,
                                                                p.slots, p.departures)
                rows.append(arena.offsets[p.name] + slots)
                positions.append(p.base + sel)
        if rows:
            pos = np.concatenate(positions)  # ascending: parts in order, each one's cached keys in order
            n = sum(len(p.keys_U) for p in parts)
            g = grads[:n] if pos.shape[0] == n else grads.index_select(0, torch.from_numpy(pos).to(grads.device))
            arena.update(np.concatenate(rows), g)

    def _apply(self, part: _TablePart, keys_U: np.ndarray, grads_UD: np.ndarray, step: int) -> None:
        table = self.tables[part.name]
        if part.slots is not None:
            table.apply_gradients(keys_U, grads_UD, step, slots_hint=part.slots, hint_departures=part.departures)
        else:
            table.apply_gradients(keys_U, grads_UD, step)
