"""The Parquet streaming reader: exactly-once, resumable at any world size, prefetching.

::

    files ─► units (file, row group) ─► epoch order (seed, epoch) ─► dealt to slots
                                                                     slot = rank × W + worker
    slot runner (a thread, or a worker process per slot):
        open units (≤ shuffle_buffer; more loading) ─► rows drawn across them ─► batch + delta
    consumer (the caller's thread):
        takes the slots' items in a fixed turn order and applies each delta only when its
        batch is handed to the caller ─► state_dict() counts delivered rows only

The turn order is "fewest batches delivered first, then lowest slot" (round-robin over
workers). It depends on the state only, so a resume with the same layout continues
bit-identically; with another layout the unfinished units are re-dealt over the new slots
(``generation`` + 1) and partly read units keep their consumed prefix. The state format is
described in ``recsys.io.state``.

Each batch lives in one buffer (all its tensors are views), so a worker process hands a
batch over as one block of shared memory: a slot of its ring (fork), else one torch
shared-memory segment (the worker processes: ``recsys.io.reader_workers``). Memory per slot:
``shuffle_buffer`` converted units open, as many (at least two) loaded ahead, ``prefetch``
batches queued.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import Iterator

import numpy as np
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.runtime import priority
from recsys.io.batch import Batch
from recsys.io.config import ReaderConfig
from recsys.io.decode import UnitConverter
from recsys.io.errors import ReadError
from recsys.io.inspect import describe
from recsys.io.plan import ReadContext, SlotPlan, SlotRunner, background_priority, priority_target
from recsys.io.partitions import parse_filter, select
from recsys.io.reader_workers import WorkerPool, batch_views, to_torch
from recsys.io.state import STATE_VERSION, Progress, check_shape, merge_states, unit_index
from recsys.io.units import build_units, expand_paths, hold_out
from recsys.features.schema import Schema

__all__ = ["ParquetReader", "ReadError", "describe", "STATE_VERSION"]

log = logging.getLogger("recsys.io.reader")


class ParquetReader:
    """Streams ``Batch``es from Parquet files, exactly once per epoch across ranks and restarts."""

    def __init__(
        self,
        cfg: ReaderConfig,
        schema: Schema,
        *,
        rank: int = 0,
        world_size: int = 1,
        filesystem=None,
        dense_stats=None,
    ) -> None:
        """``dense_stats``: the training data's ``recsys.features.dense.DenseStats``, needed by the
        transforms of ``schema.dense_transform`` that read them."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, found rank={rank}, world_size={world_size}")
        self.cfg = cfg
        self.schema = schema
        self.rank = rank
        self.world_size = world_size
        self._slots_per_rank = max(1, cfg.num_workers)
        files = select(expand_paths(cfg.paths, filesystem), parse_filter(cfg.filter), ", ".join(cfg.paths))
        table = build_units(files, schema, list(cfg.passthrough), cfg.on_bad_file)
        row0 = _row0(table)  # row numbers within the files, before any unit is held out
        if cfg.holdout_fraction:
            table, kept = hold_out(table, cfg.holdout_fraction, cfg.holdout_seed, cfg.holdout,
                                    cfg.holdout_fold)
            row0 = row0[kept]
        self._table = table
        self._rows = table.unit_rows
        self._keys = table.unit_keys
        self._key_index = {k: i for i, k in enumerate(self._keys)}
        self._ctx = ReadContext(
            table=table,
            converter=UnitConverter(schema, list(cfg.passthrough), dense_stats),
            columns=schema.columns(list(cfg.passthrough)),
            batch_size=cfg.batch_size,
            shuffle=cfg.shuffle,
            shuffle_buffer=cfg.shuffle_buffer,
            drop_last=cfg.drop_last,
            seed=cfg.seed,
            arrow_threads=cfg.arrow_threads,
            nice=priority_target(cfg.nice),
            on_bad_file=cfg.on_bad_file,
            unit_row0=row0,
        )
        self._feature_names = schema.feature_names
        self.stats: dict = {
            "files": len(files),
            "row_groups": table.num_units,
            "rows_per_epoch": int(self._rows.sum()),
            "rows": 0,
            "batches": 0,
            "epochs_completed": 0,
            "skipped_files": len(table.skipped_files),
            "skipped_row_groups": 0,
            "skipped_rows": 0,
            "empty_files": len(table.empty_files),
            "empty_row_groups": len(table.empty_units),
            "dropped_rows": 0,
        }
        """Counters since the reader was built: rows/batches delivered, epochs completed,
        files, row groups and rows skipped as bad (``on_bad_file = "skip"``), files and row
        groups without rows (nothing to read), rows dropped by drop_last. The table in
        docs/data.md says which case lands where."""
        self._skipped: set[int] = set()
        self._cur = self._fresh(0)
        self._later: list[Progress] = []
        """Progress other ranks already made in the epochs after this one (from a merged state)."""
        self._active: weakref.ref | None = None
        self._pool: WorkerPool | None = None
        """This rank's worker processes (``num_workers > 0``), kept from epoch to epoch."""

    # ------------------------------------------------------------------ epochs

    @property
    def epoch(self) -> int:
        """The epoch being read (the next batch's, unless this rank just delivered its last)."""
        return self._cur.epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the next iteration reads from: ``epoch``, or the one after it when this
        rank delivered all of ``epoch`` but the caller never hit its end (``__iter__`` then
        rolls over first). A caller that keeps ranks in step compares it with its own epoch."""
        if self._rank_finished() and (self._rank_started() or self._later):
            return self._cur.epoch + 1
        return self._cur.epoch

    @property
    def num_slots(self) -> int:
        """Readers over all ranks: world_size × max(1, num_workers)."""
        return self.world_size * self._slots_per_rank

    def _own_slots(self) -> range:
        n = self._slots_per_rank
        return range(self.rank * n, (self.rank + 1) * n)

    def _fresh(self, epoch: int) -> Progress:
        return Progress.fresh(epoch, self._rows, self.num_slots, self.cfg.seed, self.cfg.shuffle)

    def _rank_finished(self) -> bool:
        """Whether this rank's slots have nothing left to yield in the current epoch."""
        p = self._cur
        for j in self._own_slots():
            if p.done[j]:
                continue
            left = p.remaining(j, self._rows, self._skipped)
            if left > 0 and not (self.cfg.drop_last and left < self.cfg.batch_size):
                return False
        return True

    def _rank_started(self) -> bool:
        return any(self._cur.batches[j] or self._cur.done[j] for j in self._own_slots())

    def _rollover(self) -> None:
        self.stats["epochs_completed"] += 1
        self._cur = self._later.pop(0) if self._later else self._fresh(self._cur.epoch + 1)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Batch]:
        """Yield the rest of the current epoch; then the state moves to the next epoch."""
        self._close_active()
        it = self._iterate()
        # weak: an iterator the caller drops is finalized (its finally stops the readers)
        self._active = weakref.ref(it)
        return it

    def _iterate(self) -> Iterator[Batch]:
        if self._rank_finished() and (self._rank_started() or self._later):
            self._rollover()  # all delivered, but the caller never hit the end of the epoch
        p = self._cur
        plans = {
            j: SlotPlan(
                slot=j,
                epoch=p.epoch,
                generation=p.generation,
                units=list(p.slots[j]),
                consumed={u: int(p.consumed[u]) for u in p.slots[j] if p.consumed[u]},
                skipped={u for u in p.slots[j] if u in self._skipped},
                batches=p.batches[j],
            )
            for j in self._own_slots()
            if not p.done[j]
        }
        source = None
        try:
            if plans:
                if self.cfg.num_workers > 0:
                    if self._pool is not None and not self._pool.healthy():  # nothing of this epoch read yet
                        self._pool.close()
                        self._pool = None
                    if self._pool is None:
                        self._pool = WorkerPool(self._ctx, self.rank, self.cfg)
                    source = self._pool.run(plans)
                else:
                    (plan,) = plans.values()
                    source = _ThreadSource(self._ctx, plan, self.cfg.prefetch)
            while True:
                alive = [j for j in plans if not p.done[j]]
                if not alive:
                    break
                j = min(alive, key=lambda s: (p.batches[s], s))
                batch = self._apply(p, source.next(j))
                if batch is not None:
                    yield batch
            self._rollover()
        finally:
            try:
                if source is not None:
                    source.close()
            finally:
                if self._pool is not None and self._pool.broken:  # the next epoch starts anew
                    self._pool.close()
                    self._pool = None

    def _apply(self, p: Progress, item: dict) -> Batch | None:
        """Apply an item's progress (it is being handed to the caller); return its batch."""
        if "error" in item:
            raise ReadError.from_fields(item["error"])
        if "exception" in item:
            raise item["exception"]
        for s in item["skipped"]:
            self._skipped.add(s["unit"])
            self.stats["skipped_row_groups"] += 1
            self.stats["skipped_rows"] += s["rows"]
            log.warning("skipped bad row group: %s", s["message"])
        j = item["slot"]
        if item.get("end"):
            p.done[j] = True
            self.stats["dropped_rows"] += item["dropped"]
            return None
        if item["k"] != p.batches[j]:  # a bug, not bad input
            raise RuntimeError(f"slot {j}: got batch {item['k']}, expected {p.batches[j]}")
        for u, t in item["delta"]:
            p.consumed[u] += t
        p.batches[j] += 1
        b = item["batch"]
        t = b.get("views") or batch_views(b)
        size = int(t["labels"].shape[0])
        self.stats["rows"] += size
        self.stats["batches"] += 1
        sparse = KeyedJaggedTensor(
            keys=self._feature_names,
            values=t["values"],
            weights=t.get("id_weights"),
            lengths=t["lengths"],
            stride=size,
            length_per_key=b["length_per_key"],
            offset_per_key=b["offset_per_key"],
        )
        extra = {name[len("extra."):]: v for name, v in t.items() if name.startswith("extra.")}
        return Batch(dense=t["dense"], labels=t["labels"], sparse=sparse, extra=extra, weights=t.get("weights"))

    def _close_active(self) -> None:
        ref, self._active = self._active, None
        it = ref() if ref is not None else None
        if it is not None:
            it.close()

    def close(self) -> None:
        """Stop any background reading (threads, worker processes); the state stays."""
        self._close_active()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> "ParquetReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Return this rank's progress (delivered rows only) as JSON-serializable data."""
        keys = self._keys
        return {
            "version": STATE_VERSION,
            "seed": self.cfg.seed,
            "shuffle": self.cfg.shuffle,
            "layout": {"world_size": self.world_size, "slots_per_rank": self._slots_per_rank},
            "ranks": [self.rank],
            "units": [[k, n] for k, n in zip(keys, self._rows.tolist())],
            "skipped": sorted(keys[u] for u in self._skipped),
            "epoch": self._cur.epoch,
            **self._cur.to_json(keys),
            "later": [p.to_json(keys) for p in self._later],
        }

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """Return one global state from every rank's state (all taken at the same point)."""
        return merge_states(states)

    def load_state_dict(self, state: dict) -> None:
        """Resume from a global state (``merge_states`` of all ranks), at any layout."""
        check_shape(state)
        self._close_active()
        self._check_units(state["units"])
        if (state["seed"], state["shuffle"]) != (self.cfg.seed, self.cfg.shuffle):
            raise ValueError(
                f"reader state was saved with seed={state['seed']}, shuffle={state['shuffle']}; "
                f"this reader has seed={self.cfg.seed}, shuffle={self.cfg.shuffle} (rows within "
                "partly read row groups would not line up)"
            )
        layout = state["layout"]
        world = layout["world_size"]
        if sorted(state["ranks"]) != list(range(world)):
            raise ValueError(
                f"reader state holds the progress of rank(s) {state['ranks']} of {world} only; "
                "combine every rank's state with ParquetReader.merge_states first"
            )
        skipped = {unit_index(self._key_index, k) for k in state["skipped"]}
        e = state["epoch"]
        records = [state, *state["later"]]
        progress = [Progress.from_json(e + i, rec, self._key_index, self._rows) for i, rec in enumerate(records)]
        if (world, layout["slots_per_rank"]) != (self.world_size, self._slots_per_rank):
            args = (self._rows, skipped, self.num_slots, self.cfg.seed, self.cfg.shuffle)
            progress = [p.redeal(*args) for p in progress]
        self._skipped, self._cur, self._later = skipped, progress[0], progress[1:]
        while self._later and self._rank_finished():
            self._cur = self._later.pop(0)  # this rank had moved on to a later epoch

    def _check_units(self, units: list) -> None:
        mine = [[k, n] for k, n in zip(self._keys, self._rows.tolist())]
        if units == mine:
            return
        theirs = {k: n for k, n in units}
        ours = {k: n for k, n in mine}
        only_state = sorted(set(theirs) - set(ours))[:3]
        only_data = sorted(set(ours) - set(theirs))[:3]
        changed = [k for k in theirs if k in ours and theirs[k] != ours[k]][:3]
        parts = []
        if only_state:
            parts.append(f"units only in the state: {only_state}")
        if only_data:
            parts.append(f"units only in the data: {only_data}")
        if changed:
            parts.append(
                "row counts changed: "
                + ", ".join(f"{k} had {theirs[k]} rows, now {ours[k]}" for k in changed)
            )
        raise ValueError(
            "reader state was saved for a different file set ("
            + ("; ".join(parts) or "same units in another order")
            + ")"
        )


# --------------------------------------------------------------------------- sources


class _ThreadSource:
    """Runs one slot in a background thread; a bounded queue holds ``prefetch`` items."""

    def __init__(self, ctx: ReadContext, plan: SlotPlan, prefetch: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._slot = plan.slot
        self._thread = threading.Thread(
            target=self._run, args=(ctx, plan), name=f"recsys-reader-slot{plan.slot}", daemon=True
        )
        self._thread.start()

    def _run(self, ctx: ReadContext, plan: SlotPlan) -> None:
        background_priority(ctx.nice)
        items = iter(SlotRunner(ctx, plan, self._stop))
        try:
            for item in items:
                if self._stop.is_set():
                    return
                # the tensors are made on this thread: each torch call on the trainer's
                # thread between its steps is time its other torch threads sit idle
                self._q.put(to_torch(item, views=True))
        except ReadError as err:
            self._q.put({"slot": self._slot, "error": err.fields()})
        except BaseException as exc:  # surfaces in the caller's thread
            self._q.put({"slot": self._slot, "exception": exc})
        finally:
            items.close()

    def next(self, slot: int) -> dict:
        try:
            return self._q.get_nowait()
        except queue.Empty:
            pass
        # the consumer waits: the reader's threads get the normal policy while it does
        low = priority.READER.low
        priority.READER.raise_()
        try:
            while True:
                try:
                    return self._q.get(timeout=1.0)
                except queue.Empty:
                    if not self._thread.is_alive() and self._q.empty():
                        raise RuntimeError("reader thread ended without finishing its units") from None
        finally:
            if low:
                priority.READER.lower()

    def close(self) -> None:
        self._stop.set()
        # free the producer if it waits on a full queue; it then sees the stop flag
        while self._thread.is_alive():
            try:
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)




# --------------------------------------------------------------------------- helpers


def _row0(table) -> np.ndarray:
    """Return each unit's first row number within its file (units are in file, row group order)."""
    out = np.zeros(table.num_units, dtype=np.int64)
    prev_file, acc = -1, 0
    for u, (f, n) in enumerate(zip(table.unit_file.tolist(), table.unit_rows.tolist())):
        if f != prev_file:
            prev_file, acc = f, 0
        out[u] = acc
        acc += n
    return out
