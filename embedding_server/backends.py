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
import hashlib
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


class _WrongType(Exception):
    """Redis answered WRONGTYPE: the key holds another kind of value than the layout says."""


_WRONGTYPE = b"\0wrongtype"
"""Stands for a manifest key that holds no string (refused by its own message)."""

MAX_BUCKETS = overlay.MAX_BUCKETS
"""Buckets a row key can name (4 hex digits, ``recsys.redisio.published``)."""

ON_DEMAND_REFRESH_S = 0.1
"""While nothing is served, a request reads the alias itself at most this often (and at most
every ``refresh_s``): a burst of requests is not a burst of Redis reads."""


def _digest(text: bytes) -> bytes:
    return hashlib.blake2b(text, digest_size=16).digest()


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
        self._overlay: overlay.Overlay | None = None
        self._live_seen: tuple | None = None  # (version, its manifest digest, live manifest) of the overlay
        self._live_note = "" if not follow else f"live namespace {follow!r} not read yet"
        self._live_said: set[str] = set()  # reasons already logged
        self._base_digest = b""  # of the served version's manifest: a changed one is another version
        self._refusal: tuple | None = None  # (current's raw value, manifest digest, shown, why): not served
        self._waiting = ""  # current names a version not servable yet (no manifest; being deleted)
        self._lost = ""  # why the version served until now is no longer served
        self._registry_note = ""
        self._bad: dict[str, tuple[int, str, str]] = {}  # "version 'v' table 't'" -> (values, why, fate)
        self.bad_rows = 0  # published row values read that could not be served (wrong length, not finite)
        self.bad_live_rows = 0  # live row values likewise (also a step that is not 16 hex digits)
        self.refreshes = 0  # refreshes started
        self.switched_at = 0  # the refresh that loaded the served version
        self._refreshing = asyncio.Lock()
        self._refreshed_at = -float("inf")
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
        or a request; see ``_settle``) and a version is loaded. The reason also names a refused
        version, a current version not servable yet and row values that could not be served."""
        if self._last_error:
            return False, self._last_error + self._notes()
        if self._snap is None:
            return False, self._unready_reason()
        note = f"; {self._live_note}" if self._live_note else ""
        return True, f"serving version {self._snap.version} from {redact(self.url)}{note}{self._notes()}"

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
        except redis.ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise self._failed(mine, what, exc) from None
            self._settle(mine, "")  # Redis answered, about data: the caller says what it means
            raise _WrongType(str(exc)) from None
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            raise self._failed(mine, what, exc) from None
        self._settle(mine, "")  # Redis answered: ready again as soon as it does
        return result

    def _failed(self, mine: int, what: str, exc: BaseException) -> BackendUnavailable:
        self.errors += 1
        why = f"Redis at {redact(self.url)} failed during {what}: {type(exc).__name__}: {exc}"
        self._settle(mine, why)
        return BackendUnavailable(why)

    def _settle(self, call: int, error: str) -> None:
        """Record the outcome of call number ``call`` unless a call started after it has ended."""
        if call > self._outcome_of:
            self._outcome_of = call
            self._last_error = error

    # ------------------------------------------------------------------ versions

    async def refresh(self) -> Snapshot | None:
        """Read the alias now (and the live manifest when following); load the manifest of a
        new version; check that the served version is still there; return the served snapshot."""
        async with self._refreshing:  # the follower and a request may both ask: one at a time
            self.refreshes += 1
            try:
                base = await self._refresh_version()
                if base is None:
                    self._snap = None
                    return None
                live_now = await self._refresh_live(base) if self.follow else None
                snap = self._snap
                if (snap is None or snap.version != base.version or snap.cache is not base.cache
                        or snap.live is not live_now):
                    self._snap = dataclasses.replace(base, live=live_now)
                return self._snap
            finally:
                self._refreshed_at = time.monotonic()

    async def _refresh_version(self) -> Snapshot | None:
        """Read the alias; return the published version to serve (its snapshot without overlay).

        What ``current`` names is served once its manifest validates (``_load``). A value that
        is no version name, or a version whose manifest does not validate, is refused: the
        version served until then stays, and /readyz names the refusal. A refusal holds for
        that name and manifest only: the same name published again (another manifest) is
        tried again. The served version itself is checked at every refresh (``_served_gone``):
        once a gc starts deleting it, or its manifest is gone, it is no longer served."""
        cur_key = layout.current_key(self.ns)
        self._registry_note = ""
        try:
            raw = await self._call("read of the current version", lambda c: c.get(cur_key))
        except _WrongType:
            raw, name, shown = _WRONGTYPE, None, f"(no string in {cur_key})"
            why = f"{cur_key} is not a string (WRONGTYPE): it should hold a version name"
        else:
            if raw is None:
                self._base, self._refusal, self._waiting = None, None, ""
                return None
            name, why = self._version_name(raw, cur_key)
            shown = repr(raw[:40]) if name is None else repr(name)
        base = self._base
        if base is not None:
            gone = await self._served_gone(base, name)
            if gone:
                self._lost = (f"version {base.version!r} (served while {cur_key} named {shown}) {gone}: nothing "
                              f"is served until {cur_key} names a version this server can serve")
                log.error("%s", self._lost)
                self._base = base = None
        if why is not None:
            self._refuse(raw, None, shown, why)
            return base
        if base is not None and base.version == name:
            self._refusal, self._waiting = None, ""
            return base
        mkey = layout.manifest_key(self.ns, name)
        try:
            text = await self._call("read of a manifest", lambda c: c.get(mkey))
        except _WrongType:
            text = _WRONGTYPE  # refused below, by its own message
        if text is None:
            self._waiting = f"version {name!r} ({cur_key}) has no manifest ({mkey}): not served until it has one"
            return base
        digest = _digest(text)
        if self._refusal is not None and self._refusal[:2] == (raw, digest):  # refused already: as it was
            return base
        going = await self._going(name, name)
        if going:
            self._waiting = f"version {name!r} ({cur_key}) is not served: {going}"
            return base
        try:
            if text is _WRONGTYPE:
                raise ValueError(f"{mkey} is not a string (WRONGTYPE): it should hold the version's manifest")
            snap = self._load(name, text, mkey)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError, MemoryError) as exc:
            # a manifest this server cannot serve (another format, other hashing, a bad field):
            # keep the version served now, say why in /readyz, try again only if it changes
            self._refuse(raw, digest, shown, f"{type(exc).__name__}: {exc}")
            return base
        self._base, self._base_digest = snap, digest
        self._refusal, self._waiting, self._lost = None, "", ""
        self._bad.clear()
        self.switched_at = self.refreshes
        log.info("serving version %s", name)
        return snap

    @staticmethod
    def _version_name(raw: bytes, cur_key: str) -> tuple[str | None, str | None]:
        """Return (the version name in ``raw``, None) or (the name or None, why it is none)."""
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, f"{cur_key} is not UTF-8 text ({raw[:40]!r}): it should hold a version name"
        if not layout.NAME.match(name):
            return name, f"{cur_key} holds {name!r:.80}, not a version name (expected {layout.NAME.pattern})"
        if name == live.VERSION:
            return name, (f"{cur_key} names {name!r}, the name live rows use (recsys.redisio.live.VERSION): "
                          "no published version is called so")
        return name, None

    def _refuse(self, raw: bytes, digest: bytes | None, shown: str, why: str) -> None:
        """Record that what ``current`` names (``raw``; its manifest's ``digest``) is not served."""
        if self._refusal is None or self._refusal[:2] != (raw, digest):
            log.error("refusing version %s: %s", shown, why)
        self._refusal = (raw, digest, shown, why)
        self._waiting = ""

    def _load(self, name: str, text: bytes, mkey: str) -> Snapshot:
        """Return the snapshot of version ``name`` from its manifest ``text``, every field checked."""
        where = f"manifest of version {name!r} ({mkey})"
        try:
            manifest = json.loads(text)
        except RecursionError:
            raise ValueError(f"{where}: nested too deep to be a manifest") from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise ValueError(f"{where}: not JSON: {exc}") from None
        catalog = Catalog.from_manifest(manifest, where)
        dtype, buckets = manifest.get("dtype"), manifest.get("buckets")
        if not isinstance(dtype, str) or dtype not in layout.DTYPES:
            raise ValueError(f"{where}: dtype {dtype!r:.40}, this server decodes {sorted(layout.DTYPES)}")
        if type(buckets) is not int or not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError(f"{where}: buckets must be an integer in [1, {MAX_BUCKETS}], found {buckets!r:.40}")
        for field, expected in (("version", name), ("namespace", self.ns)):
            if field in manifest and manifest[field] != expected:
                raise ValueError(f"{where}: its {field} is {manifest[field]!r:.60}, expected {expected!r}: a manifest "
                                 "copied under another name would find none of its rows")
        cache = CacheBudget(self.cache_bytes, {n: (t.rows, t.dim) for n, t in catalog.tables.items()})
        return Snapshot(version=name, dtype=dtype, buckets=buckets, catalog=catalog, cache=cache)

    async def _served_gone(self, base: Snapshot, current: str | None) -> str:
        """Return why the served version ``base`` can no longer be served ('' while it can)."""
        mkey = layout.manifest_key(self.ns, base.version)
        try:
            text = await self._call("read of the served version's manifest", lambda c: c.get(mkey))
        except _WrongType:
            return f"is gone: its manifest key {mkey} no longer holds a manifest (WRONGTYPE)"
        if text is None:
            return f"is gone: its manifest {mkey} was deleted (by a gc, or by hand)"
        if _digest(text) != self._base_digest:
            return f"was replaced: its manifest {mkey} changed (deleted and published again under its name)"
        going = await self._going(base.version, current)
        return f"is no longer served: {going}" if going else ""

    async def _going(self, version: str, current: str | None) -> str:
        """Return why a gc deletes (or may be deleting) ``version`` by its registry entry ('' if
        it does not). An entry this server cannot read is noted in /readyz, not acted on."""
        rkey = layout.registry_key(self.ns)
        try:
            text = await self._call("read of the registry", lambda c: c.hget(rkey, version))
        except _WrongType:
            self._registry_note = f"{rkey} is not a hash (WRONGTYPE): the versions' states are unknown"
            return ""
        if text is None:  # not registered (published by hand): its manifest says it is there
            return ""
        try:
            state = json.loads(text)["state"]
            if not isinstance(state, str):
                raise TypeError(f"state {state!r:.40}")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            self._registry_note = (f"the registry entry of version {version!r} ({rkey}) is not a JSON object with a "
                                   f"state ({type(exc).__name__}): its state is unknown")
            return ""
        if state == "deleting":
            return f"a gc is deleting it (its registry state in {rkey} is 'deleting')"
        if state == "failed" and version != current:
            return f"its registry state in {rkey} is 'failed' and current does not name it: a gc deletes it at once"
        return ""

    async def _refresh_live(self, base: Snapshot) -> overlay.Overlay | None:
        """Read the live manifest; return the overlay to serve on ``base`` (None: published only)."""
        key = live.manifest_key(self.follow)
        try:
            text = await self._call("read of the live manifest", lambda c: c.get(key))
        except _WrongType:
            text = _WRONGTYPE  # not a live manifest: said below
        if self._live_seen == (base.version, self._base_digest, text):
            return self._overlay
        self._live_seen = (base.version, self._base_digest, text)
        previous, self._overlay = self._overlay, None
        if text is None:
            self._live_note = f"live namespace {self.follow!r} has no manifest ({key}): serving published rows only"
            self._say(self._live_note, logging.INFO)
            return None
        try:
            if text is _WRONGTYPE:
                raise ValueError(f"{key}: not a live manifest: the key is not a string (WRONGTYPE)")
            manifest = live.parse_manifest(text, key)
            why = overlay.incompatibility(manifest, base.catalog)
        except ValueError as exc:  # not a live manifest (parse_manifest names the key)
            why = str(exc)
        except (KeyError, TypeError, AttributeError, RecursionError) as exc:
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
            if self._refreshing.locked():  # a refresh is under way: its outcome is the answer
                async with self._refreshing:
                    pass
                snap = self._snap
            elif time.monotonic() - self._refreshed_at >= min(self.refresh_s, ON_DEMAND_REFRESH_S):
                snap = await self.refresh()
        if snap is None:
            raise BackendUnavailable(self._unready_reason())
        return snap

    def _unready_reason(self) -> str:
        """Why no version is served (no Redis error): the lost version, or none published."""
        if self._lost:
            return self._lost + self._notes()
        if self._refusal is not None or self._waiting:
            return f"no version served under namespace {self.ns!r} at {redact(self.url)}{self._notes()}"
        return f"no version published under namespace {self.ns!r} at {redact(self.url)} (run `recsys export`)"

    def _notes(self) -> str:
        """What /readyz adds: a refused or not yet servable current version, rows not served."""
        out = ""
        if self._refusal is not None:
            out += f"; refused version {self._refusal[2]}: {self._refusal[3]}"
        if self._waiting:
            out += f"; {self._waiting}"
        if self._registry_note:
            out += f"; {self._registry_note}"
        for where, (n, why, fate) in self._bad.items():
            out += f"; {n} row value(s) of {where} {fate}: {why}"
        return out

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
            unusable = None
            if got.any():
                rows_, ok, why = decode_values([v for v in vals if v is not None], vec.shape[1], snap.dtype)
                vec[miss[got]] = rows_
                if why:  # served as unseen ids (found false), counted, named in /readyz; never cached
                    bad = np.flatnonzero(got)[~ok]
                    got[bad] = False
                    unusable = miss[bad]
                    self.bad_rows += bad.shape[0]
                    self._note_bad(f"version {snap.version!r} table {table!r}", bad.shape[0], why,
                                   "served as unseen ids (found false)")
            found[miss] = got
            if cache is not None:  # no await since the get: see embedding_server.cache
                if unusable is None:
                    cache.put(keys, vec, found)
                else:
                    keep = np.ones(keys.shape[0], dtype=bool)
                    keep[unusable] = False
                    cache.put(keys[keep], vec[keep], found[keep])
            if lplan is not None:
                lmiss, (lrows, lfound, lsteps, lstamps), lcache = lplan
                lvals = values[lstart : lstart + lmiss.shape[0]]
                lstart += lmiss.shape[0]
                lgot = np.array([v is not None for v in lvals], dtype=bool)
                lbad = None
                if lgot.any():
                    steps_, rows_, ok, why = decode_live_values([v for v in lvals if v is not None], vec.shape[1],
                                                                ov.dtype)
                    lsteps[lmiss[lgot]], lrows[lmiss[lgot]] = steps_, rows_
                    if why:  # as if the key had no live row: its published row is served
                        bad = np.flatnonzero(lgot)[~ok]
                        lgot[bad] = False
                        lbad = lmiss[bad]
                        lsteps[lbad] = -1
                        self.bad_live_rows += bad.shape[0]
                        self._note_bad(f"live namespace {ov.ns!r} table {table!r}", bad.shape[0], why,
                                       "not overlaid (the published row served)")
                lfound[lmiss] = lgot
                lstamps[lmiss] = now
                if lcache is not None:  # keeps a later step another request cached meanwhile
                    if lbad is None:
                        lrows, lfound, lsteps, lstamps = lcache.put(keys, lrows, lfound, lsteps, lstamps)
                    else:  # the unusable values are not cached: read (and counted) again
                        keep = np.ones(keys.shape[0], dtype=bool)
                        keep[lbad] = False
                        kept = lcache.put(keys[keep], lrows[keep], lfound[keep], lsteps[keep], lstamps[keep])
                        for full, part in zip((lrows, lfound, lsteps, lstamps), kept):
                            full[keep] = part
                if lfound.any():
                    vec[lfound] = lrows[lfound]
                    found |= lfound
                    self.live_rows += int(lfound.sum())
                    step = int(lsteps[lfound].max())
                    newest = step if newest is None else max(newest, step)
            out.append((vec, found))
        return out, newest

    def _note_bad(self, where: str, n: int, why: str, fate: str) -> None:
        """Count ``n`` row values of ``where`` that could not be served (``fate``: what was
        served instead); log the first of each place."""
        seen = self._bad.get(where, (0,))[0]
        if not seen:
            log.error("%s: %s; such values are %s", where, why, fate)
        self._bad[where] = (seen + n, why, fate)

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


def decode_values(values: list[bytes], dim: int, dtype: str):
    """Return (float32 [N, dim] rows, ok [N], why) of published row values read from Redis
    (``dim`` numbers of ``dtype`` each). A value of another length, or with a number that is
    not finite, is not ok (its row: zeros); ``why`` names the first such ('' when all are ok)."""
    _raw, rows, ok, why = _decode(values, dim, dtype, 0)
    return rows, ok, why


def _decode(values: list[bytes], dim: int, dtype: str, prefix: int):
    """``decode_values`` of values that start with ``prefix`` bytes; also returns uint8 [N, size]."""
    dt = layout.DTYPES[dtype]
    size = prefix + dim * dt.itemsize
    n = len(values)
    why = ""
    if set(map(len, values)) == {size}:  # the common case: one join, one view
        ok = np.ones(n, dtype=bool)
        raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, size)
    else:
        ok = np.fromiter((len(v) == size for v in values), dtype=bool, count=n)
        raw = np.zeros((n, size), dtype=np.uint8)
        if ok.any():
            raw[ok] = np.frombuffer(b"".join(v for v, k in zip(values, ok) if k), dtype=np.uint8).reshape(-1, size)
        bad = next(len(v) for v in values if len(v) != size)
        why = f"a value of {bad} bytes, expected {size} ({f'{prefix} + ' if prefix else ''}{dim} x {dtype})"
    rows = np.ascontiguousarray(raw[:, prefix:]).view(dt).astype(np.float32, copy=False)
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        why = why or f"a value holds a number that is not finite (NaN or infinity) in {dim} x {dtype}"
        ok &= finite
    return raw, rows, ok, why


_HEX = np.zeros(256, dtype=np.int16) - 1
_HEX[np.frombuffer(b"0123456789", dtype=np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", dtype=np.uint8)] = np.arange(10, 16)
_SHIFTS = np.arange(4 * (live.STEP_BYTES - 1), -1, -4, dtype=np.uint64)


def decode_live_values(values: list[bytes], dim: int, dtype: str):
    """Return (int64 [N] steps, float32 [N, dim] rows, ok [N], why) of live values
    (``recsys.redisio.live``: 16 lowercase hex digits of the step, then the row): a value
    whose row is not ok (``decode_values``) or whose step is not such digits, or past
    ``live.MAX_STEP``, is not ok."""
    raw, rows, ok, why = _decode(values, dim, dtype, live.STEP_BYTES)
    digits = _HEX[raw[:, : live.STEP_BYTES]]  # a value of the wrong length: zeros here, not ok already
    hex_ok = (digits >= 0).all(axis=1)
    steps = (np.where(digits >= 0, digits, 0).astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64)
    step_ok = hex_ok & (steps <= np.uint64(live.MAX_STEP))
    if not step_ok[ok].all():
        why = why or f"a value does not start with its step in {live.STEP_BYTES} lowercase hex digits <= {live.MAX_STEP}"
    ok &= step_ok
    return np.where(step_ok, steps, 0).astype(np.int64), rows, ok, why


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
