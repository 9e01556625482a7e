"""The store's per-table work spread over threads: a call's tables handed out one at a time,
largest first, to the store's worker, its helper lanes and (``Board``) a thread waiting for
the store. Which thread runs a table changes no number; a failure is raised as the first
failing table in the call's own (schema) order, as a loop in that order would raise it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

class Job:
    """One call's items, each taken by whichever thread asks next, in the order given;
    ``index[k]`` is item k's place in the call's own (schema) order. After a failure, only
    items placed before the earliest failure so far are still run, so the earliest failing
    item is found, as a loop in schema order would find it."""

    def __init__(self, items: list, fn: Callable, index: list[int]) -> None:
        self.items, self.fn, self.index = items, fn, index
        self.failed: list[tuple[int, BaseException]] = []  # (schema-order index, error)
        self._cond = threading.Condition()
        self._next = 0
        self._running = 0
        self._first_failure = len(items)

    def work(self) -> None:
        """Run items until none is left; a helper's interruption is recorded as its item's
        failure and raised in the helper too."""
        while True:
            with self._cond:
                while self._next < len(self.items) and self.index[self._next] > self._first_failure:
                    self._next += 1
                k = self._next
                if k >= len(self.items):
                    return
                self._next = k + 1
                self._running += 1
            try:
                self.fn(self.items[k])
            except BaseException as exc:  # noqa: BLE001 - raised by the store's worker, in schema order
                with self._cond:
                    self.failed.append((self.index[k], exc))
                    self._first_failure = min(self._first_failure, self.index[k])
                if not isinstance(exc, Exception):
                    raise
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def wait_idle(self) -> None:
        """Wait until no thread runs an item (call after ``work`` returned: none is handed out)."""
        with self._cond:
            while self._running:
                self._cond.wait()


class Board:
    """Where a store's worker posts its per-table work while another thread waits for the
    worker: the waiting thread takes tables too instead of idling (the trainer, between
    its dense optimizer step and the next lookup, on the core the step leaves free)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._job: Job | None = None

    def run(self, items: list, fn: Callable, index: list[int], pool: ThreadPoolExecutor | None = None,
            helpers: int = 0) -> list:
        """Run ``fn`` on the items (``Job``; also on ``helpers`` threads of ``pool``); return
        the failures as (schema-order index, error)."""
        job = Job(items, fn, index)
        with self._cond:
            self._job = job
            self._cond.notify_all()
        lanes = [pool.submit(job.work) for _ in range(helpers)] if pool is not None else []
        try:
            job.work()
        finally:
            with self._cond:
                self._job = None
            for f in lanes:
                f.result()
            job.wait_idle()
        return job.failed

    def help_until(self, fut: Future) -> None:
        """Take posted work until ``fut`` is done."""
        fut.add_done_callback(self._poke)
        helped = None
        while True:
            with self._cond:
                while (self._job is None or self._job is helped) and not fut.done():
                    self._cond.wait()
                if fut.done():
                    return
                helped = self._job
            helped.work()

    def _poke(self, _fut: Future) -> None:
        with self._cond:
            self._cond.notify_all()


class HelpedFuture(Future):
    """A future whose waiter takes the store worker's posted work while it waits."""

    def __init__(self, board: Board) -> None:
        super().__init__()
        self._board = board

    def result(self, timeout=None):
        if timeout is None and not self.done():
            self._board.help_until(self)
        return super().result(timeout)


class Lanes:
    """Runs one call's per-table work on up to ``n`` threads: the calling thread and ``n - 1``
    helpers (numba kernels release the GIL). Tables share no arrays, so which thread does a
    table changes no number; a group that fails reports its first failing item, and of
    those the lowest item's error is raised, as a loop in item order would raise it.

    With a ``board``, tables are not split into fixed groups: they are handed out one at a
    time, largest first, to the calling thread, the helpers and any thread waiting for the
    store (``HelpedFuture``); the lowest failing item's error is raised likewise."""

    def __init__(self, n: int, board: Board | None = None) -> None:
        self.n = max(1, int(n))
        self.board = board
        self._pool = ThreadPoolExecutor(self.n - 1, thread_name_prefix="store-lane") if self.n > 1 else None

    def split(self, costs: list[float]) -> list[list[int]]:
        """Return up to ``n`` groups of item indices, balanced by cost (largest first onto
        the least loaded group), each in ascending order."""
        k = min(self.n, len(costs))
        if k <= 1:
            return [list(range(len(costs)))]
        load = [0.0] * k
        groups: list[list[int]] = [[] for _ in range(k)]
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            g = load.index(min(load))
            groups[g].append(i)
            load[g] += costs[i]
        return [sorted(g) for g in groups if g]

    def each(self, items: list, costs: list[float], fn: Callable, before: Callable | None = None) -> None:
        """Call ``fn(item)`` for every item (``before(group's items)`` first in each group;
        with a board, ``before(items)`` once)."""
        if self.board is not None and len(items) > 1:
            if before is not None:
                before(items)
            order = sorted(range(len(items)), key=lambda i: -costs[i])
            raise_first(self.board.run([items[i] for i in order], fn, order, self._pool, self.n - 1))
            return
        groups = self.split(costs)
        if len(groups) == 1:
            if before is not None:
                before(items)
            for item in items:
                fn(item)
            return

        def run(group: list[int]):
            try:
                if before is not None:
                    before([items[i] for i in group])
            except BaseException as exc:  # noqa: BLE001 - raised by the caller, in item order
                return -1, exc
            for i in group:
                try:
                    fn(items[i])
                except BaseException as exc:  # noqa: BLE001
                    return i, exc
            return None

        futures = [self._pool.submit(run, g) for g in groups[1:]]
        failed = [run(groups[0])] + [f.result() for f in futures]
        raise_first([x for x in failed if x is not None])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def raise_first(failed: list[tuple[int, BaseException]]) -> None:
    """Raise the error of the lowest item index among ``failed`` (item order), if any."""
    if failed:
        raise min(failed, key=lambda x: x[0])[1]
