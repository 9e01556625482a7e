"""The spill tier: evicted rows kept in Redis with their optimizer state, back on the next miss.

Legend: ``N`` rows of a call, ``D`` dim, ``B`` keys per Redis command (``spill_batch_rows``).

One ``SpillTier`` per table and shard (``EmbeddingTable`` drives it; see its module doc)::

    table evicts rows ──► put(rows) ──► encode ──► buffer {key: bytes} ──► writer thread
                                                   │   (pending, then in flight)   │ pipelined MSET
                                                   │                               ▼ / UNLINK, B keys
    table misses ──► fetch(keys) ──► buffer first ─┘  else MGET (chunks of B) ──► Redis
    rows restored ──► forget(keys) ──► buffer {key: None} (a tombstone) ──► writer: UNLINK

Keys: ``<namespace>:spill:<table>:<key as 16 lowercase hex digits>`` (the key's uint64
bits). Nothing about the shard or world size enters it, so a row spilled at one world size
is found at any other.

Values: raw little-endian bytes, one fixed-size record per row, decoded with
``np.frombuffer`` (no pickle, no JSON)::

    offset  size  field
         0     1  format version (``FORMAT_VERSION``; a reader refuses any other)
         1     1  embedding dtype code: 0 float32, 1 float16
         2     1  optimizer code: 0 rowwise_adagrad, 1 adagrad, 2 adam, 3 sgd
         3     1  reserved (0)
         4     4  dim, uint32
         8     8  key, int64 (checked against the Redis key on read)
        16     8  last_seen, int64
        24  D·2|4 embedding in the storage dtype
         …        optimizer state columns in ``optim.state_columns`` order:
                  per-dim ones D·4 (float32), row-wise ones 4 (float32) or 8 (adam_step, int64)

Semantics, exactly:

- ``put`` encodes at once and buffers the rows (the newest copy of a key wins); a writer
  thread writes the buffer in pipelined batches. Each batch is *in flight* until Redis
  confirmed it. While the buffer holds ``spill_queue_rows`` rows or more, ``put`` waits
  for the writer (back-pressure), never dropping rows.
- ``fetch`` answers from the buffer first (pending, then in flight): a buffered value is
  the newest copy, a buffered tombstone means "not spilled". Only keys the buffer does
  not know are read from Redis (MGET, read-only). A value of another format raises.
- After the table restored rows it calls ``forget``: tombstones, written as UNLINK by the
  writer, after any in-flight SET of the same key (batches are written in order), so a
  later eviction's copy is the only one that counts.
- Every Redis call is retried ``spill_retries`` times on connection errors and timeouts,
  waiting ``spill_backoff_s`` and doubling; then ``SpillError`` (the URL, the operation,
  the table, what to do). A failed read leaves the table unchanged. A failed background
  write keeps its rows buffered (still served by ``fetch``) and raises ``SpillError`` on
  the next call of this tier (``check`` at every table call); the writer then tries again.
- ``flush`` waits until the buffer is written; ``close`` flushes and stops the writer.
- Enumeration (``rows``, ``clear``) uses ``SCAN`` and ``UNLINK``, never ``KEYS``.

Counters: ``spill_writes`` (rows confirmed written), ``spill_unlinks`` (tombstones
applied), ``spill_hits`` / ``spill_misses`` (fetched keys found / not found),
``spill_buffer_hits`` (hits answered from the buffer), ``spill_errors`` (failed Redis
attempts, retried ones included), ``spill_pending`` (rows and tombstones not yet written).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from recsys.redis_util import glob_escape as _glob_escape
from recsys.redis_util import redact as _redact
from recsys.store import optim
from recsys.store.config import StoreConfig
from recsys.store.keymap import as_keys
from recsys.store.table import RowBlock, _int64_column, _matrix_column, _vector_column, to_float16

__all__ = ["SpillTier", "SpillError", "spill_key", "spill_prefix", "value_dtype", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_DTYPE_CODES = {"float32": 0, "float16": 1}
_OPTIMIZER_CODES = {"rowwise_adagrad": 0, "adagrad": 1, "adam": 2, "sgd": 3}
_HEADER = np.dtype([("version", "u1"), ("dtype", "u1"), ("optimizer", "u1"), ("reserved", "u1"), ("dim", "<u4")])
_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)
_BATCHES_PER_ROUND = 16  # commands per pipelined round trip of the writer
_UNKNOWN = object()  # fetch: the buffer does not know the key
COUNTERS = ("spill_writes", "spill_unlinks", "spill_hits", "spill_misses", "spill_buffer_hits", "spill_errors")


class SpillError(RuntimeError):
    """Redis, as the spill tier, failed past the bounded retry (or holds unreadable values)."""


# --------------------------------------------------------------------------- keys and values


def spill_prefix(namespace: str, table: str) -> str:
    """Return the prefix of every spill key of ``table``."""
    return f"{namespace}:spill:{table}:"


def spill_key(namespace: str, table: str, key: int) -> str:
    """Return the Redis key of ``key``'s spilled row: world-size and shard independent."""
    return f"{spill_prefix(namespace, table)}{key & 0xFFFFFFFFFFFFFFFF:016x}"


def value_dtype(dim: int, cfg: StoreConfig) -> np.dtype:
    """Return the numpy record type of one spilled row (see the module doc)."""
    emb = "<f4" if cfg.dtype == "float32" else "<f2"
    fields = [(name, _HEADER.fields[name][0]) for name in _HEADER.names]
    fields += [("key", "<i8"), ("last_seen", "<i8"), ("embedding", emb, (dim,))]
    for c in optim.state_columns(cfg.optimizer):
        t = "<f4" if c.dtype == np.float32 else "<i8"
        fields.append((c.name, t, (dim,)) if c.per_dim else (c.name, t))
    return np.dtype(fields)


# --------------------------------------------------------------------------- the tier


class SpillTier:
    """Evicted rows of one table (and shard) in Redis, written by a background thread.

    ``owns(keys) -> bool mask`` limits ``rows`` and ``clear`` to this shard's keys (None:
    all keys of the table). ``client``: a ready ``redis.Redis`` (tests); by default one
    is made from ``cfg.spill_url`` with this module's retry policy and no other.
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
        if not cfg.spill_url and client is None:
            raise ValueError(f"table {table!r}: a spill tier needs StoreConfig.spill_url (or a client)")
        self.table = table
        self.dim = int(dim)
        self.cfg = cfg
        self.url = _redact(cfg.spill_url) if cfg.spill_url else "<given client>"
        self.prefix = spill_prefix(cfg.spill_namespace, table)
        self._prefix_b = self.prefix.encode()
        self._owns = owns
        self.dtype = value_dtype(self.dim, cfg)
        self._columns = optim.state_columns(cfg.optimizer)
        self._storage = np.dtype(cfg.dtype)
        self._header = np.zeros(1, dtype=_HEADER)
        self._header[0] = (FORMAT_VERSION, _DTYPE_CODES[cfg.dtype], _OPTIMIZER_CODES[cfg.optimizer], 0, self.dim)
        self._own_client = client is None
        self._client = client if client is not None else redis.Redis.from_url(
            cfg.spill_url,
            socket_timeout=cfg.spill_timeout_s,
            socket_connect_timeout=cfg.spill_timeout_s,
            retry=Retry(NoBackoff(), 0),  # the retries are ours (bounded, with backoff)
            health_check_interval=0,
        )
        self._cond = threading.Condition()
        self._pending: dict[int, bytes | None] = {}  # newest wanted state per key, not yet taken
        self._inflight: dict[int, bytes | None] = {}  # the batch the writer is writing
        self._error: SpillError | None = None  # a failed write, not yet raised
        self._paused = False  # the writer waits until the error was raised
        self._closing = False
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._write_gate: Callable[[], object] | None = None  # test hook: called per batch taken
        self._writer = threading.Thread(target=self._write_loop, name=f"spill-writer-{table}", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ public API

    def counters(self) -> dict[str, int]:
        """Return the counters (see the module doc)."""
        with self._cond:
            return {**self._counters, "spill_pending": len(self._pending) + len(self._inflight)}

    @property
    def write_failed(self) -> bool:
        """Return True while a failed background write waits to be raised by ``check``."""
        with self._cond:
            return self._error is not None

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
        limit = self.cfg.spill_queue_rows
        with self._cond:
            self._pending.update(zip(block.keys.tolist(), values))
            self._cond.notify_all()
            while (len(self._pending) + len(self._inflight) > limit and self._error is None
                   and self._writer.is_alive()):
                self._cond.wait(timeout=1.0)
        self.check()
        self._check_writer()

    def forget(self, keys: np.ndarray) -> None:
        """Mark ``keys``' spilled copies as stale (restored into the table): they will be
        unlinked, and ``fetch`` reports them as not spilled from now on."""
        keys = as_keys(keys)
        if keys.shape[0] == 0:
            return
        with self._cond:
            self._pending.update(dict.fromkeys(keys.tolist()))
            self._cond.notify_all()

    def fetch(self, keys_N: np.ndarray, count: bool = True) -> tuple[np.ndarray, RowBlock]:
        """Return (found mask [N], the found rows in input order) of ``keys_N``; read-only.

        Raises ``SpillError`` if Redis cannot answer within the retry bound."""
        keys = as_keys(keys_N)
        n = keys.shape[0]
        found = np.zeros(n, dtype=bool)
        values: list[bytes | None] = [None] * n
        unknown: list[int] = []
        with self._cond:
            pending, inflight = self._pending, self._inflight
            if not pending and not inflight:
                unknown = list(range(n))
            else:
                for i, k in enumerate(keys.tolist()):
                    v = pending.get(k, _UNKNOWN)
                    if v is _UNKNOWN:
                        v = inflight.get(k, _UNKNOWN)
                    if v is _UNKNOWN:
                        unknown.append(i)
                    elif v is not None:  # None: a tombstone, the key is not spilled
                        values[i] = v
                        found[i] = True
        n_buffer = int(found.sum())
        if unknown:
            idx = np.asarray(unknown, dtype=np.int64)
            got = self._mget(self._names(keys[idx]), "read (MGET) of spilled rows")
            for i, v in zip(unknown, got):
                if v is not None:
                    values[i] = v
                    found[i] = True
        block = self._decode([v for v in values if v is not None], keys[found])
        if count:
            with self._cond:
                c = self._counters
                c["spill_hits"] += block.num_rows
                c["spill_misses"] += n - block.num_rows
                c["spill_buffer_hits"] += n_buffer
        return found, block

    def flush(self) -> None:
        """Wait until every buffered row and tombstone is in Redis; raise a write failure."""
        self.check()
        with self._cond:
            self._cond.notify_all()
            while (self._pending or self._inflight) and self._error is None and self._writer.is_alive():
                self._cond.wait(timeout=1.0)
        self.check()
        self._check_writer()

    def close(self) -> None:
        """Flush, stop the writer and close the connections. If the flush fails the rows
        stay buffered in this object and ``SpillError`` is raised. Closing twice is a no-op."""
        if self._closing:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._writer.join()
            if self._own_client:
                self._client.close()

    def _spilled_keys(self) -> np.ndarray:
        """Return the keys of this table's spilled rows (``owns``' keys only), after a flush."""
        self.flush()
        match = _glob_escape(self.prefix) + "*"
        names = self._retry("SCAN of spilled keys",
                            lambda: list(self._client.scan_iter(match=match, count=self.cfg.spill_batch_rows)))
        keys = self._parse_names(names)
        if self._owns is not None and keys.shape[0]:
            keys = keys[np.asarray(self._owns(keys), dtype=bool)]
        return keys

    def rows(self) -> RowBlock:
        """Return every row spilled by this table (``owns``' keys only), after a flush."""
        keys = self._spilled_keys()
        values = self._mget(self._names(keys), "read (MGET) of spilled rows")
        have = np.array([v is not None for v in values], dtype=bool)
        return self._decode([v for v in values if v is not None], keys[have])

    def clear(self) -> int:
        """Delete this table's spilled rows (``owns``' keys only) and the buffer; return how
        many Redis keys were unlinked (SCAN + UNLINK)."""
        keys = self._spilled_keys()
        names = self._names(keys)
        B = self.cfg.spill_batch_rows

        def unlink():
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(names), B):
                pipe.execute_command("UNLINK", *names[start : start + B])
            return sum(pipe.execute())

        return int(self._retry("UNLINK of spilled keys", unlink)) if names else 0

    # ------------------------------------------------------------------ encoding

    def _encode(self, block: RowBlock) -> list[bytes]:
        n = block.num_rows
        rec = np.zeros(n, dtype=self.dtype)
        for name in _HEADER.names:
            rec[name] = self._header[name][0]
        rec["key"] = block.keys
        rec["last_seen"] = block.last_seen
        emb = block.emb
        if emb.dtype != self._storage:
            emb = to_float16(emb) if self._storage == np.float16 else emb.astype(np.float32)
        rec["embedding"] = emb
        for c in self._columns:
            rec[c.name] = block.states[c.name]
        buf = rec.tobytes()
        size = self.dtype.itemsize
        return [buf[i * size : (i + 1) * size] for i in range(n)]

    def _decode(self, values: list[bytes], keys: np.ndarray) -> RowBlock:
        size = self.dtype.itemsize
        for v, k in zip(values, keys.tolist()):
            if len(v) != size or v[:8] != self._header.tobytes():
                raise SpillError(self._format_message(v, k))
        rec = np.frombuffer(b"".join(values), dtype=self.dtype) if values else np.zeros(0, self.dtype)
        if not np.array_equal(rec["key"], keys):
            bad = int(np.flatnonzero(rec["key"] != keys)[0])
            raise SpillError(
                f"spill tier of table {self.table!r} at {self.url}: the value under "
                f"{spill_key(self.cfg.spill_namespace, self.table, int(keys[bad]))} holds key "
                f"{int(rec['key'][bad])}; the namespace {self.cfg.spill_namespace!r} is shared with "
                "something else: use a namespace of its own (StoreConfig.spill_namespace)"
            )
        states = {}
        for c in self._columns:
            states[c.name] = rec[c.name].astype(c.dtype)  # native byte order, a copy
        return RowBlock(rec["key"].astype(np.int64), rec["embedding"].astype(self._storage), states,
                        rec["last_seen"].astype(np.int64))

    def _format_message(self, value: bytes, key: int) -> str:
        where = (f"spill tier of table {self.table!r} at {self.url}: the value under "
                 f"{spill_key(self.cfg.spill_namespace, self.table, key)}")
        expected = (f"this store reads format version {FORMAT_VERSION}, {self.cfg.dtype}, "
                    f"{self.cfg.optimizer}, dim {self.dim}: {self.dtype.itemsize} bytes")
        if len(value) < _HEADER.itemsize:
            return f"{where} has {len(value)} bytes, too short for a spilled row; {expected}"
        h = np.frombuffer(value[: _HEADER.itemsize], dtype=_HEADER)[0]
        dtypes = {v: k for k, v in _DTYPE_CODES.items()}
        opts = {v: k for k, v in _OPTIMIZER_CODES.items()}
        return (
            f"{where} has format version {int(h['version'])}, {dtypes.get(int(h['dtype']), '?')}, "
            f"{opts.get(int(h['optimizer']), '?')}, dim {int(h['dim'])} ({len(value)} bytes); {expected}. "
            "Rows spilled by another configuration cannot be read: clear the namespace or use another one "
            "(StoreConfig.spill_namespace)"
        )

    def _from_arrow(self, rows: pa.Table) -> RowBlock:
        where = f"spill tier of table {self.table!r}: rows to put"
        emb = _matrix_column(rows, "embedding", self.dim, where, (np.float32, np.float16))
        states = {}
        for c in self._columns:
            states[c.name] = (_matrix_column(rows, c.name, self.dim, where, (c.dtype,)) if c.per_dim
                              else _vector_column(rows, c.name, where, c.dtype))
        return RowBlock(_int64_column(rows, "key", where), emb, states, _int64_column(rows, "last_seen", where))

    # ------------------------------------------------------------------ Redis

    def _names(self, keys: np.ndarray) -> list[str]:
        p = self.prefix
        return [f"{p}{k:016x}" for k in as_keys(keys).view(np.uint64).tolist()]

    def _parse_names(self, names: list[bytes]) -> np.ndarray:
        n0 = len(self._prefix_b)
        out = []
        for name in names:
            suffix = name[n0:]
            if len(suffix) == 16 and name.startswith(self._prefix_b):
                try:
                    out.append(int(suffix, 16))
                except ValueError:
                    continue  # not one of ours
        return np.array(out, dtype=np.uint64).view(np.int64)

    def _mget(self, names: list[str], what: str) -> list[bytes | None]:
        if not names:
            return []
        B = self.cfg.spill_batch_rows

        def op():
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(names), B):
                pipe.execute_command("MGET", *names[start : start + B])
            return [v for chunk in pipe.execute() for v in chunk]

        return self._retry(what, op)

    def _retry(self, what: str, op):
        """Return ``op()``, retried on transient Redis errors with exponential backoff."""
        delay = self.cfg.spill_backoff_s
        attempts = self.cfg.spill_retries + 1
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
        raise SpillError(self._error_message(what, attempts, time.monotonic() - t0, last)) from last

    def _error_message(self, what: str, attempts: int, elapsed: float, exc: BaseException) -> str:
        return (
            f"spill tier of table {self.table!r}: {what} at Redis {self.url} failed after {attempts} "
            f"attempt(s) in {elapsed:.2f}s: {type(exc).__name__}: {str(exc).rstrip('.')}. No row was re-initialized: rows "
            "that could not be read were not touched and rows not yet written stay buffered in memory. "
            "Check that Redis is up and reachable at StoreConfig.spill_url (or raise spill_retries / "
            "spill_backoff_s / spill_timeout_s), then retry the call"
        )

    def _check_writer(self) -> None:
        if not self._writer.is_alive() and not self._closing:
            raise SpillError(f"spill tier of table {self.table!r}: the writer thread stopped unexpectedly")

    # ------------------------------------------------------------------ the writer

    def _write_loop(self) -> None:
        round_rows = self.cfg.spill_batch_rows * _BATCHES_PER_ROUND
        while True:
            with self._cond:
                while not self._pending or self._paused:
                    if self._closing:
                        return
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
                n_set, n_unlink = self._write(batch)
            except SpillError as exc:
                error = exc
            except BaseException as exc:  # noqa: BLE001 - surfaced by check(), never swallowed
                error = SpillError(f"spill tier of table {self.table!r}: the writer failed: {exc!r}")
                error.__cause__ = exc
            with self._cond:
                if error is None:
                    self._counters["spill_writes"] += n_set
                    self._counters["spill_unlinks"] += n_unlink
                else:
                    for k, v in batch.items():  # back in the buffer unless a newer state came
                        self._pending.setdefault(k, v)
                    self._error = error
                    self._paused = True
                self._inflight = {}
                self._cond.notify_all()

    def _write(self, batch: dict[int, bytes | None]) -> tuple[int, int]:
        keys = np.fromiter(batch.keys(), dtype=np.int64, count=len(batch))
        names = self._names(keys)
        sets: list = []
        unlinks: list[str] = []
        for name, value in zip(names, batch.values()):
            if value is None:
                unlinks.append(name)
            else:
                sets.append(name)
                sets.append(value)
        B = self.cfg.spill_batch_rows

        def op():
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(sets), 2 * B):
                pipe.execute_command("MSET", *sets[start : start + 2 * B])
            for start in range(0, len(unlinks), B):
                pipe.execute_command("UNLINK", *unlinks[start : start + B])
            pipe.execute()

        self._retry(f"write (MSET of {len(sets) // 2} rows, UNLINK of {len(unlinks)} keys)", op)
        return len(sets) // 2, len(unlinks)
