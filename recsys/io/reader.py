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
shared-memory segment. Memory per slot: ``shuffle_buffer`` converted units open, as many
(at least two) loaded ahead, ``prefetch`` batches queued.
"""

from __future__ import annotations

import gc
import logging
import mmap
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys import priority
from recsys.io.batch import Batch
from recsys.io.config import ReaderConfig
from recsys.io.decode import BatchArrays, UnitConverter
from recsys.io.errors import ReadError
from recsys.io.inspect import describe
from recsys.io.plan import ReadContext, SlotPlan, SlotRunner, background_priority, priority_target
from recsys.io.partitions import parse_filter, select
from recsys.io.state import STATE_VERSION, Progress, check_shape, merge_states, unit_index
from recsys.io.units import build_units, expand_paths, hold_out
from recsys.schema import Schema

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
        """``dense_stats``: the training data's ``recsys.dense.DenseStats``, needed by the
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
            table, kept = hold_out(table, cfg.holdout_fraction, cfg.holdout_seed, cfg.holdout)
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
        self._pool: _WorkerPool | None = None
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
                        self._pool = _WorkerPool(self._ctx, self.rank, self.cfg)
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
        t = b.get("views") or _views(b)
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


def _to_torch(item: dict, views: bool = False) -> dict:
    """Replace the item's BatchArrays by its buffer (a tensor, or a ring slot) and layout;
    with ``views`` (a source in this process), also by its tensors (``_views``), made here
    rather than by the consumer."""
    b: BatchArrays | None = item.get("batch")
    if b is not None:
        out = {
            "layout": b.layout,
            "nbytes": int(b.buffer.shape[0]),
            "length_per_key": b.length_per_key,
            "offset_per_key": b.offset_per_key,
        }
        if isinstance(b.owner, _RingSlot):
            out["ring_slot"] = b.owner.index
        else:
            out["buffer"] = b.owner if b.owner is not None else torch.from_numpy(b.buffer)
            if views:
                out["views"] = _views(out)
        item["batch"] = out
    return item


def _shared_alloc(nbytes: int):
    """Allocate a batch buffer in shared memory, so a worker sends it without a copy."""
    t = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(nbytes, 1)))
    return t, t.numpy()


_TORCH_DTYPES = {
    "int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
    "float64": torch.float64, "bool": torch.bool,
}


def _views(b: dict) -> dict[str, torch.Tensor]:
    """Return the batch's tensors as views into its buffer."""
    buf = b["buffer"]
    out = {}
    for name, (off, dtype, shape) in b["layout"].items():
        tdtype = _TORCH_DTYPES[dtype]
        size = int(np.prod(shape, dtype=np.int64)) * tdtype.itemsize
        out[name] = buf[off : off + size].view(tdtype).view(shape)
    return out


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
                self._q.put(_to_torch(item, views=True))
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


class _RingSlot:
    """Owner tag of a batch written into a ring slot."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Stopped(Exception):
    """The consumer ended the run while the worker waited for a free ring slot."""


class _Flag:
    """A stop flag shared with a worker process, without a lock: ``multiprocessing.Event``
    takes a cross-process lock even to read, and a worker killed while holding it (the OOM
    killer, ``kill -9``) would leave the consumer's next ``set()`` waiting forever."""

    def __init__(self, mp_context) -> None:
        self._value = mp_context.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def clear(self) -> None:
        self._value.value = 0

    def is_set(self) -> bool:
        return bool(self._value.value)


class _Ring:
    """One worker's batch slots: credits always, shared memory when the worker is forked.

    Every batch a worker sends holds one credit (``slots`` of them), taken before its buffer
    is allocated and given back when the consumer receives it, so a worker runs at most
    ``slots`` batches ahead. With fork, the credits are also slots of one anonymous shared
    mapping: the worker assembles a batch straight into its slot and sends only the slot's
    number; the consumer copies it out (the caller may keep batches as long as it likes).
    Without it, or for a batch larger than a slot, the buffer is a torch shared-memory
    segment sent with the item (torch's own transport: ~1 ms of the consumer's time per
    batch, for one descriptor per storage over a socket). Slots are given back in the order
    they were taken, so the next slot in turn is free whenever a credit is.
    """

    def __init__(self, mp_context, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.mem = mmap.mmap(-1, slots * slot_bytes) if slot_bytes else None  # shared; fork keeps it
        self.free = mp_context.Semaphore(slots)
        self.stop = _Flag(mp_context)
        """Set by the consumer to end the worker's current run."""
        self._next = 0  # worker side from here on: its own copies after the start
        self._held = 0
        self._parent = 0
        """The worker's parent when it started (the reader's process; with forkserver, the
        server, which exits with the reader's process): another parent means it is gone."""

    def alloc(self, nbytes: int):
        """Worker side: take a credit (waiting for one), return (owner, uint8 array)."""
        while not self.free.acquire(timeout=0.2):
            if self.stop.is_set():
                raise _Stopped
            if self.orphaned():  # the reader's process is gone
                os._exit(0)
        self._held += 1
        i, self._next = self._next, (self._next + 1) % self.slots
        if self.mem is None or nbytes > self.slot_bytes:
            return _shared_alloc(nbytes)
        return _RingSlot(i), np.frombuffer(self.mem, np.uint8, count=nbytes, offset=i * self.slot_bytes)

    def orphaned(self) -> bool:
        return os.getppid() != self._parent

    def sent(self) -> None:
        """Worker side: a batch went to the consumer with its credit."""
        self._held -= 1

    def give_back(self) -> None:
        """Worker side, after a run: return credits of batches assembled but never sent."""
        for _ in range(self._held):
            self.free.release()
        self._held = 0

    def receive(self, b: dict) -> None:
        """Consumer side: own the batch ``b`` of a received item and give its credit back (one
        lost to an interruption before this point is restored by ``reset`` at the next run)."""
        if "ring_slot" in b:
            out = torch.empty(b["nbytes"], dtype=torch.uint8)
            out.numpy()[:] = np.frombuffer(self.mem, np.uint8, count=b["nbytes"],
                                           offset=b["ring_slot"] * self.slot_bytes)
            b["buffer"] = out
        self.free.release()

    def reset(self) -> None:
        """Consumer side, the worker idle: exactly ``slots`` credits again (one lost to an
        interruption between an item's receipt and its release is back)."""
        while self.free.acquire(False):
            pass
        for _ in range(self.slots):
            self.free.release()

    def close(self) -> None:
        if self.mem is not None:
            try:
                self.mem.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass


def _worker_main(ctx: ReadContext, conn, ring: _Ring, slot: int, num_workers: int) -> None:
    """A worker process: runs each plan it is sent (one per epoch) until told to end.

    Items go back over ``conn`` in order, then ``{"run_done": True}`` ends each run (also a
    run cut short by ``ring.stop``, or by an error, which is sent as an item first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the reader's to handle; it ends us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's handler (a fork inherits it)
    ring._parent = os.getppid()
    torch.set_num_threads(1)
    background_priority(ctx.nice)  # threads started from here on inherit it
    share = len(os.sched_getaffinity(0)) // num_workers
    if share > 1:  # the workers share the cores: one full Arrow pool each would oversubscribe
        pa.set_cpu_count(share)
    else:  # decode in the loader thread itself (this is the worker's own copy)
        ctx.arrow_threads = False
    try:
        while True:
            if not conn.poll(1.0):
                if ring.orphaned():
                    return
                continue
            plan = conn.recv()
            if plan is None:
                return
            _run_plan(ctx, plan, conn, ring)
            conn.send({"slot": slot, "run_done": True})
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return  # the reader's end of the pipe closed


def _run_plan(ctx: ReadContext, plan: SlotPlan, conn, ring: _Ring) -> None:
    items = iter(SlotRunner(ctx, plan, ring.stop, alloc=ring.alloc))
    try:
        for item in items:
            has_batch = item.get("batch") is not None
            conn.send(_to_torch(item))
            if has_batch:
                ring.sent()
    except _Stopped:
        pass
    except ReadError as err:  # re-raised in the caller with the same message
        conn.send({"slot": plan.slot, "error": err.fields()})
    except Exception as exc:
        conn.send({"slot": plan.slot, "exception": _portable(exc, plan.slot)})
    finally:
        items.close()
        ring.give_back()


def _portable(exc: Exception, slot: int) -> Exception:
    """Return ``exc`` with the worker's traceback as a note, or a RuntimeError carrying both
    when ``exc`` does not survive pickling."""
    import pickle
    import traceback

    text = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"in the reader worker of slot {slot}:\n{text}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"reader worker of slot {slot} failed:\n{text}")


class _Worker:
    __slots__ = ("slot", "proc", "conn", "ring", "running")

    def __init__(self, slot, proc, conn, ring) -> None:
        self.slot, self.proc, self.conn, self.ring = slot, proc, conn, ring
        self.running = False


class _WorkerPool:
    """A rank's worker processes, started by the first epoch that needs them and kept until
    the reader closes; worker w runs slot rank × W + w in every epoch.

    Kept, not started per epoch: a fresh process faults in every page it writes (its
    allocators start empty, and every inherited page it touches is copied), which on a
    2-core VM cost more system time per epoch than the decode saves (BENCHMARKS.md). An
    epoch sends each worker its slot's plan; ending an epoch early stops the runs and drains
    what they sent, so the workers are idle and every credit is back before the next one.
    A worker that dies breaks the pool: the reader raises, and its next epoch starts anew.
    """

    def __init__(self, ctx: ReadContext, rank: int, cfg: ReaderConfig) -> None:
        mp_context = multiprocessing.get_context(cfg.start_method)
        fork = cfg.start_method == "fork"
        size = _slot_bytes(ctx) if fork else 0
        self.broken = False
        self._workers: dict[int, _Worker] = {}
        if fork:
            # Every object of this process is frozen (gc.freeze) across the forks, so a
            # worker's garbage collector never frees an object it inherited: uncollected
            # garbage of this process may own native resources whose destructors are only
            # valid here. A torch ProcessGroupGloo is one: its destructor joins threads that a
            # forked child does not have, and the worker dies of a segmentation fault (seen
            # with a torchrec model's optimizer garbage).
            gc.freeze()
        try:
            for w in range(cfg.num_workers):
                slot = rank * cfg.num_workers + w
                ring = _Ring(mp_context, cfg.prefetch + 2, size)
                ours, theirs = mp_context.Pipe(duplex=True)
                proc = mp_context.Process(target=_worker_main, args=(ctx, theirs, ring, slot, cfg.num_workers),
                                          name=f"recsys-reader-slot{slot}", daemon=True)
                try:
                    proc.start()
                except BaseException:
                    ours.close()
                    ring.close()
                    raise
                finally:
                    theirs.close()
                self._workers[slot] = _Worker(slot, proc, ours, ring)
        except BaseException:
            self.close()
            raise
        finally:
            if fork:
                gc.unfreeze()
        self._finalizer = weakref.finalize(self, _stop_workers, list(self._workers.values()))

    def run(self, plans: dict[int, SlotPlan]) -> "_PoolRun":
        """Start one epoch's runs (the slots in ``plans``; the other workers stay idle)."""
        if any(w.running for w in self._workers.values()):  # a bug: end_runs sets broken if it cannot drain
            raise RuntimeError("reader workers still run the previous epoch")
        for j, plan in plans.items():
            w = self._workers[j]
            w.ring.reset()
            w.ring.stop.clear()
            self._send(w, plan)
            w.running = True
        return _PoolRun(self)

    def healthy(self) -> bool:
        """Whether the pool can run an epoch: not broken, every worker alive."""
        return not self.broken and all(w.proc.is_alive() for w in self._workers.values())

    def next(self, slot: int) -> dict:
        w = self._workers[slot]
        item = self._recv(w)
        if item.get("run_done"):
            w.running = False
            raise RuntimeError(f"reader worker of slot {slot} ended its run without finishing its units")
        b = item.get("batch")
        if b is not None:
            w.ring.receive(b)
        return item

    def end_runs(self) -> None:
        """Stop what still runs and drain it, so every worker is idle with all its credits."""
        running = [w for w in self._workers.values() if w.running]
        for w in running:
            w.ring.stop.set()
        try:
            for w in running:
                while w.running:
                    item = self._recv(w)
                    if item.get("run_done"):
                        w.running = False
                    elif item.get("batch") is not None:
                        w.ring.free.release()  # dropped unread: only its credit comes back
        except RuntimeError:  # a worker died (raised to the caller by next(), or now ending anyway)
            self.broken = True
        except BaseException:  # an interruption: what the workers sent is not drained
            self.broken = True
            raise

    def _send(self, w: _Worker, msg) -> None:
        try:
            w.conn.send(msg)
        except OSError:
            self.broken = True
            raise RuntimeError(f"reader worker of slot {w.slot} is gone: {_exit_text(w.proc)}") from None

    def _recv(self, w: _Worker) -> dict:
        try:
            while not w.conn.poll(1.0):
                if not w.proc.is_alive():
                    raise EOFError
            return w.conn.recv()
        except (EOFError, OSError):
            self.broken = True
            w.proc.join(timeout=1.0)
            raise RuntimeError(
                f"reader worker of slot {w.slot} (pid {w.proc.pid}) {_exit_text(w.proc)} during the epoch; "
                "the rows it had not delivered are not counted as read"
            ) from None

    def close(self) -> None:
        """End the worker processes (they finish nothing; the reader's state stays)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        _stop_workers(list(self._workers.values()))
        self._workers.clear()


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        w.ring.stop.set()  # a run in progress ends at its next batch
        try:
            w.conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        w.ring.close()


def _exit_text(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _PoolRun:
    """One epoch's reading by a worker pool (what ``_ThreadSource`` is for the thread)."""

    def __init__(self, pool: _WorkerPool) -> None:
        self._pool = pool

    def next(self, slot: int) -> dict:
        return self._pool.next(slot)

    def close(self) -> None:
        self._pool.end_runs()


def _slot_bytes(ctx: ReadContext) -> int:
    """Return a ring slot size that fits a typical batch (multi-hot bags up to ~32 ids)."""
    conv = ctx.converter
    per_row = (4 * len(conv.schema.dense) + 4 + 4 * bool(conv.schema.weight) + 4 * conv.num_features + 8 * len(conv.single)
               + (8 + 4 * conv.weighted) * 32 * len(conv.multi) + 8 * len(conv.passthrough))
    nbytes = ctx.batch_size * per_row + 64 * (5 + len(conv.passthrough))
    return -(-nbytes // (1 << 20)) * (1 << 20)


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
