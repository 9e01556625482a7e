"""Live pushes: fresh rows of the keys training touched, streamed to Redis while it trains.

With a ``[publish]`` section (``redis`` set), every rank publishes the rows its owner shards
hold (model-parallel by owner: no row is published twice, none is missed):

- **On the store's op sequence** (where pushes are applied, in step order), after the push
  of step t: the keys it updated join the *touched* set. When ``every_s`` seconds have passed
  since the last snapshot, the current rows of every touched key are copied (a gather: no
  Redis, no lock, nothing changed) and handed to the push thread as one snapshot tagged
  with step t. Those rows are exactly the trainer's rows after the optimizer step t.
- **On the push thread**: each snapshot is written with ``recsys.train.live_writer.LiveWriter``
  (Redis never replaces a row with one of an earlier step: plain MSETs checked against the
  namespace's fence in one transaction, a Lua guard when the fence says an earlier attempt
  may hold later steps), then the rank's head ``{"step", "time", "rows"}``. The ranks of one
  attempt are one writer group (``group``, the same token on every rank): they own disjoint
  keys, so one rank's steps never send another's writes down the guarded path.
- **Under pressure** the queue between them is bounded (``queue_snapshots``): when it is
  full, no snapshot is taken; the touched set keeps growing, and the next snapshot writes
  each key once, with its newest row (counted as ``publish/coalesced``).
- **Redis unreachable**: the push thread retries with backoff (``retries``, ``backoff_s``);
  a snapshot that still fails is dropped, its keys go back to the touched set (their rows
  are read again, newer, at the next snapshot), and ``publish/errors`` counts it. Training
  never waits for any of this.
- **The end**: the last snapshot (every key touched since the previous one) is written
  before training returns, within ``final_timeout_s``.
- **The wide arm** (``model.wide``): its weights live in a store of their own, with its own
  op sequence, so each rank has a second publisher for the ``<table>.wide`` tables, a
  writer ``<rank>.wide`` of the same fence group (its keys are disjoint from the
  embeddings': other tables). ``PublisherGroup`` shows the two as one to the trainer.

A training step never waits on Redis: the only work on the training path is the touched-set
bookkeeping per push and one gather of the touched rows per ``every_s``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from recsys.train.config import PublishConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Snapshot:
    """Rows of one rank's touched keys after the optimizer step ``step``."""

    step: int
    parts: list[tuple[str, np.ndarray, np.ndarray]]  # (table, keys, float32 rows)

    @property
    def rows(self) -> int:
        return sum(k.shape[0] for _, k, _ in self.parts)


class LivePublisher:
    """One rank's live pushes (see the module doc).

    ``after_push`` and ``finish`` run on the store's op sequence (``ShardedEmbeddingStore``
    calls them); the push thread owns the Redis connection. ``read_rows(table, keys) ->
    (found, rows)`` reads this rank's current rows and changes nothing. ``clock`` is the
    interval's clock (a test drives it by steps).
    """

    def __init__(self, cfg: PublishConfig, rank: int, read_rows: Callable, writer=None,
                 clock: Callable[[], float] = time.monotonic, group: str | None = None,
                 member: str | None = None) -> None:
        """``member``: the writer's name in its fence group and its field of the head hash
        (default: the rank; ``<rank>.wide`` for the wide arm's publisher)."""
        from recsys.train.live_writer import LiveWriter

        self.cfg, self.rank, self.read_rows, self.clock = cfg, rank, read_rows, clock
        self.member = member if member is not None else str(rank)
        self.writer = writer or LiveWriter(cfg.redis, cfg.namespace, cfg.buckets, cfg.timeout_s,
                                           group=group, member=self.member, password_file=cfg.redis_password_file)
        if writer is None:
            self.writer.register()  # the trainer then waits for every rank's (see LiveWriter.register)
        self._touched: dict[str, list[np.ndarray]] = {}
        self._returned: list[tuple[str, np.ndarray]] = []  # keys of failed snapshots (push thread -> store)
        self._returned_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_snapshots)
        self._last = clock()
        self.snapshot_steps: list[int] = []  # steps of the snapshots taken (for tests and metrics)
        self.counters = {"snapshots": 0, "pushes": 0, "rows": 0, "rows_replaced": 0, "coalesced": 0,
                         "errors": 0, "retries": 0, "skipped_absent": 0, "snapshot_ms": 0.0}
        self.last_pushed_step = -1
        self._failing = 0  # snapshots failed in a row (the push thread's)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"live-push-{self.member}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ store side

    def after_push(self, step: int, parts: list[tuple[str, np.ndarray]]) -> None:
        """Record the keys a push updated; snapshot when ``every_s`` has passed. ``step``: the
        optimizer steps the rows now reflect (the trainer's step count, as in ``metrics.jsonl``
        and checkpoint names)."""
        for table, keys in parts:
            if keys.shape[0]:
                self._touched.setdefault(table, []).append(keys)
        if self.clock() - self._last >= self.cfg.every_s:
            self._snapshot(step)

    def _snapshot(self, step: int) -> bool:
        """Take a snapshot of the touched rows into the queue; False (coalesced) if it is full."""
        from recsys.store.tables.dedup import unique_inverse

        if self._queue.full():
            self.counters["coalesced"] += 1
            return False
        t0 = time.perf_counter()
        with self._returned_lock:
            returned, self._returned = self._returned, []
        for table, keys in returned:
            self._touched.setdefault(table, []).append(keys)
        budget = self.cfg.max_rows_per_push
        parts, left = [], {}
        for table, chunks in self._touched.items():
            # hash dedup in first-touch order: np.unique's sort was over half of a gather's time
            keys = unique_inverse(np.concatenate(chunks))[0]
            if budget <= 0:
                left[table] = [keys]
                continue
            if keys.shape[0] > budget:
                left[table] = [keys[budget:]]
                keys = keys[:budget]
            found, rows = self.read_rows(table, keys)
            self.counters["skipped_absent"] += int((~found).sum())  # evicted without a spill tier
            if found.any():
                parts.append((table, keys[found], rows[found]))
                budget -= int(found.sum())
        self._touched = left
        self._last = self.clock()
        self.snapshot_steps.append(step)
        self.counters["snapshots"] += 1
        self.counters["snapshot_ms"] += 1000.0 * (time.perf_counter() - t0)  # a float: most gathers take < 1 ms
        self._queue.put_nowait(Snapshot(step, parts))
        return True

    def finish(self, step: int) -> bool:
        """Snapshot what is left and wait (``final_timeout_s`` at most) until every snapshot
        is written; stop the push thread. Returns whether all were written."""
        deadline = time.monotonic() + self.cfg.final_timeout_s
        while self._pending() and time.monotonic() < deadline:
            if self._snapshot(step):
                self._wait_idle(deadline)  # written, or its keys returned for another try
            else:
                time.sleep(0.01)
        done = self._wait_idle(deadline) and not self._pending()
        try:
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        except queue.Full:
            pass  # the thread is stuck in a write; it is a daemon
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        if not done:
            log.warning("live pushes: the last rows were not written within publish.final_timeout_s = %s s",
                        self.cfg.final_timeout_s)
        return done

    def _pending(self) -> bool:
        with self._returned_lock:
            return bool(self._touched) or bool(self._returned)

    def _wait_idle(self, deadline: float) -> bool:
        """Wait until the push thread has handled every queued snapshot; False at ``deadline``."""
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Stop the push thread without writing what is left (a failed job, or after
        ``finish``): a write stuck on an unresponsive Redis is interrupted (its socket shut
        down), queued snapshots are dropped, and the thread is joined."""
        self._closing = True
        self.writer.reset()  # shuts the sockets down: a blocked read returns at once
        if self._thread.is_alive():
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queue.task_done()
            try:
                self._queue.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(timeout=5.0)
        self.writer.reset()  # a write that raced the first reset may have reconnected

    # ------------------------------------------------------------------ push thread

    def _run(self) -> None:
        from recsys.io.plan import background_priority

        background_priority(self.cfg.nice)
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                self._write(snap)
            finally:
                self._queue.task_done()

    def _write(self, snap: Snapshot) -> None:
        delay = self.cfg.backoff_s
        for attempt in range(self.cfg.retries):
            if self._closing:
                return
            try:
                replaced = self.writer.write(snap.parts, snap.step, self.cfg.dtype)
                self.writer.write_head(self.member, snap.step, snap.rows)
            except Exception as exc:  # noqa: BLE001 - Redis errors of any kind: retried, then counted
                self.writer.reset()
                if self._closing:
                    return
                if attempt + 1 < self.cfg.retries:
                    self.counters["retries"] += 1
                    time.sleep(delay)
                    delay *= 2
                    continue
                self.counters["errors"] += 1
                self._failing += 1
                if self._failing == 1:  # once per outage; the recovery says how long it lasted
                    log.warning("live pushes: the rows of step %d were not written (%s: %s); training goes on, "
                                "and the keys are pushed with the next snapshot that gets through",
                                snap.step, type(exc).__name__, exc)
                with self._returned_lock:
                    self._returned += [(table, keys) for table, keys, _ in snap.parts]
                return
            if self._failing:
                log.warning("live pushes: written again (step %d) after %d failed snapshot(s)", snap.step, self._failing)
                self._failing = 0
            self.counters["pushes"] += 1
            self.counters["rows"] += snap.rows
            self.counters["rows_replaced"] += replaced
            self.last_pushed_step = snap.step
            return

    def totals(self) -> dict[str, float]:
        """This rank's counters and its writer's (rows written plain and guarded, fence conflicts)."""
        return {**self.counters, **getattr(self.writer, "counters", {})}

    def metrics(self) -> dict[str, float]:
        """This rank's ``publish/*`` figures for ``metrics.jsonl``."""
        out = {f"publish/{k}": v for k, v in self.totals().items()}
        out["publish/last_step"] = self.last_pushed_step
        out["publish/queued"] = self._queue.qsize()
        return out


class PublisherGroup:
    """One rank's publishers of several stores (the embeddings' and the wide arm's), seen as
    one by the trainer: summed counters, and the step through which every one has pushed."""

    def __init__(self, publishers: list[LivePublisher]) -> None:
        self.publishers = list(publishers)

    @property
    def last_pushed_step(self) -> int:
        return min(p.last_pushed_step for p in self.publishers)

    def totals(self) -> dict[str, float]:
        return _summed(p.totals() for p in self.publishers)

    def metrics(self) -> dict[str, float]:
        return {**_summed(p.metrics() for p in self.publishers), "publish/last_step": self.last_pushed_step}

    def close(self) -> None:
        for p in self.publishers:
            p.close()


def _summed(dicts) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def live_manifest(cfg: PublishConfig, run: str, schema, wide: bool = False) -> dict:
    """Return the live namespace's manifest for a job of ``schema`` in the run ``run``; with
    ``wide`` (``model.wide``) the wide arm's dim-1 tables too, whose keys are hashed with
    their embedding table's salt (the trainer looks both up with the same keys)."""
    from recsys.features import hashing
    from recsys.redisio import live as live_protocol
    from recsys.store.tables.wide import wide_table

    dims = {n: t.dim for n, t in schema.tables.items()}
    salts = {n: f"{hashing.table_salt(n):016x}" for n in schema.tables}
    if wide:
        dims.update({wide_table(n): 1 for n in schema.tables})
        salts.update({wide_table(n): salts[n] for n in schema.tables})
    return live_protocol.manifest(run, cfg.dtype, cfg.buckets, dims, salts)


def claim(cfg: PublishConfig, manifest: dict, writer=None) -> bool:
    """Make the live namespace this run's (rank 0, before training): write its manifest.

    Refuses (``UserError``) a namespace whose live rows belong to another run, unless
    ``takeover`` (then they are deleted first). Returns False, with a warning, when Redis
    cannot be reached: training starts anyway and the push threads retry.
    """
    import redis

    from recsys.errors import UserError
    from recsys.redisio.client import redact
    from recsys.train.live_writer import LiveWriter

    writer = writer or LiveWriter(cfg.redis, cfg.namespace, cfg.buckets, cfg.timeout_s,
                                  password_file=cfg.redis_password_file)
    where = f"live namespace {cfg.namespace!r} at {redact(cfg.redis)}"
    try:
        try:
            found = writer.read_manifest()
        except ValueError as exc:
            found = {"run": f"(unreadable manifest: {exc})"}
        if found is not None and found.get("run") != manifest["run"]:
            if not cfg.takeover:
                heads = writer.read_head()
                newest = max((h.get("step", -1) for h in heads.values()), default=-1)
                raise UserError(
                    f"publish: {where} holds the live rows of another run ({found.get('run')}, newest step "
                    f"{newest}); this run's rows would be refused as older. Set publish.namespace to a name of "
                    "its own, or publish.takeover = true to delete them first")
            deleted = writer.clear()
            log.warning("publish: took over %s: deleted %d live rows of run %s", where, deleted, found.get("run"))
        writer.write_manifest(manifest)
        return True
    except (redis.RedisError, OSError) as exc:
        log.warning("publish: %s cannot be reached (%s: %s); training starts, live pushes retry", where,
                    type(exc).__name__, exc)
        return False
    finally:
        writer.close()
