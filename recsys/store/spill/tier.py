"""The spill tier: evicted rows kept in Redis with their optimizer state, back on the next miss.

Legend: ``N`` rows of a call, ``D`` dim, ``B`` keys per Redis command (``spill.batch_rows``).

One ``SpillTier`` per table and shard (``EmbeddingTable`` drives it; see its module doc)::

    table evicts rows ──► put(rows) ──► encode ──► buffer {key: bytes} ──► writer thread
                                                   │   (pending, then in flight)   │ pipelined MSET
                                                   │                               ▼ / UNLINK, B keys
    table misses ──► fetch(keys) ──► buffer first ─┤  else, keys in the index: read ahead, or MGET ──► Redis
                                                   └─ else: not spilled (no round trip)
    next lookup's misses ──► prefetch(keys) ──► MGET ahead (while the step trains)
    rows restored ──► restored(keys): copies kept (spill.delete_restored: forget(keys) ──►
                      buffer {key: None} (a tombstone) ──► writer: UNLINK)

Keys: ``<namespace>:spill:<table>:<key as 16 lowercase hex digits>`` (the key's uint64
bits). Nothing about the shard or world size enters it, so a row spilled at one world size
is found at any other. The namespace (``store.spill.namespace``) belongs to one
training run: ``<namespace>:owner`` names it (``claim``), and a run deletes its tables'
rows at start (``clear_tables``): the checkpoint it resumes from holds every spilled row.

Values: raw little-endian bytes, one fixed-size record per row, decoded with
``np.frombuffer`` (no pickle, no JSON). The layout of the values, the keys and the owner
record is in ``recsys.redisio.spill_layout``. Fixed-size names and values let a batch's
MSET / MGET / UNLINK commands be packed as one byte array (``recsys.redisio.resp``),
not argument by argument.

The index (``recsys.store.spill.index``): the exact set of keys this tier has in Redis
(built by one SCAN on first use, or known empty after ``clear``; then kept by the writer: a
confirmed SET adds a key, a confirmed UNLINK removes it). 14-36 bytes of host memory per
spilled row (up to ~54 while it grows), and no pause to grow it or to clean up after deletions (see that module). It
lets a miss of a key never spilled cost no round trip and no Redis at all, which is what
lets training go on during an outage; and a key in the index that Redis no longer has is a
lost row, reported (``SpillError``) instead of re-initialized. One writer
per key: a namespace belongs to one run and a key to one shard; rows written by another tier
after this one's index was built are not seen.

Semantics, exactly:

- ``put`` encodes at once and buffers the rows (the newest copy of a key wins); a writer
  thread writes the buffer in pipelined batches. Each batch is *in flight* until Redis
  confirmed it. While the buffer holds ``spill.queue_rows`` rows or more, ``put`` waits
  for the writer (back-pressure), never dropping rows.
- ``fetch`` answers from the buffer first (pending, then in flight): a buffered value is
  the newest copy, a buffered tombstone means "not spilled". Keys the buffer does not know
  are read from Redis (MGET, read-only) if the index has them, else are not spilled. A
  value of another format raises; so does a key of the index that Redis does not have.
- ``prefetch`` reads ahead (one MGET, one attempt) the rows of keys a coming ``fetch`` will
  ask for: the store calls it with a training lookup's misses while that lookup still waits
  for the pushes before it, so the round trip overlaps the step's dense work. It is a hint:
  it never raises, and ``fetch`` reads itself whatever it did not get (see ``prefetch``).
- After the table restored rows it calls ``restored``. By default the copies stay: the
  table asks only for keys it does not hold and ``rows(skip=...)`` passes over those it
  does, so a copy is never read while its row is in memory, and the row's next ``put``
  overwrites it (Redis then holds every row evicted at least once: the price in Redis
  memory of sending no UNLINK per restored row). With ``spill.delete_restored``,
  ``restored`` is ``forget``: tombstones, written as UNLINK by the writer, after any
  in-flight SET of the same key (batches are written in order), so a later eviction's copy
  is the only one that counts. Once the index is built, only keys it or the buffer holds get
  one (the others are not spilled: nothing to delete). The table also ``forget``s the rows
  it hands over (``pop_rows``, flushed before they leave, so a new owner's write of the same
  key lands after the UNLINK), whose copies would otherwise outlive them, and passes
  ``prefetch`` only the keys it does not hold.
- Every Redis call is retried ``spill.retries`` times on connection errors and timeouts,
  waiting ``spill.backoff_s`` and doubling. Then, by ``spill.outage``:

  - ``"fail"``: ``SpillError`` (the URL, the operation, the table, what to do). A failed
    read leaves the table unchanged. A failed background write keeps its rows buffered
    (still served by ``fetch``) and raises ``SpillError`` on the next call of this tier
    (``check`` at every table call); the writer then tries again.
  - ``"hold"``: an *outage* begins. The writer keeps its rows buffered (served by
    ``fetch``) and tries again every ~1 s; ``put`` stops waiting for the writer (the buffer
    may grow to ``spill.hold_max_rows``, then ``put`` raises, the rows kept); a miss of a
    key the index does not have needs no Redis; a read that needs Redis (a key in the
    index, ``rows``, ``clear``) and ``flush`` wait for it. The first Redis call that
    succeeds ends the outage. Once it lasted ``spill.hold_timeout_s``, calls raise
    ``SpillError`` as with ``"fail"``.
- ``write_rows`` writes rows at once in the caller's thread (after a flush, so no older
  buffered copy lands after them): a restore's rows beyond the table's capacity, millions
  at a time, without a buffered value a row. ``retain`` deletes every spilled row but
  those of the given keys (a restore's: the checkpoint is the whole truth).
- ``flush`` waits until the buffer is written; ``close`` flushes and stops the writer (and
  deletes a temporary namespace's rows); ``abandon`` stops the writer without writing
  (after a failure: the checkpoint, not this process, holds the truth).
- Enumeration (``clear``, building the index) uses ``SCAN`` and ``UNLINK``, never ``KEYS``.

Counters: ``spill_writes`` (rows confirmed written), ``spill_unlinks`` (tombstones
applied), ``spill_hits`` / ``spill_misses`` (fetched keys found / not found),
``spill_buffer_hits`` (hits answered from the buffer), ``spill_prefetch_hits`` (hits answered
from ``prefetch``'s read-ahead), ``spill_errors`` (failed Redis
attempts, retried ones included), ``spill_outages`` (outages begun, ``"hold"``),
``spill_pending`` (rows and tombstones not yet written), ``spill_stored`` (keys in the
index; -1 before it is built).
"""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from recsys.errors import UserError
from recsys.features.hashing import hex_into
from recsys.redisio.client import client_options as _client_options
from recsys.redisio.client import glob_escape as _glob_escape
from recsys.redisio.client import redact as _redact
from recsys.redisio import resp as spill_wire
from recsys.store.tables import optim
from recsys.store.config import StoreConfig
from recsys.store.tables.float16 import to_float16
from recsys.store.tables.keymap import as_keys
from recsys.store.tables.rowblock import RowBlock, int64_column, matrix_column, vector_column
from recsys.store.spill.index import KeyIndex
from recsys.redisio.spill_layout import (DTYPE_CODES, FORMAT_VERSION, HEADER, OPTIMIZER_CODES, describe_owner,
                                         owner_key, parse_owner, spill_key, spill_prefix, value_dtype)

__all__ = ["SpillTier", "SpillError", "clear_tables", "find_leftovers"]

_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)
_HEX_VALUES = np.full(256, 16, dtype=np.uint8)  # a byte's hex value (16: not a hex digit)
_HEX_VALUES[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16)
_HEX_VALUES[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16)
_BATCHES_PER_ROUND = 16  # commands per pipelined round trip of the writer
_ROWS_PER_READ = 1 << 20  # ``rows``: spilled rows read and decoded per piece
_ROWS_PER_WRITE = 1 << 16  # ``write_rows``: rows encoded and sent per piece
_HOLD_MAX_DELAY_S = 1.0  # "hold": the longest wait between two tries during an outage
_UNKNOWN = object()  # fetch: the buffer does not know the key
COUNTERS = ("spill_writes", "spill_unlinks", "spill_hits", "spill_misses", "spill_buffer_hits",
            "spill_prefetch_hits", "spill_errors", "spill_outages")


class SpillError(UserError, RuntimeError):
    """Redis, as the spill tier, failed past the bounded retry (or holds unreadable values,
    lost spilled rows, or the namespace belongs to another run).

    A ``UserError`` (the environment, not the code, is at fault): commands print its one
    line. ``transient``: a connection error or timeout that outlasted the retries."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


# --------------------------------------------------------------------------- the tier


class SpillTier:
    """Evicted rows of one table (and shard) in Redis, written by a background thread.

    ``owns(keys) -> bool mask`` limits ``rows`` and ``clear`` to this shard's keys (None:
    all keys of the table). ``client``: a ready ``redis.Redis`` (tests); by default one
    is made from ``cfg.spill.url`` with this module's retry policy and no other. An empty
    ``cfg.spill.namespace`` gives the tier a temporary namespace of its own
    (``recsys-tmp-<random>``, its rows deleted by ``close``).
    """

    def __init__(
        self,
        table: str,
        dim: int,
        cfg: StoreConfig,
        *,
        owns: Callable[[np.ndarray], np.ndarray] | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        if not cfg.spill.url and client is None:
            raise ValueError(f"table {table!r}: a spill tier needs store.spill.url (or a client)")
        self.table = table
        self.dim = int(dim)
        self.cfg = cfg
        self.url = _redact(cfg.spill.url) if cfg.spill.url else "<given client>"
        self.temporary = not cfg.spill.namespace
        self.namespace = cfg.spill.namespace or f"recsys-tmp-{secrets.token_hex(8)}"
        self.prefix = spill_prefix(self.namespace, table)
        self._prefix_b = self.prefix.encode()
        self._owns = owns
        self._hold = cfg.spill.outage == "hold"
        self.dtype = value_dtype(self.dim, cfg)
        self._columns = optim.state_columns(cfg.optimizer)
        self._storage = np.dtype(cfg.dtype)
        self._header = np.zeros(1, dtype=HEADER)
        self._header[0] = (FORMAT_VERSION, DTYPE_CODES[cfg.dtype], OPTIMIZER_CODES[cfg.optimizer], 0, self.dim)
        self._own_client = client is None
        self._client = client if client is not None else redis.Redis.from_url(
            cfg.spill.url,
            socket_timeout=cfg.spill.timeout_s,
            socket_connect_timeout=cfg.spill.timeout_s,
            retry=Retry(NoBackoff(), 0),  # the retries are ours (bounded, with backoff)
            health_check_interval=0,
            **_client_options(cfg.spill.url, cfg.spill.password_file, "store.spill.password_file"),
        )
        self._cond = threading.Condition()  # re-entrant
        self._pending: dict[int, bytes | None] = {}  # newest wanted state per key, not yet taken
        self._inflight: dict[int, bytes | None] = {}  # the batch the writer is writing
        self._index: KeyIndex | None = None  # keys in Redis (None: not built yet)
        self._leftovers = False  # the index holds an earlier attempt's rows (``find_leftovers``)
        self._ahead: dict[int, bytes] | None = None  # ``prefetch``'s values, until the next fetch
        self._error: SpillError | None = None  # a failed write, not yet raised
        self._paused = False  # the writer waits until the error was raised
        self._closing = False
        self._abandoned = False
        self._used_redis = False  # wrote or deleted something (a temporary namespace is cleaned)
        self._outage_since: float | None = None  # "hold": monotonic start of the current outage
        self._outage_cause = ""
        self._retry_at = 0.0  # "hold": the writer's next try during an outage
        self._writer_delay = max(cfg.spill.backoff_s, 0.01)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._write_gate: Callable[[], object] | None = None  # test hook: called per batch taken
        self._writer = threading.Thread(target=self._write_loop, name=f"spill-writer-{table}", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ public API

    def counters(self) -> dict[str, int]:
        """Return the counters (see the module doc)."""
        with self._cond:
            return {**self._counters, "spill_pending": len(self._pending) + len(self._inflight),
                    "spill_stored": -1 if self._index is None else self._index.size}

    @property
    def write_failed(self) -> bool:
        """Return True while a failed background write waits to be raised by ``check``."""
        with self._cond:
            return self._error is not None

    @property
    def holds_leftovers(self) -> bool:
        """Return True while the index holds an earlier attempt's rows kept for a restore
        (``find_leftovers``), until ``retain`` or ``clear``."""
        with self._cond:
            return self._leftovers

    @property
    def in_outage(self) -> bool:
        """Return True while Redis is unreachable and ``spill.outage = "hold"`` holds rows."""
        with self._cond:
            return self._outage_since is not None

    def check(self) -> None:
        """Raise the ``SpillError`` of a failed background write once (the writer then retries)."""
        with self._cond:
            err = self._error
            if err is None:
                return
            self._error = None
            self._paused = False
            self._cond.notify_all()
        raise err

    def put(self, rows: RowBlock | pa.Table) -> None:
        """Buffer evicted rows for writing; wait while the buffer is full (rows are kept
        first, so a ``SpillError`` raised here loses nothing)."""
        block = rows if isinstance(rows, RowBlock) else self._from_arrow(rows)
        if block.num_rows == 0:
            return
        values = self._encode(block)
        limit = self.cfg.spill.queue_rows
        with self._cond:
            self._drop_ahead(block.keys)
            self._pending.update(zip(block.keys.tolist(), values))
            self._cond.notify_all()
            while (len(self._pending) + len(self._inflight) > limit and self._error is None
                   and self._outage_since is None and self._writer.is_alive() and not self._abandoned):
                self._cond.wait(timeout=1.0)
            held = len(self._pending) + len(self._inflight)
            over = self._outage_since is not None and held > self.cfg.spill.hold_max_rows
        self.check()
        self._check_writer()
        if over:
            raise SpillError(
                f"spill tier of table {self.table!r}: Redis {self.url} is unreachable and {held} evicted rows "
                f"and deletions are held in memory, more than store.spill.hold_max_rows "
                f"({self.cfg.spill.hold_max_rows}) allows (last error: {self._outage_cause}); they are not lost "
                "while this process lives. Bring Redis back, or raise store.spill.hold_max_rows", transient=True)

    def restored(self, keys: np.ndarray) -> None:
        """Note that the rows of ``keys`` are back in the table's memory: with
        ``spill.delete_restored`` their copies are deleted (``forget``); else kept, unread while
        the rows stay in memory and overwritten by their next ``put``."""
        if self.cfg.spill.delete_restored:
            self.forget(keys)
            return
        keys = as_keys(keys)
        if keys.shape[0]:
            with self._cond:
                self._drop_ahead(keys)

    def forget(self, keys: np.ndarray) -> None:
        """Mark ``keys``' spilled copies as stale (restored into the table, or gone from it):
        they will be unlinked, and ``fetch`` reports them as not spilled from now on."""
        keys = as_keys(keys)
        if keys.shape[0] == 0:
            return
        with self._cond:
            if self._index is not None:
                # only a key Redis has or the buffer holds needs a tombstone: the others are not
                # spilled already (a restore after a clear inserts millions of such keys)
                held = self._index.contains(keys)
                rest = np.flatnonzero(~held)
                held[rest] = self._buffered(keys[rest])
                keys = keys[held]
            self._drop_ahead(keys)
            self._pending.update(dict.fromkeys(keys.tolist()))
            self._cond.notify_all()

    def fetch(self, keys_N: np.ndarray, count: bool = True) -> tuple[np.ndarray, RowBlock]:
        """Return (found mask [N], the found rows in input order) of ``keys_N``; read-only.

        Raises ``SpillError`` if Redis cannot answer within the retry bound (``"hold"``:
        within ``spill.hold_timeout_s`` of the outage's start), or lost a spilled row."""
        keys = as_keys(keys_N)
        n = keys.shape[0]
        found = np.zeros(n, dtype=bool)
        values: list[bytes | None] = [None] * n
        if n == 0:
            return found, self._decode([], keys[:0])
        self._ensure_index()
        self._refuse_leftovers("read spilled rows")
        with self._cond:
            ahead, self._ahead = self._ahead, None  # taken by this fetch, whatever it asks
            pending, inflight = self._pending, self._inflight
            if not pending and not inflight:
                unknown = np.arange(n)
            else:
                rest = []
                for i, k in enumerate(keys.tolist()):
                    v = pending.get(k, _UNKNOWN)
                    if v is _UNKNOWN:
                        v = inflight.get(k, _UNKNOWN)
                    if v is _UNKNOWN:
                        rest.append(i)
                    elif v is not None:  # None: a tombstone, the key is not spilled
                        values[i] = v
                        found[i] = True
                unknown = np.asarray(rest, dtype=np.int64)
            ask = unknown[self._index.contains(keys[unknown])] if unknown.shape[0] else unknown
        n_buffer = int(found.sum())
        got: list = []
        n_ahead = 0
        if ask.shape[0]:
            if not ahead:
                got = self._mget(keys[ask], "read (MGET) of spilled rows")
            else:  # what the read-ahead did not get (or Redis did not have then) is read now
                got = [ahead.get(k) for k in keys[ask].tolist()]
                rest = [i for i, v in enumerate(got) if v is None]
                n_ahead = len(got) - len(rest)
                if rest:
                    for i, v in zip(rest, self._mget(keys[ask[rest]], "read (MGET) of spilled rows")):
                        got[i] = v
            if None in got:
                raise self._lost_error(keys[ask[[v is None for v in got]]])
            found[ask] = True
        if n_buffer == 0:  # Redis's values are in input order already (``ask`` ascends)
            block = self._decode(got, keys[ask])
        else:
            for i, v in zip(ask.tolist(), got):
                values[i] = v
            block = self._decode([v for v in values if v is not None], keys[found])
        if count:
            with self._cond:
                c = self._counters
                c["spill_hits"] += block.num_rows
                c["spill_misses"] += n - block.num_rows
                c["spill_buffer_hits"] += n_buffer
                c["spill_prefetch_hits"] += n_ahead
        return found, block

    def prefetch(self, keys_N: np.ndarray) -> int:
        """Read ahead the spilled rows of ``keys_N``, keys the next ``fetch`` will ask for (a
        training lookup's misses, known before the pushes it waits for are applied), so that
        the MGET overlaps other work; return how many rows were read.

        A hint, never a failure: one attempt, no retry. Nothing is read before the index is
        built, during an outage, with a write failure not yet raised, or for keys the buffer
        holds (``fetch`` answers those); a failed read counts in ``spill_errors`` and is
        dropped (``fetch`` reads those rows itself, with the retry policy). The values stay
        until the next ``fetch``, which takes those it asks for and drops the rest. They
        cannot go stale before it: a key the table does not hold and the buffer does not know
        keeps its value in Redis until a fetch restores it, and ``put``, ``forget`` and
        ``clear`` drop the values of the keys they change."""
        keys = as_keys(keys_N)
        with self._cond:
            self._ahead = None
            if (not keys.shape[0] or self._index is None or self._error is not None
                    or self._outage_since is not None or self._closing or self._leftovers):
                return 0
            ask = keys[self._index.contains(keys)]
            ask = ask[~self._buffered(ask)]
        if not ask.shape[0]:
            return 0
        try:
            got = self._mget_once(ask)
        except redis.exceptions.RedisError:
            with self._cond:
                self._counters["spill_errors"] += 1
            return 0
        with self._cond:
            self._ahead = {k: v for k, v in zip(ask.tolist(), got) if v is not None}
            return len(self._ahead)

    def flush(self) -> None:
        """Wait until every buffered row and tombstone is in Redis; raise a write failure."""
        self.check()
        with self._cond:
            self._cond.notify_all()
            while ((self._pending or self._inflight) and self._error is None and self._writer.is_alive()
                   and not self._abandoned):
                self._cond.wait(timeout=1.0)
        self.check()
        self._check_writer()

    def close(self) -> None:
        """Flush, stop the writer and close the connections; a temporary namespace's rows
        are deleted. If the flush fails the rows stay buffered in this object and
        ``SpillError`` is raised. Closing twice is a no-op."""
        if self._closing:
            return
        try:
            self.flush()
            if self.temporary and self._used_redis:
                self.clear()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._writer.join()
            if self._own_client:
                self._client.close()

    def abandon(self) -> None:
        """Stop the writer without writing what is buffered and close the connections
        (after a failure, when the checkpoint holds the truth). Idempotent."""
        with self._cond:
            self._abandoned = True
            self._closing = True
            self._cond.notify_all()
        # a write in progress ends within its retry bound
        self._writer.join(timeout=(self.cfg.spill.retries + 1) * (2 * self.cfg.spill.timeout_s)
                          + self.cfg.spill.retry_budget_s() + 1)
        if self._own_client:
            self._client.close()

    def rows(self, skip: Callable[[np.ndarray], np.ndarray] | None = None) -> RowBlock:
        """Return every row spilled by this table (``owns``' keys only), after a flush.

        ``skip(keys) -> bool mask``: keys whose copies are not read (the table's: rows it holds
        in memory, whose copies kept by ``restored`` are stale)."""
        self._ensure_index()
        self._refuse_leftovers("list spilled rows")
        self.flush()
        with self._cond:
            keys = self._index.keys()
        if skip is not None and keys.shape[0]:
            keys = keys[~np.asarray(skip(keys), dtype=bool)]
        blocks = []
        # a piece at a time: the replies as bytes objects take ~1.5x the decoded rows
        for start in range(0, max(keys.shape[0], 1), _ROWS_PER_READ):
            part = keys[start : start + _ROWS_PER_READ]
            values = self._mget(part, "read (MGET) of spilled rows")
            lost = np.array([v is None for v in values], dtype=bool)
            if lost.any():
                raise self._lost_error(part[lost])
            blocks.append(self._decode(values, part))
        return RowBlock.concat(blocks)

    def clear(self) -> int:
        """Delete this table's spilled rows (``owns``' keys only, found by SCAN, so rows
        another process left are deleted too) after a flush; return how many Redis keys
        were unlinked."""
        self.flush()
        keys = self._scan_keys()
        n = self._unlink(keys)
        with self._cond:
            self._index = KeyIndex()
            self._ahead = None
            self._leftovers = False
        return n

    def mark_empty(self) -> None:
        """Record that Redis holds none of this tier's keys (``clear_tables`` just deleted them)."""
        with self._cond:
            self._index = KeyIndex()
            self._ahead = None
            self._leftovers = False

    def write_rows(self, rows: RowBlock) -> None:
        """Write ``rows`` to Redis now, in the caller's thread, replacing any copy of their
        keys in Redis or the buffer: the rows a restore spills as it loads (millions at a
        time, so not through ``put``'s buffer of one value a row). Raises ``SpillError`` as
        ``fetch`` does; the rows written before a failure stay written and indexed."""
        if rows.num_rows == 0:
            return
        self._ensure_index()
        self.flush()  # a buffered older state of these keys must not land after them
        with self._cond:
            self._drop_ahead(rows.keys)
        for start in range(0, rows.num_rows, _ROWS_PER_WRITE):
            part = rows.take(slice(start, start + _ROWS_PER_WRITE))
            raw = self._records(part).view(np.uint8).reshape(part.num_rows, self.dtype.itemsize)
            packed = self._packed(b"MSET", part.keys, raw)
            self._used_redis = True
            self._redis(f"write (MSET of {part.num_rows} rows)", lambda: spill_wire.call(self._client, packed))
            with self._cond:
                self._index.add(part.keys)
                self._counters["spill_writes"] += part.num_rows

    def retain(self, keys: np.ndarray) -> int:
        """Delete this tier's spilled rows except those of ``keys`` (a restore's rows: it
        writes them again or loads them into the table, whose ``restored`` keeps or deletes
        their copies), after a flush; return how many Redis keys were unlinked. Builds the
        index first if needed."""
        keys = as_keys(keys)
        self._ensure_index()
        self.flush()
        with self._cond:
            kept = keys[self._index.contains(keys)]
            if kept.shape[0] == self._index.size:
                self._leftovers = False
                return 0
            self._index.remove(kept)  # what is left are the keys to delete
            stale = self._index.keys()
            self._index.add(kept)
        n = self._unlink(stale)
        with self._cond:
            self._index.remove(stale)
            self._drop_ahead(stale)
            self._leftovers = False
        return n

    def claim(self, owner: dict, takeover: bool = False) -> dict | None:
        """Make the run described by ``owner`` (JSON-able: run_dir, job) the namespace's owner.

        Refuses (``SpillError``) a namespace another run owns unless ``takeover``; returns
        the owner taken over from (None: the namespace was free or already ours)."""
        key = owner_key(self.namespace)
        value = json.dumps(owner, sort_keys=True)

        def op():
            if takeover:
                previous = self._client.get(key)
                self._client.set(key, value)
                return previous
            self._client.set(key, value, nx=True)
            return self._client.get(key)

        got = self._redis(f"claim of the namespace (SET NX / GET {key})", op)
        theirs = parse_owner(got)
        if theirs is None or theirs == json.loads(value):
            return None
        if takeover:
            return theirs
        raise SpillError(
            f"spill namespace {self.namespace!r} at Redis {self.url} belongs to another run "
            f"({describe_owner(theirs)}), not to this one ({describe_owner(owner)}): its rows are not this "
            "run's. Leave store.spill.namespace empty (one namespace per run directory), choose another one, "
            "or set store.spill.takeover = true to delete this job's rows in it and take it over"
        )

    # ------------------------------------------------------------------ the index

    def _ensure_index(self) -> None:
        """Build the index by one SCAN if it is not built yet (the buffer flushed first)."""
        if self._index is not None:
            return
        self.flush()
        keys = self._scan_keys()
        with self._cond:
            self._index = KeyIndex(keys)

    def _scan_keys(self) -> np.ndarray:
        """Return the keys of this table's spilled rows in Redis (``owns``' keys only)."""
        match = _glob_escape(self.prefix) + "*"
        names = self._redis("SCAN of spilled keys",
                            lambda: list(self._client.scan_iter(match=match, count=self.cfg.spill.batch_rows)))
        return self._owned(self._parse_names(names))

    def _refuse_leftovers(self, what: str) -> None:
        if self._leftovers:
            raise RuntimeError(
                f"spill tier of table {self.table!r}: cannot {what}: the rows Redis holds in namespace "
                f"{self.namespace!r} are an earlier attempt's, kept for a restore (the store was built with "
                "restoring=True); load the checkpoint (load_state_dict) first")

    def _owned(self, keys: np.ndarray) -> np.ndarray:
        if self._owns is not None and keys.shape[0]:
            keys = keys[np.asarray(self._owns(keys), dtype=bool)]
        return keys

    def _unlink(self, keys: np.ndarray) -> int:
        """UNLINK the names of ``keys``; return how many Redis had."""
        if not keys.shape[0]:
            return 0
        packed = self._packed(b"UNLINK", keys)
        self._used_redis = True
        return int(self._redis("UNLINK of spilled keys", lambda: sum(spill_wire.call(self._client, packed))))

    def _lost_error(self, keys: np.ndarray) -> SpillError:
        return SpillError(
            f"spill tier of table {self.table!r}: {keys.shape[0]} spilled row(s) are missing from Redis "
            f"{self.url} (e.g. {spill_key(self.namespace, self.table, int(keys[0]))}): Redis lost them "
            "(restarted without persistence, evicted under maxmemory, or deleted by someone else). No row was "
            "re-initialized. Give Redis persistence (appendonly yes) and maxmemory-policy noeviction, then resume "
            "from the latest checkpoint, which holds every spilled row"
        )

    # ------------------------------------------------------------------ encoding

    def _encode(self, block: RowBlock) -> list[bytes]:
        """Return one value (bytes) per row of ``block`` (``_records``)."""
        buf = self._records(block).tobytes()
        size = self.dtype.itemsize
        return [buf[i * size : (i + 1) * size] for i in range(block.num_rows)]

    def _records(self, block: RowBlock) -> np.ndarray:
        """Return the rows of ``block`` as records of ``self.dtype`` (their Redis values)."""
        n = block.num_rows
        rec = np.zeros(n, dtype=self.dtype)
        for name in HEADER.names:
            rec[name] = self._header[name][0]
        rec["key"] = block.keys
        rec["last_seen"] = block.last_seen
        emb = block.emb
        if emb.dtype != self._storage:
            emb = to_float16(emb) if self._storage == np.float16 else emb.astype(np.float32)
        rec["embedding"] = emb
        for c in self._columns:
            rec[c.name] = block.states[c.name]
        return rec

    def _decode(self, values: list[bytes], keys: np.ndarray) -> RowBlock:
        size = self.dtype.itemsize
        rec = np.zeros(0, self.dtype)
        if values:
            # checked as arrays, not value by value (the loop cost ~1 µs a row): every value has
            # the row's size and this store's 8-byte header, else the first that does not is named
            raw = b"".join(values)
            ok = set(map(len, values)) == {size}
            if ok:
                head = np.frombuffer(raw, dtype=np.uint8).reshape(len(values), size)[:, : HEADER.itemsize]
                ok = bool((head == self._header.view(np.uint8)).all())
            if not ok:
                want = self._header.tobytes()
                for v, k in zip(values, keys.tolist()):
                    if len(v) != size or v[:8] != want:
                        raise SpillError(self._format_message(v, k))
            rec = np.frombuffer(raw, dtype=self.dtype)
        if not np.array_equal(rec["key"], keys):
            bad = int(np.flatnonzero(rec["key"] != keys)[0])
            raise SpillError(
                f"spill tier of table {self.table!r} at {self.url}: the value under "
                f"{spill_key(self.namespace, self.table, int(keys[bad]))} holds key "
                f"{int(rec['key'][bad])}; the namespace {self.namespace!r} is shared with "
                "something else: use a namespace of its own (store.spill.namespace)"
            )
        states = {}
        for c in self._columns:
            states[c.name] = rec[c.name].astype(c.dtype)  # native byte order, a copy
        return RowBlock(rec["key"].astype(np.int64), rec["embedding"].astype(self._storage), states,
                        rec["last_seen"].astype(np.int64))

    def _format_message(self, value: bytes, key: int) -> str:
        where = (f"spill tier of table {self.table!r} at {self.url}: the value under "
                 f"{spill_key(self.namespace, self.table, key)}")
        expected = (f"this store reads format version {FORMAT_VERSION}, {self.cfg.dtype}, "
                    f"{self.cfg.optimizer}, dim {self.dim}: {self.dtype.itemsize} bytes")
        if len(value) < HEADER.itemsize:
            return f"{where} has {len(value)} bytes, too short for a spilled row; {expected}"
        h = np.frombuffer(value[: HEADER.itemsize], dtype=HEADER)[0]
        dtypes = {v: k for k, v in DTYPE_CODES.items()}
        opts = {v: k for k, v in OPTIMIZER_CODES.items()}
        return (
            f"{where} has format version {int(h['version'])}, {dtypes.get(int(h['dtype']), '?')}, "
            f"{opts.get(int(h['optimizer']), '?')}, dim {int(h['dim'])} ({len(value)} bytes); {expected}. "
            "Rows spilled by another configuration cannot be read: clear the namespace or use another one "
            "(store.spill.namespace)"
        )

    def _from_arrow(self, rows: pa.Table) -> RowBlock:
        where = f"spill tier of table {self.table!r}: rows to put"
        emb = matrix_column(rows, "embedding", self.dim, where, (np.float32, np.float16))
        states = {}
        for c in self._columns:
            states[c.name] = (matrix_column(rows, c.name, self.dim, where, (c.dtype,)) if c.per_dim
                              else vector_column(rows, c.name, where, c.dtype))
        return RowBlock(int64_column(rows, "key", where), emb, states, int64_column(rows, "last_seen", where))

    # ------------------------------------------------------------------ Redis

    def _name_chars(self, keys: np.ndarray) -> np.ndarray:
        """Return the Redis names of ``keys`` (``spill_key``'s) as rows of bytes [N, W],
        their hex digits written by one compiled pass rather than one string at a time."""
        keys = as_keys(keys)
        p = np.frombuffer(self._prefix_b, dtype=np.uint8)
        chars = np.empty((keys.shape[0], p.shape[0] + 16), dtype=np.uint8)
        chars[:, : p.shape[0]] = p
        hex_into(keys, chars, p.shape[0])
        return chars

    def _packed(self, command: bytes, keys: np.ndarray, values_NV: np.ndarray | None = None) -> list[bytes]:
        """Return ``spill_wire.pack`` of ``command`` over the names of ``keys`` (and values)."""
        return spill_wire.pack(command, self._name_chars(keys), values_NV, self.cfg.spill.batch_rows)

    def _parse_names(self, names: list[bytes]) -> np.ndarray:
        """Return the keys of the names that are this table's spill keys (others are skipped),
        parsed as one array of hex digits."""
        p = np.frombuffer(self._prefix_b, dtype=np.uint8)
        width = p.shape[0] + 16
        lens = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
        fit = lens == width
        chosen = names if fit.all() else [names[i] for i in np.flatnonzero(fit).tolist()]
        if not chosen:
            return np.zeros(0, dtype=np.int64)
        chars = np.frombuffer(b"".join(chosen), dtype=np.uint8).reshape(len(chosen), width)
        digits = _HEX_VALUES[chars[:, p.shape[0] :]]
        ours = (chars[:, : p.shape[0]] == p).all(axis=1) & (digits < 16).all(axis=1)
        digits = digits[ours]
        packed = np.ascontiguousarray((digits[:, 0::2] << 4) | digits[:, 1::2])  # 8 bytes a key, big-endian
        return packed.view(">u8")[:, 0].astype(np.uint64).view(np.int64)

    def _mget(self, keys: np.ndarray, what: str) -> list[bytes | None]:
        """Return Redis's values of ``keys`` in order (None: Redis has none), retried by ``_redis``."""
        if not keys.shape[0]:
            return []
        return self._redis(what, lambda: self._mget_once(keys))

    def _mget_once(self, keys: np.ndarray) -> list[bytes | None]:
        """``_mget`` in one attempt (redis-py's exceptions raised as they come)."""
        return list(itertools.chain.from_iterable(spill_wire.call(self._client, self._packed(b"MGET", keys))))

    def _buffered(self, keys: np.ndarray) -> np.ndarray:
        """Return whether the buffer (pending or in flight) holds each of ``keys``; under ``_cond``."""
        pending, inflight = self._pending, self._inflight
        if not (pending or inflight) or not keys.shape[0]:
            return np.zeros(keys.shape[0], dtype=bool)
        return np.fromiter((k in pending or k in inflight for k in keys.tolist()), dtype=bool, count=keys.shape[0])

    def _drop_ahead(self, keys: np.ndarray) -> None:
        """Forget ``prefetch``'s values of ``keys`` (their state changes); under ``_cond``."""
        if self._ahead:
            for k in keys.tolist():
                self._ahead.pop(k, None)

    def _redis(self, what: str, op):
        """Return ``op()`` run by ``_retry``; with ``spill.outage = "hold"`` an outage is
        waited out (tries every <= 1 s) until ``spill.hold_timeout_s`` after its start."""
        delay = max(self.cfg.spill.backoff_s, 0.01)
        while True:
            try:
                out = self._retry(what, op)
            except SpillError as exc:
                if not (self._hold and exc.transient) or self._abandoned:
                    raise
                deadline = self._begin_outage(exc)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._hold_expired(what) from exc
                time.sleep(min(delay, left))
                delay = min(2 * delay, _HOLD_MAX_DELAY_S)
                continue
            self._end_outage()
            return out

    def _begin_outage(self, exc: BaseException) -> float:
        """Record an outage (if none is on); return when holding it ends."""
        with self._cond:
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                self._counters["spill_outages"] += 1
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            self._outage_cause = f"{type(cause).__name__}: {str(cause).rstrip('.')}"
            return self._outage_since + self.cfg.spill.hold_timeout_s

    def _end_outage(self) -> None:
        with self._cond:
            if self._outage_since is not None:
                self._outage_since = None
                self._retry_at = 0.0
                self._writer_delay = max(self.cfg.spill.backoff_s, 0.01)
                self._cond.notify_all()

    def _hold_expired(self, what: str) -> SpillError:
        with self._cond:
            since = self._outage_since if self._outage_since is not None else time.monotonic()
            held = len(self._pending) + len(self._inflight)
            cause = self._outage_cause
        return SpillError(
            f"spill tier of table {self.table!r}: {what} at Redis {self.url}: Redis has been unreachable for "
            f"{time.monotonic() - since:.1f}s, longer than store.spill.hold_timeout_s "
            f"({self.cfg.spill.hold_timeout_s:g}s) allows (store.spill.outage = 'hold'); last error: {cause}. "
            f"No row was re-initialized; {held} evicted row(s) and deletions are still held in this process's memory",
            transient=True,
        )

    def _retry(self, what: str, op):
        """Return ``op()``, retried on transient Redis errors with exponential backoff."""
        delay = self.cfg.spill.backoff_s
        attempts = self.cfg.spill.retries + 1
        t0 = time.monotonic()
        for attempt in range(attempts):
            try:
                return op()
            except _TRANSIENT as exc:
                with self._cond:
                    self._counters["spill_errors"] += 1
                last = exc
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
            except redis.exceptions.RedisError as exc:
                with self._cond:
                    self._counters["spill_errors"] += 1
                raise SpillError(self._error_message(what, 1, time.monotonic() - t0, exc)) from exc
        raise SpillError(self._error_message(what, attempts, time.monotonic() - t0, last), transient=True) from last

    def _error_message(self, what: str, attempts: int, elapsed: float, exc: BaseException) -> str:
        return (
            f"spill tier of table {self.table!r}: {what} at Redis {self.url} failed after {attempts} "
            f"attempt(s) in {elapsed:.2f}s: {type(exc).__name__}: {str(exc).rstrip('.')}. No row was re-initialized "
            "(rows not yet written stay buffered in this process). Check that Redis is up and reachable at "
            "store.spill.url (or raise store.spill.retries / backoff_s / timeout_s, or set "
            "store.spill.outage = 'hold' to train through an outage)"
        )

    def _check_writer(self) -> None:
        if not self._writer.is_alive() and not self._closing:
            raise SpillError(f"spill tier of table {self.table!r}: the writer thread stopped unexpectedly")

    # ------------------------------------------------------------------ the writer

    def _write_loop(self) -> None:
        round_rows = self.cfg.spill.batch_rows * _BATCHES_PER_ROUND
        while True:
            with self._cond:
                while True:
                    if self._abandoned:
                        return
                    if self._pending and not self._paused:
                        wait = self._retry_at - time.monotonic()  # "hold": the next try of an outage
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    elif self._closing:
                        return
                    else:
                        self._cond.wait()
                if len(self._pending) <= round_rows:
                    batch, self._pending = self._pending, {}
                else:
                    batch = dict(itertools.islice(self._pending.items(), round_rows))
                    for k in batch:
                        del self._pending[k]
                self._inflight = batch
            error = None
            try:
                if self._write_gate is not None:
                    self._write_gate()
                set_keys, unlink_keys = self._write(batch)
            except SpillError as exc:
                error = exc
            except BaseException as exc:  # noqa: BLE001 - surfaced by check(), never swallowed
                error = SpillError(f"spill tier of table {self.table!r}: the writer failed: {exc!r}")
                error.__cause__ = exc
            with self._cond:
                if error is None:
                    self._counters["spill_writes"] += set_keys.shape[0]
                    self._counters["spill_unlinks"] += unlink_keys.shape[0]
                    if self._index is not None:
                        self._index.add(set_keys)
                        self._index.remove(unlink_keys)
                    self._end_outage()
                else:
                    for k, v in batch.items():  # back in the buffer unless a newer state came
                        self._pending.setdefault(k, v)
                    if self._hold and error.transient and not self._abandoned:
                        deadline = self._begin_outage(error)
                        if time.monotonic() >= deadline:
                            self._error = self._hold_expired("a write (MSET / UNLINK) of evicted rows")
                            self._paused = True
                        else:
                            self._retry_at = time.monotonic() + self._writer_delay
                            self._writer_delay = min(2 * self._writer_delay, _HOLD_MAX_DELAY_S)
                    else:
                        self._error = error
                        self._paused = True
                self._inflight = {}
                self._cond.notify_all()

    def _write(self, batch: dict[int, bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        """Write ``batch`` (SETs and UNLINKs); return the keys set and the keys unlinked."""
        keys = np.fromiter(batch.keys(), dtype=np.int64, count=len(batch))
        values = list(batch.values())
        is_set = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        set_keys, unlink_keys = keys[is_set], keys[~is_set]
        # every value is one record of ``self.dtype`` (``_encode``): rows of a byte matrix
        rows = np.frombuffer(b"".join(v for v in values if v is not None), dtype=np.uint8)
        packed = (self._packed(b"MSET", set_keys, rows.reshape(set_keys.shape[0], self.dtype.itemsize))
                  + self._packed(b"UNLINK", unlink_keys))
        self._used_redis = True
        self._retry(f"write (MSET of {set_keys.shape[0]} rows, UNLINK of {unlink_keys.shape[0]} keys)",
                    lambda: spill_wire.call(self._client, packed))
        return set_keys, unlink_keys


# --------------------------------------------------------------------------- namespaces


def clear_tables(tiers: list[SpillTier]) -> int:
    """Delete the spilled rows of ``tiers`` (each tier's ``owns`` keys only) with one SCAN
    per namespace, not one per table (each SCAN walks every table's keys: 26 tables and
    27 M spilled rows took minutes), and mark their indexes empty; return how many Redis
    keys were unlinked. Keys of other tables under a namespace are left."""
    return sum(_clear_namespace(group) for group in _by_namespace(tiers))


def find_leftovers(tiers: list[SpillTier]) -> int:
    """Index the rows of ``tiers`` (each tier's ``owns`` keys only) that Redis holds, with one
    SCAN per namespace as ``clear_tables``, and keep them there as *leftovers*: a run's
    earlier attempt's rows, which a restore about to come either rewrites or deletes
    (``retain``) instead of their deletion first. Until then the tiers never read them
    (``fetch`` and ``rows`` raise, ``prefetch`` reads nothing); ``retain`` or ``clear`` ends
    that. Return how many were found."""
    found = 0
    for group in _by_namespace(tiers):
        for t, keys in _scan_namespace(group).items():
            with t._cond:
                t._index = KeyIndex(keys)
                t._ahead = None
                t._leftovers = True
            found += keys.shape[0]
    return found


def _by_namespace(tiers: list[SpillTier]) -> list[list[SpillTier]]:
    """Return ``tiers`` grouped by namespace (one SCAN walks one namespace's keys)."""
    groups: dict[str, list[SpillTier]] = {}
    for t in tiers:
        groups.setdefault(t.namespace, []).append(t)
    return list(groups.values())


def _clear_namespace(tiers: list[SpillTier]) -> int:
    """``clear_tables`` for tiers of one namespace."""
    first = tiers[0]
    packed: list[bytes] = []
    for t, keys in _scan_namespace(tiers).items():
        if keys.shape[0]:
            packed += t._packed(b"UNLINK", keys)
            t._used_redis = True
    n = int(first._redis("UNLINK of spilled keys", lambda: sum(spill_wire.call(first._client, packed))))
    for t in tiers:
        t.mark_empty()
    return n


def _scan_namespace(tiers: list[SpillTier]) -> dict[SpillTier, np.ndarray]:
    """Return the keys Redis holds of each of ``tiers`` (its ``owns`` keys only), tiers of
    one namespace, found by one SCAN after a flush of each."""
    first = tiers[0]
    for t in tiers:
        t.flush()
    match = _glob_escape(f"{first.namespace}:spill:") + "*"
    names = first._redis("SCAN of spilled keys",
                         lambda: list(first._client.scan_iter(match=match, count=first.cfg.spill.batch_rows)))
    by_prefix = {t._prefix_b: t for t in tiers}
    per_tier: dict[bytes, list[bytes]] = {}
    for name in names:
        if len(name) > 16 and name[:-16] in by_prefix:
            per_tier.setdefault(name[:-16], []).append(name)
    return {t: t._owned(t._parse_names(per_tier.get(prefix, []))) for prefix, t in by_prefix.items()}
