"""The sharded store's schedule: every lookup, push, flush and call runs in one sequence
(on the store's worker thread when ``threaded``, else in the caller), identical on every
rank, and a training lookup of step t runs once the pushes of steps ``<= t - staleness - 1``
have arrived (``recsys.store.sharded.store`` states the staleness contract). On the worker, a
lookup's batch-only work (``_prepare``) runs when it arrives and its key work
(``_reserve``) once it is first in line; only its row reads wait for the pushes.

``StoreSchedule`` is a part of ``ShardedEmbeddingStore``: it uses the store's
``staleness``, ``_unpushed``, ``_pending_pushes``, ``visibility``, ``_threaded``,
``_ops``, ``_board``, ``_failure`` and its work (``_prepare``, ``_reserve``,
``_do_lookup``, ``_do_push``, ``_explain``).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.runtime import priority
from recsys.store.sharded.lanes import HelpedFuture
from recsys.store.sharded.lookup import Lookup, _Failed, _Prepared

__all__ = ["StoreSchedule"]


class StoreSchedule:
    """The store's op sequence (see module doc)."""

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

    def _fulfil(self, lookup: Lookup) -> None:
        if lookup.step not in self._unpushed:
            raise ValueError(f"step {lookup.step}: no pending training lookup promised this push")
        self._unpushed.discard(lookup.step)

    def _call(self, fn):
        """Return ``fn()`` run in the store's op sequence (after everything queued)."""
        return self._submit(("call", fn)).result()

    def _submit(self, op) -> Future:
        fut: Future = Future() if self._board is None else HelpedFuture(self._board)
        if self._threaded:
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
                result = self._do_lookup(kjt, step, train)
            fut.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the future
            exc = self._explain(exc)
            if self._threaded:
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
                    item = ((op[0], self._prepare_early(op[1]), *op[2:]), item[1])
                    if op[3]:
                        unpushed.add(op[2])
                waiting.append(item)
            while waiting:
                op, fut = waiting[0]
                if (op[0] == "lookup" and op[3] and self._failure is None and isinstance(op[1], _Prepared)
                        and not op[1].reserved):
                    # first in line: take its slots now (key work only), read rows later
                    try:
                        # early: pushes it must see are still awaited (read ahead meanwhile)
                        awaited = any(s <= self._visible_through(op[2]) for s in unpushed)
                        self._reserve(op[1], op[2], True, early=awaited)
                    except BaseException as exc:  # noqa: BLE001 - surfaced through the future
                        exc = self._explain(exc)
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

    def _prepare_early(self, kjt: KeyedJaggedTensor) -> _Prepared | _Failed:
        try:
            return self._prepare(kjt)
        except Exception as exc:  # noqa: BLE001 - raised in order, when the lookup runs
            return _Failed(exc)

    def _apply_pushes_through(self, last_step: float, for_lookup: int | None = None) -> None:
        for s in sorted(self._pending_pushes):
            if s > last_step:
                break
            self._do_push(*self._pending_pushes.pop(s))
            self.visibility.append((s, -1 if for_lookup is None else for_lookup))
