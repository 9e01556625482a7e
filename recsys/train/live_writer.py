"""``LiveWriter``: the trainer's writer of live rows (``recsys.train.live_push`` runs one per
rank and store on its push thread).

What it writes and why no row ever goes back to an older step: ``recsys.redisio.live`` (the
fence, the plain MSET transaction, the guard). Its commands are packed here with numpy.
"""

from __future__ import annotations

import json
import time

import numpy as np

from recsys.redisio import published as layout
from recsys.redisio import resp
from recsys.redisio.live import (GUARDED_SET, MAX_KEYS_PER_CALL, VERSION, decode, fence_allows, fence_key, head_key,
                                  head_steps, manifest_key, parse_manifest, row_keys, value_bytes, writers_key)
from recsys.redisio.client import redact

ROWS_PER_TRANSACTION = 4096
"""Rows of one fenced MSET transaction: Redis runs an EXEC without serving anyone else, so a
transaction stays short (its cost: docs/benchmarks-history.md, "Figures from module
docstrings"); a push of R rows costs ceil(R / 4,096) transactions of two round trips each."""


def pack_evalsha(sha: str, fence: tuple[str, str] | None, writer: str, step_hex: bytes, names_NK: np.ndarray,
                 values_NV: np.ndarray) -> bytes:
    """Return ``EVALSHA sha`` of ``GUARDED_SET`` for these rows in RESP; ``fence``: the
    writer's fence key and the registry, or None (no fence: ``writer`` is not sent)."""
    n = names_NK.shape[0]
    keys = n + (2 if fence else 0)
    head = b"*%d\r\n" % (3 + keys + 2 + n) + resp.bulks("EVALSHA", sha, b"%d" % keys, *(fence or ()))
    return (head + resp.bulk(names_NK).tobytes() + resp.bulks(writer if fence else "", step_hex)
            + resp.bulk(values_NV).tobytes())


def _transactions(chunks: list, rows: int) -> list[list]:
    """Group consecutive chunks into lists of at most ``rows`` rows (at least one chunk each)."""
    out, current, n = [], [], 0
    for chunk in chunks:
        if current and n + chunk[0].shape[0] > rows:
            out.append(current)
            current, n = [], 0
        current.append(chunk)
        n += chunk[0].shape[0]
    if current:
        out.append(current)
    return out


class LiveWriter:
    """Write live rows to one Redis (or Redis Cluster), never replacing a row with an older
    one (see the module doc); synchronous (the trainer calls it from its push thread, never
    from a training step).

    ``group`` and ``member`` name the writer in the fence: writers of one group promise to
    write disjoint keys (the ranks of one training attempt); the default group is a new
    random token, a group of its own. Errors are redis-py's (``redis.RedisError`` /
    ``OSError``): the caller retries. A ``url`` without a password takes it from
    ``password_file``, else ``$REDIS_PASSWORD`` (``recsys.redisio.client.password_for``).
    """

    def __init__(self, url: str, ns: str, buckets: int = 64, timeout_s: float = 5.0,
                 max_keys_per_call: int = MAX_KEYS_PER_CALL, group: str | None = None, member: str = "0",
                 password_file: str = "") -> None:
        import secrets

        from recsys.redisio.client import check_url

        check_url(url, "publish.redis")
        self.url, self.ns, self.buckets = url, layout.check_name(ns, "publish.namespace"), int(buckets)
        self.password_file = password_file
        self.timeout_s = timeout_s
        self.max_keys_per_call = max_keys_per_call
        self.group = group or secrets.token_hex(6)
        if "/" in self.group:
            raise ValueError(f"a live writer's group must not contain '/', found {self.group!r}")
        self.name = f"{self.group}/{member}"
        self._others: list[str] = []  # the other groups' writers, as last read from the registry
        self._client = None
        self._sha: str | None = None
        self.counters = {"rows_plain": 0, "rows_guarded": 0, "fence_conflicts": 0}
        """Rows written by a fenced plain MSET, rows sent through the guard, and fenced
        transactions another writer's fence change aborted (their rows then went guarded)."""

    @property
    def client(self):
        if self._client is None:
            from recsys.redisio.client import connect

            self._client = connect(self.url, self.timeout_s, self.password_file, "publish.redis")
        return self._client

    def register(self) -> None:
        """Enter this writer in the namespace's registry now, before its first write. Every
        fenced transaction WATCHes the registry, so a writer of the same group entering it
        for the first time meanwhile would abort that transaction and send its rows down the
        guarded path; writers that register before any of their group writes never do (a
        repeated SADD changes nothing and touches no WATCH)."""
        self.client.sadd(writers_key(self.ns), self.name)

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
        """Write ``(table, keys_N, float32 rows_ND)`` parts as rows of ``step``; return how
        many rows replaced an older one or were new (the others were as new already).

        The commands are packed with numpy (``recsys.redisio.resp``: every key and value of a
        table has one length) and sent pipelined on one pooled connection; redis-py's own
        packing in Python cost more than the rest of a push together (docs/benchmarks-history.md,
        "Figures from module docstrings"). One Redis: fenced plain MSETs, each chunk that
        may meet a newer row guarded instead. A Redis Cluster: guarded calls, per node (a call's
        keys share a hash slot); a slot that moved fails the write with MOVED, and the caller's
        retry reconnects and reads the slot map again."""
        client = self.client
        cluster = hasattr(client, "get_primaries")
        step_hex = b"%016x" % step
        chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (key names, values), at most max_keys_per_call rows
        for table, keys, rows in parts:
            if keys.shape[0] == 0:
                continue
            names = layout.row_key_bytes(self.ns, VERSION, table, keys, self.buckets)
            values = value_bytes(step, rows, dtype)
            # a cluster: a call's keys must share a hash slot (one bucket per call); one Redis:
            # any keys in one call (a few calls of max_keys_per_call rows, not one per bucket)
            groups = layout.by_bucket(layout.buckets_of(keys, self.buckets)) if cluster else [slice(None)]
            for group in groups:
                group_names, group_values = names[group], values[group]
                for s in range(0, group_names.shape[0], self.max_keys_per_call):
                    e = s + self.max_keys_per_call
                    chunks.append((group_names[s:e], group_values[s:e]))
        if not chunks:
            return 0
        if cluster:
            return self._write_guarded(client, chunks, step_hex, fenced=False)
        written, txs = 0, _transactions(chunks, ROWS_PER_TRANSACTION)
        for i, tx in enumerate(txs):
            done = self._write_fenced(client, tx, step_hex)
            if done is None:  # refused (the same step would be again) or raced: the rest go guarded
                rest = [chunk for later in txs[i:] for chunk in later]
                return written + self._write_guarded(client, rest, step_hex, fenced=True)
            written += done
        return written

    def _write_fenced(self, client, chunks: list[tuple[np.ndarray, np.ndarray]], step_hex: bytes) -> int | None:
        """Write ``chunks`` as one MSET transaction if the fence allows it; return the rows
        written, or None (nothing written) when a row there may be as new (or another writer
        changed the fence meanwhile)."""
        registry, own_key = writers_key(self.ns), fence_key(self.ns, self.name)
        with resp.connection(client) as conn:  # WATCH belongs to a connection: one for the exchange
            for _ in range(3):  # until the registry holds no writer this one does not watch
                fences = [fence_key(self.ns, w) for w in self._others]
                _, members, steps = self._exchange(conn, [resp.command("WATCH", registry, *fences),
                                                          resp.command("SMEMBERS", registry),
                                                          resp.command("MGET", own_key, *fences)])
                for r in (members, steps):
                    if isinstance(r, Exception):
                        raise r
                mine = self.group.encode() + b"/"
                others = sorted(w.decode() for w in members if not w.startswith(mine))
                if others == self._others:
                    break
                self._others = others
                self._exchange(conn, [resp.command("UNWATCH")])
            else:
                return None  # writers keep joining: the guard does not need the registry read
            if not fence_allows(steps[0], steps[1:], step_hex):
                self._exchange(conn, [resp.command("UNWATCH")])
                return None
            packed = [resp.command("MULTI")] + [c for n, v in chunks for c in resp.pack(b"MSET", n, v, n.shape[0])]
            packed += [resp.command("SET", own_key, step_hex), resp.command("SADD", registry, self.name),
                       resp.command("EXEC")]
            replies = self._exchange(conn, packed)
        for r in replies:
            if isinstance(r, Exception):  # e.g. OOM while queueing: Redis discarded the transaction
                raise r
        if replies[-1] is None:  # a watched fence changed after WATCH: another writer wrote meanwhile
            self.counters["fence_conflicts"] += 1
            return None
        rows = sum(n.shape[0] for n, _ in chunks)
        self.counters["rows_plain"] += rows
        return rows

    def _write_guarded(self, client, chunks: list[tuple[np.ndarray, np.ndarray]], step_hex: bytes,
                       fenced: bool) -> int:
        """Write ``chunks`` through ``GUARDED_SET`` (one call each; ``fenced``: raising this
        writer's fence step); return how many rows it replaced."""
        import redis

        if self._sha is None:
            self._sha = client.script_load(GUARDED_SET)
        fence = (fence_key(self.ns, self.name), writers_key(self.ns)) if fenced else None
        self.counters["rows_guarded"] += sum(n.shape[0] for n, _ in chunks)
        for attempt in range(2):
            if hasattr(client, "get_primaries"):
                # a cluster: the keys of one call share a hash slot; each node gets its calls,
                # packed the same way, on its own connection (redis-py's cluster pipeline
                # refuses EVALSHA)
                by_node: dict[str, tuple] = {}
                for names, values in chunks:
                    node = client.get_node_from_key(names[0].tobytes())
                    by_node.setdefault(node.name, (node, []))[1].append(
                        pack_evalsha(self._sha, fence, self.name, step_hex, names, values))
                results = []
                for node, packed in by_node.values():
                    results += self._send(node.redis_connection or client.get_redis_connection(node), packed)
            else:
                results = self._send(client, [pack_evalsha(self._sha, fence, self.name, step_hex, names, values)
                                              for names, values in chunks])
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results) and attempt == 0:
                self._sha = client.script_load(GUARDED_SET)  # Redis restarted (or a new cluster node)
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return int(sum(results))
        raise AssertionError("unreachable")

    @staticmethod
    def _exchange(conn, packed: list[bytes]) -> list:
        """Send pre-packed commands pipelined, all in one send; return their replies (errors as
        values: a transaction's every reply is inspected)."""
        return resp.exchange(conn, packed, window=None, errors_as_values=True)

    @classmethod
    def _send(cls, client, packed: list[bytes]) -> list:
        """Send pre-packed commands on one pooled connection; return their replies (errors as values)."""
        with resp.connection(client) as conn:
            return cls._exchange(conn, packed)

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
        return None if raw is None else parse_manifest(raw, f"{manifest_key(self.ns)} at {redact(self.url)}")

    def write_head(self, rank: int, step: int, rows: int) -> None:
        self.client.hset(head_key(self.ns), str(rank), json.dumps({"step": step, "time": time.time(), "rows": rows}))

    def read_head(self) -> dict[str, dict]:
        return head_steps(self.client.hgetall(head_key(self.ns)))

    def clear(self) -> int:
        """Delete every live row, the head and the manifest (SCAN + UNLINK); return rows deleted."""
        n = layout.unlink_version(self.client, self.ns, VERSION)
        writers = [w.decode() for w in self.client.smembers(writers_key(self.ns))]
        for key in (manifest_key(self.ns), head_key(self.ns), writers_key(self.ns),
                    *(fence_key(self.ns, w) for w in writers)):
            self.client.delete(key)  # one by one: on a cluster they lie in several slots
        return n
