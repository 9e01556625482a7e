"""The reader's worker processes (``num_workers > 0``), and how a batch crosses to the consumer.

A rank's ``WorkerPool`` keeps one process per slot from epoch to epoch; each runs its slot's
plan (``recsys.io.plan.SlotRunner``) and sends the items back over a pipe. A batch is one
buffer: the worker assembles it into a slot of its ``_Ring`` (one shared mapping, with fork)
and sends the slot's number, else into a torch shared-memory segment sent with the item; the
ring's credits bound how far a worker runs ahead. ``to_torch`` and ``batch_views`` turn an
item's batch into that buffer and back into tensors, for the worker processes and for the
reader's own thread (``recsys.io.reader``) alike.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import signal
import time
import weakref

import numpy as np
import pyarrow as pa
import torch

from recsys.io.config import ReaderConfig
from recsys.io.batch_arrays import BatchArrays
from recsys.io.errors import ReadError
from recsys.io.plan import ReadContext, SlotPlan, SlotRunner, background_priority


def to_torch(item: dict, views: bool = False) -> dict:
    """Replace the item's BatchArrays by its buffer (a tensor, or a ring slot) and layout;
    with ``views`` (a source in this process), also by its tensors (``batch_views``), made here
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
                out["views"] = batch_views(out)
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


def batch_views(b: dict) -> dict[str, torch.Tensor]:
    """Return the batch's tensors as views into its buffer."""
    buf = b["buffer"]
    out = {}
    for name, (off, dtype, shape) in b["layout"].items():
        tdtype = _TORCH_DTYPES[dtype]
        size = int(np.prod(shape, dtype=np.int64)) * tdtype.itemsize
        out[name] = buf[off : off + size].view(tdtype).view(shape)
    return out

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
            conn.send(to_torch(item))
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


class WorkerPool:
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
    """One epoch's reading by a worker pool (what ``recsys.io.reader._ThreadSource`` is for the thread)."""

    def __init__(self, pool: WorkerPool) -> None:
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
