"""The sharded store's schedule: every lookup, push, flush and call runs in one sequence
(on the schedule's worker thread when ``threaded``, else in the caller), identical on every
rank, and a training lookup of step t runs once the pushes of steps ``<= t - staleness - 1``
have arrived (``recsys.store.sharded.store`` states the staleness contract). On the worker, a
lookup's batch-only work (``prepare``) runs when it arrives and its key work (``reserve``)
once it is first in line; only its row reads wait for the pushes.

``StoreSchedule`` is an object the store owns: it holds the op queue, the worker thread, the
pushes received and not yet applied, the steps whose push is still owed and the first
failure. It knows nothing of tables: the store hands it its work as functions
(``StoreWork``) and calls it through ``submit_lookup``, ``push``, ``cancel``, ``call``,
``submit_call``, ``flush``, ``stop`` and ``apply_remaining``.
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.runtime import priority
from recsys.store.sharded.lanes import Board, HelpedFuture
from recsys.store.sharded.lookup import Lookup, _Failed

__all__ = ["StoreSchedule", "StoreWork"]


@dataclass(frozen=True, slots=True)
class StoreWork:
    """The store's work the schedule runs, always on its op sequence."""

    prepare: Callable[[KeyedJaggedTensor, bool], Any]
    """``prepare(kjt, train)``: a lookup's batch-only part (reads no table)."""
    reserve: Callable[..., None]
    """``reserve(prep, step, train, early=...)``: a lookup's key work (slots, no row values)."""
    lookup: Callable[[Any, int | None, bool], Lookup]
    """``lookup(batch or prepared, step, train)``: the whole lookup, its row reads included."""
    push: Callable[..., None]
    """``push(lookup, g_rows, g_pooled, ready)``: apply a push's gradients at their owners."""
    explain: Callable[[BaseException], BaseException]
    """The error a caller reads for a failure of the work."""


class StoreSchedule:
    """The store's op sequence (see module doc)."""

    def __init__(self, work: StoreWork, staleness: int, threaded: bool, board: Board | None) -> None:
        self.staleness = staleness
        self.visibility: list[tuple[int, int]] = []  # (push step, first lookup step that saw it)
        self.threaded = threaded
        self._work_fns = work
        self._board = board
        self._pending_pushes: dict[int, tuple] = {}  # step -> the push's arguments
        self._unpushed: set[int] = set()  # training lookups whose push the caller still owes
        self._failure: BaseException | None = None
        self._ops: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if threaded:
            self._ops = queue.Queue()
            self._worker = threading.Thread(target=self._work, name="store-worker", daemon=True)
            self._worker.start()

    @property
    def failure(self) -> BaseException | None:
        """The worker's first failure (raised to its caller already), or None."""
        return self._failure

    # ------------------------------------------------------------------ the interface

    def check_pushes_before(self, step: int) -> None:
        """Raise unless every push the training lookup of ``step`` must see was made."""
        self._check_pushes_before(step)

    def submit_lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool) -> Future:
        """Queue a lookup; a training one promises its step's ``push`` (or ``cancel``)."""
        if train:
            if step is None:
                raise ValueError("a training lookup needs a step")
            if not self.threaded:
                self._check_pushes_before(step)
            if step in self._unpushed:
                raise ValueError(f"step {step} was already looked up for training")
            self._unpushed.add(step)
        return self._submit(("lookup", kjt, step, train))

    def push(self, step: int, arguments: Callable[[], tuple]) -> None:
        """Queue the push of ``step``: ``arguments()`` (called once the push is known to be
        owed) returns ``StoreWork.push``'s arguments."""
        self._fulfil(step)
        self._submit(("push", step, arguments()))

    def cancel(self, step: int | None) -> None:
        """Withdraw the push the training lookup of ``step`` promised."""
        self._fulfil(step)
        self._submit(("push", step, None))

    def call(self, fn):
        """Return ``fn()`` run in the store's op sequence (after everything queued)."""
        return self.submit_call(fn).result()

    def submit_call(self, fn) -> Future:
        """Queue ``fn()`` on the op sequence; return its future."""
        return self._submit(("call", fn))

    def flush(self, through_step: int | None = None) -> None:
        """Apply every queued push of steps ``<= through_step`` (all when None) now."""
        limit = float("inf") if through_step is None else through_step
        missing = sorted(s for s in self._unpushed if s <= limit)
        if missing:
            raise RuntimeError(f"flush through step {through_step}: steps {missing} were looked up but not pushed")
        self._submit(("flush", limit)).result()

    def stop(self) -> None:
        """Stop the worker thread after the ops queued before (none runs after)."""
        if self._worker is not None and self._worker.is_alive():
            priority.STORE.raise_()
            self._ops.put(None)
            self._worker.join()

    def apply_remaining(self) -> None:
        """Apply every push received and not applied yet (in the caller; after ``stop``)."""
        self._apply_pushes_through(float("inf"))

    # ------------------------------------------------------------------ the sequence

    def _visible_through(self, step: int) -> int:
        """Return the last push step the training lookup of ``step`` must see."""
        return step - self.staleness - 1

    def _check_pushes_before(self, step: int) -> None:
        missing = sorted(s for s in self._unpushed if s <= self._visible_through(step))
        if missing:
            raise RuntimeError(
                f"the lookup of step {step} must see the pushes of steps {missing} "
                f"(staleness {self.staleness}), which were not made yet"
            )

    def _fulfil(self, step: int | None) -> None:
        if step not in self._unpushed:
            raise ValueError(f"step {step}: no pending training lookup promised this push")
        self._unpushed.discard(step)

    def _submit(self, op) -> Future:
        fut: Future = Future() if self._board is None else HelpedFuture(self._board)
        if self.threaded:
            if self._failure is not None:
                raise self._failed_earlier()
            # whatever is submitted, someone waits for it (the push: the next lookup)
            priority.STORE.raise_()
            self._ops.put((op, fut))
        else:
            self._run(op, fut)
        return fut

    def _failed_earlier(self) -> BaseException:
        """Return what a call after the worker's failure raises: the failure itself when it
        is the user's to read (a ``UserError``, e.g. ``SpillError``: one line), else a
        ``RuntimeError`` caused by it."""
        from recsys.errors import UserError

        if isinstance(self._failure, UserError):
            return self._failure
        err = RuntimeError("the store worker failed earlier")
        err.__cause__ = self._failure
        return err

    def _run(self, op, fut: Future) -> None:
        try:
            kind = op[0]
            if kind == "push":
                if op[2] is not None:
                    self._pending_pushes[op[1]] = op[2]
                result = None
            elif kind == "flush":
                self._apply_pushes_through(op[1])
                result = None
            elif kind == "call":
                result = op[1]()
            else:
                _, kjt, step, train = op
                if train:
                    self._apply_pushes_through(self._visible_through(step), step)
                result = self._work_fns.lookup(kjt, step, train)
            fut.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the future
            exc = self._work_fns.explain(exc)
            if self.threaded:
                self._failure = exc
            fut.set_exception(exc)

    def _work(self) -> None:
        """Run ops in arrival order; an op waits until every push it must see has arrived."""
        waiting: collections.deque = collections.deque()
        unpushed: set[int] = set()  # promised by a training lookup, push not arrived yet
        while True:
            item = self._ops.get()
            if item is None:
                break
            op = item[0]
            if op[0] == "push":
                # a push only registers its gradients (applied at a fixed point of the
                # schedule), so it never waits behind the lookups that wait for it
                unpushed.discard(op[1])
                self._run(*item)
            else:
                if op[0] == "lookup":
                    # the batch's own work now, while the pushes it must see are awaited
                    item = ((op[0], self._prepare_early(op[1], op[3]), *op[2:]), item[1])
                    if op[3]:
                        unpushed.add(op[2])
                waiting.append(item)
            while waiting:
                op, fut = waiting[0]
                if (op[0] == "lookup" and op[3] and self._failure is None
                        and getattr(op[1], "reserved", None) is False):  # a _Prepared, or the device key map's
                    # first in line: take its slots now (key work only), read rows later
                    try:
                        # early: pushes it must see are still awaited (read ahead meanwhile)
                        awaited = any(s <= self._visible_through(op[2]) for s in unpushed)
                        self._work_fns.reserve(op[1], op[2], True, early=awaited)
                    except BaseException as exc:  # noqa: BLE001 - surfaced through the future
                        exc = self._work_fns.explain(exc)
                        self._failure = exc
                        waiting.popleft()
                        fut.set_exception(exc)
                        continue
                if op[0] == "lookup" and op[3]:
                    limit = self._visible_through(op[2])
                elif op[0] == "flush":
                    limit = op[1]
                else:
                    limit = float("-inf")
                if any(s <= limit for s in unpushed):
                    break
                waiting.popleft()
                if self._failure is not None:
                    fut.set_exception(self._failed_earlier())
                else:
                    self._run(op, fut)

    def _prepare_early(self, kjt: KeyedJaggedTensor, train: bool) -> Any:
        try:
            return self._work_fns.prepare(kjt, train)
        except Exception as exc:  # noqa: BLE001 - raised in order, when the lookup runs
            return _Failed(exc)

    def _apply_pushes_through(self, last_step: float, for_lookup: int | None = None) -> None:
        for s in sorted(self._pending_pushes):
            if s > last_step:
                break
            self._work_fns.push(*self._pending_pushes.pop(s))
            self.visibility.append((s, -1 if for_lookup is None else for_lookup))
