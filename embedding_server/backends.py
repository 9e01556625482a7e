"""Where served rows come from: a checkpoint in memory (embedded) or published versions in Redis.

Legend: ``U`` unique keys of a request part, ``D`` dim.

Both backends answer the same two questions, asynchronously:

- ``snapshot()``: the version to serve now, with its ``Catalog``. A request takes one
  snapshot and reads every row by that version, so a response never mixes versions.
- ``rows(snap, parts)``: for each ``(table, keys_U)`` part, float32 ``[U, D]`` rows and a
  ``found`` mask (rows of keys not found are zeros; the app fills in the unseen-key vector),
  and the newest training step among the live rows served (None: no live row).
  The Redis backend reads all parts with one round trip (one MGET; per hash slot in a
  cluster), through the LRU cache. With ``follow`` (``recsys serve --follow NS``) the same
  round trip reads the live rows of the keys (``embedding_server.overlay``): a key with a
  live row is served that row, ``found``, whatever the version holds.

``BackendUnavailable`` (Redis unreachable, timed out, nothing published) becomes a 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import hiredis
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedding_server import overlay
from embedding_server.cache import CacheBudget
from embedding_server.catalog import Catalog
from embedding_server.redis_mget import MGET_KEYS, RespPipeline
from recsys.checkpoint import read as checkpoint_files
from recsys.redisio import live
from recsys.redisio import published as layout
from recsys.redisio.client import client_options, is_cluster_info, redact

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The backend cannot answer now (the message says why); the service answers 503."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One served version."""

    version: str
    catalog: Catalog
    dtype: str = "float32"
    buckets: int = 1
    cache: CacheBudget | None = None
    """The version's row caches (Redis backend)."""
    live: overlay.Overlay | None = None
    """The live namespace overlaid on the version (None: published rows only)."""


# --------------------------------------------------------------------------- embedded


class EmbeddedBackend:
    """Serve a checkpoint's rows from memory, no Redis (``recsys serve --checkpoint``).

    Rows are loaded once (sorted by key, in the checkpoint's storage dtype) and found by
    binary search. They are loaded rather than memory-mapped: checkpoint shards are zstd
    Parquet, which cannot be mapped without first writing an uncompressed copy.
    """

    name = "embedded"

    def __init__(self, checkpoint: str | Path, tables: list[str] | None = None) -> None:
        path = checkpoint_files.resolve(checkpoint)
        meta = checkpoint_files.load_meta(path)
        self._keys: dict[str, np.ndarray] = {}
        self._rows: dict[str, np.ndarray] = {}
        counts = {}
        for name in tables or meta["tables"]:
            data = pa.concat_tables(pq.read_table(f, columns=["key", "embedding"])
                                    for f in checkpoint_files.sparse_files(path, name))
            keys = data.column("key").to_numpy()
            flat = data.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
            order = np.argsort(keys, kind="stable")
            self._keys[name] = np.ascontiguousarray(keys[order])
            self._rows[name] = np.ascontiguousarray(flat.reshape(keys.shape[0], -1)[order])
            counts[name] = int(keys.shape[0])
        catalog = Catalog.from_checkpoint(path, meta, counts, tables)
        self._snap = Snapshot(version=f"checkpoint:{path.name}", catalog=catalog,
                              dtype=str(next(iter(self._rows.values())).dtype) if self._rows else "float32")
        self.path = path

    async def start(self) -> None:
        """Nothing to open: the rows are loaded."""

    async def close(self) -> None:
        """Nothing to close."""

    def status(self) -> tuple[bool, str]:
        """Return (ready, why)."""
        return True, f"serving {self.path}"

    async def snapshot(self) -> Snapshot:
        """Return the one version this backend serves."""
        return self._snap

    async def rows(self, snap: Snapshot,
                   parts: list[tuple[str, np.ndarray]]) -> tuple[list[tuple[np.ndarray, np.ndarray]], None]:
        """Return (float32 [U, D] rows, found [U]) per ``(table, keys_U)`` part, and None (no live rows)."""
        out = []
        for table, keys in parts:
            sorted_keys = self._keys[table]
            rows = self._rows[table]
            pos = np.searchsorted(sorted_keys, keys)
            np.minimum(pos, max(sorted_keys.shape[0] - 1, 0), out=pos)
            found = sorted_keys[pos] == keys if sorted_keys.shape[0] else np.zeros(keys.shape[0], dtype=bool)
            vec = rows[pos].astype(np.float32) if sorted_keys.shape[0] else np.zeros((keys.shape[0], rows.shape[1]), np.float32)
            vec[~found] = 0.0
            out.append((vec, found))
        return out, None


# --------------------------------------------------------------------------- Redis


class RedisBackend:
    """Serve the version the Redis alias names, through a byte-bounded LRU cache.

    A background task reads the alias every ``refresh_s`` seconds; a new version's manifest
    is loaded before it is served. Until Redis answers (at start, or after an outage) the
    backend is not ready and requests get 503; the client reconnects by itself.

    ``follow``: a live namespace whose manifest is read at every refresh too, and whose rows
    are overlaid on the version when compatible (``embedding_server.overlay``). Live rows
    are cached ``live_ttl_s`` seconds by ``clock`` (0: not cached), in half of
    ``cache_bytes``; the published rows' caches get the other half.

    A ``url`` without a password takes it from ``password_file``, else ``$REDIS_PASSWORD``
    (``recsys.redisio.client.password_for``), read once here.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str = "recsys", cache_bytes: int = 256 << 20,
                 refresh_s: float = 1.0, timeout_s: float = 2.0, follow: str = "", live_ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, password_file: str = "") -> None:
        self.url = url
        # read now: a missing or empty password file fails at start, naming it, not in every request
        self._options = client_options(url, password_file, "redis_password_file")
        self.ns = namespace
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.follow = follow
        self.live_ttl_s = live_ttl_s
        self.clock = clock
        live_share = cache_bytes // 2 if follow and live_ttl_s > 0 else 0
        self.cache_bytes = cache_bytes - live_share
        self.live_cache_bytes = live_share
        self.hits = 0  # keys answered by the cache, over all versions
        self.misses = 0  # keys read from Redis
        self.live_rows = 0  # distinct keys of a lookup answered with a live row
        self.live_hits = 0  # keys whose live row (or its absence) came from the live cache
        self.live_misses = 0  # keys whose live row was read from Redis
        self.errors = 0
        self._client = None
        self._cluster = False
        self._resp: RespPipeline | None = None  # row MGETs on a single node over plain TCP / Unix socket
        self._snap: Snapshot | None = None  # what requests are served: the version and its overlay
        self._base: Snapshot | None = None  # the published version alone
        self._manifests: dict[str, Snapshot] = {}
        self._overlay: overlay.Overlay | None = None
        self._live_seen: tuple | None = None  # (version, live manifest text) the overlay was built for
        self._live_note = "" if not follow else f"live namespace {follow!r} not read yet"
        self._live_said: set[str] = set()  # reasons already logged
        self._refused: dict[str, str] = {}  # version -> why its manifest cannot be served
        self._last_error = "not connected yet"
        # calls overlap (the follower's refresh, requests): the outcome status() reports is that
        # of the latest-started call to have ended, so an older call that fails after a newer one
        # answered does not mark a recovered Redis unready
        self._calls_started = 0
        self._outcome_of = 0  # start number of the call whose outcome _last_error holds
        self._task: asyncio.Task | None = None
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect (if Redis answers) and start following the alias."""
        try:
            await self.refresh()
        except BackendUnavailable as exc:
            log.warning("lookup service starting without Redis: %s", exc)
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        """Stop following the alias and close the connection pool."""
        self._closing = True  # the follower also stops by itself should a Redis call swallow the cancel
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._client.aclose()
        if self._resp is not None:
            self._resp.close()

    def status(self) -> tuple[bool, str]:
        """Return (ready, why): the latest-started Redis call to end got an answer (a refresh
        or a request; see ``_settle``) and a version is loaded."""
        refused = "".join(f"; refused version {v!r}: {why}" for v, why in self._refused.items())
        if self._last_error:
            return False, self._last_error + refused
        if self._snap is None:
            return False, f"no version published under namespace {self.ns!r} at {redact(self.url)}{refused}"
        note = f"; {self._live_note}" if self._live_note else ""
        return True, f"serving version {self._snap.version} from {redact(self.url)}{note}{refused}"

    async def _follow(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except BackendUnavailable:
                pass  # recorded in _last_error; the next tick tries again
            except Exception:  # noqa: BLE001 - never let the follower die: log and go on
                log.exception("refreshing the served version failed; trying again in %.1f s", self.refresh_s)

    async def _connect(self):
        import redis.asyncio as aredis
        from redis.asyncio.cluster import RedisCluster

        opts = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, **self._options)
        probe = aredis.Redis.from_url(self.url, **opts)
        try:
            cluster = not self.url.startswith("unix://") and is_cluster_info(await probe.info("cluster"))
        finally:
            await probe.aclose()
        self._cluster = cluster
        if not cluster and self.url.startswith(("redis://", "unix://")):
            self._resp = RespPipeline(self.url, self.timeout_s, self._options.get("password"))
        return RedisCluster.from_url(self.url, **opts) if cluster else aredis.Redis.from_url(self.url, **opts)

    async def _call(self, what: str, op):
        """Run ``op(client)``; Redis errors become ``BackendUnavailable`` naming the URL."""
        import redis

        self._calls_started += 1
        mine = self._calls_started
        try:
            if self._client is None:
                self._client = await self._connect()
            result = await op(self._client)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            self.errors += 1
            why = f"Redis at {redact(self.url)} failed during {what}: {type(exc).__name__}: {exc}"
            self._settle(mine, why)
            raise BackendUnavailable(why) from None
        self._settle(mine, "")  # Redis answered: ready again as soon as it does
        return result

    def _settle(self, call: int, error: str) -> None:
        """Record the outcome of call number ``call`` unless a call started after it has ended."""
        if call > self._outcome_of:
            self._outcome_of = call
            self._last_error = error

    # ------------------------------------------------------------------ versions

    async def refresh(self) -> Snapshot | None:
        """Read the alias now (and the live manifest when following); load the manifest of a
        new version; return the served snapshot."""
        base = await self._refresh_version()
        if base is None:
            self._snap = None
            return None
        live_now = await self._refresh_live(base) if self.follow else None
        snap = self._snap
        if snap is None or snap.version != base.version or snap.cache is not base.cache or snap.live is not live_now:
            self._snap = dataclasses.replace(base, live=live_now)
        return self._snap

    async def _refresh_version(self) -> Snapshot | None:
        """Read the alias; return the published version to serve (its snapshot without overlay)."""
        raw = await self._call("read of the current version", lambda c: c.get(layout.current_key(self.ns)))
        if raw is None:
            self._base = None
            return None
        version = raw.decode()
        if version in self._refused:  # keep serving what we serve (if anything)
            return self._base
        if self._base is None or self._base.version != version:
            snap = self._manifests.get(version)
            if snap is None:
                text = await self._call("read of a manifest", lambda c: c.get(layout.manifest_key(self.ns, version)))
                if text is None:
                    self._last_error = f"version {version!r} has no manifest under namespace {self.ns!r}"
                    raise BackendUnavailable(self._last_error)
                try:
                    manifest = json.loads(text)
                    catalog = Catalog.from_manifest(manifest, f"manifest of version {version!r}")
                    dtype, buckets = manifest["dtype"], int(manifest["buckets"])
                    if dtype not in layout.DTYPES:
                        raise ValueError(f"dtype {dtype!r}, this server decodes {sorted(layout.DTYPES)}")
                except (ValueError, KeyError, TypeError) as exc:
                    # a manifest this server cannot serve (another format, other hashing): keep
                    # the version served now, say why in /readyz, do not try it again
                    self._refused[version] = f"{type(exc).__name__}: {exc}"
                    log.error("refusing version %s: %s", version, self._refused[version])
                    return self._base
                cache = CacheBudget(self.cache_bytes, {n: (t.rows, t.dim) for n, t in catalog.tables.items()})
                snap = Snapshot(version=version, dtype=dtype, buckets=buckets, catalog=catalog, cache=cache)
                self._manifests = {version: snap}  # only the served one is needed again
            self._base = snap
            log.info("serving version %s", version)
        return self._base

    async def _refresh_live(self, base: Snapshot) -> overlay.Overlay | None:
        """Read the live manifest; return the overlay to serve on ``base`` (None: published only)."""
        key = live.manifest_key(self.follow)
        text = await self._call("read of the live manifest", lambda c: c.get(key))
        if self._live_seen == (base.version, text):
            return self._overlay
        self._live_seen = (base.version, text)
        previous, self._overlay = self._overlay, None
        if text is None:
            self._live_note = f"live namespace {self.follow!r} has no manifest ({key}): serving published rows only"
            self._say(self._live_note, logging.INFO)
            return None
        try:
            manifest = live.parse_manifest(text, key)
            why = overlay.incompatibility(manifest, base.catalog)
        except ValueError as exc:  # not a live manifest (parse_manifest names the key)
            why = str(exc)
        except (KeyError, TypeError) as exc:
            why = f"{key}: not a live manifest: {type(exc).__name__}: {exc}"
        if why is not None:
            self._live_note = (f"live namespace {self.follow!r} not overlaid on version {base.version!r}, "
                               f"serving published rows only: {why}")
            self._say(self._live_note, logging.WARNING)
            return None
        self._overlay = overlay.build(self.follow, manifest, base.catalog, self.live_cache_bytes, self.live_ttl_s,
                                      previous)
        self._live_note = f"overlaying live namespace {self.follow!r} ({self._overlay.describe()})"
        self._say(f"{self._live_note} on version {base.version!r}", logging.INFO)
        return self._overlay

    def _say(self, reason: str, level: int) -> None:
        """Log ``reason`` once (a refresh every second must not repeat it)."""
        if reason not in self._live_said:
            self._live_said.add(reason)
            log.log(level, "%s", reason)

    async def snapshot(self) -> Snapshot:
        """Return the version to serve now (``BackendUnavailable`` if none can be)."""
        snap = self._snap
        if snap is None:
            snap = await self.refresh()
        if snap is None:
            refused = "".join(f"; refused version {v!r}: {why}" for v, why in self._refused.items())
            raise BackendUnavailable(f"no version published under namespace {self.ns!r} at {redact(self.url)} "
                                     f"(run `recsys export`){refused}")
        return snap

    # ------------------------------------------------------------------ rows

    def cache_stats(self) -> tuple[int, int, int]:
        """Return (hits, misses, bytes) of the served version's row cache."""
        snap = self._snap
        return self.hits, self.misses, snap.cache.bytes if snap is not None and snap.cache is not None else 0

    def live_stats(self) -> tuple[bool, int, int, int, int] | None:
        """Return (overlaying now, live rows served, live cache hits, misses, bytes); None without ``follow``."""
        if not self.follow:
            return None
        ov = self._snap.live if self._snap is not None else None
        size = ov.caches.bytes if ov is not None and ov.caches is not None else 0
        return ov is not None, self.live_rows, self.live_hits, self.live_misses, size

    async def rows(self, snap: Snapshot,
                   parts: list[tuple[str, np.ndarray]]) -> tuple[list[tuple[np.ndarray, np.ndarray]], int | None]:
        """Return (float32 [U, D] rows, found [U]) per ``(table, keys_U)`` part: cached rows,
        and one MGET round trip for all the others; with a live overlay, a key's live row
        (cached or read in the same round trip) replaces the published one. Also return the
        newest step among the live rows served (None: none)."""
        ov = snap.live
        now = self.clock() if ov is not None else 0.0  # before the read: a row is at least this fresh
        plan, names, live_names = [], [], []
        for table, keys in parts:
            cache = snap.cache.get(table) if snap.cache is not None else None
            if cache is not None:
                hit, vec, found = cache.get(keys)
            else:
                dim = snap.catalog.tables[table].dim
                hit, vec, found = (np.zeros(keys.shape[0], dtype=bool), np.zeros((keys.shape[0], dim), np.float32),
                                   np.zeros(keys.shape[0], dtype=bool))
            miss = np.flatnonzero(~hit)
            self.misses += miss.shape[0]
            self.hits += keys.shape[0] - miss.shape[0]
            names += layout.row_keys(self.ns, snap.version, table, keys[miss], snap.buckets)
            lplan = None
            if ov is not None and table in ov.dims:
                lcache = ov.caches.get(table) if ov.caches is not None else None
                if lcache is not None:
                    lhit, *lentry = lcache.get(keys, now)
                else:
                    n = keys.shape[0]
                    lhit = np.zeros(n, dtype=bool)
                    lentry = [np.zeros((n, vec.shape[1]), np.float32), np.zeros(n, dtype=bool),
                              np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.float64)]
                lmiss = np.flatnonzero(~lhit)
                self.live_misses += lmiss.shape[0]
                self.live_hits += keys.shape[0] - lmiss.shape[0]
                live_names += live.row_keys(ov.ns, table, keys[lmiss], ov.buckets)
                lplan = (lmiss, lentry, lcache)
            plan.append((table, keys, vec, found, miss, cache, lplan))
        values = await self._mget(names + live_names) if names or live_names else []
        out, start, lstart, newest = [], 0, len(names), None
        for table, keys, vec, found, miss, cache, lplan in plan:
            vals = values[start : start + miss.shape[0]]
            start += miss.shape[0]
            got = np.array([v is not None for v in vals], dtype=bool)
            if got.any():
                vec[miss[got]] = layout.decode_rows([v for v in vals if v is not None], vec.shape[1], snap.dtype,
                                                    f"version {snap.version!r} table {table!r}")
            found[miss] = got
            if cache is not None:
                cache.put(keys, vec, found)  # no await since the get: see embedding_server.cache
            if lplan is not None:
                lmiss, (lrows, lfound, lsteps, lstamps), lcache = lplan
                lvals = values[lstart : lstart + lmiss.shape[0]]
                lstart += lmiss.shape[0]
                lgot = np.array([v is not None for v in lvals], dtype=bool)
                if lgot.any():
                    where = f"live namespace {ov.ns!r} table {table!r}"
                    lsteps[lmiss[lgot]], lrows[lmiss[lgot]] = live.decode([v for v in lvals if v is not None],
                                                                          vec.shape[1], ov.dtype, where)
                lfound[lmiss] = lgot
                lstamps[lmiss] = now
                if lcache is not None:  # keeps a later step another request cached meanwhile
                    lrows, lfound, lsteps, lstamps = lcache.put(keys, lrows, lfound, lsteps, lstamps)
                if lfound.any():
                    vec[lfound] = lrows[lfound]
                    found |= lfound
                    self.live_rows += int(lfound.sum())
                    step = int(lsteps[lfound].max())
                    newest = step if newest is None else max(newest, step)
            out.append((vec, found))
        return out, newest

    async def _mget(self, names: list[bytes]) -> list[bytes | None]:
        if self._cluster:  # one MGET per hash slot, pipelined per node (redis-py)
            return await self._call("MGET of rows", lambda c: c.mget_nonatomic(names))
        if self._resp is not None:  # plain TCP or a Unix socket: the lean client, pipelined
            return await self._call("MGET of rows", lambda _c: self._resp.mget(names))

        async def packed(c):
            # TLS: the command is packed by hiredis (C) and sent on one of redis-py's pooled
            # connections: redis-py's asyncio client packs in Python, measured at ~1/3 of a
            # 256-key lookup's server CPU.
            conn = await c.connection_pool.get_connection()
            try:
                out = []
                for s in range(0, len(names), MGET_KEYS):
                    await conn.send_packed_command(hiredis.pack_command(("MGET", *names[s : s + MGET_KEYS])))
                for _ in range(0, len(names), MGET_KEYS):
                    out += await conn.read_response()
                return out
            except BaseException:
                await conn.disconnect()  # a half-read reply must not reach the next request
                raise
            finally:
                await c.connection_pool.release(conn)

        return await self._call("MGET of rows", packed)


def backend_from_settings(settings) -> EmbeddedBackend | RedisBackend:
    """Return the backend ``settings`` ask for."""
    if settings.checkpoint:
        t0 = time.perf_counter()
        backend = EmbeddedBackend(settings.checkpoint)
        log.info("loaded %s in %.1f s", backend.path, time.perf_counter() - t0)
        return backend
    return RedisBackend(settings.redis, settings.namespace, settings.cache_bytes, settings.refresh_s,
                        settings.redis_timeout_s, follow=settings.follow, live_ttl_s=settings.live_ttl_s,
                        password_file=settings.redis_password_file)
