"""Live rows: what a training job pushes to Redis while it trains, and how they are read.

A job with a ``[publish]`` section writes, every ``every_s`` seconds, the current rows of the
keys its owner shards updated since the last push into a *live namespace* (default
``live``). ``recsys serve --follow NS`` overlays those rows on the published version it
serves. Keys (``ns`` the live namespace)::

    ns:live:manifest                 string (JSON): format, dtype, buckets, the tables' dims,
                                     the hashing salts, the run that owns the namespace
    ns:live:head                     hash: rank -> {"step", "time", "rows"} (JSON) of that
                                     rank's newest completed push
    ns:{live:table:bbbb}:kkkk...     string: one row (``layout.row_keys`` with the version
                                     ``live``)

A row value is the training step it reflects as 16 hex digits, then the row's numbers
(little-endian float32 or float16, as a published row). The step travels with the row so
that Redis itself refuses to go back: every write runs ``GUARDED_SET`` (Lua), which
replaces a row only with one of a later step. Pushes of one rank are ordered; the guard
also holds against a restarted job re-pushing a step it already pushed, and against any
interleaving of concurrent writers.

One ``EVALSHA`` per (table, bucket): the keys of a bucket share a hash slot, so a Redis
Cluster runs each call on one node.
"""

from __future__ import annotations

import json
import time

import numpy as np

from embedding_server import layout

FORMAT = 1
VERSION = "live"
"""The version component of live row keys."""
STEP_BYTES = 16
"""Bytes of a live value's step prefix (hex digits)."""
MAX_STEP = (1 << 52) - 1
"""Steps must stay exact in Lua's numbers (doubles)."""

GUARDED_SET = """
local old = redis.call('MGET', unpack(KEYS))
local args = {}
for i = 1, #KEYS do
  local o = old[i]
  if (not o) or tonumber(string.sub(o, 1, 16), 16) < tonumber(string.sub(ARGV[i], 1, 16), 16) then
    args[#args + 1] = KEYS[i]
    args[#args + 1] = ARGV[i]
  end
end
if #args > 0 then
  redis.call('MSET', unpack(args))
end
return #args / 2
"""
"""Set each of KEYS to its ARGV value unless the row there reflects the same or a later step
(one MGET and one MSET per call: a redis.call per key costs several times more). Returns
how many rows it replaced. Keys of one call share a hash slot; at most ``MAX_KEYS_PER_CALL``
(Lua's ``unpack`` limit is about 8,000 values)."""
MAX_KEYS_PER_CALL = 512


def manifest_key(ns: str) -> str:
    return f"{ns}:live:manifest"


def head_key(ns: str) -> str:
    return f"{ns}:live:head"


def row_keys(ns: str, table: str, keys_N: np.ndarray, buckets: int) -> list[bytes]:
    """Return the Redis key of each live row of ``table``."""
    return layout.row_keys(ns, VERSION, table, keys_N, buckets)


def pattern(ns: str) -> str:
    """Return the SCAN MATCH pattern of every live row key of ``ns``."""
    return layout.version_pattern(ns, VERSION)


def encode(step: int, rows_ND: np.ndarray, dtype: str) -> list[bytes]:
    """Return one live value per row: ``step`` as 16 hex digits, then the row."""
    buf = value_bytes(step, rows_ND, dtype)
    return buf.view(f"S{buf.shape[1]}").reshape(buf.shape[0]).tolist() if buf.shape[0] else []


def value_bytes(step: int, rows_ND: np.ndarray, dtype: str) -> np.ndarray:
    """Return uint8 [N, 16 + D * itemsize]: ``encode``'s values as one array."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"a live row's step must be in [0, {MAX_STEP}], found {step}")
    arr = np.ascontiguousarray(rows_ND, dtype=layout.DTYPES[dtype])
    n = arr.shape[0]
    out = np.empty((n, STEP_BYTES + arr.shape[1] * arr.itemsize), dtype=np.uint8)
    out[:, :STEP_BYTES] = np.frombuffer(b"%016x" % step, dtype=np.uint8)
    out[:, STEP_BYTES:] = arr.view(np.uint8).reshape(n, -1)
    return out


def _args(items_NL: np.ndarray) -> bytes:
    """RESP bulk strings of the rows of ``items_NL`` (all of one length)."""
    n, length = items_NL.shape
    head = np.frombuffer(b"$%d\r\n" % length, dtype=np.uint8)
    buf = np.empty((n, head.shape[0] + length + 2), dtype=np.uint8)
    buf[:, : head.shape[0]] = head
    buf[:, head.shape[0] : head.shape[0] + length] = items_NL
    buf[:, -2:] = (13, 10)
    return buf.tobytes()


def pack_evalsha(sha: str, names_NK: np.ndarray, values_NV: np.ndarray) -> bytes:
    """Return ``EVALSHA sha N names... values...`` in the Redis protocol (RESP)."""
    n = names_NK.shape[0]
    count = b"%d" % n
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        3 + 2 * n, len(sha), sha.encode(), len(count), count)
    return head + _args(names_NK) + _args(values_NV)


def decode(values: list[bytes], dim: int, dtype: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (int64 [N] steps, float32 [N, dim] rows) of live values (all present)."""
    try:
        steps = np.array([int(v[:STEP_BYTES], 16) for v in values], dtype=np.int64)
    except ValueError:
        raise ValueError(f"{where}: a live value does not start with a 16-hex-digit step") from None
    rows = layout.decode_rows([v[STEP_BYTES:] for v in values], dim, dtype, where)
    return steps, rows


def manifest(run: str, dtype: str, buckets: int, dims: dict[str, int], salts: dict) -> dict:
    """Return the live namespace's manifest."""
    if dtype not in layout.DTYPES:
        raise ValueError(f"publish.dtype must be one of {sorted(layout.DTYPES)}, found {dtype!r}")
    return {"format": FORMAT, "run": run, "dtype": dtype, "buckets": int(buckets),
            "tables": {name: {"dim": int(dim)} for name, dim in sorted(dims.items())}, "salts": salts,
            "started": time.time()}


def parse_manifest(text: bytes | str, where: str) -> dict:
    """Return a live manifest read from Redis (``ValueError`` naming ``where`` if it is not one)."""
    try:
        out = json.loads(text)
        if out.get("format") != FORMAT:
            raise ValueError(f"format {out.get('format')!r}, this code reads format {FORMAT}")
        if out["dtype"] not in layout.DTYPES:
            raise ValueError(f"dtype {out['dtype']!r}")
        int(out["buckets"])
        {name: int(t["dim"]) for name, t in out["tables"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: not a live manifest: {exc}") from None
    return out


def head_steps(raw: dict) -> dict[str, dict]:
    """Decode an ``HGETALL`` of the head hash: ``{rank: {"step", "time", "rows"}}``."""
    out = {}
    for rank, value in raw.items():
        try:
            out[rank.decode() if isinstance(rank, bytes) else rank] = json.loads(value)
        except (ValueError, TypeError):
            continue
    return out


class LiveWriter:
    """Write live rows to one Redis (or Redis Cluster) through ``GUARDED_SET``; synchronous
    (the trainer calls it from its push thread, never from a training step).

    Errors are redis-py's (``redis.RedisError`` / ``OSError``): the caller retries.
    """

    def __init__(self, url: str, ns: str, buckets: int = 64, timeout_s: float = 5.0,
                 max_keys_per_call: int = MAX_KEYS_PER_CALL) -> None:
        from recsys.redis_util import check_url

        check_url(url, "publish.redis")
        self.url, self.ns, self.buckets = url, layout.check_name(ns, "publish.namespace"), int(buckets)
        self.timeout_s = timeout_s
        self.max_keys_per_call = max_keys_per_call
        self._client = None
        self._sha: str | None = None

    @property
    def client(self):
        if self._client is None:
            from recsys.redis_util import connect

            self._client = connect(self.url, self.timeout_s)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def reset(self) -> None:
        """Drop the connection (after an error; the next call reconnects)."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a broken connection may fail to close: it is dropped anyway
            self._client = None

    def write(self, parts: list[tuple[str, np.ndarray, np.ndarray]], step: int, dtype: str) -> int:
        """Write ``(table, keys_N, float32 rows_ND)`` parts as rows of ``step`` in one pipelined
        round trip; return how many rows replaced an older one (the others were as new).

        One Redis or Redis over TLS: the commands are packed with numpy (every key and value
        of a table has one length) and sent on one pooled connection; redis-py's own packing
        in Python cost more than the rest of a push together (measured: 0.43 of 0.76 s for
        50 k rows). A Redis Cluster: the same, per node (a call's keys share a hash slot); a
        slot that moved fails the write with MOVED, and the caller's retry reconnects and
        reads the slot map again."""
        import redis

        client = self.client
        cluster = hasattr(client, "get_primaries")
        commands: list[tuple[np.ndarray, np.ndarray]] = []  # (key names, values) of one call each
        for table, keys, rows in parts:
            if keys.shape[0] == 0:
                continue
            names = layout.row_key_bytes(self.ns, VERSION, table, keys, self.buckets)
            values = value_bytes(step, rows, dtype)
            # a cluster: a call's keys must share a hash slot (one bucket per call); one Redis:
            # any keys in one call (58 k rows: 113 calls instead of ~1,600)
            groups = layout.by_bucket(layout.buckets_of(keys, self.buckets)) if cluster else [slice(None)]
            for group in groups:
                group_names, group_values = names[group], values[group]
                for s in range(0, group_names.shape[0], self.max_keys_per_call):
                    e = s + self.max_keys_per_call
                    commands.append((group_names[s:e], group_values[s:e]))
        if not commands:
            return 0
        if self._sha is None:
            self._sha = client.script_load(GUARDED_SET)
        for attempt in range(2):
            if cluster:
                # a cluster: the keys of one call share a hash slot; each node gets its calls,
                # packed the same way, on its own connection (redis-py's cluster pipeline
                # refuses EVALSHA)
                by_node: dict[str, tuple] = {}
                for names, values in commands:
                    node = client.get_node_from_key(names[0].tobytes())
                    by_node.setdefault(node.name, (node, []))[1].append(pack_evalsha(self._sha, names, values))
                results = []
                for node, packed in by_node.values():
                    results += self._send(node.redis_connection or client.get_redis_connection(node), packed)
            else:
                results = self._send(client, [pack_evalsha(self._sha, names, values) for names, values in commands])
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results) and attempt == 0:
                self._sha = client.script_load(GUARDED_SET)  # Redis restarted (or a new cluster node)
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return int(sum(results))
        raise AssertionError("unreachable")

    @staticmethod
    def _send(client, packed: list[bytes]) -> list:
        """Send pre-packed commands on one pooled connection; return their replies (errors as values)."""
        import redis

        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed)
            out = []
            for _ in packed:
                try:
                    out.append(conn.read_response())
                except redis.exceptions.ResponseError as exc:
                    out.append(exc)
            return out
        except BaseException:
            conn.disconnect()  # a half-read reply must not reach the next call
            raise
        finally:
            pool.release(conn)

    def read(self, table: str, keys_N: np.ndarray, dim: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (found [N], steps [N] (-1 where absent), float32 rows [N, dim]) of live rows."""
        names = row_keys(self.ns, table, keys_N, self.buckets)
        values = self.client.mget_nonatomic(names) if hasattr(self.client, "mget_nonatomic") \
            else self.client.mget(names)
        found = np.array([v is not None for v in values], dtype=bool)
        steps = np.full(len(values), -1, dtype=np.int64)
        rows = np.zeros((len(values), dim), dtype=np.float32)
        if found.any():
            s, r = decode([v for v in values if v is not None], dim, dtype, f"live namespace {self.ns!r} table {table!r}")
            steps[found], rows[found] = s, r
        return found, steps, rows

    def write_manifest(self, value: dict) -> None:
        self.client.set(manifest_key(self.ns), json.dumps(value))

    def read_manifest(self) -> dict | None:
        raw = self.client.get(manifest_key(self.ns))
        return None if raw is None else parse_manifest(raw, f"{manifest_key(self.ns)} at {self.url}")

    def write_head(self, rank: int, step: int, rows: int) -> None:
        self.client.hset(head_key(self.ns), str(rank), json.dumps({"step": step, "time": time.time(), "rows": rows}))

    def read_head(self) -> dict[str, dict]:
        return head_steps(self.client.hgetall(head_key(self.ns)))

    def clear(self) -> int:
        """Delete every live row, the head and the manifest (SCAN + UNLINK); return rows deleted."""
        from embedding_server.publish import _unlink_version

        n = _unlink_version(self.client, self.ns, VERSION)
        self.client.delete(manifest_key(self.ns))
        self.client.delete(head_key(self.ns))
        return n
