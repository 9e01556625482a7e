"""The deterministic plan of an epoch: units dealt to slots, and the batches of one slot.

Everything a slot yields is a pure function of (seed, epoch, generation, slot, the slot's
unit list, rows already consumed per unit, the slot's batch counter). Random streams are
separate numpy generators keyed by purpose::

    unit order of an epoch   (seed; ORDER, epoch, generation)
    rows within a unit       (seed; ROWS,  epoch, file, row group)   fixed for the epoch
    rows drawn for batch k   (seed; DRAW,  epoch, generation, slot, k)

A unit's rows are consumed as a prefix of its fixed permutation, so "rows consumed" is one
count per unit. A slot keeps its first ``shuffle_buffer`` unfinished units open and draws
each batch's rows across them with a multivariate hypergeometric draw over their remaining
counts; the open set is thus itself a function of the consumed counts.
"""

from __future__ import annotations

import heapq
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys.io.batch_arrays import assemble, numpy_alloc
from recsys.io.decode import UnitConverter, UnitData
from recsys.io.errors import ReadError
from recsys.io.units import UnitTable, check_file_schema, open_parquet

_MASK64 = (1 << 64) - 1
ORDER, ROWS, DRAW = 0, 1, 2
_MIN_READ_AHEAD = 2
"""Units loaded ahead of need per slot, at least (one decoding while one converts)."""


def rng_for(seed: int, *key: int) -> np.random.Generator:
    """Return the numpy generator of stream ``key`` under ``seed`` (any Python ints)."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(seed & _MASK64, spawn_key=tuple(int(k) for k in key)))
    )


def deal(order: list[int], rows: np.ndarray, num_slots: int) -> list[list[int]]:
    """Return the units of ``order`` dealt to ``num_slots`` slots, balancing rows greedily.

    Each unit in turn goes to the slot holding the fewest rows so far (lowest index on
    ties), so slots (and ranks) get about the same number of batches.
    """
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    heap = [(0, j) for j in range(num_slots)]
    for u in order:
        load, j = heapq.heappop(heap)
        slots[j].append(u)
        heapq.heappush(heap, (load + int(rows[u]), j))
    return slots


def epoch_order(units: list[int], seed: int, epoch: int, generation: int, shuffle: bool) -> list[int]:
    """Return ``units`` (sorted) in the order of (epoch, generation): shuffled when asked."""
    units = sorted(units)
    if not shuffle or len(units) < 2:
        return units
    perm = rng_for(seed, ORDER, epoch, generation).permutation(len(units))
    return [units[i] for i in perm]


# --------------------------------------------------------------------------- context


@dataclass(slots=True)
class ReadContext:
    """What a slot runner needs to read (picklable: crosses into worker processes)."""

    table: UnitTable
    converter: UnitConverter
    columns: list[str]
    batch_size: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool
    seed: int
    arrow_threads: bool
    nice: int  # the reader threads' nice value (priority_target of ReaderConfig.nice; 0: unchanged)
    on_bad_file: str
    unit_row0: np.ndarray
    """int64 [U] row number of each unit's first row within its file."""


@dataclass(slots=True)
class SlotPlan:
    """What one slot must still do in the current epoch (a snapshot of the reader state)."""

    slot: int
    epoch: int
    generation: int
    units: list[int]
    consumed: dict[int, int]
    skipped: set[int]
    batches: int


# --------------------------------------------------------------------------- loading


def priority_target(nice: int) -> int:
    """Return the nice value ``nice`` steps below the calling thread's priority (0: none)."""
    if nice <= 0 or sys.platform != "linux":
        return 0
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)


def background_priority(target: int) -> None:
    """Lower the calling thread's CPU priority to nice value ``target`` (``priority_target``)
    unless it is already that low. Linux only: a thread is a task with its own nice value,
    inherited by the threads it starts; elsewhere, or if refused, nothing happens."""
    if target <= 0 or sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:
        pass


class UnitLoader:
    """Reads units ahead in two background stages: Arrow decode, then conversion.

    Each stage is one thread, so decoding the next unit overlaps converting this one
    (Arrow's own pool parallelizes the decode across columns).
    """

    def __init__(self, ctx: ReadContext, max_open_files: int = 8) -> None:
        self.ctx = ctx
        self._decode = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recsys-reader-decode",
                                          initializer=background_priority, initargs=(ctx.nice,))
        self._convert = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recsys-reader-convert",
                                           initializer=background_priority, initargs=(ctx.nice,))
        self._pending: dict[int, Future] = {}
        self._files: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._max_open = max_open_files

    def prefetch(self, unit: int, epoch: int) -> None:
        """Start loading ``unit`` in the background (if not already)."""
        if unit not in self._pending:
            decoded = self._decode.submit(self._read, unit)
            self._pending[unit] = self._convert.submit(self._finish, unit, epoch, decoded)

    def get(self, unit: int, epoch: int) -> UnitData:
        """Return the converted unit, rows in its epoch order (ReadError on bad data)."""
        self.prefetch(unit, epoch)
        return self._pending.pop(unit).result()

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._convert.shutdown(wait=True, cancel_futures=True)
        self._decode.shutdown(wait=True, cancel_futures=True)
        for pf in self._files.values():
            pf.close()
        self._files.clear()

    def _open(self, file_index: int) -> pq.ParquetFile:
        pf = self._files.pop(file_index, None)
        if pf is None:
            sf = self.ctx.table.files[file_index]
            conv = self.ctx.converter
            pf = open_parquet(sf, conv.schema)
            try:  # the file may have been replaced since the reader was built
                check_file_schema(conv.schema, conv.passthrough, pf.schema_arrow, sf.display)
            except ReadError:
                pf.close()
                raise
        self._files[file_index] = pf
        while len(self._files) > self._max_open:
            _, old = self._files.popitem(last=False)
            old.close()
        return pf

    def _read(self, unit: int) -> pa.Table:
        ctx = self.ctx
        table = ctx.table
        file_index = int(table.unit_file[unit])
        rg = int(table.unit_rg[unit])
        display = table.files[file_index].display
        try:
            pf = self._open(file_index)
        except ReadError as err:  # name the row group being read
            raise ReadError(file=err.file, row_group=rg, column=err.column, expected=err.expected,
                            found=err.found) from None
        try:
            data = pf.read_row_group(rg, columns=ctx.columns, use_threads=ctx.arrow_threads)
        except (pa.ArrowException, OSError) as exc:
            raise ReadError(
                file=display, row_group=rg, column=_failing_column(pf, rg, ctx.columns),
                expected="a readable row group", found=f"{type(exc).__name__}: {exc}",
            ) from None
        expected_rows = int(table.unit_rows[unit])
        if data.num_rows != expected_rows:
            raise ReadError(
                file=display, row_group=rg,
                expected=f"{expected_rows} rows (as its footer said when the reader was built)",
                found=f"{data.num_rows} rows (file changed?)",
            )
        return data

    def _finish(self, unit: int, epoch: int, decoded: Future) -> UnitData:
        ctx = self.ctx
        data = decoded.result()
        display, rg = ctx.table.where(unit)
        perm = unit_permutation(ctx, epoch, unit) if ctx.shuffle else None
        return ctx.converter.convert(data, display, rg, int(ctx.unit_row0[unit]), perm)


def unit_permutation(ctx: ReadContext, epoch: int, unit: int) -> np.ndarray:
    """Return the fixed order in which ``unit``'s rows are consumed in ``epoch``."""
    t = ctx.table
    rng = rng_for(ctx.seed, ROWS, epoch, int(t.unit_file[unit]), int(t.unit_rg[unit]))
    return rng.permutation(int(t.unit_rows[unit]))


def _failing_column(pf: pq.ParquetFile, rg: int, columns: list[str]) -> str | None:
    """Return the first column that cannot be read alone (the culprit), if any."""
    for c in columns:
        try:
            pf.read_row_group(rg, columns=[c], use_threads=False)
        except (pa.ArrowException, OSError):
            return c
    return None


# --------------------------------------------------------------------------- one slot


class SlotRunner:
    """Yields the items of one slot: batches with their progress deltas, then an end marker.

    Items are dicts::

        {"slot", "k", "delta": [(unit, rows)], "skipped": [...], "batch": BatchArrays}
        {"slot", "end": True, "dropped": rows, "skipped": [...]}

    ``skipped`` lists units found bad while reading (with ``on_bad_file = "skip"``):
    ``{"unit", "rows", "message"}``. ReadError propagates otherwise.
    """

    def __init__(self, ctx: ReadContext, plan: SlotPlan, stop: threading.Event | None = None,
                 alloc=numpy_alloc) -> None:
        self.ctx = ctx
        self.plan = plan
        self.stop = stop
        self.alloc = alloc
        """Allocates each batch's buffer (see ``recsys.io.batch_arrays.assemble``)."""

    def __iter__(self):
        loader = UnitLoader(self.ctx)
        try:
            yield from self._run(loader)
        finally:
            loader.close()

    def _run(self, loader: UnitLoader):
        ctx, plan = self.ctx, self.plan
        rows = ctx.table.unit_rows
        units = plan.units
        rem = {u: int(rows[u]) - plan.consumed.get(u, 0) for u in units}
        for u in plan.skipped:
            rem[u] = 0
        B = ctx.batch_size
        K = ctx.shuffle_buffer if ctx.shuffle else 1
        open_: list[int] = []
        data: dict[int, UnitData] = {}
        skipped: list[dict] = []
        pos = 0
        k = plan.batches

        # Open units drain together (draws are proportional to what they have left), so
        # as many as are open get loaded ahead: the next wave is ready when this one ends.
        read_ahead = max(K, _MIN_READ_AHEAD)

        def refill() -> None:
            nonlocal pos
            want, i = K - len(open_) + read_ahead, pos  # queue the loads first: they overlap
            while want > 0 and i < len(units):
                if rem[units[i]] > 0:
                    loader.prefetch(units[i], plan.epoch)
                    want -= 1
                i += 1
            while len(open_) < K and pos < len(units):
                u = units[pos]
                pos += 1
                if rem[u] <= 0:
                    continue
                try:
                    data[u] = loader.get(u, plan.epoch)
                except ReadError as err:
                    if ctx.on_bad_file != "skip":
                        raise
                    skipped.append({"unit": u, "rows": rem[u], "message": str(err)})
                    rem[u] = 0
                    continue
                open_.append(u)

        while self.stop is None or not self.stop.is_set():
            need = B
            pieces: list[tuple[UnitData, int, int]] = []
            delta: list[tuple[int, int]] = []
            rng = None
            while need > 0:
                refill()
                if not open_:
                    break
                remaining = np.array([rem[u] for u in open_], dtype=np.int64)
                if remaining.sum() <= need:
                    take = remaining
                elif len(open_) == 1:
                    take = np.array([need])
                else:
                    if rng is None:
                        rng = rng_for(ctx.seed, DRAW, plan.epoch, plan.generation, plan.slot, k)
                    take = rng.multivariate_hypergeometric(remaining, need)
                for u, t in zip(open_, take.tolist()):
                    if t == 0:
                        continue
                    pieces.append((data[u], int(rows[u]) - rem[u], t))
                    delta.append((u, t))
                    rem[u] -= t
                    need -= t
                for u in [u for u in open_ if rem[u] == 0]:
                    open_.remove(u)
                    del data[u]
            got = B - need
            if got == 0 or (got < B and ctx.drop_last):
                yield {"slot": plan.slot, "end": True, "dropped": got, "skipped": skipped}
                return
            batch = assemble(pieces, ctx.converter, self.alloc)
            pieces.clear()
            yield {"slot": plan.slot, "k": k, "delta": delta, "skipped": skipped, "batch": batch}
            skipped = []
            k += 1
